// (3) The Trainer, as the course shows it: per_device_train_batch_size = 1 with
// gradient_accumulation_steps = 4, evaluation each epoch with accuracy and F1. The same run with a
// memory budget instead of a fixed micro-batch: `.per_device_train_batch_size = kAutoBatch,
// .train_batch_size = 4, .memory_budget = ...` lets the planner choose the split. As Hugging Face's
// Trainer, it trains on cuda:0 when a CUDA device is present (`.use_cpu = true` keeps it on the CPU).
#include <iostream>

#include "examples/example_data.h"
#include "nn/models.h"
#include "train/trainer.h"

namespace {
// The first n examples of a dataset, held as tensors.
std::unique_ptr<microbatch::train::Dataset> first(const microbatch::train::Dataset& data, std::int64_t n) {
  using namespace microbatch;
  n = std::min(n, data.size());
  train::Example e0 = data.get(0);
  Shape shape = e0.input.shape();
  shape.insert(shape.begin(), n);
  Tensor inputs = empty(shape, {.dtype = e0.input.dtype()});
  Tensor labels = empty({n}, {.dtype = DType::i64});
  for (std::int64_t i = 0; i < n; ++i) {
    train::Example e = data.get(i);
    inputs.select(0, i).copy_(e.input);
    labels.select(0, i).copy_(e.label);
  }
  return std::make_unique<train::TensorDataset>(inputs, labels);
}
}  // namespace

int main() {
  using namespace microbatch;
  auto all = examples::example_dataset();
  auto train_set = first(*all, 4000);
  auto eval_set = examples::example_test_dataset();
  eval_set = first(*eval_set, 2000);
  train::TrainingArguments args{.output_dir = "runs/example_trainer",
                                .per_device_train_batch_size = 1,
                                .per_device_eval_batch_size = 256,
                                .gradient_accumulation_steps = 4,
                                .num_train_epochs = 2,
                                .learning_rate = 1e-3,
                                .logging_steps = 250,
                                .eval_strategy = "epoch"};
  train::Trainer trainer([] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {128}}); }, args,
                         *train_set, eval_set.get(), train::classification_metrics);
  train::TrainOutput out = trainer.train();
  std::cout << "trainer on " << trainer.device().str() << ": " << out.global_step << " steps; eval accuracy "
            << out.metrics["eval_accuracy"] << ", macro F1 " << out.metrics["eval_f1"] << "\n";
}
