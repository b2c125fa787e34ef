// The boundary step: what follows a window's last micro-batch (the gradient norm and non-finite
// flag, unscale and clip, the optimizer update, the loss-scale update, the schedule), behind one
// call that the trainer makes on any device.
//
// Note [Boundary step on the device]: on the CPU the step runs at once, as it always has: the
// norm, inv_scale and clip on the host, the scaler's update, then AdamW and the schedule. On CUDA
// the host never waits for it. It queues, in stream order:
//   1. one reduction of the gradient arena into {sum_sq, non_finite, first_non_finite};
//   2. the gated optimizer pass, which reads those and the device loss scale, computes
//      grad_scale = inv_scale * clip_coef in every thread, and returns at once on a non-finite flag;
//   3. the one-thread loss-scale update (kernels::apply_loss_scale_update on the device state);
//   4. an async copy of the statistics and the scale state into pinned host memory, and an event.
// The optimizer runs before the scale update, so that it unscales with the scale the window's
// backward ran with. Backward is seeded with the device scale itself (a view of that state), so
// no micro-batch reads the scale on the host either.
//
// The host reads the record at the next boundary, before queueing anything (the event is long
// complete by then: a whole window of work was queued after it), or at once when a log line, a
// checkpoint or the end of training needs it (Settle::Now, settle()). From the record it does what
// the CPU path does at the boundary itself: counts the optimizer step and advances the schedule
// when the step was taken; runs the same rule on its own DynamicLossScaler, which so warns and
// throws LossScaleFloorError as on the CPU and is checked against the device's state; reports a
// skipped window with its first non-finite parameter. Since step k's record is read before step
// k+1 is queued, every step runs with the CPU's step count (bias correction) and learning rate.
// Only reports can come one boundary late:
//   - window k's "skipped" outcome (and so the trainer's skipped count and event) at boundary k+1;
//   - window k's LossScaleFloorError at boundary k+1, before step k+1 is queued: the saved last good
//     state holds the same weights, with the trainer's step counter one window further;
//   - between boundaries, the host's optimizer step count and scaler lag the device by one step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/loss_scale.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace microbatch::optim {

/// When a deferred step's outcome is read: at the next boundary, or before step() returns.
enum class Settle { Later, Now };

/// Immediate: computed on the host at the boundary (CPU stores only). Deferred: queued, its
/// record read later (Note [Boundary step on the device]); on the CPU it runs the same
/// bookkeeping, which tests use. Auto: Immediate on the CPU, Deferred on CUDA.
enum class BoundaryTiming { Auto, Immediate, Deferred };

struct BoundaryStepConfig {
  double max_grad_norm = 0.0;  // clip the unscaled gradients' norm to this; 0: no clipping
  BoundaryTiming timing = BoundaryTiming::Auto;
};

/// A window's step, once the host knows how it went.
struct StepOutcome {
  std::int64_t step = 0;         // the caller's number for the window
  bool skipped = false;          // a gradient was not finite: no weight, moment, count or schedule moved
  double grad_norm = 0.0;        // of the unscaled gradients, before clipping
  double lr = 0.0;               // the learning rate the step ran with
  double loss_scale = 1.0;       // the scale the window's backward ran with
  std::string first_non_finite;  // when skipped: the first parameter (arena order) at fault
  std::string floor_error;       // LossScaleFloorError's message: save the last good state and stop
};

/// The device memory a deferred step holds for its whole life, from its construction: the
/// statistics buffer, and with a loss scaler the scale's state, whose scale seeds every backward.
/// On the meta device it allocates the same blocks and copies no values: the planner holds it
/// there when it predicts for a GPU (Note [What the Trainer holds beside the arenas] in
/// train/planner.cpp).
struct DeferredBuffers {
  Tensor stats;        // (sizeof GradStatsBuffer) u8, zeroed
  Tensor scale_state;  // (sizeof LossScaleState) u8 holding `scale`'s state; undefined without one
  Tensor scale;        // () f32 view of scale_state's scale
  /// scale: the scaler's state to copy to the device, or nullptr without loss scaling.
  DeferredBuffers(Device device, const kernels::LossScaleState* scale);
  DeferredBuffers() = default;
  /// The gradient that seeds a micro-batch's backward: the scale in the loss's shape (a view of
  /// scale_state for an f32 loss, allocating nothing), or undefined without a scaler.
  Tensor seed(const Tensor& loss) const;
};

class BoundaryStep {
 public:
  /// scaler: nullptr without loss scaling. A deferred step copies the scaler's state to the device
  /// here: make it after loading a checkpoint.
  BoundaryStep(ParamStore& store, Optimizer& optimizer, LRScheduler& scheduler, DynamicLossScaler* scaler,
               BoundaryStepConfig config = {});
  ~BoundaryStep();
  BoundaryStep(const BoundaryStep&) = delete;
  BoundaryStep& operator=(const BoundaryStep&) = delete;

  /// The gradient that seeds a micro-batch's backward: the loss scale in the loss's shape (a view
  /// of the device scale when deferred), or an undefined tensor (implicit ones) without a scaler.
  Tensor backward_seed(const Tensor& loss) const;
  /// Runs or queues the step of the window the caller numbers `step`. Returns the outcomes that
  /// became known, oldest first: the previous window's when deferred, and this one's when
  /// immediate or `when` is Settle::Now. After an outcome with a floor_error nothing more is queued.
  std::vector<StepOutcome> step(std::int64_t step, Settle when);
  /// Reads the pending record, if any (before a checkpoint or at the end of training).
  std::vector<StepOutcome> settle();
  bool deferred() const { return deferred_; }

 private:
  struct Pending {
    std::int64_t step = 0;
    double lr = 0.0;
    double loss_scale = 1.0;
  };
  struct Record {  // what the host reads back: pinned host memory on CUDA
    kernels::GradStats stats;
    kernels::LossScaleState scale;
  };

  StepOutcome step_now(std::int64_t step);
  void queue(std::int64_t step);
  StepOutcome resolve(const Pending& pending, const Record& record);

  ParamStore& store_;
  Optimizer& optimizer_;
  LRScheduler& scheduler_;
  DynamicLossScaler* scaler_;
  BoundaryStepConfig config_;
  bool deferred_ = false;
  DeferredBuffers buffers_;  // on the store's device; deferred only
  Record* record_ = nullptr;
  bool pinned_ = false;  // record_ is page-locked (CUDA); else it was made with new
  void* event_ = nullptr;
  std::optional<Pending> pending_;
};

}  // namespace microbatch::optim
