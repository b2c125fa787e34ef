// plan_training: the memory plan of a Trainer's run, from its arguments and training set. For
// token sequences of different lengths it replays the run's windows to find the shapes of the
// micro-batches the run will make (Note [Mixed lengths] in train/planner.cpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <vector>

#include "core/rng.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/trainer.h"
#include "train/windows.h"

namespace microbatch::train {

namespace {

// The most windows of a run that a plan for token sequences of different lengths reads, the most
// distinct micro-batch shapes of one stretch between cache hand-backs it measures, and the most
// shapes of all stretches (Note [Mixed lengths] in train/planner.cpp). A run past these is
// predicted from what was measured, and may cache more later.
constexpr std::int64_t kWindowsScanned = std::int64_t{1} << 16;
constexpr std::size_t kShapesMeasured = 256;
constexpr std::size_t kShapesInAll = 2048;

// The window a run resumed from resume_from_checkpoint starts at, read from the checkpoint's
// folder name (checkpoint-<step>; for "latest", the newest complete one in output_dir); 0 when
// there is none, or the name says no step. Its cache starts empty there.
std::int64_t resume_window(const TrainingArguments& args) {
  if (args.resume_from_checkpoint.empty()) return 0;
  std::string path = args.resume_from_checkpoint;
  if (path == "latest") {
    const std::vector<std::string> all = list_checkpoints(args.output_dir);
    if (all.empty()) return 0;
    path = all.back();
  }
  return checkpoint_step(std::filesystem::path(path).lexically_normal().filename().string())
      .value_or(0);
}

// Whether train() hands the allocator's cache back after `step` (an evaluation, a checkpoint's
// save, or either at an epoch's end), so that the next window starts from an empty cache.
bool hands_back_cache(const TrainingArguments& args, std::int64_t step, std::int64_t per_epoch) {
  const bool epoch_end = step % per_epoch == 0;
  return args.evaluates_after(step) || args.saves_after(step) ||
         (epoch_end && (args.eval_strategy == "epoch" || args.save_strategy == "epoch"));
}

// The shapes (rows, padded length) of the micro-batches of a run's windows (the first
// kWindowsScanned), cut into stretches where train() hands its cache back: each stretch's distinct
// shapes in the order it first meets them, stretches with the same sequence given once; a resumed
// run starts a stretch at the window it resumes at. Packed within `token_budget` padded tokens, or
// `micro` rows to a micro-batch when token_budget is 0. The windows are the Trainer's: the
// loader's batches of `global` samples (global_window), shuffled with `seed`, of which each of
// `world` ranks takes its share; every rank's stretches are given, in one pass over the windows
// (Note [Mixed lengths] and Note [Agreed plans] in train/planner.cpp; Note [Data parallel] in
// train/distributed.h).
std::vector<std::vector<PackedShape>> run_shapes(const Dataset& data,
                                                 const std::vector<std::int64_t>& lengths,
                                                 const TrainingArguments& args, std::int64_t global,
                                                 int world, std::int64_t micro,
                                                 std::int64_t token_budget) {
  DataLoader loader(data,
                    {.batch_size = global, .shuffle = true, .seed = args.seed, .prefetch = 0});
  const std::int64_t per_epoch = loader.num_batches();
  // The run's windows as train() counts them (max_steps, else the epochs'), the first
  // kWindowsScanned of them.
  const double epoch_windows = std::ceil(args.num_train_epochs * static_cast<double>(per_epoch));
  const std::int64_t windows =
      args.max_steps > 0
          ? std::min(args.max_steps, kWindowsScanned)
          : static_cast<std::int64_t>(std::min(epoch_windows, static_cast<double>(kWindowsScanned)));
  const std::int64_t resumed_at = resume_window(args);
  std::vector<std::vector<PackedShape>> stretches;
  std::set<std::vector<PackedShape>> distinct;
  // The ranks share the limits: each measures up to kShapesInAll / world shapes in all, and up to
  // as many, or kShapesMeasured, a stretch.
  const std::size_t rank_in_all =
      std::max<std::size_t>(kShapesInAll / static_cast<std::size_t>(world), 1);
  const std::size_t rank_measured = std::min(kShapesMeasured, rank_in_all);
  // Each rank's stretch in progress: its distinct shapes, in the order it first meets them.
  struct Stretch {
    std::vector<PackedShape> shapes;
    std::set<PackedShape> seen;
    std::size_t in_all = 0;  // the shapes of its stretches given so far
  };
  std::vector<Stretch> ranks(static_cast<std::size_t>(world));
  auto close_stretches = [&] {
    for (Stretch& r : ranks) {
      if (!r.shapes.empty() && distinct.insert(r.shapes).second) {
        r.in_all += r.shapes.size();
        stretches.push_back(r.shapes);
      }
      r.shapes.clear();
      r.seen.clear();
    }
  };
  auto open = [&](const Stretch& r) { return r.in_all < rank_in_all; };
  // One pass over the windows, each cut into every rank's share.
  for (std::int64_t w = 0; w < windows && std::any_of(ranks.begin(), ranks.end(), open); ++w) {
    if (w > 0 && (w == resumed_at || hands_back_cache(args, w, per_epoch))) close_stretches();
    if (w % per_epoch == 0) loader.set_epoch(w / per_epoch);
    const bool all_measured = std::all_of(ranks.begin(), ranks.end(), [&](const Stretch& r) {
      return !open(r) ||
             r.seen.size() == rank_measured;  // this stretch's first shapes are measured
    });
    if (all_measured) continue;
    const std::vector<std::int64_t> window = loader.batch_indices(w % per_epoch);
    for (int rank = 0; rank < world; ++rank) {
      Stretch& r = ranks[static_cast<std::size_t>(rank)];
      if (!open(r) || r.seen.size() == rank_measured) continue;
      const std::vector<std::int64_t> indices = window_share(window, rank, world);
      std::vector<std::int64_t> window_lengths;
      for (std::int64_t i : indices) window_lengths.push_back(lengths[static_cast<std::size_t>(i)]);
      const std::vector<Chunk> chunks = token_budget > 0
                                            ? pack_window(indices, window_lengths, token_budget)
                                            : split_window(indices, micro);
      for (const Chunk& chunk : chunks) {
        PackedShape shape{.rows = static_cast<std::int64_t>(chunk.size())};
        for (std::int64_t i : chunk)
          shape.length = std::max(shape.length, lengths[static_cast<std::size_t>(i)]);
        if (r.seen.size() == rank_measured || !r.seen.insert(shape).second) continue;
        r.shapes.push_back(shape);
      }
    }
  }
  close_stretches();
  return stretches;
}

}  // namespace

std::int64_t global_window(std::int64_t rank_effective, std::int64_t samples, int world) {
  // min(rank_effective x world, samples), without the product's overflow.
  return rank_effective >= share_size(samples, 0, world) ? samples : rank_effective * world;
}

MemoryPlan plan_training(const ModelInit& model_init, const TrainingArguments& args,
                         const Dataset& train_set, Device device, int world) {
  BatchTriad triad = resolve_batch_triad(args);
  MB_CHECK(train_set.size() > 0, "[plan_training] the training set is empty");
  MB_CHECK(world >= 1, "[plan_training] a run needs at least one process, got {}", world);
  // The ranks' windows are their shares of windows of `global` samples (all of them, one process);
  // the plan is one for all of them, made from rank 0's shares, the largest, and the others' (Note
  // [Agreed plans] in train/planner.cpp).
  const std::int64_t global = global_window(triad.effective, train_set.size(), world);
  const std::int64_t share = share_size(global, 0, world);
  if (triad.effective > share) {
    // A window never holds more than the training set (the loader's one batch is all of it): a
    // larger effective batch is planned and trained as the whole set (a rank: as its share of it),
    // which also keeps the loader's and the planner's batch counts clear of int64 overflow.
    triad = triad.micro > 0 ? split_effective_batch(share, triad.micro) : BatchTriad{share, 0, 0};
  }
  if (args.memory_budget == 0) {
    MemoryPlan p;
    p.micro_batch_size = triad.micro;
    p.accumulation_steps = triad.accumulation;
    p.effective_batch = triad.effective;
    p.gradient_checkpointing = args.gradient_checkpointing;
    p.device = device;
    p.outside_budget = device_overheads(device);
    return p;
  }
  PlannerConfig config;
  config.budget = args.memory_budget;
  config.effective_batch = triad.effective;
  // The loader keeps a short last window; each rank has its share of it.
  const std::int64_t remainder = train_set.size() % global;
  config.epoch_remainder = share_size(remainder, 0, world);
  for (int rank = 1; rank < world; ++rank) {
    const RankShare other{share_size(global, rank, world), share_size(remainder, rank, world)};
    const bool differs =
        other.window != config.effective_batch || other.epoch_remainder != config.epoch_remainder;
    // A rank with no share of a window (fewer samples than ranks) runs no micro-batch.
    if (other.window > 0 && differs &&
        std::find(config.other_ranks.begin(), config.other_ranks.end(), other) ==
            config.other_ranks.end()) {
      config.other_ranks.push_back(other);
    }
  }
  if (args.gradient_checkpointing) config.force_checkpointing = true;
  if (triad.micro > 0) config.micro_batch_size = triad.micro;
  if (args.fp16) config.store.compute_dtype = DType::f16;
  if (args.bf16) config.store.compute_dtype = DType::bf16;
  config.store.grad_dtype = args.accumulation_dtype();
  config.adamw = {.lr = args.learning_rate,
                  .beta1 = args.adam_beta1,
                  .beta2 = args.adam_beta2,
                  .eps = args.adam_epsilon,
                  .weight_decay = args.weight_decay};
  config.device = device;
  // Token sequences of different lengths are planned at the longest (Note [Token-budget
  // micro-batches] in train/windows.cpp): a row shorter than it is measured as that longest one.
  const bool token_labels = train_set.get(0).label.dim() > 0;
  const std::vector<std::int64_t> lengths =
      token_labels ? sequence_lengths(train_set) : std::vector<std::int64_t>{};
  std::map<std::int64_t, std::int64_t> example_of_length;  // the first example of each length
  for (std::size_t i = 0; i < lengths.size(); ++i)
    example_of_length.emplace(lengths[i], static_cast<std::int64_t>(i));
  // The first of the longest examples, by input elements (a sequence's tokens), and that length:
  // what a plan for variable-length sequences measures its windows with.
  std::int64_t longest_length = 0, longest_index = 0;
  if (!example_of_length.empty()) {
    longest_length = example_of_length.rbegin()->first;
    longest_index = example_of_length.rbegin()->second;
  }
  auto batch_of = [&](std::vector<Example> examples) {
    // On a GPU the batch is collated on the host: its one copy to the device is what counts, and
    // the planner makes that copy on meta.
    if (!device.is_cpu()) return collate(examples);
    // On the CPU it is collated on meta, so that what a real collate allocates (and the cache
    // blocks it leaves) is counted like the training loop's. Memory the example alone holds (the
    // dataset made it afresh: its input and label may be views of one such tensor) is a meta
    // allocation of the same bytes, live as long as the example; a view of the dataset's own
    // tensors allocates nothing.
    for (Example& e : examples) {
      const bool shared = e.input.storage() == e.label.storage();
      // The references the example itself holds: two views, or one tensor given twice ({x, x}).
      const long held = shared && e.input.impl() != e.label.impl() ? 2 : 1;
      std::shared_ptr<Storage> own;  // the meta copy of a storage the two views share
      auto to_meta = [&](const Tensor& t) {
        if (t.storage().use_count() != held) {
          return make_strided(std::make_shared<Storage>(0, kMeta), t.shape(),
                              contiguous_strides(t.shape()), 0, t.dtype());
        }
        std::shared_ptr<Storage> meta =
            shared && own ? own : std::make_shared<Storage>(t.storage()->nbytes, kMeta);
        if (shared) own = meta;
        return make_strided(meta, t.shape(), t.strides(), t.offset(), t.dtype());
      };
      e = {to_meta(e.input), to_meta(e.label)};
    }
    return collate(examples);
  };
  if (example_of_length.size() > 1) {
    // The run's micro-batches have other shapes than the window's (Note [Mixed lengths] in
    // train/planner.cpp): the planner measures those of the run's windows, as train() makes them.
    config.packed_shapes = [&](std::int64_t n) {
      return run_shapes(train_set, lengths, args, global, world, n,
                        args.pack_by_tokens ? n * longest_length : 0);
    };
    // Rows of the shape's length, each read afresh as the training loop reads them.
    config.sample_packed = [&](PackedShape shape) {
      std::vector<Example> examples;
      for (std::int64_t i = 0; i < shape.rows; ++i)
        examples.push_back(train_set.get(example_of_length.at(shape.length)));
      return batch_of(std::move(examples));
    };
  }
  // Measuring builds models: keep the random stream the training run will see untouched.
  GeneratorStateGuard rng;
  MemoryPlanner planner(
      [&](bool checkpointing) {
        std::unique_ptr<nn::Model> m = model_init();
        m->set_gradient_checkpointing(checkpointing);
        return m;
      },
      [&](std::int64_t n) {
        std::vector<Example> examples;
        for (std::int64_t i = 0; i < n; ++i) {
          Example e = train_set.get(i % train_set.size());
          if (token_labels && e.input.numel() < longest_length) e = train_set.get(longest_index);
          examples.push_back(std::move(e));
        }
        return batch_of(std::move(examples));
      },
      config);
  MemoryPlan p;
  try {
    p = planner.plan();
  } catch (const OutOfMemoryError& e) {
    // The planner speaks of the micro-batch it was given: say where it came from when the one
    // asked for was cut to the training set.
    const std::int64_t asked = resolve_batch_triad(args).micro;
    if (asked <= triad.micro) throw;
    throw OutOfMemoryError(
        world == 1 ? fmt::format("per_device_train_batch_size {} is more than the {} training "
                                 "examples, so a micro-batch holds all of them: {}",
                                 asked, train_set.size(), e.what())
                   : fmt::format("per_device_train_batch_size {} is more than the {} examples of "
                                 "rank 0's share of a window (the training set's {} over {} "
                                 "processes), so a micro-batch holds all of them: {}",
                                 asked, triad.effective, train_set.size(), world, e.what()),
        e.requested());
  }
  p.sequence_length = longest_length;
  return p;
}

namespace {

// FNV-1a: the same 64 bits for the same text in every process.
std::int64_t text_hash(const std::string& text) {
  std::uint64_t h = 14695981039346656037ULL;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  return static_cast<std::int64_t>(h);
}

}  // namespace

// Note [Agreed plans] (train/planner.cpp): every rank makes the same plan from the same arguments
// and data. Ranks given different ones (a budget, a training set or a seed of their own) would
// plan, cut windows and call their collectives differently, and train on a sum that is no one
// window's gradient: refused on every rank, naming what differs.
void check_arguments_agree(ProcessGroup& group, const TrainingArguments& args) {
  if (group.size() == 1) return;
  // Where each rank trains, and how it sums, are its own to name (a device index per rank, say):
  // prepare_rank compares what they come to.
  nlohmann::json compared = args.to_json();
  for (const char* own : {"device", "use_cpu", "ddp_backend"}) compared.erase(own);
  const std::string arguments = compared.dump();
  const std::vector<std::int64_t> all = group.all_gather({text_hash(arguments)});
  if (std::all_of(all.begin(), all.end(), [&](std::int64_t h) { return h == all[0]; })) return;
  // Each rank names the arguments that differ from rank 0's.
  std::string first = arguments;
  group.broadcast(first, 0);
  const nlohmann::json theirs = nlohmann::json::parse(first);
  std::string differ;
  for (const auto& [key, value] : compared.items()) {
    if (!theirs.contains(key) || theirs.at(key) != value) {
      differ += fmt::format("{}{} {} (rank 0: {})", differ.empty() ? "" : ", ", key, value.dump(),
                            theirs.contains(key) ? theirs.at(key).dump() : "-");
    }
  }
  group.together("comparing its arguments with rank 0's", [&] {
    MB_CHECK(differ.empty(),
             "[Trainer] rank {} of {} was given other training arguments than rank 0: {}; give "
             "every rank the same",
             group.rank(), group.size(), differ);
  });
}

void check_ranks_agree(ProcessGroup& group, const RankInputs& inputs, const MemoryPlan& plan) {
  if (group.size() == 1) return;
  const std::vector<std::int64_t> mine{text_hash(inputs.train_fingerprint),
                                       inputs.window,
                                       inputs.eval_examples,
                                       inputs.compute_metrics ? 1 : 0,
                                       plan.micro_batch_size,
                                       plan.gradient_checkpointing ? 1 : 0,
                                       plan.predicted_peak};
  const std::vector<std::int64_t> all = group.all_gather(mine);
  auto rank_values = [&](int r) {
    return all.begin() + static_cast<std::ptrdiff_t>(r * mine.size());
  };
  auto rank_text = [&](int r) {
    const auto v = rank_values(r);
    return fmt::format(
        "rank {}: training labels {:016x}, windows of {}, {}, {}, micro-batches of {}{}, "
        "predicted peak {} bytes",
        r, static_cast<std::uint64_t>(v[0]), v[1],
        v[2] < 0 ? std::string("no evaluation set") : fmt::format("{} evaluation examples", v[2]),
        v[3] != 0 ? "compute_metrics" : "no compute_metrics", v[4],
        v[5] != 0 ? " with checkpointing" : "", v[6]);
  };
  // Every rank refuses alike, the same comparisons of the same values (rank 0's against each
  // other's): shared, the command prints it once.
  group.together("comparing its data and plan with rank 0's", [&] {
    for (int r = 1; r < group.size(); ++r) {
      MB_CHECK(std::equal(rank_values(0), rank_values(1), rank_values(r)),
               "[Trainer] the {} processes of this run differ in their data or plan ({}; {}): give "
               "every rank the same training and evaluation sets, and compute_metrics",
               group.size(), rank_text(0), rank_text(r));
    }
  });
}

TrainingArguments rank_arguments(const TrainingArguments& args, int world) {
  TrainingArguments rank = args;
  if (world > 1 && args.train_batch_size > 0) {
    MB_CHECK(args.train_batch_size % world == 0,
             "[Trainer] train_batch_size {} is not divisible by the {} processes of this run: each "
             "takes an equal share of the effective batch",
             args.train_batch_size, world);
    rank.train_batch_size = args.train_batch_size / world;
  }
  return rank;
}

}  // namespace microbatch::train
