// MemoryPlanner: chooses the micro-batch size (and whether to checkpoint activations) for a memory
// budget, holding the effective batch fixed. The fixed bytes (weight and gradient arenas, AdamW
// moments) are counted exactly; the activation peak of a candidate micro-batch is measured by
// running its forward and backward on the meta device, whose allocator follows the caching rules
// of the training device (the CPU's, or the CUDA allocator's) and whose ops allocate what that
// device's kernels allocate, so the predicted peak is the reserved peak a real step reaches (Note
// [Predicting a step's peak]). Planning for a GPU needs no GPU.
//
//   MemoryPlanner planner(make_model, sample_batch, {.budget = 256 << 20, .effective_batch = 64});
//   MemoryPlan plan = planner.plan();   // e.g. micro-batch 24, 3 steps (24 + 24 + 16)
//   std::cout << plan.str();
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nn/models.h"
#include "optim/optimizer.h"
#include "train/data.h"

namespace microbatch::train {

/// Bytes of a training step's peak, by what holds them. total() is the predicted reserved peak.
struct MemoryBreakdown {
  std::int64_t weights = 0;          // the weight arena
  std::int64_t gradients = 0;        // the gradient arena
  std::int64_t optimizer_state = 0;  // AdamW's two moment arenas
  std::int64_t activations = 0;      // live tensors of the step at their high-water mark
  std::int64_t workspace = 0;        // reserved at the peak beyond live tensors (cached blocks)
  std::int64_t total() const;
  nlohmann::json to_json() const;
};

/// Device memory that training takes outside the caching allocator: the budget does not cover it
/// and the predicted peak does not count it (Note [Outside the allocator] in planner.cpp).
struct DeviceOverhead {
  std::string what;
  std::int64_t bytes = 0;
};

/// What the device holds outside the allocator while training there: nothing on the CPU; on CUDA
/// the cuBLAS workspace. The CUDA context itself is the driver's and not listed.
std::vector<DeviceOverhead> device_overheads(Device device);

struct MemoryPlan {
  std::int64_t micro_batch_size = 0;    // samples per micro-batch
  std::int64_t accumulation_steps = 0;  // ceil(effective_batch / micro_batch_size)
  std::int64_t effective_batch = 0;     // held fixed (train_batch_size)
  bool gradient_checkpointing = false;
  /// Bytes of reserved memory at a training window's peak; with sequences of many lengths, at the
  /// run's, which may pass the usable budget (Note [Mixed lengths] in train/planner.cpp).
  std::int64_t predicted_peak = 0;
  MemoryBreakdown breakdown;
  std::int64_t budget = 0;
  double margin = 0.05;  // the plan's window peak must be <= budget * (1 - margin)
  Device device = kCPU;  // the training device the plan is for
  std::vector<DeviceOverhead> outside_budget;  // device_overheads(device)
  /// Token data: the sequence length every planned row had, the training set's longest (Note
  /// [Token-budget micro-batches] in train/windows.cpp); 0 otherwise.
  std::int64_t sequence_length = 0;
  /// The plan and its predicted peak broken down, as a table.
  std::string str() const;
  nlohmann::json to_json() const;
};

/// The shape of a micro-batch of token sequences: `rows` sequences, each padded to `length` tokens.
struct PackedShape {
  std::int64_t rows = 0;
  std::int64_t length = 0;
  auto operator<=>(const PackedShape&) const = default;
};

/// One rank's windows in a data-parallel run: its share of a window, and of an epoch's last window.
struct RankShare {
  std::int64_t window = 0;
  std::int64_t epoch_remainder = 0;
  auto operator<=>(const RankShare&) const = default;
};

/// Builds a fresh model for measurement; the argument says whether to checkpoint activations.
using ModelFactory = std::function<std::unique_ptr<nn::Model>(bool gradient_checkpointing)>;
/// A batch of n samples shaped like the training data (values irrelevant: it will be moved to
/// meta). A host batch counts as the copy a training step makes of it on the device; a meta batch
/// counts as whatever its making allocated on meta.
using SampleBatchFn = std::function<Batch(std::int64_t n)>;
/// A batch of that shape, counted as SampleBatchFn's batches are.
using SamplePackedFn = std::function<Batch(PackedShape shape)>;

struct PlannerConfig {
  std::int64_t budget = 0;  // bytes
  double margin = 0.05;
  std::int64_t effective_batch = 0;  // train_batch_size
  /// Samples in an epoch's last window when the training set is not a whole number of effective
  /// batches (0: none); its smaller micro-batches are measured too (Note [Uneven windows]).
  std::int64_t epoch_remainder = 0;
  /// A data-parallel run's other ranks, where their shares differ from this one's (effective_batch
  /// and epoch_remainder; each window at most effective_batch): the plan is one for every rank, and
  /// a window is predicted as the highest of the ranks' (Note [Agreed plans]).
  std::vector<RankShare> other_ranks;
  bool allow_checkpointing = true;
  std::optional<bool> force_checkpointing;  // user's gradient_checkpointing if set
  std::optional<std::int64_t>
      micro_batch_size;        // user fixed per_device_train_batch_size (then only checked)
  optim::AdamWConfig adamw{};  // the optimizer whose state is counted
  optim::ParamStoreOptions store{};  // the arenas counted (a 16-bit compute dtype adds a master copy)
  /// The training device: meta mirrors its allocator and its kernels' allocations (MetaBackendGuard).
  Device device = kCPU;
  /// Token sequences of different lengths (Note [Mixed lengths]): the micro-batches a run makes
  /// when its micro-batch size is n (n rows of the longest length), as stretches between the
  /// points where the training loop hands its cache back (an evaluation, a checkpoint's save):
  /// each stretch's distinct shapes, in the order it first meets them. Unset for data whose
  /// micro-batches all have the window's shape.
  std::function<std::vector<std::vector<PackedShape>>(std::int64_t n)> packed_shapes;
  SamplePackedFn sample_packed;  // a batch of one of packed_shapes' shapes; set with it
};

class MemoryPlanner {
 public:
  MemoryPlanner(ModelFactory make_model, SampleBatchFn sample, PlannerConfig config);

