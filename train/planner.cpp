#include "train/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <sstream>

#include "core/allocator.h"
#include "core/ops/dispatch.h"
#include "core/rng.h"
#include "optim/boundary_step.h"
#include "train/loss_sum.h"

namespace microbatch::train {

// Note [Predicting a step's peak]: predict() builds the model as training would (arenas, AdamW
// moments) on the meta device, moves a sample micro-batch there, and runs forward and backward
// there. Meta tensors hold no data but go through an allocator with the training device's caching
// rules (block rounding, best fit, reuse of freed blocks), and under MetaBackendGuard every op
// allocates the tensors that device's kernels allocate (Note [Meta mirrors a backend] in
// core/ops/dispatch.h), so meta's reserved peak is the reserved peak of the same step on the CPU or
// on the GPU, byte for byte (tests/core/test_memory.cpp). The optimizer step is not run on meta: it
// updates the arenas in place and allocates nothing, so its memory is the fixed bytes already
// counted. The prediction is
// the natural peak, with no budget in force: a plan whose natural peak fits under the budget never
// makes the allocator release its cache or refuse a request. A plan is judged by the peak of a
// whole window (Note [Uneven windows]), measured the same way with its micro-batches run in
// sequence.
//
// The breakdown splits that peak exactly: weights, gradients and optimizer state are the arenas'
// reserved blocks; activations are the step's live bytes at their high-water mark (the batch, the
// tensors saved for backward, gradients in flight, kernel scratch); workspace is the rest of the
// reserved peak, the blocks the caching allocator holds beyond live tensors (freed blocks kept for
// reuse, blocks larger than their request). Workspace is the price of caching, not of the model.
//
// Note [What the Trainer holds beside the arenas]: on a GPU the Trainer keeps a few small blocks
// on the device through every window that no model op makes: the deferred boundary step's buffers
// (optim::DeferredBuffers: a 33 KB statistics buffer and, with fp16, the loss scale's state, a view
// of which seeds every backward) and the running loss sums (LossSum in train/trainer.cpp: an f64
// scalar for the run, one for the window, and after each backward the loss cast to f64 and
// weighted). They go to the small pool, whose 2 MiB segments the step's own small blocks share, so
// without them a prediction could fall one segment short of the measured peak: the Fashion-MNIST
// MLP's at micro-batches of 64 in f32 rises from 4 to 6 MiB with them (`microbatch plan --model mlp
// --device cuda --per-device-train-batch-size 64 --train-batch-size 256`). measure() allocates the
// same blocks on meta when it mirrors a GPU, the boundary step's with the same type, and seeds fp16
// backward with the same view. On the CPU none of them exists: the boundary step runs at once and
// the loss sums are host doubles. The blocks held before the step count in no breakdown row but
// workspace (the share of the reserved peak beyond the arenas and the step's live bytes); the
// window's sum and the loss's f64 copies, made in it, count as activations.
//
// Note [Outside the allocator]: on a GPU, cuBLAS takes a 32 MiB workspace per device with
// cudaMalloc, once, on first use (kernels/cuda/runtime.cu), and the CUDA context takes
// a few hundred MiB that the driver manages. None of it goes through the caching allocator, so the
// budget (which the allocator enforces) does not cover it and the predicted and measured peaks do
// not count it; the plan states the workspace beside the budget, so that budget + overheads is
// what the device must have free.

namespace {

std::int64_t block_bytes(std::size_t bytes) {
  return static_cast<std::int64_t>((bytes + kBlockRound - 1) / kBlockRound * kBlockRound);
}

// Meta mirrors the training device's backend inside it; the meta cache is emptied and the RNG put
// back on every exit, so a prediction changes nothing.
class PredictionScope {
 public:
  explicit PredictionScope(Device device)
      : mirror_(device.is_cuda() ? Backend::cuda : Backend::cpu) {
    empty_cache(kMeta);
  }
  ~PredictionScope() { empty_cache(kMeta); }
  PredictionScope(const PredictionScope&) = delete;
  PredictionScope& operator=(const PredictionScope&) = delete;

