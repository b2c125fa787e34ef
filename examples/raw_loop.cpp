// (1) The raw loop, PyTorch style: loss.backward() per micro-batch and optimizer.step() every N.
// The one difference from the usual `loss / N`: each micro-batch is weighted by its share of the
// window's items, which makes the result equal the full batch's even for uneven or padded batches.
#include <iostream>

#include "core/error.h"
#include "examples/accumulation_styles.h"
#include "optim/optimizer.h"

namespace microbatch::examples {

std::vector<double> train_raw_loop(nn::Model& model, const train::Dataset& data,
                                   ExampleConfig config) {
  MB_CHECK(config.gradient_accumulation_steps >= 1,
           "[train_raw_loop] gradient_accumulation_steps must be >= 1, got {}",
           config.gradient_accumulation_steps);
  model.to(config.device);  // before the arenas are built: they are made where the parameters are
  optim::ParamStore store(model);
  optim::AdamW optimizer(store, {.lr = config.learning_rate});
  train::DataLoader loader(data, {.batch_size = config.per_device_train_batch_size, .shuffle = true,
                                  .seed = config.seed});
  // With no batch at all, the loop below would start new epochs forever waiting for a window.
  MB_CHECK(loader.num_batches() > 0,
           "[train_raw_loop] the loader has no batches ({} examples, batch_size {}): there is no "
           "window to train on", data.size(), config.per_device_train_batch_size);
  std::vector<Tensor> losses;  // () each, on the device: reading one would make the host wait
  std::int64_t steps = 0, epoch = 0;
  optimizer.zero_grad();
  while (steps < config.max_steps) {
    // Read one window ahead and count its items: that fixes every micro-batch's weight.
    std::vector<train::Batch> window;
    std::int64_t window_items = 0;
    while (static_cast<std::int64_t>(window.size()) < config.gradient_accumulation_steps) {
      std::optional<train::Batch> batch = loader.next();
      if (!batch) {
        if (!window.empty()) break;  // the data's last window may be shorter
        loader.set_epoch(++epoch);
        continue;
      }
      window_items += batch->num_items;
      window.push_back(std::move(*batch));
    }
    for (const train::Batch& host_batch : window) {
      const train::Batch batch = host_batch.to(config.device);  // collated on the host, one copy
      // Only the loss is kept: with the logits gone, its backward writes their gradient over them.
      Tensor loss = model(batch.inputs, batch.labels).loss;
      // A window whose labels are all ignore_index has no items: its gradients count for nothing
      // (0, not 0 / 0 = NaN, which would poison every gradient), as in the Accelerator.
      GradWeightGuard weight(window_items > 0 ? static_cast<double>(batch.num_items) /
                                                    static_cast<double>(window_items)
                                              : 0.0);
      loss.backward();
      losses.push_back(loss.detach());
    }
    optimizer.step();
    optimizer.zero_grad();
    ++steps;
  }
  std::vector<double> values;
  for (const Tensor& loss : losses) values.push_back(loss.item());
  return values;
}

}  // namespace microbatch::examples

#ifdef MB_EXAMPLE_MAIN
#include "examples/example_data.h"

int main() {
  using namespace microbatch;
  manual_seed(0);
  nn::MLP model({.in_features = 784, .hidden = {128}, .num_classes = 10});
  auto data = examples::example_dataset();
  const Device device = cuda_available() ? cuda_device(0) : kCPU;
  std::vector<double> losses = examples::train_raw_loop(model, *data, {.device = device});
  std::cout << "raw loop on " << device.str() << ": " << losses.size()
            << " micro-batches, first loss " << losses.front() << ", last loss " << losses.back()
            << "\n";
}
#endif
