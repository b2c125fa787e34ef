// (2) The Accelerator: `accumulate()` scopes, `backward()`, and an optimizer and scheduler that act
// only at a window's boundary. The loss is never divided by hand (Note [Exact accumulation]).
#include <iostream>

#include "examples/accumulation_styles.h"
#include "optim/optimizer.h"
#include "train/accelerator.h"

namespace microbatch::examples {

std::vector<double> train_with_accelerator(nn::Model& model, const train::Dataset& data,
                                           ExampleConfig config) {
  train::Accelerator accelerator({.gradient_accumulation_steps = config.gradient_accumulation_steps,
                                  .device = config.device});
  // Before the arenas are built: they are made where the parameters are.
  accelerator.prepare_model(model);
  optim::ParamStore store(model);
  optim::AdamW adamw(store, {.lr = config.learning_rate});
  optim::LRScheduler constant(adamw, {.type = optim::ScheduleType::Constant});
  auto optimizer = accelerator.prepare(adamw);
  auto scheduler = accelerator.prepare(constant);
  // Each process's share of every epoch (one process: the whole of it), so that the same program
  // trains data-parallel under `mpirun -np W` (README: Data-parallel training).
  train::DataLoader loader(data, {.batch_size = config.per_device_train_batch_size,
                                  .shuffle = true,
                                  .seed = config.seed,
                                  .num_replicas = accelerator.num_processes(),
                                  .rank = accelerator.process_index()});
  // An epoch's end closes the window; set_epoch() starts the next one. Refuses an empty loader.
  train::WindowedLoader batches = accelerator.prepare(loader);
  std::int64_t epoch = 0;
  std::vector<Tensor> losses;  // () each, on the device: read once, at the end
  adamw.zero_grad();
  while (adamw.step_count() < config.max_steps) {
    std::optional<train::WindowBatch> batch = batches.next();
    if (!batch) {
      batches.set_epoch(++epoch);
      continue;
    }
    auto scope = accelerator.accumulate(*batch);
    Tensor loss = model(batch->batch.inputs, batch->batch.labels).loss;
    accelerator.backward(loss);
    optimizer.step();
    scheduler.step();
    optimizer.zero_grad();
    losses.push_back(loss.detach());
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
  // Under `mpirun -np W` each process takes its own GPU (cuda:<local rank>).
  const Device device =
      train::rank_device(train::ProcessGroup::world(), cuda_available() ? cuda_device(0) : kCPU);
  std::vector<double> losses = examples::train_with_accelerator(model, *data, {.device = device});
  train::ProcessGroup& world = train::ProcessGroup::world();
  std::cout << "accelerator on " << device.str();
  if (world.size() > 1) std::cout << " (process " << world.rank() << " of " << world.size() << ")";
  std::cout << ": " << losses.size() << " micro-batches, first loss " << losses.front()
            << ", last loss " << losses.back() << "\n";
  world.finalize();
}
#endif
