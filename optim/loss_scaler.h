// Dynamic loss scaling for fp16 mixed precision: torch.amp.GradScaler's update rule and defaults,
// plus DeepSpeed's hysteresis and loss-scale floor as options (REFERENCE.md "Loss scaling").
// The scale lives in f32 as PyTorch keeps it, so inv_scale and every backoff/growth round the
// same way; each update computes in f64 and rounds once to f32, like torch's kernel. The rule is
// kernels::apply_loss_scale_update, which a CUDA boundary step also runs on the device (Note
// [Boundary step on the device] in optim/boundary_step.h); this class is then the host's copy.
//
// Note [Loss-scale floor]: PyTorch has no floor, and a run whose gradients never become finite
// again backs its scale off to 0. Here a backoff stops at 2^-126 (kernels::kSmallestLossScale,
// where the scaler warns once), and with min_loss_scale set it never goes below the floor; the
// scaler warns once (stderr) when it gets there, and with max_overflows_at_floor = n, the n-th
// consecutive overflowing step taken at the floor throws LossScaleFloorError so the caller can
// stop after saving the last good state (a skipped step leaves the weights as they were).
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/loss_scale.h"

namespace microbatch::optim {

/// Where the scaler's one-time warnings go (Note [Loss-scale floor]): a data-parallel run's ranks
/// all see the same overflows, and only rank 0 prints (kQuiet on the others).
enum class ScalerWarnings { kPrint, kQuiet };

struct LossScalerConfig {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t hysteresis = 1;          // DeepSpeed: overflows tolerated before backing off (1 = PyTorch)
  bool consecutive_hysteresis = false;  // DeepSpeed's: only a run of `hysteresis` overflows in a
                                        // row backs off (Note [Hysteresis], kernels/loss_scale.h)
  double min_loss_scale = 0.0;          // floor; 0 = none (PyTorch). At the floor the scale stays.
  std::int64_t max_overflows_at_floor = 0;  // consecutive overflowing steps at the floor before
                                            // update() throws LossScaleFloorError; 0 = never
  ScalerWarnings warnings = ScalerWarnings::kPrint;
};

/// Thrown when the scale sits at its floor and steps keep overflowing.
class LossScaleFloorError : public Error { using Error::Error; };

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerConfig config = {});
  double scale() const;              // f32 value, as PyTorch keeps it
  /// inv_scale = (float)(1.0 / (double)scale), as torch's unscale.
  float inv_scale() const;
  /// After a window: found_inf says whether any gradient was not finite. Returns true when the
  /// optimizer step must be skipped. Applies the update rule; may warn once (stderr) when the floor is
  /// reached; throws LossScaleFloorError with a clear message (scale, floor, overflow count) when
  /// max_overflows_at_floor consecutive overflows happen at the floor.
  bool update(bool found_inf);
  std::int64_t growth_tracker() const;
  std::int64_t skipped_steps() const;   // total steps skipped so far
  /// Overflows counted against the hysteresis since it was last restored (Note [Hysteresis]).
  std::int64_t hysteresis_overflows() const;
  /// For checkpoints: everything needed to continue bit for bit.
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

  const LossScalerConfig& config() const { return config_; }
  /// The state the update rule works on, and the rule's constants (what a device copy needs).
  const kernels::LossScaleState& state() const { return state_; }
  kernels::LossScaleRule rule() const;

 private:
  LossScalerConfig config_;
  kernels::LossScaleState state_;           // scale, growth tracker, overflow counts
  std::int64_t skipped_steps_ = 0;
  bool warned_floor_ = false;               // diagnostics only; not part of the state
};

}  // namespace microbatch::optim
