// Optimizers over a ParamStore: each step is one fused pass over the whole arena.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "kernels/optim.h"
#include "optim/param_store.h"

namespace microbatch::optim {

/// A count (a step number) in a state_dict read from a checkpoint: one whole number >= 0 that an
/// int64 holds. Throws naming `op` and `name` otherwise, and when the state has no such entry.
std::int64_t saved_count(const std::map<std::string, Tensor>& state, const char* name,
                         const char* op);

/// Per-step inputs that the caller computes at the window's boundary.
struct StepOptions {
  double grad_scale = 1.0;  // multiplies every gradient: 1 / loss_scale * clip_coef
  /// A gradient was not finite: the step changes nothing — no weight, no moment, no step count
  /// (as torch's fused optimizers read found_inf).
  bool found_inf = false;
};

class Optimizer {
 public:
  explicit Optimizer(ParamStore& store) : store_(store) {}
  virtual ~Optimizer() = default;
  /// One update from the gradients in the store.
  virtual void step(StepOptions options = {}) = 0;
  /// One update whose skip flag, loss scale and norm are read where the store lives (Note
  /// [Boundary step on the device] in optim/boundary_step.h): the pass changes nothing when
  /// gate.stats->non_finite. The step count does not move: call commit_step() once the host knows
  /// the step was taken. The gate's pointers are in the store's memory (host memory on the CPU).
  virtual void step_gated(const kernels::DeviceGate& gate) = 0;
  /// Counts a step_gated() update that was taken.
  void commit_step() { ++step_count_; }
  void zero_grad() { store_.zero_grad(); }
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
  /// The lr before any schedule (torch's param_group["initial_lr"]): lr() when first asked, which
  /// the first LRScheduler does, so that a later scheduler of the same optimizer starts from it
  /// and not from the lr an earlier schedule left.
  double initial_lr() {
    if (!initial_lr_) initial_lr_ = lr();
    return *initial_lr_;
  }
  /// Steps actually taken.
  std::int64_t step_count() const { return step_count_; }
  /// The state (moments, step count) as named tensors, for checkpoints.
  virtual std::map<std::string, Tensor> state_dict() const = 0;
  virtual void load_state_dict(const std::map<std::string, Tensor>& state) = 0;
  ParamStore& store() { return store_; }

 protected:
  ParamStore& store_;
  std::int64_t step_count_ = 0;
  std::optional<double> initial_lr_;
};

/// torch.optim.AdamW defaults.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

/// Decoupled weight decay Adam, as torch.optim.AdamW, over the decay range of the store.
class AdamW final : public Optimizer {
 public:
  AdamW(ParamStore& store, AdamWConfig config = {});
  void step(StepOptions options = {}) override;
  void step_gated(const kernels::DeviceGate& gate) override;
  double lr() const override { return config_.lr; }
  void set_lr(double lr) override { config_.lr = lr; }
  std::map<std::string, Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, Tensor>& state) override;
  const AdamWConfig& config() const { return config_; }
  std::size_t state_bytes() const { return exp_avg_.nbytes() + exp_avg_sq_.nbytes(); }

 private:
  kernels::AdamWArgs step_args(std::int64_t step, double grad_scale) const;
  void run(kernels::AdamWArgs args, const kernels::DeviceGate& gate);

  AdamWConfig config_;
  Tensor exp_avg_;     // (trainable_numel) f32 (f64 for f64 weights)
  Tensor exp_avg_sq_;  // (trainable_numel)
};

/// torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay added to the gradient).
struct SGDConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD final : public Optimizer {
 public:
  SGD(ParamStore& store, SGDConfig config = {});
  void step(StepOptions options = {}) override;
  void step_gated(const kernels::DeviceGate& gate) override;
  double lr() const override { return config_.lr; }
  void set_lr(double lr) override { config_.lr = lr; }
  std::map<std::string, Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, Tensor>& state) override;

 private:
  void run(double grad_scale, const kernels::DeviceGate& gate);

  SGDConfig config_;
  Tensor momentum_buffer_;  // (trainable_numel), only with momentum
};

}  // namespace microbatch::optim
