// The Accelerator: gradient accumulation as a scope, in the style of Hugging Face Accelerate,
// but exact. Note [Exact accumulation]: micro-batch i of a window is weighted by n_i / sum_j n_j,
// where n counts its loss-bearing items (samples, or tokens != ignore_index), so that the window's
// gradient equals the full batch's mean-loss gradient to rounding, whatever the split. The weight
// is applied where the gradient lands (`grad += w * g`, GradWeightGuard), not by scaling the loss:
// users must not divide the loss themselves (Accelerate's backward divides by N; ours weighs by
// items). An accumulate() scope holds its micro-batch's weight for its whole lifetime, so every
// backward inside it is weighted, accelerator.backward() or loss.backward() alike; outside a scope
// the weight is unknown, and backward() refuses to guess when N > 1. To know n_j for the whole
// window before the first backward, the prepared loader reads the window's batches ahead
// (Note [Window read-ahead]): counting needs no forward pass.
//
// As Accelerate does, it places the work: device() is cuda:0 when a CUDA device is present (unless
// `cpu` or an explicit `device` says otherwise); prepare_model() moves the model there before its
// ParamStore is built, and a prepared loader hands out each batch copied there (the window read
// ahead stays on the host).
//
// Note [Window read-ahead]: a window's batches are read into a pending buffer and published, with
// their weights and the end-of-window mark, only once the window is complete. A source that throws
// mid-window keeps what was read; the DataLoader retries the failed batch on its next call, so the
// window resumes where it stopped. Moving a DataLoader source (set_epoch, set_state: through the
// windowed loader or on the DataLoader itself) drops the read-ahead, so the next batch is the one
// the loader would hand out; a window cut that way starts afresh.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <vector>

#include "core/autograd.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/data.h"
#include "train/distributed.h"

namespace microbatch::train {

struct AcceleratorConfig {
  std::int64_t gradient_accumulation_steps = 1;
  bool cpu = false;              // Accelerate's `cpu`: the CPU even with a CUDA device present
  std::optional<Device> device;  // an explicit device (cpu or cuda:N), over the choice above
  /// In a data-parallel run: auto (nccl on CUDA, mpi on the CPU), mpi or nccl.
  std::string ddp_backend = "auto";
  /// The processes that train together; nullptr is ProcessGroup::world(), those the launcher
  /// started (ProcessGroup::solo() trains this process alone).
  ProcessGroup* group = nullptr;
};

/// A batch with its exact weight in the accumulation window, and whether the window ends with it.
/// Accelerator::accumulate() takes only those a WindowedLoader made.
struct WindowBatch {
  Batch batch;
  double weight = 1.0;        // n_i / sum of n over the window
  bool ends_window = false;   // the optimizer steps after this batch's backward
  std::int64_t window_items = 0;
  /// Whether a WindowedLoader made it: a hand-built batch belongs to no window and never syncs.
  bool from_loader() const { return from_loader_; }

 private:
  friend class WindowedLoader;
  bool from_loader_ = false;
};

/// Groups batches from a source into windows of up to N (the last window of the data may be
/// shorter), attaches each batch's weight, and hands each out copied to `device`
/// (Note [Window read-ahead]).
class WindowedLoader {
 public:
  /// Over any source of batches; call reset() after moving the source yourself.
  WindowedLoader(std::function<std::optional<Batch>()> next, std::int64_t steps,
                 Device device = kCPU);
  /// Over a DataLoader with at least one batch; it must outlive this. Moving the loader drops the
  /// read-ahead, whether through set_epoch() / set_state() here or on the loader itself; between
  /// windows only (Note [Cutting a window]).
  WindowedLoader(DataLoader& loader, std::int64_t steps, Device device = kCPU);
  /// One loader hands out each batch once: a copy would hand out the same read-ahead again.
  WindowedLoader(const WindowedLoader&) = delete;
  WindowedLoader& operator=(const WindowedLoader&) = delete;
  WindowedLoader(WindowedLoader&&) = default;
  WindowedLoader& operator=(WindowedLoader&&) = default;
  /// The next batch with its weight, or nullopt once the source has none (an epoch's end).
  std::optional<WindowBatch> next();
  /// loader.set_epoch(epoch) for a DataLoader source, and a fresh window from its first batch.
  /// Refused while part of a window has been handed out (Note [Cutting a window]).
  void set_epoch(std::int64_t epoch);
  /// loader.set_state(state) for a DataLoader source, and a fresh window from there. Refused
  /// while part of a window has been handed out.
  void set_state(LoaderState state);
  /// Drops the batches read ahead: the next window starts with the source's next batch. Dropping
  /// a window part of which was handed out is the caller's decision: the gradients its
  /// micro-batches added stay, for the caller to zero or keep.
  void reset();

 private:
  bool read_window();
  void check_between_windows(const char* what) const;

