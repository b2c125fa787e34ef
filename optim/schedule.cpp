#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace microbatch::optim {

ScheduleType parse_schedule(const std::string& name) {
  if (name == "constant") return ScheduleType::Constant;
  if (name == "constant_with_warmup") return ScheduleType::ConstantWithWarmup;
  if (name == "linear") return ScheduleType::Linear;
  if (name == "cosine") return ScheduleType::Cosine;
  MB_CHECK(false, "[lr_scheduler_type] unknown schedule '{}': expected constant, "
           "constant_with_warmup, linear or cosine", name);
  return ScheduleType::Constant;
}

const char* schedule_name(ScheduleType type) {
  switch (type) {
    case ScheduleType::Constant: return "constant";
    case ScheduleType::ConstantWithWarmup: return "constant_with_warmup";
    case ScheduleType::Linear: return "linear";
    case ScheduleType::Cosine: return "cosine";
  }
  return "?";
}

double lr_multiplier(const ScheduleConfig& c, std::int64_t step) {
  const double s = static_cast<double>(step);
  const double warm = static_cast<double>(c.warmup_steps);
  if (c.type == ScheduleType::Constant) return 1.0;
  if (step < c.warmup_steps) return s / std::max(1.0, warm);
  const double total = static_cast<double>(c.total_steps);
  switch (c.type) {
    case ScheduleType::ConstantWithWarmup: return 1.0;
    case ScheduleType::Linear: return std::max(0.0, (total - s) / std::max(1.0, total - warm));
    case ScheduleType::Cosine: {
      const double progress = (s - warm) / std::max(1.0, total - warm);
      return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
    }
    default: return 1.0;
  }
}

LRScheduler::LRScheduler(Optimizer& optimizer, ScheduleConfig config)
    : optimizer_(optimizer), config_(config), base_lr_(optimizer.initial_lr()) {
  MB_CHECK(config.warmup_steps >= 0, "[LRScheduler] warmup_steps must be >= 0, got {}", config.warmup_steps);
  MB_CHECK(config.type == ScheduleType::Constant || config.type == ScheduleType::ConstantWithWarmup ||
               config.total_steps > 0,
           "[LRScheduler] the {} schedule needs total_steps > 0", schedule_name(config.type));
  optimizer_.set_lr(base_lr_ * lr_multiplier(config_, 0));
}

void LRScheduler::step() {
  ++steps_;
  optimizer_.set_lr(base_lr_ * lr_multiplier(config_, steps_));
}

void LRScheduler::set_steps(std::int64_t steps) {
  steps_ = steps;
  optimizer_.set_lr(base_lr_ * lr_multiplier(config_, steps_));
}

std::map<std::string, Tensor> LRScheduler::state_dict() const {
  return {{"steps", scalar_tensor(static_cast<double>(steps_), {.dtype = DType::i64})},
          {"base_lr", scalar_tensor(base_lr_, {.dtype = DType::f64})}};
}

void LRScheduler::load_state_dict(const std::map<std::string, Tensor>& state) {
  auto steps = state.find("steps");
  auto base = state.find("base_lr");
  MB_CHECK(steps != state.end() && base != state.end(), "[LRScheduler] state needs 'steps' and 'base_lr'");
  const std::int64_t n = saved_count(state, "steps", "LRScheduler");
  MB_CHECK(base->second.numel() == 1, "[LRScheduler] state 'base_lr' must hold one value");
  const double lr = base->second.item();
  MB_CHECK(std::isfinite(lr) && lr >= 0, "[LRScheduler] state 'base_lr' must be a finite lr >= 0, got {}",
           lr);
  base_lr_ = lr;
  set_steps(n);
}

}  // namespace microbatch::optim