 private:
  MetaBackendGuard mirror_;
  GeneratorStateGuard rng_;
};

// The cuBLAS workspace size (kernels/cuda/runtime.cu).
constexpr std::int64_t kCublasWorkspaceBytes = std::int64_t{32} << 20;

std::string breakdown_text(const MemoryBreakdown& b) {
  return fmt::format("weights {}, gradients {}, optimizer state {}, activations {}, workspace {}",
                     format_bytes(b.weights), format_bytes(b.gradients),
                     format_bytes(b.optimizer_state), format_bytes(b.activations),
                     format_bytes(b.workspace));
}

// ceil(a / b) for a >= 0, b >= 1, without (a + b - 1)'s overflow near INT64_MAX.
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0); }

// budget * (1 - margin), rounded down: the most a plan's predicted peak may be.
std::int64_t usable_bytes(std::int64_t budget, double margin) {
  return static_cast<std::int64_t>(std::floor(static_cast<double>(budget) * (1.0 - margin)));
}

// The most micro-batch counts the search for fewer micro-batches measures, two windows each (Note
// [Searching for the micro-batch]).
constexpr std::int64_t kCountsScanned = 64;

}  // namespace

std::vector<DeviceOverhead> device_overheads(Device device) {
  if (!device.is_cuda()) return {};
  return {{"cuBLAS workspace", kCublasWorkspaceBytes}};
}

std::int64_t MemoryBreakdown::total() const {
  return weights + gradients + optimizer_state + activations + workspace;
}

nlohmann::json MemoryBreakdown::to_json() const {
  return {
      {"weights", weights},         {"gradients", gradients}, {"optimizer_state", optimizer_state},
      {"activations", activations}, {"workspace", workspace}, {"total", total()}};
}

std::string MemoryPlan::str() const {
  const std::int64_t last = effective_batch - (accumulation_steps - 1) * micro_batch_size;
  const std::int64_t usable = usable_bytes(budget, margin);
  std::ostringstream os;
  os << fmt::format("memory plan for {} with a budget of {} ({} usable with a {:g}% margin)\n",
                    device.str(), format_bytes(budget), format_bytes(usable), margin * 100.0);
  if (device.is_cuda()) {
    os << "  predicted on the meta device with the CUDA allocator's rules and the CUDA kernels'\n"
          "  allocations: planning needs no GPU\n";
  }
  os << fmt::format("  {:<24}{}\n", "effective batch", effective_batch);
  os << fmt::format("  {:<24}{}\n", "micro-batch size", micro_batch_size);
  os << fmt::format("  {:<24}{}{}\n", "accumulation steps", accumulation_steps,
                    micro_batch_size > 0 && last != micro_batch_size
                        ? fmt::format(" (the last has {})", last)
                        : "");
  os << fmt::format("  {:<24}{}\n", "gradient checkpointing",
                    gradient_checkpointing ? "on" : "off");
  os << fmt::format("  {:<24}{:>12}  {:>6}\n", "predicted peak", format_bytes(predicted_peak),
                    "share");
  const std::pair<const char*, std::int64_t> rows[] = {
      {"weights", breakdown.weights},
      {"gradients", breakdown.gradients},
      {"optimizer state", breakdown.optimizer_state},
      {"activations", breakdown.activations},
      {"workspace", breakdown.workspace}};
  for (const auto& [name, bytes] : rows) {
    const double share = predicted_peak > 0 ? 100.0 * static_cast<double>(bytes) /
                                                  static_cast<double>(predicted_peak)
                                            : 0.0;
    os << fmt::format("    {:<22}{:>12}  {:>5.1f}%\n", name, format_bytes(bytes), share);
  }
  if (predicted_peak > usable) {  // Note [Mixed lengths]
    os << "  the predicted peak is above the usable budget: the micro-batches' many shapes cache\n"
          "  more than it holds, and the allocator hands its cache back before it passes the\n"
          "  budget\n";
  }
  if (!outside_budget.empty()) {
    std::int64_t outside = 0;
    for (const DeviceOverhead& o : outside_budget) outside += o.bytes;
    os << fmt::format("  {:<24}{:>12}  (not in the budget)\n", "outside the allocator", format_bytes(outside));
    for (const DeviceOverhead& o : outside_budget)
      os << fmt::format("    {:<22}{:>12}\n", o.what, format_bytes(o.bytes));
    os << "    and the CUDA context, which the driver manages (a few hundred MiB)\n";
  }
  return os.str();
}

