// What the Trainer's tests share: small datasets (images, token sequences of chosen lengths),
// small models, a small run's arguments, and the budget that fits a window.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "core/ops.h"
#include "core/rng.h"
#include "nn/models.h"
#include "train/planner.h"
#include "train/trainer.h"

namespace microbatch::testing {

using train::Dataset;
using train::Example;
using train::MemoryPlanner;
using train::ModelInit;
using train::TensorDataset;
using train::TrainingArguments;
using train::collate;

/// n random 28 x 28 images with labels in [0, 10), from `seed`.
inline TensorDataset synthetic_images(std::int64_t n, std::uint64_t seed) {
  manual_seed(seed);
  Tensor x = rand({n, 28, 28});
  Tensor y = (rand({n}) * 10.0).to(DType::i64);
  return TensorDataset(x, y);
}

// Token sequences of different lengths (next-token labels), so a micro-batch's memory depends on
// which sequences it holds.
class Sequences : public Dataset {
 public:
  Sequences(std::vector<std::int64_t> lengths, std::int64_t vocab) : lengths_(std::move(lengths)), vocab_(vocab) {}
  std::int64_t size() const override { return static_cast<std::int64_t>(lengths_.size()); }
  Example get(std::int64_t i) const override {
    check_index(i, "Sequences");
    const std::int64_t t = lengths_[i];
    std::vector<double> ids(t + 1);
    for (std::int64_t k = 0; k <= t; ++k) ids[k] = static_cast<double>((i * 7 + k * 3) % vocab_);
    Tensor all = from_vector(ids, {t + 1}, {.dtype = DType::i64});
    return {all.slice(0, 0, t).contiguous(), all.slice(0, 1, t + 1).contiguous()};
  }

 private:
  std::vector<std::int64_t> lengths_;
  std::int64_t vocab_;
};

// The smallest budget (with the planner's 5% margin) under which a window of n of the dataset's
// first examples runs as one micro-batch.
inline std::int64_t budget_for_window(const ModelInit& init, const Dataset& data, std::int64_t n) {
  MemoryPlanner probe([&](bool ckpt) { auto m = init(); m->set_gradient_checkpointing(ckpt); return m; },
                      [&](std::int64_t k) {
                        std::vector<Example> ex;
                        for (std::int64_t i = 0; i < k; ++i) ex.push_back(data.get(i));
                        return collate(ex);
                      },
                      {.budget = 1 << 30, .effective_batch = n});
  return static_cast<std::int64_t>(static_cast<double>(probe.predict_window(n, false).total()) / 0.95) + 4096;
}

/// A small MLP for 28 x 28 images.
inline ModelInit small_mlp() {
  return [] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64, 32}}); };
}

/// Two epochs of micro-batches of 8, two to a window, logged every step, on the CPU.
inline TrainingArguments small_run(const std::filesystem::path& dir) {
  return {.output_dir = dir.string(), .per_device_train_batch_size = 8, .gradient_accumulation_steps = 2,
          .num_train_epochs = 2, .learning_rate = 1e-3, .logging_steps = 1, .use_cpu = true};
}

/// Trains small_mlp() with `a` on `data`, its console lines discarded.
inline train::TrainOutput quiet_train(const TrainingArguments& a, const Dataset& data,
                                      const Dataset* eval = nullptr) {
  std::ostringstream sink;
  train::Trainer trainer(small_mlp(), a, data, eval,
                         eval != nullptr ? train::classification_metrics : train::ComputeMetrics());
  trainer.set_log_stream(&sink);
  return trainer.train();
}

/// A one-layer GPT in f64 over `vocab` tokens and sequences of up to 16, for budget tests.
inline ModelInit f64_gpt(std::int64_t vocab) {
  return [vocab] {
    auto m = std::make_unique<nn::GPT>(
        nn::GPTConfig{.vocab_size = vocab, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16});
    m->to(DType::f64);
    return m;
  };
}

}  // namespace microbatch::testing