  std::function<std::optional<Batch>()> next_;
  DataLoader* loader_ = nullptr;  // the source, when it is a DataLoader
  LoaderState read_to_;           // loader_'s state after the last batch read ahead
  std::int64_t steps_;
  Device device_;
  std::vector<Batch> pending_;      // the window being read; kept when the source throws
  std::deque<WindowBatch> window_;  // the complete window, weighted, on the host
  std::int64_t handed_ = 0;         // batches of the current window handed out, before its last
  ProcessGroup* group_ = nullptr;   // a data-parallel run's ranks, whose windows are one window
  friend class Accelerator;
};

class Accelerator;

/// An optimizer whose step() and zero_grad() act only at a window's boundary. In a data-parallel
/// run step() first sums the gradients over the processes, once per window (a norm read before it
/// sees this process's share).
class AcceleratedOptimizer {
 public:
  AcceleratedOptimizer(Accelerator& accelerator, optim::Optimizer& optimizer);
  void step(optim::StepOptions options = {});
  void zero_grad();
  /// Whether the last boundary step was skipped (found_inf): the step count did not move.
  bool step_was_skipped() const;
  optim::Optimizer& inner() { return optimizer_; }

 private:
  Accelerator& accelerator_;
  optim::Optimizer& optimizer_;
  std::size_t index_;  // this optimizer's entry in Accelerator::prepared_
};

/// A scheduler that advances only at a window's boundary, and not after a skipped step.
class AcceleratedScheduler {
 public:
  AcceleratedScheduler(Accelerator& accelerator, optim::LRScheduler& scheduler)
      : accelerator_(accelerator), scheduler_(scheduler) {}
  void step();

 private:
  Accelerator& accelerator_;
  optim::LRScheduler& scheduler_;
};

/// The scope of one micro-batch: while it lives, every backward adds w * g with this micro-batch's
/// weight; sync_gradients() says whether the window ends with it.
class AccumulateScope {
 public:
  ~AccumulateScope();
  AccumulateScope(const AccumulateScope&) = delete;
  AccumulateScope& operator=(const AccumulateScope&) = delete;

 private:
  friend class Accelerator;
  AccumulateScope(Accelerator& accelerator, double weight);

  Accelerator& accelerator_;
  GradWeightGuard weight_;
};

class Accelerator {
 public:
  explicit Accelerator(AcceleratorConfig config = {});

  /// Where the model and batches go: config.device, else cuda:0 when present and not config.cpu
  /// (cuda:(local rank) in a data-parallel run), else the CPU.
  Device device() const { return device_; }
  /// The processes of a data-parallel run, as Accelerate names them (Note [Data parallel] in
  /// train/distributed.h): 1, 0, 0 and true for a single process.
  int num_processes() const { return group_->size(); }
  int process_index() const { return group_->rank(); }
  int local_process_index() const { return group_->local_rank(); }
  bool is_main_process() const { return group_->is_main(); }
  /// The sum of `value` over the processes (a loss to log, a count): every process calls it.
  double reduce(double value) { return group_->all_reduce_sum(value); }
  /// Moves the model to device(); call it before building the model's ParamStore. For an
  /// nn::Model, loaders prepared before or after must collate with its ignore_index. In a
  /// data-parallel run every process then holds process 0's weights.
  nn::Module& prepare_model(nn::Module& model);
  /// Windows over a DataLoader (which must outlive them): each batch comes with its window weight
  /// (Note [Exact accumulation]), on device(). Refuses a loader with no batches. In a
  /// data-parallel run the loader must be sharded for this process (.num_replicas =
  /// num_processes(), .rank = process_index()), and the weights are shares of the window over
  /// every process: each window's item count is summed over them.
  WindowedLoader prepare(DataLoader& loader);
  /// The same over any batch source; in a data-parallel run every process's source must yield
  /// as many batches.
  WindowedLoader prepare(std::function<std::optional<Batch>()> next);
  AcceleratedOptimizer prepare(optim::Optimizer& optimizer) { return {*this, optimizer}; }
  /// The scheduler skips a step when its own optimizer's last step was skipped (when that
  /// optimizer was prepared; else when any prepared optimizer's was, as Accelerate does).
  AcceleratedScheduler prepare(optim::LRScheduler& scheduler) { return {*this, scheduler}; }

  /// Enters the scope of the micro-batch most recently taken from a prepared loader.
  [[nodiscard]] AccumulateScope accumulate(const WindowBatch& batch);
  /// loss.backward(grad, options), weighted by the enclosing scope (never divide the loss).
  /// Outside a scope only with gradient_accumulation_steps = 1 in one process, where the weight
  /// is 1.
  void backward(const Tensor& loss, const Tensor& grad = {}, BackwardOptions options = {});
  /// True when the current micro-batch ends its window (the optimizer will step).
  bool sync_gradients() const { return sync_gradients_; }
  std::int64_t gradient_accumulation_steps() const { return config_.gradient_accumulation_steps; }

 private:
  friend class AccumulateScope;
  friend class AcceleratedOptimizer;
  friend class AcceleratedScheduler;
  AcceleratorConfig config_;
  ProcessGroup* group_;
  Device device_ = kCPU;
  bool sync_gradients_ = true;
  bool in_scope_ = false;
  struct PreparedOptimizer {
    const optim::Optimizer* optimizer;
    bool step_skipped = false;  // its last boundary step was skipped
  };
  std::vector<PreparedOptimizer> prepared_;  // in the order they were prepared
  std::optional<std::int64_t> model_ignore_index_;  // the prepared model's, when it is an nn::Model
  std::vector<std::int64_t> loader_ignore_indices_;  // the prepared DataLoaders' collate options
};

}  // namespace microbatch::train
