#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "core/json_text.h"
#include "optim/boundary_step.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/budget_guard.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/loss_sum.h"
#include "train/weights.h"
#include "train/windows.h"

namespace microbatch::train {

// ---- set-up and planning -----------------------------------------------------------------------

Trainer::Trainer(ModelInit model_init, TrainingArguments args, const Dataset& train_set,
                 const Dataset* eval_set, ComputeMetrics compute_metrics, ProcessGroup* group)
    : model_init_(std::move(model_init)),
      args_(std::move(args)),
      train_set_(train_set),
      eval_set_(eval_set),
      compute_metrics_(std::move(compute_metrics)),
      log_stream_(&std::cout),
      group_(group != nullptr ? group : &ProcessGroup::world()) {
  // Each step of the set-up that may fail on one rank alone fails on every rank (Note [Failing
  // together] in train/distributed.h).
  Device asked = kCPU;
  group_->together("checking its arguments", [&] {
    args_.validate();
    asked = args_.training_device();  // refuses a CUDA device this machine lacks
    MB_CHECK(train_set_.size() > 0, "[Trainer] the training set is empty");
    MB_CHECK(eval_set_ != nullptr || args_.eval_strategy == "no",
             "[Trainer] eval_strategy = {} needs an evaluation dataset: pass one, or set "
             "eval_strategy = no",
             args_.eval_strategy);
  });
  check_arguments_agree(*group_, args_);  // before they lead the ranks apart
  // Note [Data parallel]: rank r trains on cuda:(local rank) unless a device index was named.
  device_ = prepare_rank(
      *group_, asked,
      args_.device.find(':') == std::string::npos ? DeviceIndex::Default : DeviceIndex::Named,
      args_.ddp_backend);
  empty_cache(device_);
  baseline_ = memory_stats(device_).reserved.current;
  if (args_.fp16) compute_dtype_ = DType::f16;
  if (args_.bf16) compute_dtype_ = DType::bf16;
  manual_seed(args_.seed);
  // A run resumed from "latest" is planned from the newest checkpoint rank 0 sees (where its
  // stretches start): a rank whose view of a shared folder lags would plan others.
  std::string latest;  // its path; empty for none
  if (group_->size() > 1 && args_.resume_from_checkpoint == "latest") {
    group_->together("finding the latest checkpoint", [&] {
      if (!group_->is_main()) return;
      const std::vector<std::string> all = list_checkpoints(args_.output_dir);
      if (!all.empty()) latest = all.back();
    });
    group_->broadcast(latest, 0);
  }
  group_->together("building its model and plan", [&] {  // Note [Failing together]
    model_ = model_init_();
    MB_CHECK(model_ != nullptr, "[Trainer] model_init returned no model");
    model_->to(device_);
    plan_ = make_plan(latest);
    fingerprint_ = label_fingerprint(train_set_);
  });
  // The ranks' loaders must cut the same windows.
  global_batch_ =
      global_window(resolve_batch_triad(rank_arguments(args_, group_->size())).effective,
                    train_set_.size(), group_->size());
  check_ranks_agree(*group_,
                    {.train_fingerprint = fingerprint_,
                     .window = global_batch_,
                     .eval_examples = eval_set_ != nullptr ? eval_set_->size() : -1,
                     .compute_metrics = static_cast<bool>(compute_metrics_)},
                    plan_);
  model_->set_gradient_checkpointing(plan_.gradient_checkpointing);
  // Note [Inputs in the weights' dtype]: before train() the model holds the weights model_init
  // made (f32, the masters train() will start from, unless made in 16 bits).
  if (compute_dtype_) {
    for (const Tensor& p : model_->parameters()) {
      if (!is_floating(p.dtype())) continue;
      input_dtype_ = p.dtype();
      break;
    }
  }
  eval_batch_size_ = args_.per_device_eval_batch_size;
  if (args_.memory_budget > 0) {
    // Evaluation keeps no activations for backward, so the training micro-batch always fits.
    eval_batch_size_ = std::min(eval_batch_size_, std::max<std::int64_t>(plan_.micro_batch_size, 1));
  }
}

Trainer::~Trainer() = default;

std::optional<DType> Trainer::gradient_dtype() const { return args_.accumulation_dtype(); }

Tensor Trainer::model_inputs(const Tensor& inputs) const {
  if (!input_dtype_ || !is_floating(inputs.dtype()) || inputs.dtype() == *input_dtype_) return inputs;
  return inputs.to(*input_dtype_);
}

MemoryPlan Trainer::make_plan(const std::string& resume_from) {
  TrainingArguments planned = rank_arguments(args_, group_->size());
  if (!resume_from.empty()) planned.resume_from_checkpoint = resume_from;
  return plan_training(model_init_, planned, train_set_, device_, group_->size());
}

// ---- training ----------------------------------------------------------------------------------

namespace {

// Note [Non-finite losses]: one window whose loss is NaN or inf (an inf input under fp16, say: the
// loss scaler skips its step) would make the running total NaN for good: every later log line's
// loss, the training loss and every later checkpoint's loss_sum. With logging_nan_inf_filter (on
// by default, as in Hugging Face's TrainingArguments), such a window adds in its place what
// Hugging Face's Trainer adds, tr_loss / (1 + global_step - globalstep_last_logged): the total's
// growth since the last log line over the windows it holds, plus one (0 for the first window after
// a line). Hugging Face applies the rule to each micro-batch's loss; here it applies to the
// window's weighted sum, the unit that is logged and saved: the same when a window is one
// micro-batch. On a device the test and the stand-in are kernels (`where`), so the host still never
// waits between log lines. With the filter off the total stays NaN, as in Hugging Face; a
// checkpoint then writes its loss sums as "NaN", "Infinity" or "-Infinity" (Python json's
// spellings: JSON has no such numbers, and a null would not read back), so that it resumes as the
// uninterrupted run would go on. A checkpoint also keeps where its logging window began
// (logged_step, logged_loss_sum): a resumed run's log lines, and its stand-ins, are those of the
// uninterrupted run.
nlohmann::json loss_to_json(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "Infinity" : "-Infinity";
}

// A loss sum from trainer_state.json, as loss_to_json writes it; nullopt for anything else.
std::optional<double> loss_from_json(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  if (!v.is_string()) return std::nullopt;
  const std::string& text = v.get_ref<const std::string&>();
  if (text == "NaN") return std::numeric_limits<double>::quiet_NaN();
  if (text == "Infinity") return std::numeric_limits<double>::infinity();
  if (text == "-Infinity") return -std::numeric_limits<double>::infinity();
  return std::nullopt;
}

}  // namespace

// Note [Out-of-memory recovery]: a micro-batch that throws OutOfMemoryError is abandoned (its
// partial graph dies with the stack frame), split in two, and both halves are run in its place
// with their own item shares, so the window still sums to the full batch's gradient. Finished
// micro-batches are kept. Only if some of the abandoned micro-batch's gradient had already landed
// in the arena (its version moved) would keeping them double-count; then the window's gradient is
// zeroed and the whole window re-run with the split, which is exact too (and logged as such).
TrainOutput Trainer::train() {
  namespace fs = std::filesystem;
  const bool main = group_->is_main();
  // Note [A used output_dir]: a fresh run into a folder that holds another run's checkpoints would
  // share their rotation (save_total_limit could delete its own newest and keep a stale one) and
  // `latest` would resume the stale one. Refused unless overwrite_output_dir (Hugging Face's name)
  // clears them. A fresh run writes log.jsonl anew; a resumed one cuts it back to where its
  // checkpoint was saved (log_bytes), so that the lines of steps the checkpoint did not keep are
  // not there twice.
  const fs::path log_path = fs::path(args_.output_dir) / "log.jsonl";
  const bool resuming = !args_.resume_from_checkpoint.empty();
  // In a data-parallel run rank 0 alone writes the log, the checkpoints and the weights, and
  // prints; the other ranks' log stays closed (what is written to it is dropped) and they print
  // nothing.
  std::ofstream log_file;
  // Every rank goes on once the old checkpoints are gone, or every rank stops (Note [Failing
  // together] in train/distributed.h).
  group_->together("opening output_dir", [&] {
    std::error_code ec;
    fs::create_directories(args_.output_dir, ec);
    const bool folder = !ec && fs::is_directory(args_.output_dir, ec);
    MB_CHECK(folder, "[Trainer] cannot create output_dir '{}': {}", args_.output_dir,
             ec ? ec.message() : std::string("it exists and is not a folder"));
    if (!resuming) {
      const std::vector<std::string> old = list_checkpoints(args_.output_dir);
      MB_CHECK(old.empty() || args_.overwrite_output_dir,
               "[Trainer] output_dir {} holds checkpoints of another run ({}): resume it with "
               "resume_from_checkpoint = latest, or set overwrite_output_dir to delete them and "
               "start afresh",
               args_.output_dir, old.back());
      if (main) {
        for (const std::string& path : old) fs::remove_all(path);
      }
    }
    if (main) {
      log_file.open(log_path, resuming ? std::ios::app : std::ios::trunc);
      MB_CHECK(log_file.good(), "[Trainer] cannot write {}/log.jsonl", args_.output_dir);
    }
  });
  std::ostream no_output(nullptr);
  std::ostream& out = main ? *log_stream_ : no_output;
  const bool tty = main && log_stream_ == &std::cout && isatty(STDOUT_FILENO) && !args_.json;

  model_->train();
  // Note [Arenas in blocks of their own]: building the model leaves its initialisers' temporaries
  // in the cache, and an arena may take such a block up to a quarter larger than itself (the CPU's
  // best fit), for the whole run: bytes the plan, which counts each arena at its own size, does
  // not see (7.5 KiB over a 134.5 KiB prediction for a small GPT, enough to fail its budget). The
  // cache is emptied before the arenas are taken, and again before the optimizer's moments, after
  // the parameters' own blocks have gone back to it.
  empty_cache(device_);
  optim::ParamStore store(*model_, {.compute_dtype = compute_dtype_, .grad_dtype = gradient_dtype()});
  input_dtype_ = compute_dtype_;  // the working copy's (Note [Inputs in the weights' dtype])
  std::optional<optim::DynamicLossScaler> scaler;
  if (args_.fp16) {
    scaler.emplace(optim::LossScalerConfig{
        .hysteresis = args_.loss_scale_hysteresis,
        .consecutive_hysteresis = args_.loss_scale_consecutive_hysteresis,
        .min_loss_scale = args_.loss_scale_floor,
        .max_overflows_at_floor = args_.max_overflows_at_floor,
        .warnings = main ? optim::ScalerWarnings::kPrint : optim::ScalerWarnings::kQuiet});
  }
  empty_cache(device_);  // Note [Arenas in blocks of their own]
  optim::AdamW adamw(store, {.lr = args_.learning_rate, .beta1 = args_.adam_beta1, .beta2 = args_.adam_beta2,
                             .eps = args_.adam_epsilon, .weight_decay = args_.weight_decay});
  // The model's ignore_index pads token labels and is left out of each micro-batch's items (Note
  // [Batch items]), so that the weights are the shares of the items its loss averages over.
  DataLoader loader(train_set_, {.batch_size = global_batch_,
                                 .shuffle = true,
                                 .seed = args_.seed,
                                 .prefetch = 0,
                                 .collate = {.ignore_index = model_->ignore_index()}});
  const std::int64_t windows_per_epoch = loader.num_batches();
  const double epoch_steps =
      std::ceil(args_.num_train_epochs * static_cast<double>(windows_per_epoch));
  MB_CHECK(args_.max_steps > 0 || epoch_steps < std::ldexp(1.0, 63),
           "[Trainer] num_train_epochs {} x {} optimizer steps per epoch is past the int64 range",
           args_.num_train_epochs, windows_per_epoch);
  const std::int64_t total_steps =
      args_.max_steps > 0 ? args_.max_steps : static_cast<std::int64_t>(epoch_steps);
  optim::LRScheduler scheduler(adamw, {.type = optim::parse_schedule(args_.lr_scheduler_type),
                                       .warmup_steps = args_.get_warmup_steps(total_steps),
                                       .total_steps = total_steps});

  std::int64_t step = 0, epoch = 0, window = 0, samples = 0, tokens = 0, oom_splits = 0, skipped = 0;
  double loss_sum = 0.0, logged_sum = 0.0;  // the loss total, and what it was at the last log line
  std::int64_t logged_at = 0;               // the step of the last log line
  const std::string& fingerprint = fingerprint_;  // Note [Resuming the same run]
  bool token_labels = false;                // the training set's labels are token sequences
  const nlohmann::json architecture = model_->architecture();
  // Every rank reads its training labels and resumes, or every rank stops (Note [Failing
  // together] in train/distributed.h).
  // "latest" is rank 0's newest usable checkpoint, which every rank then loads: a rank whose view
  // of a shared folder lags would otherwise resume from another step.
  std::optional<ResumePoint> point;
  std::string latest;  // its path
  if (resuming && args_.resume_from_checkpoint == "latest") {
    group_->together("finding the latest checkpoint", [&] {
      if (!main) return;
      point = load_latest_checkpoint(args_.output_dir);
      MB_CHECK(point.has_value(),
               "[Trainer] resume_from_checkpoint = latest, but {} holds no usable checkpoint",
               args_.output_dir);
      latest = point->path;
    });
    group_->broadcast(latest, 0);
  }
  group_->together("resuming from its checkpoint", [&] {
    token_labels = train_set_.get(0).label.dim() > 0;
    if (resuming) {
      if (!point) {
        const std::string path = latest.empty() ? args_.resume_from_checkpoint : latest;
        point = ResumePoint{path, load_checkpoint(path), {}};
      }
      const nlohmann::json& st = point->data.trainer_state;
      // The state passed its CRC, but a CRC says nothing of what wrote it: every field is checked
      // for its type and range, and a malformed one names itself rather than aborting the run.
      const std::string state_file = (fs::path(point->path) / "trainer_state.json").string();
      auto count = [&](const char* name) -> std::int64_t {
        MB_CHECK(st.contains(name), "[Trainer] {} has no '{}'", state_file, name);
        const nlohmann::json& v = st.at(name);
        const bool ok = v.is_number_unsigned()
                            ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX)
                            : v.is_number_integer() && v.get<std::int64_t>() >= 0;
        MB_CHECK(ok, "[Trainer] {}: '{}' must be a whole number >= 0, got {}", state_file, name,
                 v.is_number() ? v.dump() : fmt::format("a JSON {}", v.type_name()));
        return v.get<std::int64_t>();
      };
      auto word = [&](const char* name) -> std::uint64_t {
        MB_CHECK(st.contains(name) && st.at(name).is_number_unsigned(),
                 "[Trainer] {}: '{}' must be an unsigned whole number", state_file, name);
        return st.at(name).get<std::uint64_t>();
      };
      MB_CHECK(st.is_object(), "[Trainer] {} is not a JSON object", state_file);
      const std::int64_t saved_step = count("global_step"), saved_epoch = count("epoch"),
                         saved_window = count("window"), saved_samples = count("samples"),
                         saved_tokens = count("tokens"), saved_scheduler = count("scheduler_steps"),
                         saved_skipped = st.contains("skipped_steps") ? count("skipped_steps") : 0;
      const std::uint64_t rng_seed = word("rng_seed"), rng_offset = word("rng_offset");
      // Loss sums are numbers, or the spellings of NaN and inf (Note [Non-finite losses]).
      auto loss = [&](const char* name) -> double {
        const std::optional<double> v =
            st.contains(name) ? loss_from_json(st.at(name)) : std::nullopt;
        MB_CHECK(v.has_value(),
                 "[Trainer] {}: '{}' must be a number, or \"NaN\", \"Infinity\" or \"-Infinity\"",
                 state_file, name);
        return *v;
      };
      const double saved_loss = loss("loss_sum");
      // Where the checkpoint's logging window began; a checkpoint without it starts a new one.
      const std::int64_t saved_logged_at =
          st.contains("logged_step") ? count("logged_step") : saved_step;
      const double saved_logged_sum =
          st.contains("logged_step") ? loss("logged_loss_sum") : saved_loss;
      MB_CHECK(saved_scheduler <= saved_step && saved_skipped <= saved_step,
               "[Trainer] {}: {} schedule steps and {} skipped steps in {} optimizer steps",
               state_file, saved_scheduler, saved_skipped, saved_step);
      MB_CHECK(saved_logged_at <= saved_step,
               "[Trainer] {}: 'logged_step' {} is past 'global_step' {}", state_file,
               saved_logged_at, saved_step);
      // Note [Resuming the same run]: the checkpoint's window counts batches of its own effective
      // batch, drawn in its own seed's order from its own training set; with any of them changed,
      // the resumed run would repeat or skip examples without a word. Refuse, naming what differs.
      auto saved_value = [&](const char* object, const char* name) -> std::optional<std::int64_t> {
        const nlohmann::json* holder = &st;
        if (object != nullptr) {
          if (!st.contains(object)) return std::nullopt;
          MB_CHECK(st.at(object).is_object(), "[Trainer] {}: '{}' must be a JSON object",
                   state_file, object);
          holder = &st.at(object);
        }
        if (!holder->contains(name)) return std::nullopt;
        const nlohmann::json& v = holder->at(name);
        MB_CHECK(v.is_number_integer(), "[Trainer] {}: '{}' must be a whole number", state_file,
                 name);
        return v.get<std::int64_t>();
      };
      auto same = [&](const char* what, std::optional<std::int64_t> saved, std::int64_t now,
                      const char* hint) {
        MB_CHECK(
            !saved || *saved == now,
            "[Trainer] cannot resume from {}: it was trained with {} {}, this run has {}; the data "
            "order would differ ({})",
            point->path, what, *saved, now, hint);
      };
      same("seed", saved_value("args", "seed"), static_cast<std::int64_t>(args_.seed),
           "pass the same seed");
      // A window is the effective batch over every rank; the processes may differ in number.
      std::optional<std::int64_t> saved_batch = saved_value(nullptr, "effective_batch");
      if (!saved_batch) {  // an older checkpoint: its plan's batch, one process's
        saved_batch = saved_value("plan", "effective_batch");
        if (saved_batch) *saved_batch *= saved_value(nullptr, "world_size").value_or(1);
      }
      same("an effective batch of", saved_batch, global_batch_,
           "keep per_device_train_batch_size x gradient_accumulation_steps x processes, which is "
           "at most the training set");
      same("a training set of", saved_value(nullptr, "train_examples"), train_set_.size(),
           "train on the same data");
      if (st.contains("train_fingerprint")) {
        MB_CHECK(st.at("train_fingerprint") == fingerprint,
                 "[Trainer] cannot resume from {}: it was trained on other data of the same size "
                 "(its examples' fingerprint differs); the data order would differ (train on the "
                 "same data)",
                 point->path);
      }
      // The weights' shapes are checked as they load; what they do not show (GPT's n_head) is in
      // the model's architecture, compared where the checkpoint and the model both record one.
      MB_CHECK(!st.contains("model") || st.at("model").is_object(),
               "[Trainer] {}: 'model' must be a JSON object, got {}", state_file,
               shown_json(st.at("model")));
      if (st.contains("model") && !architecture.is_null()) {
        const std::optional<std::string> differs =
            architecture_difference(st.at("model"), architecture, "the checkpoint");
        MB_CHECK(!differs.has_value(),
                 "[Trainer] cannot resume from {}: it was trained with another model: {}; its "
                 "weights would compute another function (build the model as the checkpoint's)",
                 point->path, *differs);
      }
      MB_CHECK(saved_window <= windows_per_epoch,
               "[Trainer] cannot resume from {}: it stopped at window {} of an epoch, and this "
               "run's epochs "
               "have {} windows",
               point->path, saved_window, windows_per_epoch);
      try {
        store.load_master_state(point->data.model);
        adamw.load_state_dict(point->data.optimizer);
        if (scaler && st.contains("scaler")) scaler->load_state_dict(st.at("scaler"));
      } catch (const Error& e) {
        MB_CHECK(false, "[Trainer] {} does not fit this run: {}", point->path, e.what());
      } catch (const nlohmann::json::exception& e) {
        MB_CHECK(false, "[Trainer] {}: the loss scaler's state is malformed: {}", state_file,
                 e.what());
      }
      // Every window a checkpoint counts either updated the weights once or was skipped and changed
      // nothing (Note [Stopping at the loss-scale floor] keeps it so at the floor too), so the
      // optimizer has taken global_step - skipped_steps steps. Any other count is another run's
      // state, and AdamW's bias correction would be off by the difference.
      const std::int64_t updates = saved_step - saved_skipped;
      MB_CHECK(
          adamw.step_count() == updates,
          "[Trainer] cannot resume from {}: the optimizer state in {} has taken {} steps, but {} "
          "counts {} ({} global steps less {} skipped)",
          point->path, (fs::path(point->path) / kCheckpointOptimizerFile).string(),
          adamw.step_count(), state_file, updates, saved_step, saved_skipped);
      skipped = saved_skipped;
      step = saved_step;
      epoch = saved_epoch;
      window = saved_window;
      samples = saved_samples;
      tokens = saved_tokens;
      loss_sum = saved_loss;
      logged_sum = saved_logged_sum;
      logged_at = saved_logged_at;
      scheduler.set_steps(saved_scheduler);
      GeneratorState rng{rng_seed, rng_offset};
      // A data-parallel checkpoint holds every rank's stream (their dropout masks differ in how
      // much they drew); a run with as many ranks takes its own, any other run rank 0's.
      if (st.contains("rng_ranks")) {
        const nlohmann::json& all = st.at("rng_ranks");
        const bool ok =
            all.is_array() && std::all_of(all.begin(), all.end(), [](const nlohmann::json& e) {
              return e.is_array() && e.size() == 2 && e[0].is_number_unsigned() &&
                     e[1].is_number_unsigned();
            });
        MB_CHECK(ok, "[Trainer] {}: 'rng_ranks' must be a list of [seed, offset] pairs",
                 state_file);
        if (all.size() == static_cast<std::size_t>(group_->size())) {
          const nlohmann::json& mine = all.at(static_cast<std::size_t>(group_->rank()));
          rng = {mine[0].get<std::uint64_t>(), mine[1].get<std::uint64_t>()};
        }
      }
      default_generator().set_state(rng);
      if (main && st.contains("log_bytes") && fs::exists(log_path)) {
        const std::int64_t kept = count("log_bytes");
        log_file.close();
        std::error_code ec;
        const auto size = fs::file_size(log_path, ec);
        if (!ec && size > static_cast<std::uintmax_t>(kept))
          fs::resize_file(log_path, static_cast<std::uintmax_t>(kept), ec);
        MB_CHECK(!ec, "[Trainer] cannot cut {} back to its checkpoint: {}", log_path.string(),
                 ec.message());
        log_file.open(log_path, std::ios::app);
        MB_CHECK(log_file.good(), "[Trainer] cannot write {}/log.jsonl", args_.output_dir);
      }
      const nlohmann::json event{{"event", "resume"}, {"step", step}, {"path", point->path}};
      log_file << event.dump() << "\n";
      if (args_.json) {
        out << event.dump() << "\n";
      } else {
        out << "resumed from " << point->path << " at step " << step << "\n";
      }
    }
  });
  point.reset();  // the checkpoint's tensors are in the arenas now: free them
  if (group_->size() > 1) {
    // Every rank starts from rank 0's weights (the same seed made the same ones; this makes sure).
    Tensor master = store.master();
    group_->broadcast(master);
    if (store.master().raw_data() != store.weights().raw_data()) {
      Tensor working = store.weights();
      group_->broadcast(working);
    }
  }
  const std::int64_t first_step = step;  // a run resumed at its end trains, evaluates and saves nothing
  LossSum loss_total(device_, loss_sum);  // of every window's loss (Note [Training on a device])
  // A log line reports the mean loss of the steps since the previous line, as Hugging Face's
  // Trainer logs tr_loss: the total's growth since then over the steps since then.
  double logged_total = logged_sum;
  std::int64_t logged_step = logged_at;