  /// Predicted peak (and breakdown) of one full training step (forward + backward of one
  /// micro-batch of n samples with all arenas and optimizer state live, plus the optimizer step)
  /// on the meta device. Leaves no allocation behind on meta or on the CPU, nor a changed RNG.
  /// The model is built on meta (nn::DeviceScope): its layers' parameters take no host memory.
  MemoryBreakdown predict(std::int64_t n, bool checkpointing);
  /// The plan with the best expected throughput (Note [Expected throughput]) whose window fits
  /// budget * (1 - margin). Throws OutOfMemoryError (a microbatch::Error) saying how much is
  /// needed when even one sample does not fit, or when a fixed micro_batch_size does not. With
  /// packed_shapes the plan's predicted peak may pass the usable budget (Note [Mixed lengths]).
  MemoryPlan plan();
  /// A micro-batch size n (at most the effective batch) whose predicted window peak fits while the
  /// peak of n + 1 does not, for a given checkpointing choice (0 if none), in O(log n)
  /// measurements plus at most 128 for fewer micro-batches: the largest that fits wherever the
  /// window's peak is monotone (Note [Searching for the micro-batch] says what holds elsewhere).
  std::int64_t max_micro_batch(bool checkpointing);
  /// Predicted peak of a window of micro-batches of n (the last one smaller when n does not divide
  /// the effective batch) followed by the next window's first micro-batch: the steady-state peak of
  /// training with that micro-batch size (Note [Uneven windows]). Plans are judged by this, but
  /// for packed_shapes: each stretch's micro-batch shapes are then measured first, on the same
  /// model, the highest peak is the prediction, and plans are judged by the window alone (Note
  /// [Mixed lengths]).
  MemoryBreakdown predict_window(std::int64_t n, bool checkpointing);
  /// budget * (1 - margin), rounded down: the most a plan's window peak may be.
  std::int64_t usable_budget() const { return usable_; }

 private:
  /// The window of n alone, without packed_shapes' micro-batches: what plans are judged by; the
  /// highest of the ranks' windows.
  MemoryBreakdown window(std::int64_t n, bool checkpointing);
  bool fits(std::int64_t n, bool checkpointing);
  /// A size in [floor, miss) whose window fits while the next one's does not, given that miss's
  /// does not fit (0 if none down to floor does): down one size at a time for `walk` sizes, then by
  /// doubling strides, then bisecting (Note [Searching for the micro-batch]).
  std::int64_t search_down(std::int64_t miss, std::int64_t floor, std::int64_t walk,
                           bool checkpointing);
  /// Micro-batch sizes in sequence, from windows of `window` samples (a rank's share).
  struct WindowRun {
    std::int64_t window = 0;
    std::vector<std::int64_t> sizes;
  };
  /// The peak of micro-batches of these shapes and then of the run's sizes in sequence, on one
  /// model (memoized).
  MemoryBreakdown measure(const std::vector<PackedShape>& shapes, const WindowRun& run,
                          bool checkpointing);
  /// The micro-batch sizes measured for a window of n (Note [Uneven windows]): a run for each
  /// rank's shares, but for one that another of the same window begins with (Note [Agreed plans]).
  std::vector<WindowRun> window_sizes(std::int64_t n) const;
  MemoryPlan make_plan(std::int64_t n, bool checkpointing);
  [[noreturn]] void throw_too_small(bool checkpointing);

  ModelFactory make_model_;
  SampleBatchFn sample_;
  PlannerConfig config_;
  std::int64_t usable_ = 0;
  std::map<std::tuple<std::vector<PackedShape>, std::int64_t, std::vector<std::int64_t>, bool>,
           MemoryBreakdown>
      predictions_;  // (shapes, window, sizes, ckpt)
};

}  // namespace microbatch::train
