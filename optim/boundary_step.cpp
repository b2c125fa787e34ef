#include "optim/boundary_step.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#include "core/ops/dispatch.h"
#include "kernels/device.h"

namespace microbatch::optim {

DeferredBuffers::DeferredBuffers(Device device, const kernels::LossScaleState* state) {
  stats = zeros({static_cast<std::int64_t>(sizeof(kernels::GradStatsBuffer))},
                {.dtype = DType::u8, .device = device});
  if (state == nullptr) return;
  scale_state =
      empty({static_cast<std::int64_t>(sizeof *state)}, {.dtype = DType::u8, .device = device});
  if (device.is_cuda()) {
    kernels::cuda::memcpy_host_to_device(scale_state.raw_data(), state, sizeof *state,
                                         device.index);
  } else if (device.is_cpu()) {
    std::memcpy(scale_state.raw_data(), state, sizeof *state);
  }
  static_assert(offsetof(kernels::LossScaleState, scale) == 0);
  scale = make_strided(scale_state.storage(), {}, {}, 0, DType::f32);
}

Tensor DeferredBuffers::seed(const Tensor& loss) const {
  if (!scale.defined()) return {};
  const Tensor s = loss.dtype() == DType::f32 ? scale : scale.to(loss.dtype());
  return s.expand(loss.shape());
}

BoundaryStep::BoundaryStep(ParamStore& store, Optimizer& optimizer, LRScheduler& scheduler,
                           DynamicLossScaler* scaler, BoundaryStepConfig config)
    : store_(store), optimizer_(optimizer), scheduler_(scheduler), scaler_(scaler), config_(config) {
  const Device device = store.grads().device();
  MB_CHECK(device.is_cpu() || device.is_cuda(), "[BoundaryStep] the store is on {}, which holds no values",
           device.str());
  MB_CHECK(!(config.timing == BoundaryTiming::Immediate && device.is_cuda()),
           "[BoundaryStep] an immediate boundary step needs a CPU store; on {} it is deferred", device.str());
  deferred_ = config.timing == BoundaryTiming::Deferred || (config.timing == BoundaryTiming::Auto && device.is_cuda());
  if (!deferred_) return;

  const kernels::LossScaleState scale =
      scaler_ != nullptr ? scaler_->state() : kernels::LossScaleState{};
  buffers_ = DeferredBuffers(device, scaler_ != nullptr ? &scale : nullptr);
  if (device.is_cuda()) {
    record_ = static_cast<Record*>(kernels::cuda::host_alloc_pinned(sizeof(Record), device.index));
    pinned_ = true;
    event_ = kernels::cuda::event_create(device.index);
  } else {
    record_ = new Record();
  }
}

BoundaryStep::~BoundaryStep() {
  if (event_ != nullptr) {
    try {
      kernels::cuda::event_synchronize(event_);  // no copy may still be landing in record_
    } catch (...) {
      // a failed device reports itself elsewhere; freeing must not throw
    }
    kernels::cuda::event_destroy(event_);
  }
  if (pinned_) {
    kernels::cuda::host_free_pinned(record_);
  } else {
    delete record_;
  }
}

Tensor BoundaryStep::backward_seed(const Tensor& loss) const {
  if (scaler_ == nullptr) return {};
  if (!deferred_) return full(loss.shape(), scaler_->scale(), {.dtype = loss.dtype()});
  return buffers_.seed(loss);
}

std::vector<StepOutcome> BoundaryStep::step(std::int64_t step, Settle when) {
  if (!deferred_) return {step_now(step)};
  std::vector<StepOutcome> known = settle();
  if (!known.empty() && !known.back().floor_error.empty()) return known;  // the caller stops here
  queue(step);
  if (when == Settle::Now) {
    for (StepOutcome& o : settle()) known.push_back(std::move(o));
  }
  return known;
}

std::vector<StepOutcome> BoundaryStep::settle() {
  if (!pending_) return {};
  const Pending pending = *pending_;
  pending_.reset();
  if (pinned_) kernels::cuda::event_synchronize(event_);
  const Record record = *record_;
  return {resolve(pending, record)};
}

// The CPU path, as the trainer has always run it.
StepOutcome BoundaryStep::step_now(std::int64_t step) {
  ParamStore::GradNorm norm = store_.grad_norm();
  const double inv_scale = scaler_ != nullptr ? static_cast<double>(scaler_->inv_scale()) : 1.0;
  norm.norm *= inv_scale;
  const double clip = config_.max_grad_norm > 0 && !norm.non_finite
                          ? std::min(1.0, config_.max_grad_norm / (norm.norm + 1e-6)) : 1.0;
  StepOutcome outcome;
  outcome.step = step;
  outcome.skipped = norm.non_finite;
  outcome.grad_norm = norm.norm;
  outcome.lr = optimizer_.lr();
  outcome.loss_scale = scaler_ != nullptr ? scaler_->scale() : 1.0;
  if (norm.non_finite) outcome.first_non_finite = store_.first_non_finite();
  if (scaler_ != nullptr) {
    try {
      outcome.skipped = scaler_->update(norm.non_finite);
    } catch (const LossScaleFloorError& e) {
      outcome.skipped = true;
      outcome.floor_error = e.what();
      return outcome;
    }
  }
  if (!outcome.skipped) {
    optimizer_.step({.grad_scale = inv_scale * clip});
    scheduler_.step();
  }
  return outcome;
}

void BoundaryStep::queue(std::int64_t step) {
  const Device device = buffers_.stats.device();
  auto* buffer = static_cast<kernels::GradStatsBuffer*>(buffers_.stats.raw_data());
  auto* scale_state = buffers_.scale_state.defined()
                          ? static_cast<kernels::LossScaleState*>(buffers_.scale_state.raw_data())
                          : nullptr;
  pending_ = Pending{.step = step, .lr = optimizer_.lr(), .loss_scale = scaler_ != nullptr ? scaler_->scale() : 1.0};

  // 1. The norm and the non-finite flag of the whole arena.
  const Tensor& grads = store_.grads();
  launch("boundary_step", device,
         [&] {
           const kernels::cpu::NormResult r = kernels::cpu::sum_squares(grads.kview());
           kernels::GradStats stats{.sum_sq = r.sum_sq, .non_finite = r.non_finite ? 1u : 0u};
           if (r.non_finite) {
             const std::string name = store_.first_non_finite();
             for (const ParamStore::Entry& e : store_.entries())
               if (e.name == name) stats.first_non_finite = e.offset;
           }
           buffer->result = stats;
         },
         [&] { kernels::cuda::sum_squares(grads.kview(), buffer); });
  // 2. The optimizer, gated by it; it unscales with the scale the window ran with.
  optimizer_.step_gated({.stats = &buffer->result,
                         .loss_scale = scale_state != nullptr ? &scale_state->scale : nullptr,
                         .max_grad_norm = config_.max_grad_norm});
  // 3. The loss scale's update, from the same flag.
  if (scaler_ != nullptr) {
    const kernels::LossScaleRule rule = scaler_->rule();
    launch("boundary_step", device,
           [&] { kernels::apply_loss_scale_update(*scale_state, buffer->result.non_finite != 0, rule); },
           [&] { kernels::cuda::update_loss_scale(scale_state, &buffer->result, rule); });
  }
  // 4. The record the host reads later.
  launch("boundary_step", device,
         [&] {
           record_->stats = buffer->result;
           if (scale_state != nullptr) record_->scale = *scale_state;
         },
         [&] {
           kernels::cuda::memcpy_device_to_host_async(&record_->stats, &buffer->result, sizeof record_->stats,
                                                      device.index);
           if (scale_state != nullptr) {
             kernels::cuda::memcpy_device_to_host_async(&record_->scale, scale_state, sizeof record_->scale,
                                                        device.index);
           }
           kernels::cuda::event_record(event_, device.index);
         });
}

StepOutcome BoundaryStep::resolve(const Pending& pending, const Record& record) {
  const bool non_finite = record.stats.non_finite != 0;
  // The host's scaler has seen every window before this one: its scale is the one this window ran with.
  const double inv_scale = scaler_ != nullptr ? static_cast<double>(scaler_->inv_scale()) : 1.0;
  StepOutcome outcome;
  outcome.step = pending.step;
  outcome.skipped = non_finite;
  outcome.grad_norm = std::sqrt(record.stats.sum_sq) * inv_scale;
  outcome.lr = pending.lr;
  outcome.loss_scale = pending.loss_scale;
  if (non_finite) outcome.first_non_finite = store_.entry_at(record.stats.first_non_finite).name;
  if (scaler_ != nullptr) {
    try {
      scaler_->update(non_finite);
    } catch (const LossScaleFloorError& e) {
      outcome.floor_error = e.what();
      return outcome;
    }
    const kernels::LossScaleState& host = scaler_->state();
    MB_ASSERT(host.scale == record.scale.scale && host.growth_tracker == record.scale.growth_tracker &&
                  host.hysteresis_overflows == record.scale.hysteresis_overflows &&
                  host.overflows_at_floor == record.scale.overflows_at_floor,
              "[BoundaryStep] the device's loss scale ({}, tracker {}) left the host's ({}, tracker {}) at step {}",
              record.scale.scale, record.scale.growth_tracker, host.scale, host.growth_tracker, pending.step);
  }
  if (!non_finite) {
    optimizer_.commit_step();
    scheduler_.step();
  }
  return outcome;
}

}  // namespace microbatch::optim
