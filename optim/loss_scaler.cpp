#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

namespace microbatch::optim {
namespace {

void check_config(const LossScalerConfig& c, const char* where) {
  MB_CHECK(std::isfinite(c.growth_factor) && c.growth_factor > 1.0,
           "[{}] growth_factor must be > 1, got {}", where, c.growth_factor);
  MB_CHECK(c.backoff_factor > 0.0 && c.backoff_factor < 1.0,
           "[{}] backoff_factor must be in (0, 1), got {}", where, c.backoff_factor);
  MB_CHECK(c.growth_interval >= 1, "[{}] growth_interval must be >= 1, got {}", where,
           c.growth_interval);
  MB_CHECK(c.hysteresis >= 1, "[{}] hysteresis must be >= 1 (1 backs off on every overflow, as "
           "PyTorch), got {}", where, c.hysteresis);
  // The scale is an f32: a value past FLT_MAX would start it at inf, one below f32's smallest
  // normal would make inv_scale inf (kernels::kSmallestLossScale).
  const double smallest = kernels::kSmallestLossScale;
  MB_CHECK(c.init_scale >= smallest && std::isfinite(static_cast<float>(c.init_scale)),
           "[{}] init_scale must be in [2^-126, FLT_MAX] (an f32 whose inverse is finite), got {}",
           where, c.init_scale);
  MB_CHECK(c.min_loss_scale == 0.0 || (c.min_loss_scale >= smallest &&
                                       std::isfinite(static_cast<float>(c.min_loss_scale))),
           "[{}] min_loss_scale must be 0 (no floor) or in [2^-126, FLT_MAX], got {}", where,
           c.min_loss_scale);
  MB_CHECK(c.init_scale >= c.min_loss_scale,
           "[{}] init_scale {} is below min_loss_scale {}", where, c.init_scale, c.min_loss_scale);
  MB_CHECK(c.max_overflows_at_floor >= 0, "[{}] max_overflows_at_floor must be >= 0 (0 = never "
           "stop), got {}", where, c.max_overflows_at_floor);
  MB_CHECK(c.max_overflows_at_floor == 0 || c.min_loss_scale > 0.0,
           "[{}] max_overflows_at_floor = {} needs a floor: set min_loss_scale > 0", where,
           c.max_overflows_at_floor);
}

}  // namespace

DynamicLossScaler::DynamicLossScaler(LossScalerConfig config) : config_(config) {
  check_config(config_, "DynamicLossScaler");
  state_.scale = static_cast<float>(config_.init_scale);
}

double DynamicLossScaler::scale() const { return state_.scale; }

float DynamicLossScaler::inv_scale() const {
  return static_cast<float>(1.0 / static_cast<double>(state_.scale));
}

std::int64_t DynamicLossScaler::growth_tracker() const { return state_.growth_tracker; }
std::int64_t DynamicLossScaler::skipped_steps() const { return skipped_steps_; }
std::int64_t DynamicLossScaler::hysteresis_overflows() const { return state_.hysteresis_overflows; }

kernels::LossScaleRule DynamicLossScaler::rule() const {
  return {.growth_factor = config_.growth_factor,
          .backoff_factor = config_.backoff_factor,
          .growth_interval = config_.growth_interval,
          .hysteresis = config_.hysteresis,
          .consecutive_hysteresis = config_.consecutive_hysteresis,
          .min_loss_scale = config_.min_loss_scale};
}

bool DynamicLossScaler::update(bool found_inf) {
  // An overflow skips the step and restarts the growth window (PyTorch, and DeepSpeed's
  // last_overflow_iter), whether or not hysteresis lets the scale stay.
  const bool was_at_floor = kernels::loss_scale_at_floor(state_, rule());  // ran at the smallest scale
  kernels::apply_loss_scale_update(state_, found_inf, rule());
  if (!found_inf) return false;
  ++skipped_steps_;
  // Hysteresis h: the first h-1 overflows counted are tolerated; the h-th and every further one
  // back off (Note [Hysteresis] in kernels/loss_scale.h).
  const bool backed_off = state_.hysteresis_overflows >= config_.hysteresis;
  if (backed_off && config_.min_loss_scale > 0.0) {
    const float floor = static_cast<float>(config_.min_loss_scale);
    if (state_.scale <= floor && !warned_floor_) {
      warned_floor_ = true;
      if (config_.warnings == ScalerWarnings::kPrint)
        std::fprintf(stderr,
                     "[loss_scaler] warning: loss scale reached its floor min_loss_scale = %g; "
                     "further overflows skip steps without lowering it\n",
                     static_cast<double>(floor));
    }
  } else if (backed_off && state_.scale == kernels::kSmallestLossScale && !warned_floor_) {
    // No floor: say so once rather than collapse silently.
    warned_floor_ = true;
    if (config_.warnings == ScalerWarnings::kPrint)
      std::fprintf(stderr,
                   "[loss_scaler] warning: loss scale reached 2^-126, the smallest it can take, "
                   "after repeated overflows; gradients are not finite at any scale (set "
                   "min_loss_scale and max_overflows_at_floor to stop the run)\n");
  }
  if (was_at_floor && config_.max_overflows_at_floor > 0 &&
      state_.overflows_at_floor >= config_.max_overflows_at_floor) {
    throw LossScaleFloorError(fmt::format(
        "[loss_scaler] {} consecutive overflowing steps at the loss-scale floor (scale {}, "
        "min_loss_scale {}, max_overflows_at_floor {}): gradients stay non-finite at the "
        "smallest allowed scale. The weights are those of the last good step; restore it and "
        "lower the learning rate, or train in bf16",
        state_.overflows_at_floor, static_cast<double>(state_.scale), config_.min_loss_scale,
        config_.max_overflows_at_floor));
  }
  return true;
}

nlohmann::json DynamicLossScaler::state_dict() const {
  // f32 -> f64 is exact and the JSON writer prints doubles round-trip, so scale reloads exactly.
  return {
      {"scale", static_cast<double>(state_.scale)},
      {"growth_factor", config_.growth_factor},
      {"backoff_factor", config_.backoff_factor},
      {"growth_interval", config_.growth_interval},
      {"hysteresis", config_.hysteresis},
      {"consecutive_hysteresis", config_.consecutive_hysteresis},
      {"min_loss_scale", config_.min_loss_scale},
      {"max_overflows_at_floor", config_.max_overflows_at_floor},
      {"growth_tracker", state_.growth_tracker},
      {"skipped_steps", skipped_steps_},
      {"hysteresis_overflows", state_.hysteresis_overflows},
      {"overflows_at_floor", state_.overflows_at_floor},
  };
}

void DynamicLossScaler::load_state_dict(const nlohmann::json& state) {
  auto get = [&](const char* key) -> const nlohmann::json& {
    MB_CHECK(state.is_object() && state.contains(key), "[loss_scaler] state has no '{}'", key);
    const auto& v = state.at(key);
    MB_CHECK(v.is_number(), "[loss_scaler] state '{}' must be a number, got {}", key, v.dump());
    return v;
  };
  auto get_int = [&](const char* key) {
    const auto& v = get(key);
    MB_CHECK(v.is_number_integer() && v.get<std::int64_t>() >= 0,
             "[loss_scaler] state '{}' must be an integer >= 0, got {}", key, v.dump());
    return v.get<std::int64_t>();
  };
  // PyTorch's load_state_dict restores the factors and interval too: the checkpoint wins.
  LossScalerConfig c = config_;
  const double scale = get("scale").get<double>();
  c.growth_factor = get("growth_factor").get<double>();
  c.backoff_factor = get("backoff_factor").get<double>();
  c.growth_interval = get_int("growth_interval");
  c.hysteresis = get_int("hysteresis");
  // A state saved before consecutive_hysteresis existed ran with it, and named its count
  // consecutive_overflows.
  const bool before_option = state.is_object() && !state.contains("consecutive_hysteresis") &&
                             state.contains("consecutive_overflows");
  if (before_option) {
    c.consecutive_hysteresis = true;
  } else {
    MB_CHECK(state.is_object() && state.contains("consecutive_hysteresis") &&
                 state.at("consecutive_hysteresis").is_boolean(),
             "[loss_scaler] state 'consecutive_hysteresis' must be true or false");
    c.consecutive_hysteresis = state.at("consecutive_hysteresis").get<bool>();
  }
  c.min_loss_scale = get("min_loss_scale").get<double>();
  c.max_overflows_at_floor = get_int("max_overflows_at_floor");
  // init_scale is not part of the state; check the rest with a stand-in that passes.
  LossScalerConfig checked = c;
  checked.init_scale = std::max<double>(c.min_loss_scale, kernels::kSmallestLossScale);
  check_config(checked, "loss_scaler state");
  MB_CHECK(scale >= kernels::kSmallestLossScale &&
               static_cast<double>(static_cast<float>(scale)) == scale,
           "[loss_scaler] state 'scale' must be an f32 value >= 2^-126, got {}", scale);
  MB_CHECK(scale >= static_cast<float>(c.min_loss_scale),
           "[loss_scaler] state 'scale' {} is below min_loss_scale {}", scale, c.min_loss_scale);
  const std::int64_t tracker = get_int("growth_tracker");
  MB_CHECK(tracker < c.growth_interval, "[loss_scaler] state growth_tracker {} must be below "
           "growth_interval {}", tracker, c.growth_interval);

  config_ = c;
  state_.scale = static_cast<float>(scale);
  state_.growth_tracker = tracker;
  skipped_steps_ = get_int("skipped_steps");
  state_.hysteresis_overflows =
      get_int(before_option ? "consecutive_overflows" : "hysteresis_overflows");
  state_.overflows_at_floor = get_int("overflows_at_floor");
}

}  // namespace microbatch::optim