nlohmann::json MemoryPlan::to_json() const {
  nlohmann::json outside = nlohmann::json::object();
  for (const DeviceOverhead& o : outside_budget) outside[o.what] = o.bytes;
  return {{"micro_batch_size", micro_batch_size},
          {"accumulation_steps", accumulation_steps},
          {"effective_batch", effective_batch},
          {"gradient_checkpointing", gradient_checkpointing},
          {"predicted_peak", predicted_peak},
          {"breakdown", breakdown.to_json()},
          {"budget", budget},
          {"margin", margin},
          {"device", device.str()},
          {"outside_budget", outside}};
}

MemoryPlanner::MemoryPlanner(ModelFactory make_model, SampleBatchFn sample, PlannerConfig config)
    : make_model_(std::move(make_model)), sample_(std::move(sample)), config_(std::move(config)) {
  MB_CHECK(make_model_ != nullptr && sample_ != nullptr,
           "[planner] a model factory and a sample batch function are needed");
  MB_CHECK(config_.budget > 0, "[planner] the memory budget must be positive, got {}",
           config_.budget);
  MB_CHECK(config_.margin >= 0.0 && config_.margin < 1.0,
           "[planner] the margin must be in [0, 1), got {}", config_.margin);
  MB_CHECK(config_.effective_batch >= 1, "[planner] the effective batch must be at least 1, got {}",
           config_.effective_batch);
  for (const RankShare& r : config_.other_ranks) {
    MB_CHECK(r.window >= 1 && r.window <= config_.effective_batch && r.epoch_remainder >= 0,
             "[planner] another rank's window of {} (epoch remainder {}) must be in [1, {}] (the "
             "effective batch)",
             r.window, r.epoch_remainder, config_.effective_batch);
  }
  MB_CHECK(!config_.packed_shapes || config_.sample_packed,
           "[planner] packed_shapes needs sample_packed, to make batches of its shapes");
  if (config_.micro_batch_size) {
    MB_CHECK(*config_.micro_batch_size >= 1 && *config_.micro_batch_size <= config_.effective_batch,
             "[planner] the micro-batch size {} must be in [1, {}] (the effective batch)",
             *config_.micro_batch_size, config_.effective_batch);
  }
  MB_CHECK(!(config_.force_checkpointing.value_or(false) && !config_.allow_checkpointing),
           "[planner] checkpointing is both forced and not allowed");
  usable_ = usable_bytes(config_.budget, config_.margin);
}

MemoryBreakdown MemoryPlanner::predict(std::int64_t n, bool checkpointing) {
  MB_CHECK(n >= 1, "[planner] a micro-batch needs at least one sample, got {}", n);
  return measure({}, {config_.effective_batch, {n}}, checkpointing);
}

// Note [Uneven windows]: the first micro-batch of a run starts from an empty cache, the next ones
// from the blocks their predecessors left, and may settle on a higher reserved peak; a smaller last
// micro-batch cannot reuse the cached blocks of the larger ones at all (a block serves a request it
// exceeds by at most a quarter), so it takes blocks of its own. The steady state of training is
// therefore measured as a window's first micro-batch, its last, and the next window's first: on
// the MLP, CNN and GPT the reserved peak settles by the second micro-batch and never moves again.
// An epoch whose training set is not a whole number of windows ends on a shorter window, whose
// last micro-batch is measured too, followed by the next epoch's first (PlannerConfig::
// epoch_remainder): without it the run's peak, at the first epoch's end, was above the prediction
// (by 3.5% for the Fashion-MNIST MLP, 13% for the tinyshakespeare GPT).
namespace {

// The micro-batches measured for one rank's windows of `window` samples, split into micro-batches
// of n, and its epoch's last window of `remainder`.
std::vector<std::int64_t> rank_window_sizes(std::int64_t window, std::int64_t remainder,
                                            std::int64_t n) {
  n = std::min(n, window);  // a rank's share smaller than the plan's micro-batch is one micro-batch
  const std::int64_t last = window - (ceil_div(window, n) - 1) * n;
  std::vector<std::int64_t> sizes = last == n ? std::vector<std::int64_t>{n, n}
                                              : std::vector<std::int64_t>{n, last, n};
  // An epoch's last window, when shorter, ends on a micro-batch of its own size, which takes
  // blocks of its own too; the next epoch's first follows it.
  remainder %= window;
  if (remainder > 0) {
    const std::int64_t tail = remainder % n == 0 ? n : remainder % n;
    if (tail != n && tail != last) {
      sizes.push_back(tail);
      sizes.push_back(n);
    }
  }
  return sizes;
}

}  // namespace

