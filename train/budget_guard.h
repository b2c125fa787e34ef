// The Trainer's memory budget on its training device, in a scope (train/trainer.cpp and
// train/evaluation.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/allocator.h"
#include "core/device.h"

namespace microbatch::train {

// Enforces baseline + budget on the training device's allocator in its scope (Note [What the
// budget covers]).
struct BudgetGuard {
  BudgetGuard(Device device, std::int64_t baseline, std::int64_t budget)
      : device(device), previous(allocator(device).budget()) {
    // In size_t: both are int64 >= 0, and their sum may pass INT64_MAX (a budget from JSON).
    if (budget > 0)
      set_memory_budget(device,
                        static_cast<std::size_t>(baseline) + static_cast<std::size_t>(budget));
  }
  ~BudgetGuard() { allocator(device).set_budget(previous); }
  Device device;
  std::optional<std::size_t> previous;
};

}  // namespace microbatch::train
