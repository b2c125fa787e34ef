// The Accelerator: gradient accumulation as a scope, in the style of Hugging Face Accelerate,
// but exact. Note [Exact accumulation]: micro-batch i of a window is weighted by n_i / sum_j n_j,
// where n counts its loss-bearing items (samples, or tokens != ignore_index), so that the window's
// gradient equals the full batch's mean-loss gradient to rounding, whatever the split. The weight
// is applied where the gradient lands (`grad += w * g`, GradWeightGuard), not by scaling the loss:
// users must not divide the loss themselves (Accelerate's backward divides by N; ours weighs by
// items). To know n_j for the whole window before the first backward, the prepared loader reads
// the window's batches ahead: counting needs no forward pass.
//
// As Accelerate does, it places the work: device() is cuda:0 when a CUDA device is present (unless
// `cpu` or an explicit `device` says otherwise); prepare_model() moves the model there before its
// ParamStore is built, and a prepared loader hands out each batch copied there (the window read
// ahead stays on the host).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>

#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/data.h"

namespace microbatch::train {

struct AcceleratorConfig {
  std::int64_t gradient_accumulation_steps = 1;
  bool cpu = false;              // Accelerate's `cpu`: stay on the CPU even with a CUDA device present
  std::optional<Device> device;  // an explicit device (cpu or cuda:N), over the choice above
};

/// A batch with its exact weight in the accumulation window, and whether the window ends with it.
struct WindowBatch {
  Batch batch;
  double weight = 1.0;        // n_i / sum of n over the window
  bool ends_window = false;   // the optimizer steps after this batch's backward
  std::int64_t window_items = 0;
};

/// Groups batches from `next` into windows of up to N (the last window of the data may be shorter),
/// attaches each batch's weight, and hands each out copied to `device`.
class WindowedLoader {
 public:
  WindowedLoader(std::function<std::optional<Batch>()> next, std::int64_t steps, Device device = kCPU);
  std::optional<WindowBatch> next();

 private:
  std::function<std::optional<Batch>()> next_;
  std::int64_t steps_;
  Device device_;
  std::deque<WindowBatch> window_;
};

class Accelerator;

/// An optimizer whose step() and zero_grad() act only at a window's boundary.
class AcceleratedOptimizer {
 public:
  AcceleratedOptimizer(Accelerator& accelerator, optim::Optimizer& optimizer)
      : accelerator_(accelerator), optimizer_(optimizer) {}
  void step(optim::StepOptions options = {});
  void zero_grad();
  optim::Optimizer& inner() { return optimizer_; }

 private:
  Accelerator& accelerator_;
  optim::Optimizer& optimizer_;
};

/// A scheduler that advances only at a window's boundary.
class AcceleratedScheduler {
 public:
  AcceleratedScheduler(Accelerator& accelerator, optim::LRScheduler& scheduler)
      : accelerator_(accelerator), scheduler_(scheduler) {}
  void step();

 private:
  Accelerator& accelerator_;
  optim::LRScheduler& scheduler_;
};

/// The scope of one micro-batch: between construction and destruction, backward() weighs this
/// micro-batch; sync_gradients() says whether the window ends with it.
class AccumulateScope {
 public:
  explicit AccumulateScope(Accelerator& accelerator);
  ~AccumulateScope();
  AccumulateScope(const AccumulateScope&) = delete;
  AccumulateScope& operator=(const AccumulateScope&) = delete;

 private:
  Accelerator& accelerator_;
};

class Accelerator {
 public:
  explicit Accelerator(AcceleratorConfig config = {});

  /// Where the model and batches go: config.device, else cuda:0 when present and not config.cpu,
  /// else the CPU.
  Device device() const { return device_; }
  /// Moves the model to device(); call it before building the model's ParamStore.
  nn::Module& prepare_model(nn::Module& model);
  /// Wraps a batch source: each batch comes with its window weight (Note [Exact accumulation]), on
  /// device().
  WindowedLoader prepare(std::function<std::optional<Batch>()> next);
  AcceleratedOptimizer prepare(optim::Optimizer& optimizer) { return {*this, optimizer}; }
  AcceleratedScheduler prepare(optim::LRScheduler& scheduler) { return {*this, scheduler}; }

  /// Enters the scope of the micro-batch most recently taken from a prepared loader.
  [[nodiscard]] AccumulateScope accumulate(const WindowBatch& batch);
  /// loss.backward() with the current micro-batch's weight (never divide the loss yourself).
  void backward(const Tensor& loss);
  /// True when the current micro-batch ends its window (the optimizer will step).
  bool sync_gradients() const { return sync_gradients_; }
  std::int64_t gradient_accumulation_steps() const { return config_.gradient_accumulation_steps; }

 private:
  friend class AccumulateScope;
  AcceleratorConfig config_;
  Device device_ = kCPU;
  double weight_ = 1.0;
  bool sync_gradients_ = true;
  bool in_scope_ = false;
};

}  // namespace microbatch::train