// Note [Agreed plans]: the ranks of a data-parallel run train with one plan, the same micro-batch
// size and checkpointing on each (ARCHITECTURE: planner decisions are agreed by all ranks). Their
// windows differ a little: each rank's share of a window, and of an epoch's short last window,
// is the window's size over the ranks, rounded up on the first ranks and down on the others, and
// sequences of different lengths fall to the ranks in different shapes. Every rank knows every
// rank's shares (they all read the same global order), so every rank plans the same problem, all
// the ranks' windows at once: effective_batch and epoch_remainder are the largest shares (rank
// 0's), other_ranks holds the other shares that differ, a window of n is predicted as the highest
// of the ranks' windows, and packed_shapes holds every rank's stretches. The plan fits each rank,
// and being a function of the same inputs on each, it is the same plan without any message; the
// Trainer still compares the ranks' plans, which differ only when their arguments or data do.
std::vector<MemoryPlanner::WindowRun> MemoryPlanner::window_sizes(std::int64_t n) const {
  std::vector<WindowRun> runs{
      {config_.effective_batch,
       rank_window_sizes(config_.effective_batch, config_.epoch_remainder, n)}};
  // A run that begins another of the same window, or another's beginning: the longer one's peak is
  // the higher.
  auto begins = [](const WindowRun& a, const WindowRun& b) {
    return a.window == b.window && a.sizes.size() <= b.sizes.size() &&
           std::equal(a.sizes.begin(), a.sizes.end(), b.sizes.begin());
  };
  for (const RankShare& r : config_.other_ranks) {
    WindowRun run{r.window, rank_window_sizes(r.window, r.epoch_remainder, n)};
    auto it = std::find_if(runs.begin(), runs.end(), [&](const WindowRun& other) {
      return begins(run, other) || begins(other, run);
    });
    if (it == runs.end()) {
      runs.push_back(std::move(run));
    } else if (it->sizes.size() < run.sizes.size()) {
      *it = std::move(run);
    }
  }
  return runs;
}

// Note [Mixed lengths]: token sequences of different lengths are planned at the longest, T_max
// (Note [Token-budget micro-batches] in train/windows.cpp), but a run's micro-batches come in many
// shapes, rows x padded length, and their tensors change size from one micro-batch to the next. On
// the CPU a cached block serves only a request it exceeds by at most a quarter, so a micro-batch
// with fewer tokens than those before it takes blocks of its own: the cache comes to hold blocks
// for each band of sizes the run has met, and the run's peak climbs far past the window's. Over 120
// windows of 16, micro-batches of up to 4 x 16 tokens of the f64 GPT of
// tests/train/test_trainer_budget.cpp on lengths uniform over 3..16 reserved 2.15 times the peak of
// the window at T_max; a 2-layer, 128-wide GPT on lengths 16..256, with micro-batches of up to 4 x
// 256 tokens, 6.4 times it (283 MiB for a 44 MiB window). With CUDA's rules, which split a larger
// cached block for a smaller request, the same GPT's run is predicted to reserve 30 MiB for a 28
// MiB window. What the cache holds depends on which shapes the run makes, and on the order in which
// it first makes them, not on how often: a micro-batch starts from every block its predecessors
// left, and one of a shape met before finds what it took then. So predict_window measures the run's
// own shapes (PlannerConfig::packed_shapes; the Trainer packs the training set's lengths into the
// run's windows as train() will, up to 256 distinct shapes of its first 65,536 windows), each once
// in the order the run first meets them, then the window at T_max, all on one model. For both GPTs,
// with micro-batches of 2 to 8 rows, that is the run's peak to the byte, or up to 0.2% under it at
// 8 rows. It costs one meta step per distinct shape, for the plan made only. An evaluation or a
// checkpoint's save hands the cache back (evaluate_now and save in train/trainer.cpp), and a
// resume starts from an empty one; after each the run meets its shapes again, in another order,
// and may cache more: measured from the first window alone, the f64 GPT above went 6% over the
// prediction when it evaluated or saved every 7 windows, and 10% after resuming at window 60. So
// the run is cut into stretches at those points (a resume starts at one: the save it resumes
// from), each stretch's shapes are measured from an empty cache in the order it first meets them,
// and the highest peak is the prediction. At most kShapesMeasured distinct shapes a stretch and
// kShapesInAll in all are measured (train/plan_training.cpp; the ranks of a data-parallel run
// share them): stretches past that are taken to cache no more than those measured.
//
// Plans are still judged by the window alone, which bounds every micro-batch's own peak (and keeps
// the micro-batch size of sequences of one length). The predicted peak may then pass the usable
// budget, and the plan says so; the run keeps within the budget, as the allocator hands its cache
// back before it takes a block past it. Judging plans by the run's peak instead would shrink the
// micro-batch until its shapes' cache fits: in the Trainer's token-budget test, 1 row instead of 2,
// and on the CPU, where the cache is several times the window's, to a fraction.
MemoryBreakdown MemoryPlanner::predict_window(std::int64_t n, bool checkpointing) {
  MB_CHECK(n >= 1 && n <= config_.effective_batch,
           "[planner] a micro-batch size must be in [1, {}], got {}", config_.effective_batch, n);
  MemoryBreakdown highest = window(n, checkpointing);
  if (!config_.packed_shapes) return highest;
  for (const std::vector<PackedShape>& stretch : config_.packed_shapes(n)) {
    for (const WindowRun& run : window_sizes(n)) {
      const MemoryBreakdown b = measure(stretch, run, checkpointing);
      if (b.total() > highest.total()) highest = b;
    }
  }
  return highest;
}