  // The boundary step runs here or is queued on the device (Note [Boundary step on the device] in
  // optim/boundary_step.h); its outcomes reach take_outcome once the host knows them.
  optim::BoundaryStep boundary(store, adamw, scheduler, scaler ? &*scaler : nullptr,
                               {.max_grad_norm = args_.max_grad_norm});
  std::function<void(const optim::StepOutcome&)> take_outcome;

  // Writes a checkpoint of the counted windows and returns its path; `rng` is the random stream to
  // save when the current one has moved past them (Note [Stopping at the loss-scale floor]).
  auto save = [&](std::optional<GeneratorState> rng = std::nullopt) {
    for (const optim::StepOutcome& o : boundary.settle()) take_outcome(o);  // a checkpoint is settled state
    // The optimizer state's scalars (its step, the arenas' layout) are allocated for the save.
    // Taken beside the last window's cached blocks they would raise the next line's peak above
    // the plan, and left cached after it they fit none of the windows' requests: the cache is
    // handed back before and after, as around an evaluation.
    empty_cache(device_);
    std::string path = (fs::path(args_.output_dir) / fmt::format("checkpoint-{}", step)).string(),
                line;
    if (!rng) rng = default_generator().state();
    nlohmann::json rank_rngs = nlohmann::json::array();
    if (group_->size() > 1) {
      // Every rank's stream.
      const std::vector<std::int64_t> all = group_->all_gather(
          {static_cast<std::int64_t>(rng->seed), static_cast<std::int64_t>(rng->offset)});
      for (std::size_t r = 0; r < all.size(); r += 2)
        rank_rngs.push_back(
            {static_cast<std::uint64_t>(all[r]), static_cast<std::uint64_t>(all[r + 1])});
    }
    // Every rank returns once the checkpoint is whole, or every rank stops (Note [Failing
    // together]): a rank that stops after a save (at the loss-scale floor) would otherwise end the
    // run while rank 0 still writes it.
    group_->together(fmt::format("saving checkpoint-{}", step), [&] {
      if (main) {
        CheckpointData data;
        for (auto& [name, t] : store.master_state()) data.model[name] = t;  // f32 master weights
        for (auto& [name, t] : adamw.state_dict()) data.optimizer[name] = t;
        data.trainer_state = {{"global_step", step},
                              {"epoch", epoch},
                              {"window", window},
                              {"samples", samples},
                              {"tokens", tokens},
                              {"loss_sum", loss_to_json(loss_total.value())},
                              {"logged_step", logged_step},
                              {"logged_loss_sum", loss_to_json(logged_total)},
                              {"scheduler_steps", scheduler.steps()},
                              {"rng_seed", rng->seed},
                              {"rng_offset", rng->offset},
                              {"plan", plan_.to_json()},
                              {"args", args_.to_json()},
                              {"skipped_steps", skipped},
                              {"train_examples", train_set_.size()},
                              {"world_size", group_->size()},
                              {"effective_batch", global_batch_},
                              {"train_fingerprint", fingerprint}};
        if (!architecture.is_null()) data.trainer_state["model"] = architecture;
        if (!rank_rngs.empty()) data.trainer_state["rng_ranks"] = rank_rngs;
        if (scaler) data.trainer_state["scaler"] = scaler->state_dict();
        // The log up to and including this save's own line (Note [A used output_dir]); the path is
        // save_checkpoint's, output_dir/checkpoint-<step>.
        line =
            nlohmann::json{
                {"event", "save"},
                {"step", step},
                {"path",
                 (fs::path(args_.output_dir) / fmt::format("checkpoint-{}", step)).string()}}
                .dump() +
            "\n";
        log_file.flush();
        data.trainer_state["log_bytes"] =
            static_cast<std::int64_t>(log_file.tellp()) + static_cast<std::int64_t>(line.size());
        path = save_checkpoint(args_.output_dir, step, data, args_.save_total_limit);
      }
    });
    empty_cache(device_);
    if (main) {
      MB_ASSERT(line.find(nlohmann::json(path).dump()) != std::string::npos,
                "checkpoint saved as {}", path);
      log_file << line;
      log_file.flush();
    }
    return path;
  };
  // Note [Stopping at the loss-scale floor]: after max_overflows_at_floor overflows at the floor
  // the run saves its last good state and stops. That checkpoint counts the window whose overflow
  // stopped the run as its loss scaler's state counts it, as a step and a skipped one, so that
  // global_step - skipped_steps is still AdamW's step count (checked on resume) and it resumes. On
  // the CPU the outcome is known at the window's own boundary, before the window is counted: the
  // run stops once it is (floor_stop). On CUDA it is known a boundary late, once the window is
  // counted and the next one has run its micro-batches: that one is not counted, and the random
  // stream it moved is saved as it was at its start (window_rng), as a checkpoint at that step
  // holds it. Either way the weights and moments are those of the last step taken.
  std::optional<GeneratorState> window_rng;  // the stream at the start of the window in progress
  std::optional<optim::StepOutcome> floor_stop;  // the window in progress, to stop once counted
  auto stop_at_floor = [&](const optim::StepOutcome& o) {
    const std::string path = save(window_rng);
    // Every rank stops here alike; shared, the command says so once (Note [Failing together]).
    group_->together("stopping at the loss-scale floor", [&] {
      MB_CHECK(false,
               "[Trainer] {} (first non-finite gradient: {}); the last good state is saved in {}",
               o.floor_error, o.first_non_finite, path);
    });
  };
  take_outcome = [&](const optim::StepOutcome& o) {
    if (!o.skipped) return;
    ++skipped;  // no weight, moment, optimizer step or schedule step moved
    nlohmann::json event{{"event", "skipped_step"}, {"step", o.step}, {"loss_scale", o.loss_scale},
                         {"first_non_finite", o.first_non_finite}};
    log_file << event.dump() << "\n";
    log_file.flush();
    if (o.floor_error.empty()) return;
    if (o.step > step) {
      floor_stop = o;
    } else {
      stop_at_floor(o);
    }
  };
  std::int64_t carried_peak = 0;  // the training peak since the last log line, kept across evaluations
  auto evaluate_now = [&] {
    // Evaluation's own peak is logged with it; step lines keep the training windows' peaks. Right
    // after a log line no window has run since its reset, and the peak then is only what is
    // reserved now, which the empty_cache below hands back: nothing of the next line's windows.
    if (step > logged_step)
      carried_peak = std::max(carried_peak, memory_stats(device_).reserved.peak);
    reset_peak_memory_stats(device_);
    Metrics m = run_evaluation(*eval_set_, nullptr);
    nlohmann::json line{{"event", "eval"}, {"step", step},
                        {"measured_peak", eval_peak_ - baseline_},
                        {"eval_batch_size", eval_batch_size_}};
    // Evaluation's cached blocks are not the training window's memory: hand them back, so that the
    // windows after it run at their planned peak.
    empty_cache(device_);
    reset_peak_memory_stats(device_);
    for (auto& [k, v] : m) line[k] = v;
    log_file << line.dump() << "\n";
    log_file.flush();
    if (args_.json) {
      out << line.dump() << "\n";
    } else {
      if (tty) out << "\n";
      out << "eval  step " << step;
      for (auto& [k, v] : m) out << fmt::format(" | {} {:.4f}", k, v);
      out << "\n";
    }
    out.flush();
    return m;
  };

