// Dynamic loss scaling's state and update rule (REFERENCE.md "Loss scaling"), written once for
// the host (optim::DynamicLossScaler) and the device (one thread, after the boundary's norm
// reduction), so that both walk the same sequence of scales.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "kernels/optim.h"

namespace microbatch::kernels {

/// The scaler's state: host memory for a CPU store, device memory for a CUDA one.
struct LossScaleState {
  float scale = 65536.0f;                  // f32, as torch's _scale tensor
  std::uint32_t reserved = 0;
  std::int64_t growth_tracker = 0;         // finite steps since the last growth or overflow
  // Overflows counted against the hysteresis since it was last restored (Note [Hysteresis]).
  std::int64_t hysteresis_overflows = 0;
  std::int64_t overflows_at_floor = 0;     // consecutive overflowing steps taken at the floor
};

/// The constants of the rule (LossScalerConfig's, less what only the host acts on).
struct LossScaleRule {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t hysteresis = 1;
  bool consecutive_hysteresis = false;  // Note [Hysteresis]
  double min_loss_scale = 0.0;  // 0: no floor
};

/// The smallest scale a backoff reaches without a floor: f32's smallest normal, 2^-126, whose
/// inverse 2^126 is finite. PyTorch's scale goes on halving to 0, and an inv_scale of inf then
/// turns zero gradients into NaN weights (0 * inf) that no non-finite check catches, as the check
/// reads the gradients before they are unscaled.
inline constexpr float kSmallestLossScale = 0x1p-126f;

// Note [Hysteresis] (DeepSpeed's DynamicLossScaler): with hysteresis h the scale backs off on the
// h-th overflow counted and on every one after it, until the count is restored to zero. DeepSpeed
// restores it when the scale grows (consecutive_hysteresis = false, its default), so h - 1
// overflows are tolerated per growth window: overflows that alternate with finite steps still back
// the scale off. With consecutive_hysteresis any finite step restores it, so only runs of h
// overflows in a row back off. Either way an overflow restarts the growth window.

MB_HOST_DEVICE inline bool is_finite_f32(float x) {
  return (float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

/// Whether a step at this scale runs at the floor (min_loss_scale > 0 and scale <= it).
MB_HOST_DEVICE inline bool loss_scale_at_floor(const LossScaleState& s, const LossScaleRule& r) {
  return r.min_loss_scale > 0.0 && s.scale <= static_cast<float>(r.min_loss_scale);
}

/// torch's _amp_update_scale_ plus DeepSpeed's hysteresis and floor. A finite step grows the scale
/// once growth_interval finite steps in a row have passed (only if the grown f32 scale is finite);
/// an overflow restarts the growth window and, from the hysteresis-th one counted on (Note
/// [Hysteresis]), backs off, never below the floor nor below kSmallestLossScale. Each new scale is
/// computed in f64 and rounded once to f32.
MB_HOST_DEVICE inline void apply_loss_scale_update(LossScaleState& s, bool found_inf, const LossScaleRule& r) {
  if (!found_inf) {
    if (r.consecutive_hysteresis) s.hysteresis_overflows = 0;
    s.overflows_at_floor = 0;
    if (++s.growth_tracker == r.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(s.scale) * r.growth_factor);
      if (is_finite_f32(grown)) s.scale = grown;
      s.growth_tracker = 0;
      s.hysteresis_overflows = 0;  // DeepSpeed restores its hysteresis whenever it grows
    }
    return;
  }
  ++s.hysteresis_overflows;
  s.growth_tracker = 0;
  if (loss_scale_at_floor(s, r)) ++s.overflows_at_floor;
  if (s.hysteresis_overflows >= r.hysteresis) {
    float next = static_cast<float>(static_cast<double>(s.scale) * r.backoff_factor);
    if (r.min_loss_scale > 0.0) {
      const float floor = static_cast<float>(r.min_loss_scale);
      if (next < floor) next = floor;
    }
    if (next < kSmallestLossScale) next = kSmallestLossScale;
    s.scale = next;
  }
}

namespace cuda {
/// One thread applies apply_loss_scale_update to *state (device memory) with found_inf =
/// stats->non_finite, read on the device.
void update_loss_scale(LossScaleState* state, const GradStats* stats, const LossScaleRule& rule);
}  // namespace cuda

}  // namespace microbatch::kernels