MemoryBreakdown MemoryPlanner::window(std::int64_t n, bool checkpointing) {
  MemoryBreakdown highest;
  for (const WindowRun& run : window_sizes(n)) {
    const MemoryBreakdown b = measure({}, run, checkpointing);
    if (highest.total() == 0 || b.total() > highest.total()) highest = b;
  }
  return highest;
}

MemoryBreakdown MemoryPlanner::measure(const std::vector<PackedShape>& shapes, const WindowRun& run,
                                       bool checkpointing) {
  const auto key = std::tuple{shapes, run.window, run.sizes, checkpointing};
  if (auto it = predictions_.find(key); it != predictions_.end()) return it->second;

  PredictionScope scope(config_.device);
  const std::int64_t base = memory_stats(kMeta).reserved.current;  // other meta users' live bytes
  MemoryBreakdown b;
  {
    std::unique_ptr<nn::Model> model;
    {
      nn::DeviceScope on_meta(kMeta);
      model = make_model_(checkpointing);
    }
    MB_CHECK(model != nullptr, "[planner] the model factory returned no model");
    model->to(kMeta);  // what the factory made outside the layers (its own tensors)
    // As the Trainer does (Note [Arenas in blocks of their own] in train/trainer.cpp): the arenas
    // and the moments take blocks of their own size, not the initialisers' cached ones.
    empty_cache(kMeta);
    optim::ParamStore store(*model, config_.store);
    empty_cache(kMeta);  // the parameters' own blocks, which the store's arenas replaced
    optim::AdamW optimizer(store, config_.adamw);
    b.weights = block_bytes(store.weights().nbytes()) + (store.has_master() ? block_bytes(store.master().nbytes()) : 0);
    b.gradients = block_bytes(store.grads().nbytes());
    b.optimizer_state = block_bytes(optimizer.state_bytes() / 2) * 2;  // two moment arenas
    // Note [What the Trainer holds beside the arenas]: held as training holds them after its first
    // window: the run's sum made, the window's made by its first micro-batch.
    const bool gpu = config_.device.is_cuda();
    const bool scaled = config_.store.compute_dtype == DType::f16;
    const kernels::LossScaleState scale_state{};
    const optim::DeferredBuffers boundary =
        gpu ? optim::DeferredBuffers(kMeta, scaled ? &scale_state : nullptr)
            : optim::DeferredBuffers();
    // The run's sum, as LossSum holds it once a window has been added: one f64 scalar.
    const Tensor run_loss = gpu ? empty({}, {.dtype = DType::f64, .device = kMeta}) : Tensor();
    // The window's, added to as the Trainer adds to it; a window ends where its rows reach the
    // run's window, a rank's share (where a window has more than two micro-batches, the sequence
    // below skips its middle ones, and the next window's first then runs beside a sum it does not
    // have: 512 bytes over).
    LossSum window_loss(kMeta);
    std::int64_t window_rows = 0;
    reset_peak_memory_stats(kMeta);
    const MemoryStats start = memory_stats(kMeta);
    MB_ASSERT(start.reserved.current - base >= b.weights + b.gradients + b.optimizer_state,
              "the arenas hold {} bytes on meta, fewer than the {} they requested",
              start.reserved.current - base, b.weights + b.gradients + b.optimizer_state);
    // As a training loop holds them, the micro-batch and the model's output (logits and loss) live
    // until its backward has run. The host batch counts on meta once copied there.
    auto step = [&](const Batch& batch) {
      Tensor inputs = batch.inputs.to(kMeta);
      Tensor labels = batch.labels.defined() ? batch.labels.to(kMeta) : Tensor();
      // As the Trainer does, floating inputs are cast to the compute dtype (both copies live).
      const DType compute = store.weights().dtype();
      Tensor model_inputs = is_floating(inputs.dtype()) && inputs.dtype() != compute ? inputs.to(compute) : inputs;
      nn::ModelOutput out = model->forward(model_inputs, labels);
      MB_CHECK(out.loss.defined(), "[planner] the model returned no loss for the sample batch");
      out.logits = Tensor();  // as the Trainer does (Note [Reusing an input's memory])
      // fp16 training seeds backward with the loss scale (optim::BoundaryStep::backward_seed): on
      // the CPU a tensor of its own, which the caller holds until backward returns; on a GPU a
      // view of the device's scale. Its value does not matter here.
      Tensor seed;
      if (gpu) {
        seed = boundary.seed(out.loss);
      } else if (scaled) {
        seed = full(out.loss.shape(), 1.0, {.dtype = out.loss.dtype(), .device = kMeta});
      }
      out.loss.backward(seed);
      if (gpu) {  // weighted by the micro-batch's share of the window, as the Trainer weights it
        const std::int64_t rows = batch.size();
        const double share = static_cast<double>(rows) / static_cast<double>(run.window);
        window_loss.add(out.loss, share);
        window_rows += rows;
        if (window_rows >= run.window) {  // the window ends: the next starts a sum
          window_loss = LossSum(kMeta);
          window_rows = 0;
        }
      }
    };
    for (const PackedShape& shape : shapes) {  // Note [Mixed lengths]
      const Batch batch = config_.sample_packed(shape);
      MB_CHECK(batch.size() == shape.rows && batch.inputs.dim() == 2 &&
                   batch.inputs.size(1) == shape.length,
               "[planner] the packed sample function returned a batch of shape {}, asked for "
               "({}, {})",
               shape_str(batch.inputs.shape()), shape.rows, shape.length);
      step(batch);
    }
    std::map<std::int64_t, Batch> host;  // one host batch per size: only its shapes matter
    for (std::int64_t n : run.sizes) {
      if (!host.count(n)) {
        host[n] = sample_(n);
        MB_CHECK(host[n].size() == n,
                 "[planner] the sample batch function returned {} samples, asked for {}",
                 host[n].size(), n);
      }
      step(host[n]);
    }
    const MemoryStats end = memory_stats(kMeta);
    b.activations = end.allocated.peak - start.allocated.current;
    b.workspace =
        end.reserved.peak - base - b.weights - b.gradients - b.optimizer_state - b.activations;
  }
  predictions_.emplace(key, b);
  return b;
}