  // Blocks cached by planning or by moving the weights into the arena are not the step's memory.
  empty_cache(device_);
  BudgetGuard budget(device_, baseline_, args_.memory_budget);
  reset_peak_memory_stats(device_);
  // The plan line: where the run goes, and its schedule.
  log_file << nlohmann::json{{"event", "plan"}, {"device", device_.str()}, {"plan", plan_.to_json()}}.dump()
           << "\n";
  Metrics last_eval;
  std::int64_t token_budget = 0;  // Note [Token-budget micro-batches]
  if (token_labels && args_.memory_budget > 0 && args_.pack_by_tokens) {
    token_budget = plan_.micro_batch_size * plan_.sequence_length;
  }
  const auto t0 = std::chrono::steady_clock::now();
  store.zero_grad();
  loader.set_epoch(epoch);
  while (step < total_steps) {
    if (window >= windows_per_epoch) {
      if (eval_set_ && args_.eval_strategy == "epoch") last_eval = evaluate_now();
      ++epoch;
      window = 0;
      loader.set_epoch(epoch);
      if (args_.save_strategy == "epoch") save();
      continue;
    }
    window_rng = default_generator().state();
    LossSum window_loss(device_);
    std::int64_t micro_batches = 0, window_samples = 0, window_items = 0;
    // A rank that fails here (reading its examples, or in a micro-batch) stops every rank before
    // the sum (Note [Failing together]).
    group_->together(fmt::format("training step {}", step + 1), [&] {
      // The window's samples, and this rank's share of them (Note [Data parallel]).
      const std::vector<std::int64_t> window_indices = loader.batch_indices(window);
      window_samples = static_cast<std::int64_t>(window_indices.size());
      const std::vector<std::int64_t> indices =
          group_->size() > 1 ? window_share(window_indices, group_->rank(), group_->size())
                             : window_indices;
      // A short last window with fewer samples than ranks leaves a rank no micro-batch: it only
      // sums with the others.
      std::vector<Chunk> chunks;
      if (token_budget > 0) {
        std::vector<std::int64_t> lengths;
        for (std::int64_t i : indices) lengths.push_back(train_set_.get(i).input.numel());
        chunks = pack_window(indices, lengths, token_budget);
      } else {
        chunks = split_window(indices, plan_.micro_batch_size);
      }
      // The loss-bearing labels (Note [Batch items]): tokens, or samples whose class is not the
      // model's ignore_index; a sample so labelled does not count, so the weights still sum to 1.
      // Counted from the labels alone: collating the window here would take its inputs' memory
      // outside the out-of-memory recovery below.
      // Over the whole window, every rank's share: each rank weighs its micro-batches by their
      // share of it, so that the ranks' gradients sum to the window's.
      window_items = loader.items_for(window_indices);

      std::deque<Chunk> queue(chunks.begin(), chunks.end());
      while (!queue.empty()) {
        Chunk chunk = queue.front();
        queue.pop_front();
        const std::int64_t version = store.grads().version();
        try {
          const Batch b = loader.batch_for(chunk).to(device_);  // collated on the host, one copy
          const double w = window_items > 0 ? static_cast<double>(b.num_items) /
                                                  static_cast<double>(window_items)
                                            : 0.0;
          nn::ModelOutput o = model_->forward(model_inputs(b.inputs), b.labels);
          // Training reads no logits: dropped, the loss's backward writes their gradient over them
          // (Note [Reusing an input's memory], core/autograd.h).
          o.logits = Tensor();
          {
            GradWeightGuard weight(w);
            // With fp16 the seed is the loss scale (on CUDA the device's own): the loss is f32, and
            // its scaled gradient flows into the 16-bit graph.
            o.loss.backward(boundary.backward_seed(o.loss));
          }
          // A micro-batch with no loss-bearing label has a NaN mean loss (as torch's) and weight 0:
          // it adds nothing to the window's loss, rather than 0 * NaN.
          if (b.num_items > 0) window_loss.add(o.loss, w);
          ++micro_batches;
        } catch (const OutOfMemoryError& e) {
          MB_CHECK(chunk.size() > 1,
                   "[Trainer] one sample does not fit in the memory budget of {}: {}",
                   format_bytes(args_.memory_budget), e.what());
          const std::size_t half = chunk.size() / 2;
          Chunk first(chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(half));
          Chunk second(chunk.begin() + static_cast<std::ptrdiff_t>(half), chunk.end());
          ++oom_splits;
          const bool restart = store.grads().version() != version;
          nlohmann::json event{{"event", "oom_split"},
                               {"step", step + 1},
                               {"micro_batch", chunk.size()},
                               {"into", {first.size(), second.size()}},
                               {"window_restarted", restart}};
          log_file << event.dump() << "\n";
          log_file.flush();
          if (restart) {
            // Part of this micro-batch's gradient had landed: redo the window from zero, exactly.
            store.zero_grad();
            std::deque<Chunk> redo;
            for (const Chunk& c : chunks) {
              if (c == chunk) {
                redo.push_back(first);
                redo.push_back(second);
              } else {
                redo.push_back(c);
              }
            }
            chunks.assign(redo.begin(), redo.end());
            queue = redo;
            window_loss = LossSum(device_);
            micro_batches = 0;
          } else {
            queue.push_front(second);
            queue.push_front(first);
            for (auto it = chunks.begin(); it != chunks.end(); ++it) {
              if (*it == chunk) {
                it = chunks.erase(it);
                it = chunks.insert(it, second);
                chunks.insert(it, first);
                break;
              }
            }
          }
        }
      }
      if (group_->size() > 1) window_loss.ready_to_reduce();  // allocated here, not between sums
    });

    if (group_->size() > 1) {
      // One sum over the ranks per window: the gradient and the loss of the whole window.
      Tensor grads = store.grads();
      group_->all_reduce_sum(grads);
      window_loss.all_reduce(*group_);
    }
    // The boundary step: one pass for the norm and the non-finite flag, one fused optimizer pass
    // that unscales and clips (grad_scale) and writes master and working weights. An overflowing
    // window changes no weight, no moment, no optimizer step and no schedule step. On CUDA nothing
    // waits for it: its outcome is read at the next boundary, or now when a line is logged.
    const bool log_due = (step + 1) % args_.logging_steps == 0 || step + 1 == total_steps;
    std::optional<optim::StepOutcome> current;
    for (optim::StepOutcome& o : boundary.step(step + 1, log_due ? optim::Settle::Now : optim::Settle::Later)) {
      take_outcome(o);
      if (o.step == step + 1) current = std::move(o);
    }
    // What a log line reports; known here whenever one is due.
    const optim::ParamStore::GradNorm norm{.norm = current ? current->grad_norm : 0.0,
                                           .non_finite = current && current->skipped};
    store.zero_grad();
    // Before the step moves: step - logged_step is the windows since the last line, this one not
    // among them (Note [Non-finite losses]).
    loss_total.add_window(window_loss, args_.logging_nan_inf_filter, logged_total,
                          step - logged_step);
    ++step;
    ++window;
    samples += window_samples;
    tokens += token_labels ? window_items : 0;
    window_rng.reset();
    if (floor_stop) stop_at_floor(*floor_stop);  // this window, now counted

    if (step % args_.logging_steps == 0 || step == total_steps) {
      // The rate the next step runs with, as Hugging Face logs _get_learning_rate() after
      // lr_scheduler.step(): the step is settled here, and a skipped one left the schedule put.
      const double lr = adamw.lr();
      MemoryStats stats = memory_stats(device_);
      const double total = loss_total.value();  // the one read of the device between log lines
      const double loss = (total - logged_total) / static_cast<double>(step - logged_step);
      logged_total = total;
      logged_step = step;
      stats.reserved.peak = std::max(stats.reserved.peak, carried_peak);
      carried_peak = 0;
      // A data-parallel run logs the largest rank's peak and every rank's splits.
      std::int64_t peak = stats.reserved.peak - baseline_, splits = oom_splits;
      if (group_->size() > 1) {
        peak = group_->all_reduce_max(peak);
        splits = group_->all_reduce_sum(oom_splits);
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      nlohmann::json line{
          {"step", step},
          {"epoch", static_cast<double>(step) / static_cast<double>(windows_per_epoch)},
          {"loss", loss},
          {"learning_rate", lr},
          {"grad_norm", norm.norm},
          {"samples", samples},
          {"tokens", tokens},
          {"micro_batch_size", plan_.micro_batch_size},
          {"token_budget", token_budget},
          {"steps_per_window", micro_batches},
          {"predicted_peak", plan_.predicted_peak},
          {"measured_peak", peak},
          {"oom_splits", splits},
          {"skipped_steps", skipped},
          {"seconds", secs}};
      if (scaler) line["loss_scale"] = scaler->scale();
      log_file << line.dump() << "\n";
      log_file.flush();
      const std::string scale_text =
          scaler ? fmt::format(" | scale {:g} | skipped {}", scaler->scale(), skipped) : std::string();
      if (args_.json) {
        out << line.dump() << "\n";
      } else if (tty) {
        const int width = 30;
        const int done = static_cast<int>(width * step / total_steps);
        out << fmt::format("\r[{}{}] {}/{} | loss {:.4f} | lr {:.2e} | peak {}",
                           std::string(done, '#'), std::string(width - done, ' '), step,
                           total_steps, loss, lr, format_bytes(peak));
        out << scale_text;
        if (step == total_steps) out << "\n";
      } else {
        out << fmt::format(
            "step {:>6}/{} | epoch {:.2f} | loss {:.4f} | lr {:.2e} | grad_norm {:.3f} | "
            "micro {} x {} | peak {} (predicted {})",
            step, total_steps, line["epoch"].get<double>(), loss, lr, norm.norm,
            plan_.micro_batch_size, micro_batches, format_bytes(peak),
            plan_.predicted_peak > 0 ? format_bytes(plan_.predicted_peak) : std::string("-"));
        out << scale_text << "\n";
      }
      out.flush();
      reset_peak_memory_stats(device_);
    }
    if (eval_set_ && args_.evaluates_after(step)) last_eval = evaluate_now();
    if (args_.saves_after(step)) save();
    // Every rank, whichever has a callback: a rank may log alone.
    if (on_step_ || group_->size() > 1) {
      group_->together("in its step callback", [&] {
        if (on_step_) on_step_(step);
      });
    }
  }
  for (const optim::StepOutcome& o : boundary.settle()) take_outcome(o);  // none pending after a logged last step
  if (step > first_step) {
    // Note [The end of training]: as Hugging Face's Trainer, the last epoch ends here, whole or cut
    // short by max_steps: it is evaluated and saved under the epoch strategies, and the last step
    // is saved under the steps strategy when save_steps did not already. A whole last epoch is
    // saved as finished (the next epoch, window 0), as the epochs before it.
    if (args_.eval_strategy == "epoch") last_eval = evaluate_now();
    if (window >= windows_per_epoch) {
      ++epoch;
      window = 0;
    }
    const bool saved_last = args_.saves_after(step);
    if (args_.save_strategy == "epoch" || (args_.save_strategy == "steps" && !saved_last)) save();
  }
  // Rank 0's files are written when train() returns on any rank.
  group_->together("writing model.safetensors", [&] {
    if (main)
      save_safetensors((fs::path(args_.output_dir) / "model.safetensors").string(),
                       model_->state_dict(), trained_weights_metadata(*model_));
  });

  TrainOutput result;
  result.global_step = step;
  result.training_loss = step > 0 ? loss_total.value() / static_cast<double>(step) : 0.0;
  result.metrics = last_eval;
  result.oom_splits = oom_splits;
  result.skipped_steps = skipped;
  return result;
}

}  // namespace microbatch::train
