// LossSum: the Trainer's running sums of weighted losses (train/trainer.cpp), which the planner
// also makes on meta to allocate what they allocate on a GPU (train/planner.cpp).
#pragma once

#include <cmath>
#include <limits>

#include "core/ops.h"
#include "train/distributed.h"

namespace microbatch::train {

// A running sum of weighted losses (Note [Training on a device] in train/trainer.h). On a GPU it
// is a device scalar: adding launches kernels and never waits, and value() is the one read. On the
// CPU it is a host double: reading a loss there costs nothing, and the step allocates nothing the
// planner did not see. On meta it takes the GPU's path, allocating without computing: the planner
// adds its losses so when it predicts for a GPU (Note [What the Trainer holds beside the arenas] in
// train/planner.cpp). Either way the sum is taken in f64, in the same order, so the CPU's and the
// GPU's agree to the bit.
class LossSum {
 public:
  explicit LossSum(Device device, double start = 0.0) : device_(device), host_(start) {}
  /// sum += weight * loss, for a scalar loss on the training device.
  void add(const Tensor& loss, double weight = 1.0) {
    if (device_.is_cpu()) {
      host_ += weight * loss.item();
      return;
    }
    Tensor term = loss.detach().to(DType::f64);
    if (weight != 1.0) term = term * weight;
    add_term(term);
  }
  /// sum += a window's sum. With `filter`, a window sum that is NaN or inf adds (sum - logged) /
  /// (1 + windows) instead: the growth since the last log line over the windows it holds, plus
  /// one (Note [Non-finite losses]).
  void add_window(const LossSum& window, bool filter, double logged, std::int64_t windows) {
    const double count = 1.0 + static_cast<double>(windows);
    if (device_.is_cpu() || !window.device_sum_.defined()) {
      // On the CPU, or a window with no device terms (on a device every window has some).
      double term = window.host_;
      if (filter && !std::isfinite(term)) term = (value() - logged) / count;
      host_ += term;
      return;
    }
    if (!filter) {
      add_term(window.device_sum_);
      return;
    }
    // On the device the test and the stand-in are kernels too, so nothing waits: the stand-in is
    // computed every window and `where` keeps the window's own sum whenever it is finite.
    if (!device_sum_.defined()) {
      device_sum_ = scalar_tensor(host_, {.dtype = DType::f64, .device = device_});
      host_ = 0.0;
    }
    const Tensor& term = window.device_sum_;
    const Tensor finite = lt(abs(term), scalar_tensor(std::numeric_limits<double>::infinity(),
                                                      {.dtype = DType::f64, .device = device_}));
    device_sum_ = device_sum_ + where(finite, term, (device_sum_ - logged) / count);
    own_sum_ = false;
  }
  /// Sums this over the ranks of a data-parallel run (a window's loss: Note [Data parallel] in
  /// train/distributed.h). Every rank calls it, one that ran no micro-batch too; on a device the
  /// sum is a collective on the stream, and the host does not wait.
  void all_reduce(ProcessGroup& group) {
    if (group.size() == 1) return;
    if (device_.is_cpu()) {
      host_ = group.all_reduce_sum(host_);
      return;
    }
    ready_to_reduce();
    group.all_reduce_sum(device_sum_);
    own_sum_ = false;
  }
  /// Gives the sum on a device a tensor of its own, which no loss tensor shares, for all_reduce: an
  /// allocation, which the Trainer makes where a rank's failure is shared with the others (Note
  /// [Failing together] in train/distributed.h). Nothing on the CPU, or when it has one already.
  void ready_to_reduce() {
    if (device_.is_cpu() || own_sum_) return;
    device_sum_ = device_sum_.defined() ? device_sum_ + host_
                                        : scalar_tensor(host_, {.dtype = DType::f64}).to(device_);
    host_ = 0.0;
    own_sum_ = true;
  }
  /// The sum (waits for the device).
  double value() const { return device_sum_.defined() ? host_ + device_sum_.item() : host_; }

 private:
  void add_term(const Tensor& term) {
    if (!device_sum_.defined() && host_ != 0.0) {
      device_sum_ = scalar_tensor(host_, {.dtype = DType::f64}).to(device_);  // a resumed run's sum
      host_ = 0.0;
    }
    device_sum_ = device_sum_.defined() ? device_sum_ + term : term;
    own_sum_ = false;
  }
  Device device_;
  double host_;         // the whole sum on the CPU; on a GPU, what came before device_sum_
  Tensor device_sum_;  // () f64 on the device, or undefined
  bool own_sum_ = false;  // device_sum_ was made by ready_to_reduce() and nothing added since
};

}  // namespace microbatch::train