bool MemoryPlanner::fits(std::int64_t n, bool checkpointing) {
  return window(n, checkpointing).total() <= usable_;
}

// Note [Searching for the micro-batch]: a window's peak is at least the peak of one step of its
// largest micro-batch, and that grows with n, so a binary search on single steps bounds the answer:
// `top`'s step fits, top + 1's does not (nor does its window). The window's own peak is not
// monotone in n: it depends on the sizes of the last micro-batch and of the epoch's tail (Note
// [Uneven windows]), which jump as n moves. An n that splits the effective batch E evenly (or
// leaves a last micro-batch close to n, whose blocks it can reuse) adds almost nothing to one
// step's peak, while its neighbour may add a whole second set of blocks, so below an n that does
// not fit a smaller one may fit again. Each window is a full measurement on meta, and walking
// down from top one size at a time took thousands of them for a large E (6 minutes for the
// Fashion-MNIST MLP at E = 8192). The search instead:
//   - walks down from top one size at a time, as far as log2(top) sizes, then gallops down
//     (strides 2, 4, 8, ...) to a size that fits and bisects between it and the last size that did
//     not. The gallop can stride over the sizes that fit and land far below them: for the MLP of
//     tests/train/test_planner.cpp at E = 513 with an epoch tail of 100, it found 20 (26
//     micro-batches) where 34 (16) fits;
//   - then, since throughput follows the number of micro-batches ceil(E / n) (Note [Expected
//     throughput]), scans the smaller counts k, fewest first from ceil(E / top). The sizes with k
//     micro-batches are ceil(E / k) (the even split) to ceil(E / (k - 1)) - 1 (the largest, top for
//     the first count); a count no size has is skipped. For each count the largest size is
//     measured, then the even split; the first count where one fits gives the answer: its largest
//     size, or else the walk, gallop and bisection from there down to the even split. At most
//     kCountsScanned counts are measured (two windows each), so that planning stays within
//     seconds when the first answer has many more micro-batches than top.
// What the answer n guarantees, and no more:
//   - n fits and n + 1 does not (or n = E);
//   - n = top, the largest size that fits, when top's window fits; and the largest size that fits
//     wherever the window's peak does not rise as n falls;
//   - for each count from ceil(E / top) to one less than n's that some size makes, the first
//     kCountsScanned of them, neither its largest size nor its even split fits. A size strictly
//     between the two may still fit with fewer micro-batches, and further counts are not measured:
//     n is not always the largest size that fits, nor always one with the fewest micro-batches.
// Over a sweep of budgets for the MLP, CNN and GPT of tests/train/test_planner.cpp the answer has
// the walk's number of micro-batches every time, and is the walk's own answer for all but a few
// budgets where the window's peak dips again further down (a size with the same count).

