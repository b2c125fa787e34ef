// The ways to accumulate gradients that the course teaches, side by side. Each trains the same
// model on the same batches; with the same seed they end with identical weights.
#pragma once

#include <cstdint>
#include <vector>

#include "nn/models.h"
#include "train/data.h"

namespace microbatch::examples {

struct ExampleConfig {
  std::int64_t per_device_train_batch_size = 8;  // the micro-batch
  std::int64_t gradient_accumulation_steps = 4;  // micro-batches per optimizer step
  std::int64_t max_steps = 20;                   // optimizer steps
  double learning_rate = 1e-3;
  std::uint64_t seed = 42;
  Device device = kCPU;  // where the model, its arenas and each micro-batch live
};

/// (1) The raw loop: count the window's items, then forward and backward each micro-batch with
/// its weight n_i / sum n, and step once per window. Moves the model to config.device first.
/// Returns the loss of each micro-batch (read from the device once, at the end). Both styles
/// refuse data that makes no batch, rather than wait forever for a window.
std::vector<double> train_raw_loop(nn::Model& model, const train::Dataset& data,
                                   ExampleConfig config);

/// (2) The Accelerator: the same loop with accumulate() scopes and wrapped optimizer/scheduler.
std::vector<double> train_with_accelerator(nn::Model& model, const train::Dataset& data,
                                           ExampleConfig config);

}  // namespace microbatch::examples
