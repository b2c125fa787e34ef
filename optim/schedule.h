// Learning-rate schedules with Hugging Face's names and shapes: the multiplier of the base rate
// after `step` optimizer steps (warmup rises linearly from 0).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "optim/optimizer.h"

namespace microbatch::optim {

enum class ScheduleType { Constant, ConstantWithWarmup, Linear, Cosine };

/// "constant", "constant_with_warmup", "linear", "cosine".
ScheduleType parse_schedule(const std::string& name);
const char* schedule_name(ScheduleType type);

struct ScheduleConfig {
  ScheduleType type = ScheduleType::Linear;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;  // needed by linear and cosine
};

/// multiplier(step) for the schedule (HF get_*_schedule_with_warmup).
double lr_multiplier(const ScheduleConfig& config, std::int64_t step);

/// Sets the optimizer's lr to base_lr * multiplier(steps taken) on each step().
class LRScheduler {
 public:
  LRScheduler(Optimizer& optimizer, ScheduleConfig config);
  /// Advances one optimizer step; call after optimizer.step() (not after a skipped step).
  void step();
  double last_lr() const { return optimizer_.lr(); }
  std::int64_t steps() const { return steps_; }
  void set_steps(std::int64_t steps);
  double base_lr() const { return base_lr_; }
  /// The optimizer whose learning rate it sets.
  const Optimizer& optimizer() const { return optimizer_; }
  /// The schedule's position (steps taken), for checkpoints.
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& state);

 private:
  Optimizer& optimizer_;
  ScheduleConfig config_;
  double base_lr_;
  std::int64_t steps_ = 0;
};

}  // namespace microbatch::optim