std::int64_t MemoryPlanner::search_down(std::int64_t miss, std::int64_t floor, std::int64_t walk,
                                        bool checkpointing) {
  std::int64_t hit = 0, stride = 1;
  for (std::int64_t probes = 1; hit == 0; ++probes) {
    const std::int64_t n = std::max(miss - stride, floor);
    if (fits(n, checkpointing)) {
      hit = n;
    } else if (n == floor) {
      return 0;
    } else {
      miss = n;
      if (probes >= walk) stride *= 2;
    }
  }
  while (miss - hit > 1) {
    const std::int64_t mid = hit + (miss - hit) / 2;
    (fits(mid, checkpointing) ? hit : miss) = mid;
  }
  return hit;
}

std::int64_t MemoryPlanner::max_micro_batch(bool checkpointing) {
  auto step_fits = [&](std::int64_t n) { return predict(n, checkpointing).total() <= usable_; };
  if (!step_fits(1)) return 0;
  const std::int64_t e = config_.effective_batch;
  std::int64_t top = 1, above = e;  // top's step fits, above's does not
  if (step_fits(above)) {
    top = above;
  } else {
    while (above - top > 1) {
      const std::int64_t mid = top + (above - top) / 2;
      (step_fits(mid) ? top : above) = mid;
    }
  }
  if (fits(top, checkpointing)) return top;
  if (top == 1) return 0;
  const auto log2_top = static_cast<std::int64_t>(std::bit_width(static_cast<std::uint64_t>(top)));
  const std::int64_t n = search_down(top, 1, log2_top, checkpointing);
  if (n == 0) return 0;
  // Fewer micro-batches, fewest first. A count's largest size is one below the smallest size with
  // fewer micro-batches, an even split measured here already or above top: it does not fit, so an
  // answer taken here stays maximal.
  std::int64_t scanned = 0;
  for (std::int64_t k = ceil_div(e, top); k < ceil_div(e, n) && scanned < kCountsScanned; ++k) {
    const std::int64_t even = ceil_div(e, k);
    const std::int64_t most = k == 1 ? top : std::min(top, ceil_div(e, k - 1) - 1);
    if (most < even) continue;  // no size splits E into k micro-batches
    ++scanned;
    if (fits(most, checkpointing)) return most;
    if (even < most && fits(even, checkpointing))
      return search_down(most, even, log2_top, checkpointing);
  }
  return n;
}

MemoryPlan MemoryPlanner::make_plan(std::int64_t n, bool checkpointing) {
  MemoryPlan p;
  p.micro_batch_size = n;
  p.accumulation_steps = ceil_div(config_.effective_batch, n);
  p.effective_batch = config_.effective_batch;
  p.gradient_checkpointing = checkpointing;
  p.breakdown = predict_window(n, checkpointing);
  p.predicted_peak = p.breakdown.total();
  p.budget = config_.budget;
  p.margin = config_.margin;
  p.device = config_.device;
  p.outside_budget = device_overheads(config_.device);
  return p;
}

void MemoryPlanner::throw_too_small(bool checkpointing) {
  const MemoryBreakdown need = window(1, checkpointing);
  // The least budget whose usable part holds the need, as the constructor computes it: 1 - margin
  // is rarely exact in a double, so ceil(need / (1 - margin)) can be a byte short or over.
  auto budget_needed = static_cast<std::int64_t>(
      std::ceil(static_cast<double>(need.total()) / (1.0 - config_.margin)));
  while (usable_bytes(budget_needed, config_.margin) < need.total()) ++budget_needed;
  while (budget_needed > 1 && usable_bytes(budget_needed - 1, config_.margin) >= need.total())
    --budget_needed;
  throw OutOfMemoryError(
      fmt::format(
          "[planner] the budget of {} is too small for one sample: one micro-batch of 1 needs {} "
          "({}){}; with a {:g}% margin that takes a budget of at least {} ({} bytes)",
          format_bytes(config_.budget), format_bytes(need.total()), breakdown_text(need),
          checkpointing ? ", with gradient checkpointing" : "", config_.margin * 100.0,
          format_bytes(budget_needed), budget_needed),
      static_cast<std::size_t>(need.total()));
}

// Note [Expected throughput]: a window's time is taken to be proportional to the bytes it moves.
// Every micro-batch, whatever its size, reads the weights (forward and backward) and reads and
// writes the gradient arena: 2 (W + G). Every sample writes its activations in forward and reads
// them in backward: 2 A, with A the activation bytes per sample measured without checkpointing.
// Checkpointing re-runs the forward during backward, about one pass in three more: 4/3. So for E
// samples in micro-batches of n,
//   time(n, ckpt) = (ceil(E / n) * 2 (W + G) + E * 2 A) * (ckpt ? 4/3 : 1),
// and the plan with the least time has the best throughput. The optimizer step runs once per window
// in every plan and is left out. Checkpointing therefore wins only when it cuts the number of
// micro-batches enough: weight-heavy models (an MLP) at small micro-batches, or a budget that
// leaves no micro-batch without it.
MemoryPlan MemoryPlanner::plan() {
  const std::int64_t effective = config_.effective_batch;
  const bool may_plain = !config_.force_checkpointing.value_or(false);
  const bool may_checkpoint =
      config_.force_checkpointing.value_or(config_.allow_checkpointing);  // forced on, or allowed

  if (config_.micro_batch_size) {  // fixed by the user: only checked
    const std::int64_t n = *config_.micro_batch_size;
    if (may_plain && fits(n, false)) return make_plan(n, false);
    if (may_checkpoint && fits(n, true)) return make_plan(n, true);
    const bool ckpt = may_checkpoint;  // the smaller need of the modes allowed
    const MemoryBreakdown need = window(n, ckpt);
    const std::int64_t largest = max_micro_batch(ckpt);
    if (largest == 0) throw_too_small(ckpt);
    throw OutOfMemoryError(
        fmt::format(
            "[planner] the micro-batch size {} does not fit the budget of {}: it needs {} ({}), "
            "more than the {} usable with a {:g}% margin; the largest that fits is {}",
            n, format_bytes(config_.budget), format_bytes(need.total()), breakdown_text(need),
            format_bytes(usable_), config_.margin * 100.0, largest),
        static_cast<std::size_t>(need.total()));
  }

  const std::int64_t plain = may_plain ? max_micro_batch(false) : 0;
  const std::int64_t ckpt = may_checkpoint && plain < effective ? max_micro_batch(true) : 0;
  if (plain == 0 && ckpt == 0) throw_too_small(may_checkpoint);
  if (ckpt <= plain) return make_plan(plain, false);
  if (plain == 0) return make_plan(ckpt, true);

  const MemoryBreakdown p = window(plain, false);
  const double per_micro_batch = 2.0 * static_cast<double>(p.weights + p.gradients);
  const double per_sample = 2.0 * static_cast<double>(p.activations) / static_cast<double>(plain);
  auto time = [&](std::int64_t n, double factor) {
    return (static_cast<double>(ceil_div(effective, n)) * per_micro_batch +
            static_cast<double>(effective) * per_sample) *
           factor;
  };
  return time(ckpt, 4.0 / 3.0) < time(plain, 1.0) ? make_plan(ckpt, true) : make_plan(plain, false);
}

}  // namespace microbatch::train
