// The Trainer: training under a memory budget (measured peak within it, same result as an
// unlimited run), out-of-memory recovery, checkpoints and kill-and-resume through the command
// (the metrics and predictions are test_metrics.cpp's; the arguments and model configs alone,
// test_arguments.cpp's; the command's flags, test_cli.cpp's).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <thread>

#include "core/safetensors.h"
#include "tests/core/harness.h"
#include "train/accumulation_check.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::train;
namespace fs = std::filesystem;

namespace {

TensorDataset synthetic_images(std::int64_t n, std::uint64_t seed) {
  manual_seed(seed);
  Tensor x = rand({n, 28, 28});
  Tensor y = (rand({n}) * 10.0).to(DType::i64);
  return TensorDataset(x, y);
}

// Token sequences of different lengths (next-token labels), so a micro-batch's memory depends on
// which sequences it holds.
class Sequences : public Dataset {
 public:
  Sequences(std::vector<std::int64_t> lengths, std::int64_t vocab) : lengths_(std::move(lengths)), vocab_(vocab) {}
  std::int64_t size() const override { return static_cast<std::int64_t>(lengths_.size()); }
  Example get(std::int64_t i) const override {
    check_index(i, "Sequences");
    const std::int64_t t = lengths_[i];
    std::vector<double> ids(t + 1);
    for (std::int64_t k = 0; k <= t; ++k) ids[k] = static_cast<double>((i * 7 + k * 3) % vocab_);
    Tensor all = from_vector(ids, {t + 1}, {.dtype = DType::i64});
    return {all.slice(0, 0, t).contiguous(), all.slice(0, 1, t + 1).contiguous()};
  }

 private:
  std::vector<std::int64_t> lengths_;
  std::int64_t vocab_;
};

// The smallest budget (with the planner's 5% margin) under which a window of n of the dataset's
// first examples runs as one micro-batch.
std::int64_t budget_for_window(const ModelInit& init, const Dataset& data, std::int64_t n) {
  MemoryPlanner probe([&](bool ckpt) { auto m = init(); m->set_gradient_checkpointing(ckpt); return m; },
                      [&](std::int64_t k) {
                        std::vector<Example> ex;
                        for (std::int64_t i = 0; i < k; ++i) ex.push_back(data.get(i));
                        return collate(ex);
                      },
                      {.budget = 1 << 30, .effective_batch = n});
  return static_cast<std::int64_t>(static_cast<double>(probe.predict_window(n, false).total()) / 0.95) + 4096;
}

ModelInit small_mlp() {
  return [] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64, 32}}); };
}

}  // namespace

TEST_CASE("Trainer: logs per step, evaluates each epoch, predicts") {
  TempDir dir;
  TensorDataset train_set = synthetic_images(96, 1), eval_set = synthetic_images(40, 2);
  std::ostringstream sink;
  Trainer trainer(small_mlp(),
                  {.output_dir = dir.path.string(), .per_device_train_batch_size = 8, .gradient_accumulation_steps = 2,
                   .num_train_epochs = 2, .learning_rate = 1e-3, .logging_steps = 1, .eval_strategy = "epoch", .use_cpu = true},
                  train_set, &eval_set, classification_metrics);
  trainer.set_log_stream(&sink);
  TrainOutput out = trainer.train();
  CHECK(out.global_step == 12);  // 96 / (8 x 2) windows x 2 epochs
  std::vector<nlohmann::json> log = read_log(dir.path);
  int steps = 0, evals = 0;
  for (auto& l : log) {
    if (l.contains("event") && l["event"] == "eval") {
      ++evals;
      CHECK(l.contains("eval_accuracy"));
      CHECK(l.contains("eval_f1"));
    } else if (!l.contains("event")) {
      ++steps;
      CHECK(l["micro_batch_size"] == 8);
      CHECK(l["steps_per_window"] == 2);
      CHECK(l["samples"].get<std::int64_t>() == 16 * l["step"].get<std::int64_t>());
    }
  }
  CHECK(steps == 12);
  CHECK(evals == 2);
  PredictionOutput p = trainer.predict(eval_set);
  CHECK(p.predictions.shape() == Shape{40, 10});
  CHECK(p.metrics.count("test_accuracy") == 1);
  CHECK(fs::exists(dir.path / "model.safetensors"));
}

namespace {
// The steps of the checkpoints in dir, in order.
std::vector<std::int64_t> checkpoint_steps(const fs::path& dir) {
  std::vector<std::int64_t> steps;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("checkpoint-", 0) == 0) steps.push_back(std::stoll(name.substr(11)));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}


// Trains small_mlp() with `a` on `data`, its console lines discarded.
TrainOutput quiet_train(const TrainingArguments& a, const Dataset& data, const Dataset* eval = nullptr) {
  std::ostringstream sink;
  Trainer trainer(small_mlp(), a, data, eval, eval != nullptr ? classification_metrics : ComputeMetrics());
  trainer.set_log_stream(&sink);
  return trainer.train();
}

TrainingArguments small_run(const fs::path& dir) {
  return {.output_dir = dir.string(), .per_device_train_batch_size = 8, .gradient_accumulation_steps = 2,
          .num_train_epochs = 2, .learning_rate = 1e-3, .logging_steps = 1, .use_cpu = true};
}

// The checkpoint that a small_run of 2 steps on `data` saves into `dir`, loaded.
CheckpointData two_step_checkpoint(const fs::path& dir, const Dataset& data) {
  TrainingArguments a = small_run(dir);
  a.max_steps = 2;
  a.save_strategy = "steps";
  a.save_steps = 2;
  quiet_train(a, data);
  return load_checkpoint((dir / "checkpoint-2").string());
}

// Resumes a small_run of 4 steps on `data` from `edited`, written whole (CRCs included) as the
// step-2 checkpoint of `out`, as anything that rewrites a checkpoint would.
void resume_from(const CheckpointData& edited, const fs::path& out, const Dataset& data) {
  TrainingArguments b = small_run(out);
  b.max_steps = 4;
  b.resume_from_checkpoint = save_checkpoint(out.string(), 2, edited, 0);
  quiet_train(b, data);
}
}  // namespace

TEST_CASE("Trainer: the end of training is saved and evaluated as Hugging Face's Trainer does") {
  // Note [The end of training]: 96 examples in windows of 16 are 6 steps an epoch.
  TensorDataset train_set = synthetic_images(96, 1), eval_set = synthetic_images(40, 2);
  auto run = [&](const TrainingArguments& a, const Dataset* eval) { return quiet_train(a, train_set, eval); };
  {
    TempDir dir;  // every epoch's end saves, the last one's too
    TrainingArguments a = small_run(dir.path);
    a.save_strategy = "epoch";
    run(a, nullptr);
    CHECK(checkpoint_steps(dir.path) == std::vector<std::int64_t>{6, 12});
  }
  {
    TempDir dir;  // the last step saves when save_steps did not reach it
    TrainingArguments a = small_run(dir.path);
    a.max_steps = 9;
    a.save_strategy = "steps";
    a.save_steps = 2;
    run(a, nullptr);
    CHECK(checkpoint_steps(dir.path) == std::vector<std::int64_t>{2, 4, 6, 8, 9});
  }
  {
    TempDir dir;  // an epoch cut short by max_steps is still evaluated and saved
    TrainingArguments a = small_run(dir.path);
    a.max_steps = 3;
    a.eval_strategy = "epoch";
    a.save_strategy = "epoch";
    TrainOutput out = run(a, &eval_set);
    CHECK(out.metrics.count("eval_accuracy") == 1);
    int evals = 0;
    for (auto& l : read_log(dir.path))
      if (l.value("event", "") == "eval") ++evals;
    CHECK(evals == 1);
    CHECK(checkpoint_steps(dir.path) == std::vector<std::int64_t>{3});
  }
}

TEST_CASE("Trainer: a frozen layer keeps its weights bit for bit, through checkpoint and resume") {
  TensorDataset train_set = synthetic_images(32, 1);
  // small_mlp() with its first Linear frozen, as a pretrained feature layer would be.
  ModelInit frozen_first = [] {
    auto m = std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64, 32}});
    const std::string first = m->named_parameters().front().first;  // "net.1.weight"
    const std::string prefix = first.substr(0, first.rfind('.') + 1);
    for (auto& [name, t] : m->named_parameters())
      if (name.rfind(prefix, 0) == 0) t.requires_grad_(false);
    return m;
  };
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    TempDir dir;
    TrainingArguments a = small_run(dir.path);
    a.max_steps = 2;
    a.save_strategy = "steps";
    a.save_steps = 2;
    a.bf16 = bf16;
    std::map<std::string, std::vector<double>> before;
    std::set<std::string> frozen;
    auto check_weights = [&](nn::Model& model) {
      for (auto& [name, t] : model.named_parameters()) {
        CAPTURE(name);
        CHECK(t.requires_grad() == (frozen.count(name) == 0));
        // The working copy is the initial value in the compute dtype.
        const std::vector<double> initial =
            from_vector(before.at(name), t.shape()).to(t.dtype()).to_vector();
        if (frozen.count(name) > 0) {
          CHECK(t.to_vector() == initial);
        } else {
          CHECK(t.to_vector() != initial);
        }
      }
    };
    {
      std::ostringstream sink;
      Trainer trainer(frozen_first, a, train_set);
      trainer.set_log_stream(&sink);
      for (auto& [name, t] : trainer.model().named_parameters()) {
        before[name] = t.to_vector();
        if (!t.requires_grad()) frozen.insert(name);
      }
      REQUIRE(frozen.size() == 2);
      trainer.train();
      check_weights(trainer.model());
    }
    // The checkpoint holds the frozen masters unrounded; a resumed run keeps them too.
    const CheckpointData saved = load_checkpoint((dir.path / "checkpoint-2").string());
    for (const std::string& name : frozen)
      CHECK(saved.model.at(name).to_vector() == before.at(name));
    a.max_steps = 4;
    a.resume_from_checkpoint = "latest";
    std::ostringstream sink;
    Trainer resumed(frozen_first, a, train_set);
    resumed.set_log_stream(&sink);
    resumed.train();
    check_weights(resumed.model());
  }
}

TEST_CASE("Trainer: a log line's loss is the mean over the steps since the last line") {
  TensorDataset train_set = synthetic_images(96, 1);
  auto losses = [&](std::int64_t logging_steps) {
    TempDir dir;
    TrainingArguments a = small_run(dir.path);
    a.max_steps = 6;
    a.logging_steps = logging_steps;
    quiet_train(a, train_set);
    std::vector<double> out;
    for (auto& l : step_lines(dir.path)) out.push_back(l["loss"].get<double>());
    return out;
  };
  const std::vector<double> each = losses(1), pairs = losses(2), rest = losses(4);
  REQUIRE(each.size() == 6);
  REQUIRE(pairs.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(pairs[i] == doctest::Approx((each[2 * i] + each[2 * i + 1]) / 2).epsilon(1e-12));
  // Steps 1-4, then the last line: steps 5 and 6.
  REQUIRE(rest.size() == 2);
  CHECK(rest[0] == doctest::Approx((each[0] + each[1] + each[2] + each[3]) / 4).epsilon(1e-12));
  CHECK(rest[1] == doctest::Approx((each[4] + each[5]) / 2).epsilon(1e-12));
}

TEST_CASE("Trainer: resuming refuses a run whose data order would differ, naming what differs") {
  TempDir dir;
  TensorDataset train_set = synthetic_images(96, 1), other_set = synthetic_images(80, 1);
  TrainingArguments a = small_run(dir.path);
  a.max_steps = 4;
  a.save_strategy = "steps";
  a.save_steps = 2;
  quiet_train(a, train_set);
  a.max_steps = 6;
  a.resume_from_checkpoint = "latest";
  auto resume = [&](const TrainingArguments& b, const Dataset& data) { quiet_train(b, data); };
  TrainingArguments seed = a;
  seed.seed = 7;
  check_throws_with([&] { resume(seed, train_set); }, "was trained with seed 42, this run has 7");
  TrainingArguments batch = a;
  batch.gradient_accumulation_steps = 3;
  check_throws_with([&] { resume(batch, train_set); }, "an effective batch of 16, this run has 24");
  check_throws_with([&] { resume(a, other_set); }, "a training set of 96, this run has 80");
  // The same size, other examples.
  TensorDataset same_size = synthetic_images(96, 2);
  check_throws_with([&] { resume(a, same_size); }, "other data of the same size");
  resume(a, train_set);  // the same run goes on
  CHECK(checkpoint_steps(dir.path).back() == 6);
}

TEST_CASE("Trainer: a fresh run into another run's checkpoints is refused unless it overwrites them") {
  // Note [A used output_dir]: sharing the folder, the fresh run's rotation would delete its own
  // newest checkpoint and keep the old run's, and `latest` would resume the old run.
  TempDir dir;
  TensorDataset train_set = synthetic_images(96, 1);
  TrainingArguments a = small_run(dir.path);
  a.max_steps = 6;
  a.save_strategy = "steps";
  a.save_steps = 2;
  quiet_train(a, train_set);
  REQUIRE(checkpoint_steps(dir.path) == std::vector<std::int64_t>{2, 4, 6});
  TrainingArguments fresh = a;
  fresh.max_steps = 2;
  check_throws_with([&] { quiet_train(fresh, train_set); }, "holds checkpoints of another run");
  CHECK(checkpoint_steps(dir.path) == std::vector<std::int64_t>{2, 4, 6});  // nothing lost
  fresh.overwrite_output_dir = true;
  quiet_train(fresh, train_set);
  CHECK(checkpoint_steps(dir.path) == std::vector<std::int64_t>{2});
  // The log is the fresh run's alone.
  std::vector<std::int64_t> steps;
  for (auto& l : read_log(dir.path))
    if (!l.contains("event")) steps.push_back(l["step"].get<std::int64_t>());
  CHECK(steps == std::vector<std::int64_t>{1, 2});
}

TEST_CASE("Trainer: a resumed run's log holds each step once, as the uninterrupted run's") {
  // A run stopped after step 6 whose last checkpoint is step 4 (checkpoint-6 removed, as if killed
  // before it was saved): the resumed run re-runs steps 5 and 6, and their lines from before the
  // stop are cut from the log, which then reads as the uninterrupted run's plus the resume line.
  TempDir dir;
  TensorDataset train_set = synthetic_images(96, 1);
  TrainingArguments a = small_run(dir.path);
  a.max_steps = 6;
  a.save_strategy = "steps";
  a.save_steps = 2;
  quiet_train(a, train_set);
  const std::vector<nlohmann::json> whole = read_log(dir.path);
  fs::remove_all(dir.path / "checkpoint-6");
  a.resume_from_checkpoint = "latest";
  quiet_train(a, train_set);
  std::vector<nlohmann::json> resumed;  // less the resume line and the plan line after it
  bool after_resume = false;
  for (auto& l : read_log(dir.path)) {
    const std::string event = l.value("event", "");
    after_resume = after_resume || event == "resume";
    if (event != "resume" && !(after_resume && event == "plan")) resumed.push_back(l);
  }
  REQUIRE(resumed.size() == whole.size());
  for (std::size_t i = 0; i < whole.size(); ++i) {
    CAPTURE(i);
    // Step lines carry wall-clock figures; the steps, events and losses must match.
    CHECK(resumed[i].value("step", -1) == whole[i].value("step", -1));
    CHECK(resumed[i].value("event", "") == whole[i].value("event", ""));
    CHECK(resumed[i].value("loss", 0.0) == whole[i].value("loss", 0.0));
  }
}

TEST_CASE("Trainer: a malformed trainer state names its field instead of aborting the run") {
  // The checkpoint's CRCs are rewritten for the edited state: the fields themselves are checked.
  TempDir dir;
  TensorDataset train_set = synthetic_images(96, 1);
  const CheckpointData good = two_step_checkpoint(dir.path / "run", train_set);
  auto resume_with = [&](const char* field, nlohmann::json value) {
    CheckpointData edited = good;
    edited.trainer_state[field] = std::move(value);
    resume_from(edited, dir.path / field, train_set);
  };
  check_throws_with([&] { resume_with("global_step", -5); }, "'global_step' must be a whole number >= 0, got -5");
  check_throws_with([&] { resume_with("window", "x"); }, "'window' must be a whole number >= 0, got a JSON string");
  check_throws_with([&] { resume_with("epoch", 1.5); }, "'epoch' must be a whole number >= 0, got 1.5");
  check_throws_with([&] { resume_with("scheduler_steps", 100); }, "100 schedule steps and 0 skipped steps in 2");
  check_throws_with([&] { resume_with("args", nlohmann::json::array({1})); }, "'args' must be a JSON object");
  check_throws_with([&] { resume_with("loss_sum", "nan"); },
                    "'loss_sum' must be a number, or \"NaN\", \"Infinity\" or \"-Infinity\"");
  check_throws_with([&] { resume_with("logged_step", 3); },
                    "'logged_step' 3 is past 'global_step' 2");
}

TEST_CASE("Trainer: an optimizer step count that disagrees with the trainer state is refused") {
  // Every window a checkpoint counts updated the weights once or was skipped: AdamW has taken
  // global_step - skipped_steps steps. A checkpoint that says otherwise is refused, by file.
  TempDir dir;
  TensorDataset train_set = synthetic_images(96, 1);
  const CheckpointData good = two_step_checkpoint(dir.path / "run", train_set);
  REQUIRE(good.optimizer.at("step").item() == 2);
  // The error of resuming from `edited`, "" when it resumes.
  auto resume_error = [&](const std::string& name, const CheckpointData& edited) -> std::string {
    try {
      resume_from(edited, dir.path / name, train_set);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  auto optimizer_file = [&](const std::string& name) {
    return (dir.path / name / "checkpoint-2" / "optimizer.safetensors").string();
  };
  CheckpointData behind = good;  // the optimizer a step behind its trainer state
  behind.optimizer["step"] = scalar_tensor(1, {.dtype = DType::i64});
  std::string error = resume_error("behind", behind);
  CHECK_MESSAGE(error.find("the optimizer state in " + optimizer_file("behind") +
                           " has taken 1 steps") != std::string::npos,
                error);
  CHECK_MESSAGE(error.find("counts 2 (2 global steps less 0 skipped)") != std::string::npos, error);
  CheckpointData skipped = good;  // a trainer state that says one of its two windows was skipped
  skipped.trainer_state["skipped_steps"] = 1;
  error = resume_error("skipped", skipped);
  CHECK_MESSAGE(error.find("the optimizer state in " + optimizer_file("skipped") +
                           " has taken 2 steps") != std::string::npos,
                error);
  CHECK_MESSAGE(error.find("counts 1 (2 global steps less 1 skipped)") != std::string::npos, error);
  CHECK(resume_error("good", good).empty());  // the checkpoint as it was written resumes
}

namespace {
// 64 images, image 5 all +inf: in windows of 16, the window that holds it has a loss that is not
// finite once an epoch (and a gradient that is not: its step is skipped).
TensorDataset images_with_an_inf() {
  manual_seed(6);
  Tensor x = rand({64, 28, 28});
  {
    NoGradGuard no_grad;
    x.select(0, 5).fill_(std::numeric_limits<double>::infinity());
  }
  Tensor y = (rand({64}) * 10.0).to(DType::i64);
  return TensorDataset(x, y);
}

TrainingArguments inf_run(const fs::path& dir, std::int64_t logging_steps) {
  return {.output_dir = dir.string(),
          .per_device_train_batch_size = 16,
          .max_steps = 12,
          .learning_rate = 1e-3,
          .logging_steps = logging_steps,
          .save_strategy = "steps",
          .save_steps = 2,
          .fp16 = true,
          .use_cpu = true};
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
}  // namespace

TEST_CASE(
    "Trainer: a non-finite window loss is filtered as Hugging Face's logging_nan_inf_filter does") {
  const TensorDataset data = images_with_an_inf();
  TempDir dir;
  // Each window's loss, from a run that logs every window: a filtered window logs 0 there, as in
  // Hugging Face (the logging window before it is empty).
  quiet_train(inf_run(dir.path / "each", 1), data);
  const std::vector<nlohmann::json> each = step_lines(dir.path / "each");
  REQUIRE(each.size() == 12);
  std::set<std::int64_t> skipped_windows;
  for (auto& l : read_log(dir.path / "each"))
    if (l.value("event", "") == "skipped_step")
      skipped_windows.insert(l["step"].get<std::int64_t>());
  std::vector<bool> bad;
  for (auto& l : each) {
    REQUIRE_MESSAGE(l["loss"].is_number(), l.dump());
    bad.push_back(l["loss"].get<double>() == 0.0);
    if (bad.back()) CHECK(skipped_windows.count(l["step"].get<std::int64_t>()) == 1);
  }
  REQUIRE(std::count(bad.begin(), bad.end(), true) >= 2);

  // Logged every 3 windows, a filtered window adds tr_loss / (1 + windows since the last line).
  const fs::path straight = dir.path / "straight";
  const TrainOutput out = quiet_train(inf_run(straight, 3), data);
  const std::vector<nlohmann::json> lines = step_lines(straight);
  REQUIRE(lines.size() == 4);
  double tr_loss = 0, total = 0;
  std::int64_t windows = 0;
  bool stand_in_used = false;  // past the first window of a line, where it is 0
  for (std::size_t k = 0, line = 0; k < 12; ++k) {
    const double stand_in = tr_loss / static_cast<double>(1 + windows);
    stand_in_used = stand_in_used || (bad[k] && stand_in != 0.0);
    tr_loss += bad[k] ? stand_in : each[k]["loss"].get<double>();
    ++windows;
    if ((k + 1) % 3 != 0) continue;
    INFO("the line of step ", k + 1);
    REQUIRE(lines[line]["loss"].is_number());
    CHECK(lines[line]["loss"].get<double>() ==
          doctest::Approx(tr_loss / static_cast<double>(windows)).epsilon(1e-12));
    total += tr_loss;
    tr_loss = 0;
    windows = 0;
    ++line;
  }
  CHECK(stand_in_used);
  CHECK(out.training_loss == doctest::Approx(total / 12).epsilon(1e-12));
  CHECK(out.skipped_steps == static_cast<std::int64_t>(skipped_windows.size()));

  // Every checkpoint's loss sum is a finite number, and every checkpoint after the first filtered
  // window resumes into the uninterrupted run, bit for bit: weights, training loss, and log lines,
  // those of a logging window that spans the checkpoint included.
  const std::int64_t first_bad = std::find(bad.begin(), bad.end(), true) - bad.begin() + 1;
  int resumed_runs = 0;
  for (std::int64_t s : checkpoint_steps(straight)) {
    INFO("checkpoint-", s);
    const fs::path checkpoint = straight / fmt::format("checkpoint-{}", s);
    const nlohmann::json loss_sum = load_checkpoint(checkpoint.string()).trainer_state["loss_sum"];
    REQUIRE(loss_sum.is_number());
    CHECK(std::isfinite(loss_sum.get<double>()));
    if (s < first_bad || s == 12) continue;
    const fs::path resumed = dir.path / fmt::format("resumed-{}", s);
    TrainingArguments b = inf_run(resumed, 3);
    b.resume_from_checkpoint = checkpoint.string();
    const TrainOutput r = quiet_train(b, data);
    ++resumed_runs;
    CHECK(r.global_step == 12);
    CHECK(r.skipped_steps == out.skipped_steps);
    CHECK(r.training_loss == out.training_loss);
    CHECK(file_bytes(resumed / "model.safetensors") == file_bytes(straight / "model.safetensors"));
    std::vector<nlohmann::json> expected;
    for (auto& l : lines)
      if (l["step"].get<std::int64_t>() > s) expected.push_back(l);
    const std::vector<nlohmann::json> got = step_lines(resumed);
    REQUIRE(got.size() == expected.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      for (const char* key :
           {"step", "loss", "grad_norm", "learning_rate", "skipped_steps", "loss_scale"})
        CHECK_MESSAGE(got[i][key] == expected[i][key], key, ": ", got[i].dump(), " vs ",
                      expected[i].dump());
  }
  CHECK(resumed_runs >= 3);
}

TEST_CASE(
    "Trainer: with logging_nan_inf_filter off the loss stays NaN, and checkpoints still resume") {
  const TensorDataset data = images_with_an_inf();
  TempDir dir;
  const fs::path straight = dir.path / "straight";
  TrainingArguments a = inf_run(straight, 3);
  a.logging_nan_inf_filter = false;
  CHECK(!TrainingArguments::from_json(nlohmann::json::parse(R"({"logging_nan_inf_filter": false})"))
             .logging_nan_inf_filter);
  const TrainOutput out = quiet_train(a, data);
  CHECK(std::isnan(out.training_loss));  // as Hugging Face's tr_loss
  CHECK(step_lines(straight).back()["loss"].is_null());
  // A NaN total is saved as Python's json spells it, and reads back: the resumed run goes on as
  // the uninterrupted one.
  const CheckpointData last = load_checkpoint((straight / "checkpoint-10").string());
  CHECK(last.trainer_state["loss_sum"] == "NaN");
  TrainingArguments b = a;
  b.output_dir = (dir.path / "resumed").string();
  b.resume_from_checkpoint = (straight / "checkpoint-10").string();
  const TrainOutput r = quiet_train(b, data);
  CHECK(r.global_step == 12);
  CHECK(std::isnan(r.training_loss));
  CHECK(file_bytes(dir.path / "resumed" / "model.safetensors") ==
        file_bytes(straight / "model.safetensors"));
}

MB_CUDA_TEST_CASE(
    "Trainer on cuda:0: a non-finite window loss is filtered on the device as on the CPU") {
  // f32, where the inf input's window is skipped without a loss scaler: the device's filter
  // (kernels, no wait) logs what the CPU's logs, to the devices' f32 agreement.
  const TensorDataset data = images_with_an_inf();
  TempDir dir;
  TrainingArguments cpu = inf_run(dir.path / "cpu", 3), gpu = inf_run(dir.path / "gpu", 3);
  cpu.fp16 = gpu.fp16 = false;
  gpu.use_cpu = false;
  gpu.device = "cuda:0";
  quiet_train(cpu, data);
  quiet_train(gpu, data);
  const std::vector<nlohmann::json> on_cpu = step_lines(dir.path / "cpu"),
                                    on_gpu = step_lines(dir.path / "gpu");
  REQUIRE(on_gpu.size() == on_cpu.size());
  for (std::size_t i = 0; i < on_gpu.size(); ++i) {
    REQUIRE_MESSAGE(on_gpu[i]["loss"].is_number(), on_gpu[i].dump());
    CHECK(on_gpu[i]["loss"].get<double>() ==
          doctest::Approx(on_cpu[i]["loss"].get<double>()).epsilon(1e-4));
    CHECK(on_gpu[i]["skipped_steps"] == on_cpu[i]["skipped_steps"]);
  }
  for (std::int64_t s : checkpoint_steps(dir.path / "gpu"))
    CHECK(load_checkpoint((dir.path / "gpu" / fmt::format("checkpoint-{}", s)).string())
              .trainer_state.at("loss_sum")
              .is_number());
}

TEST_CASE("Trainer: an evaluation strategy without an evaluation dataset is refused") {
  TempDir dir;
  TensorDataset train_set = synthetic_images(16, 1);
  TrainingArguments a = small_run(dir.path);
  a.eval_strategy = "steps";
  check_throws_with([&] { Trainer(small_mlp(), a, train_set); },
                    "eval_strategy = steps needs an evaluation dataset");
}

TEST_CASE("Trainer under a memory budget: peak within it every step, same weights as an unlimited run") {
  // f64, so that the comparison measures the accumulation: in f32, AdamW's first steps turn the
  // rounding differences of two summation orders in near-zero gradients (|g| ~ eps) into weight
  // differences of ~1e-5 relative, whatever the accumulation does.
  manual_seed(3);
  TensorDataset train_set(rand({64, 28, 28}, {.dtype = DType::f64}), (rand({64}) * 10.0).to(DType::i64));
  ModelInit init = [] {
    auto m = std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64, 32}});
    m->to(DType::f64);
    return m;
  };
  auto run = [&](TrainingArguments args) {
    TempDir dir;
    args.output_dir = dir.path.string();
    args.use_cpu = true;  // the budget and the byte-exact peaks follow the CPU allocator's rules
    std::ostringstream sink;
    Trainer trainer(init, args, train_set);
    trainer.set_log_stream(&sink);
    trainer.train();
    std::vector<Tensor> weights;
    for (auto& [n, t] : trainer.model().named_parameters()) weights.push_back(t.clone());
    return std::make_tuple(weights, read_log(dir.path), trainer.plan());
  };
  TrainingArguments common{.per_device_train_batch_size = 32, .max_steps = 4, .learning_rate = 1e-3,
                           .logging_steps = 1};
  auto [full_weights, full_log, full_plan] = run(common);
  // A budget under which the window of 32 does not fit in one micro-batch.
  TrainingArguments budgeted = common;
  budgeted.per_device_train_batch_size = kAutoBatch;
  budgeted.train_batch_size = 32;
  budgeted.memory_budget = 1800 << 10;
  auto [weights, log, plan] = run(budgeted);
  CHECK(plan.micro_batch_size < 32);
  CHECK(plan.accumulation_steps > 1);
  int steps = 0;
  for (auto& l : log) {
    if (l.contains("event")) continue;
    ++steps;
    CHECK(l["measured_peak"].get<std::int64_t>() <= budgeted.memory_budget);
    CHECK(std::abs(l["measured_peak"].get<double>() - plan.predicted_peak) <= 0.05 * plan.predicted_peak);
  }
  CHECK(steps == 4);
  for (std::size_t i = 0; i < weights.size(); ++i) CHECK(max_relative_difference(weights[i], full_weights[i]) <= 1e-10);
}

TEST_CASE("Trainer under a memory budget: the epoch's shorter last batch is in the prediction") {
  // Note [Uneven windows]: 70 samples in windows of 32 end each epoch on a window of 6, whose
  // micro-batch takes cache blocks of its own. The prediction counts it, so the run's peak (over
  // epoch ends) reaches the prediction, within one allocator block (measured: 512 bytes under it),
  // and is above the peak of the windows before the first epoch end; a training set of 64 has no
  // such window, and its lower prediction is its peak to the byte.
  manual_seed(4);
  auto run = [&](std::int64_t n) {
    TensorDataset train_set = synthetic_images(n, 5);
    TempDir dir;
    TrainingArguments args{.per_device_train_batch_size = 32, .max_steps = 7, .learning_rate = 1e-3,
                           .logging_steps = 1};
    args.memory_budget = 64 << 20;
    args.output_dir = dir.path.string();
    args.use_cpu = true;
    std::ostringstream sink;
    Trainer trainer(small_mlp(), args, train_set);
    trainer.set_log_stream(&sink);
    trainer.train();
    std::vector<std::int64_t> peaks;
    for (auto& l : read_log(dir.path))
      if (!l.contains("event")) peaks.push_back(l["measured_peak"].get<std::int64_t>());
    return std::pair{trainer.plan().predicted_peak, peaks};
  };
  const auto [predicted, peaks] = run(70);  // 3 windows an epoch: 32, 32, 6
  const auto [even_predicted, even_peaks] = run(64);
  REQUIRE(peaks.size() == 7u);
  INFO("predicted " << predicted << " (64 samples: " << even_predicted << "), peaks " << peaks[0] << " "
                    << peaks[2] << " " << peaks[6]);
  const std::int64_t run_peak = *std::max_element(peaks.begin(), peaks.end());
  CHECK(run_peak <= predicted);
  CHECK(predicted - run_peak <= 4096);
  CHECK(peaks[0] < run_peak);  // before the first epoch end
  CHECK(even_predicted < predicted);
  CHECK(*std::max_element(even_peaks.begin(), even_peaks.end()) == even_predicted);
}

TEST_CASE("Trainer: an evaluation right after a log line adds nothing to the next line's peak") {
  // 70 samples in windows of 32 end the epoch on a window of 6 (step 3), whose blocks sit in the
  // cache beside the full windows' until the evaluation at step 4 hands them back. Step 5 then
  // runs a full window from an empty cache, as step 1 did, and its line must show step 1's peak,
  // not what was reserved when the evaluation began (logged with step 4 already).
  manual_seed(4);
  TensorDataset train_set = synthetic_images(70, 5);
  TensorDataset eval_set = synthetic_images(16, 6);
  TempDir dir;
  TrainingArguments args{.per_device_train_batch_size = 32, .max_steps = 5, .learning_rate = 1e-3,
                         .logging_steps = 1, .eval_strategy = "steps", .eval_steps = 4};
  args.output_dir = dir.path.string();
  args.use_cpu = true;
  std::ostringstream sink;
  Trainer trainer(small_mlp(), args, train_set, &eval_set);
  trainer.set_log_stream(&sink);
  trainer.train();
  std::vector<std::int64_t> peaks;
  for (auto& l : read_log(dir.path))
    if (!l.contains("event")) peaks.push_back(l["measured_peak"].get<std::int64_t>());
  REQUIRE(peaks.size() == 5u);
  INFO("peaks " << peaks[0] << " " << peaks[2] << " " << peaks[3] << " " << peaks[4]);
  CHECK(peaks[2] > peaks[0]);  // the epoch's end holds both windows' blocks
  CHECK(peaks[3] == peaks[2]);  // still cached at step 4
  CHECK(peaks[4] == peaks[0]);
}

TEST_CASE("Trainer: evaluation's predictions are held outside the budget that training fits") {
  // Note [Predictions outside the budget]: the logits and labels of 4000 evaluation images (190 KB,
  // and their concatenation as much again) do not fit beside the training's memory under a budget
  // that just fits a window of 16; held in it, they failed the first evaluation with "one
  // evaluation sample does not fit", and the run saved no weights.
  TensorDataset train_set = synthetic_images(64, 6);
  manual_seed(7);
  const Tensor eval_labels = (rand({4000}) * 10.0).to(DType::i64);
  TensorDataset eval_set(rand({4000, 28, 28}), eval_labels);
  const std::int64_t budget = budget_for_window(small_mlp(), train_set, 16);
  TempDir dir;
  std::ostringstream sink;
  Trainer trainer(small_mlp(),
                  {.output_dir = dir.path.string(), .per_device_train_batch_size = kAutoBatch,
                   .train_batch_size = 16, .memory_budget = budget, .max_steps = 2,
                   .logging_steps = 1, .eval_strategy = "epoch", .use_cpu = true},
                  train_set, &eval_set, classification_metrics);
  trainer.set_log_stream(&sink);
  const TrainOutput out = trainer.train();
  CHECK(out.global_step == 2);
  CHECK(out.metrics.count("eval_accuracy") == 1);
  CHECK(fs::exists(dir.path / "model.safetensors"));
  int evals = 0;
  for (auto& l : read_log(dir.path)) {
    if (l.contains("measured_peak")) CHECK(l["measured_peak"].get<std::int64_t>() <= budget);
    evals += l.value("event", "") == "eval";
  }
  CHECK(evals == 1);
  const PredictionOutput p = trainer.predict(eval_set);
  CHECK(p.predictions.shape() == Shape{4000, 10});
  CHECK(p.label_ids.shape() == Shape{4000});
  // The labels are the evaluation set's, in order.
  CHECK(p.label_ids.to_vector() == eval_labels.to_vector());
}

TEST_CASE("out-of-memory recovery: counting a window's items collates nothing, so a split still runs") {
  // A window of 100 planned as one micro-batch, and then 250 KB taken before training: the
  // micro-batch of 100 no longer fits, and one of 50 does (its inputs alone are 157 KB fewer). Counting the window's loss-bearing labels used
  // to collate the whole window first, outside the recovery, and that collation ran out of memory.
  TensorDataset train_set = synthetic_images(200, 8);
  const std::int64_t budget = budget_for_window(small_mlp(), train_set, 100);
  empty_cache(kCPU);  // no cached blocks in the baseline: the budget is all the room there is
  TempDir dir;
  std::ostringstream sink;
  Trainer trainer(small_mlp(),
                  {.output_dir = dir.path.string(), .per_device_train_batch_size = kAutoBatch,
                   .train_batch_size = 100, .memory_budget = budget, .max_steps = 2,
                   .logging_steps = 1, .use_cpu = true},
                  train_set);
  REQUIRE(trainer.plan().micro_batch_size == 100);
  trainer.set_log_stream(&sink);
  const Tensor held = empty({250 << 10}, {.dtype = DType::u8});
  const TrainOutput out = trainer.train();
  CHECK(out.global_step == 2);
  CHECK(out.oom_splits > 0);
}

TEST_CASE("Trainer: a budget near INT64_MAX above a baseline trains (no overflow in the sum)") {
  // The allocator's limit is baseline + budget, summed in size_t: in int64 it overflowed (UB) for
  // a budget from the C++ API or a JSON config, which parse_bytes' cap does not cover.
  TensorDataset train_set = synthetic_images(32, 9);
  const Tensor held = ones({1024});  // a baseline above 0
  TempDir dir;
  TrainingArguments a = small_run(dir.path);
  a.max_steps = 1;
  a.memory_budget = std::numeric_limits<std::int64_t>::max();
  CHECK(quiet_train(a, train_set).global_step == 1);
}

TEST_CASE("a budget too small for one sample fails at once, saying how much is needed") {
  TensorDataset train_set = synthetic_images(8, 4);
  check_throws_with([&] {
    Trainer(small_mlp(), {.per_device_train_batch_size = kAutoBatch, .train_batch_size = 8, .memory_budget = 4096},
            train_set);
  }, "too small for one sample");
}

TEST_CASE("out-of-memory recovery: a long micro-batch is split and re-run, weights as without the limit") {
  // 48 short sequences and two long ones near the end, in micro-batches of 8 by count. After the
  // first step the CPU's budget drops to what a window of 8 short sequences needs, as when
  // something else takes memory mid-run (another process on a GPU): a window holding a long
  // sequence pads every row to 16 tokens and no longer fits, and is split and re-run.
  std::vector<std::int64_t> lengths(48, 4);
  lengths[40] = 16;
  lengths[45] = 16;
  Sequences data(lengths, 11);
  std::vector<std::int64_t> short_lengths(8, 4);
  Sequences short_data(short_lengths, 11);
  nn::GPTConfig cfg{.vocab_size = 11, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16};
  ModelInit init = [cfg] {
    auto m = std::make_unique<nn::GPT>(cfg);
    m->to(DType::f64);
    return m;
  };
  const std::int64_t budget = budget_for_window(init, short_data, 8);
  struct ClearBudget {
    ~ClearBudget() { clear_memory_budget(kCPU); }
  };
  auto run = [&](bool limit, TrainOutput* out) {
    TempDir dir;
    TrainingArguments args{.per_device_train_batch_size = 8, .num_train_epochs = 2,
                           .learning_rate = 1e-3, .logging_steps = 1};
    args.output_dir = dir.path.string();
    args.use_cpu = true;  // the budget follows the CPU allocator's rules
    std::ostringstream sink;
    ClearBudget clear;
    empty_cache(kCPU);  // blocks cached by earlier tests are not this run's baseline
    const std::int64_t baseline = memory_stats(kCPU).reserved.current;
    Trainer trainer(init, args, data);
    trainer.set_log_stream(&sink);
    if (limit) {
      trainer.set_step_callback([&](std::int64_t step) {
        if (step == 1) set_memory_budget(kCPU, static_cast<std::size_t>(baseline + budget));
      });
    }
    *out = trainer.train();
    std::vector<Tensor> w;
    for (auto& [n, t] : trainer.model().named_parameters()) w.push_back(t.clone());
    return w;
  };
  TrainOutput limited_out, reference_out;
  std::vector<Tensor> limited = run(true, &limited_out);
  CHECK(limited_out.oom_splits > 0);
  MESSAGE("budget " << budget << " from step 2: " << limited_out.oom_splits
                    << " out-of-memory splits");
  std::vector<Tensor> reference = run(false, &reference_out);
  CHECK(reference_out.oom_splits == 0);
  for (std::size_t i = 0; i < limited.size(); ++i) CHECK(max_relative_difference(limited[i], reference[i]) <= 1e-10);
}

#ifdef MB_CLI_PATH
TEST_CASE("kill -9 and resume: the resumed run ends with bitwise the same weights") {
  TempDir dir;
  const fs::path text = dir.path / "text.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  auto command = [&](const fs::path& out_dir, const std::string& extra) {
    return fmt::format("{} train --model gpt --data {} --block-size 16 --n-layer 1 --n-head 2 --n-embd 16 "
                       "--dropout 0.1 --per-device-train-batch-size 4 --gradient-accumulation-steps 2 "
                       "--max-steps 40 --logging-steps 1 --eval-strategy no --save-strategy steps "
                       "--save-steps 5 --save-total-limit 2 --use-cpu --output-dir {} {} > /dev/null 2>&1",
                       MB_CLI_PATH, text.string(), out_dir.string(), extra);
  };
  const fs::path straight = dir.path / "straight", killed = dir.path / "killed";
  REQUIRE(std::system(command(straight, "").c_str()) == 0);

  // Start the same run, SIGKILL it once it has logged step 12, then resume from its checkpoint.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setpgid(0, 0);  // its own process group, so one kill reaches the shell and the trainer
    ::execl("/bin/sh", "sh", "-c", command(killed, "").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  bool killed_mid_run = false;
  for (int i = 0; i < 6000; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::int64_t last = 0;
    for (auto& l : read_log(killed))
      if (l.contains("step") && !l.contains("event")) last = l["step"];
    if (last >= 12) {
      ::kill(-pid, SIGKILL);
      killed_mid_run = last < 40;
      break;
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(killed_mid_run);
  REQUIRE(std::system(command(killed, "--resume-from-checkpoint latest").c_str()) == 0);
  SafetensorsFile a = load_safetensors((straight / "model.safetensors").string());
  SafetensorsFile b = load_safetensors((killed / "model.safetensors").string());
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (auto& [name, t] : a.tensors) {
    INFO(name);
    CHECK(t.to_vector() == b.tensors.at(name).to_vector());
  }
}
#endif

TEST_CASE("token-budget micro-batches: planned at the longest sequence, short ones share") {
  // The first 12 sequences are short; later ones alternate 4 and 16 tokens. The budget fits a
  // window of 12 short ones. The plan is measured with every row as long as the longest
  // (Note [Token-budget micro-batches]), so it takes fewer rows than 12 and nothing runs out of
  // memory either way; packed by tokens, short sequences share a micro-batch up to the tokens
  // measured, so windows take fewer micro-batches than by count. Same weights both ways.
  std::vector<std::int64_t> lengths(48, 4);
  for (int i = 12; i < 48; i += 2) lengths[i] = 16;
  Sequences data(lengths, 13);
  std::vector<std::int64_t> short_lengths(12, 4);
  Sequences short_data(short_lengths, 13);
  nn::GPTConfig cfg{.vocab_size = 13, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16};
  ModelInit init = [cfg] {
    auto m = std::make_unique<nn::GPT>(cfg);
    m->to(DType::f64);
    return m;
  };
  const std::int64_t budget = budget_for_window(init, short_data, 12);
  auto run = [&](bool pack, TrainOutput* out, std::int64_t* fewest_micro_batches) {
    TempDir dir;
    std::ostringstream sink;
    Trainer trainer(init, {.output_dir = dir.path.string(), .per_device_train_batch_size = kAutoBatch,
                           .train_batch_size = 12, .memory_budget = budget, .num_train_epochs = 2,
                           .learning_rate = 1e-3, .logging_steps = 1, .pack_by_tokens = pack, .use_cpu = true}, data);
    trainer.set_log_stream(&sink);
    *out = trainer.train();
    CHECK(trainer.plan().micro_batch_size < 12);  // 12 rows of 16 tokens do not fit
    *fewest_micro_batches = 12;
    for (auto& l : read_log(dir.path)) {
      if (l.contains("event")) continue;
      CHECK(l["measured_peak"].get<std::int64_t>() <= budget);
      *fewest_micro_batches =
          std::min<std::int64_t>(*fewest_micro_batches, l["steps_per_window"].get<std::int64_t>());
    }
    std::vector<Tensor> w;
    for (auto& [n, t] : trainer.model().named_parameters()) w.push_back(t.clone());
    return w;
  };
  TrainOutput packed_out, counted_out;
  std::int64_t packed_fewest = 0, counted_fewest = 0;
  std::vector<Tensor> packed = run(true, &packed_out, &packed_fewest);
  std::vector<Tensor> counted = run(false, &counted_out, &counted_fewest);
  CHECK(packed_out.oom_splits == 0);
  CHECK(counted_out.oom_splits == 0);
  CHECK(packed_fewest < counted_fewest);  // short sequences packed several to a micro-batch
  for (std::size_t i = 0; i < packed.size(); ++i) CHECK(max_relative_difference(packed[i], counted[i]) <= 1e-10);
  MESSAGE("budget " << budget << ": fewest micro-batches a window packed by tokens " << packed_fewest
                    << ", by count " << counted_fewest);
}

TEST_CASE("a budget that one long sequence does not fit is refused when planned, not mid-run") {
  // The planner used to measure the first examples only: with short ones first, it accepted a
  // budget under which the later long sequence alone could not train ("one sample does not fit"
  // after some steps). It now measures the longest and refuses at once.
  std::vector<std::int64_t> lengths(20, 4);
  lengths[17] = 16;
  Sequences data(lengths, 13);
  std::vector<std::int64_t> short_lengths(1, 4);
  Sequences short_data(short_lengths, 13);
  nn::GPTConfig cfg{.vocab_size = 13, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16};
  ModelInit init = [cfg] {
    auto m = std::make_unique<nn::GPT>(cfg);
    m->to(DType::f64);
    return m;
  };
  const std::int64_t budget = budget_for_window(init, short_data, 1);  // one short sequence
  TempDir dir;
  // The Trainer plans when it is made, before any step.
  check_throws_with(
      [&] {
        Trainer trainer(init, {.output_dir = dir.path.string(), .per_device_train_batch_size = kAutoBatch,
                               .train_batch_size = 4, .memory_budget = budget, .max_steps = 10,
                               .logging_steps = 1, .use_cpu = true}, data);
      },
      "[planner] the budget of");
}

TEST_CASE("Trainer: an output_dir that cannot be made is refused by name, with the reason") {
  TempDir dir;
  TensorDataset train_set = synthetic_images(16, 1);
  const fs::path file = dir.path / "a_file";
  std::ofstream(file) << "x";
  for (const fs::path& out : {file, file / "below", fs::path("/proc/microbatch_test")}) {
    INFO(out.string());
    TrainingArguments a = small_run(out);
    a.max_steps = 1;
    check_throws_with([&] { quiet_train(a, train_set); },
                      "[Trainer] cannot create output_dir '" + out.string() + "': ");
  }
  check_throws_with([] { TrainingArguments{.output_dir = ""}.validate(); },
                    "output_dir must name a folder");
}

TEST_CASE("Trainer: the logged learning rate is the schedule's after the step, as Hugging Face's") {
  // Hugging Face logs _get_learning_rate() after lr_scheduler.step(): the rate the next step runs
  // with. Linear, 2 warmup steps of 4, peak 1e-3: 5e-4, 1e-3, 5e-4, 0.
  TempDir dir;
  TensorDataset train_set = synthetic_images(32, 1);
  TrainingArguments a = small_run(dir.path / "linear");
  a.max_steps = 4;
  a.warmup_steps = 2;
  quiet_train(a, train_set);
  std::vector<double> logged;
  for (const nlohmann::json& l : step_lines(dir.path / "linear"))
    logged.push_back(l["learning_rate"]);
  CHECK(logged == std::vector<double>{5e-4, 1e-3, 5e-4, 0.0});
  // A skipped step (fp16 overflow) does not move the schedule, as Hugging Face's scheduler stays
  // put when the optimizer step was skipped: each line logs the rate after the steps taken.
  quiet_train(inf_run(dir.path / "skips", 1), images_with_an_inf());
  std::int64_t skipped = 0;
  for (const nlohmann::json& l : step_lines(dir.path / "skips")) {
    const auto taken = l["step"].get<std::int64_t>() - l["skipped_steps"].get<std::int64_t>();
    skipped = l["skipped_steps"];
    CHECK(l["learning_rate"].get<double>() ==
          doctest::Approx(1e-3 * static_cast<double>(12 - taken) / 12).epsilon(1e-12));
  }
  CHECK(skipped >= 2);
}

TEST_CASE("TrainingArguments: a warmup ratio of the longest run never overflows nor outlasts it") {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  CHECK(TrainingArguments{.warmup_ratio = 1.0}.get_warmup_steps(kMax) == kMax);
  CHECK(TrainingArguments{.warmup_ratio = 0.1}.get_warmup_steps(1000) == 100);
  CHECK(TrainingArguments{.warmup_ratio = 0.1}.get_warmup_steps(5) == 1);  // ceil, as Hugging Face
  CHECK(TrainingArguments{.warmup_steps = 7, .warmup_ratio = 0.5}.get_warmup_steps(100) == 7);
  // The run starts (the scheduler accepts its warmup) and warms up from 0: its first line logs the
  // rate of the second step (as Hugging Face logs it), 1/kMax of the peak.
  TempDir dir;
  TensorDataset train_set = synthetic_images(16, 1);
  TrainingArguments a = small_run(dir.path);
  a.max_steps = kMax;
  a.warmup_ratio = 1.0;
  std::ostringstream sink;
  Trainer trainer(small_mlp(), a, train_set);
  trainer.set_log_stream(&sink);
  struct FirstStep {};
  trainer.set_step_callback([](std::int64_t) { throw FirstStep{}; });
  CHECK_THROWS_AS(trainer.train(), FirstStep);
  REQUIRE(!read_log(dir.path).empty());
  const nlohmann::json first = read_log(dir.path).back();
  CHECK(first["step"] == 1);
  CHECK(first["learning_rate"].get<double>() < 1e-12);
}

TEST_CASE("Trainer: an effective batch beyond the training set is one window of all of it") {
  TempDir dir;
  TensorDataset train_set = synthetic_images(20, 1);
  TrainingArguments a = small_run(dir.path);
  a.per_device_train_batch_size = 8;
  a.gradient_accumulation_steps = 1;
  a.train_batch_size = std::numeric_limits<std::int64_t>::max();
  a.max_steps = 2;
  std::ostringstream sink;
  Trainer trainer(small_mlp(), a, train_set);
  trainer.set_log_stream(&sink);
  CHECK(trainer.plan().effective_batch == 20);
  CHECK(trainer.plan().accumulation_steps == 3);
  CHECK(trainer.train().global_step == 2);
  for (const nlohmann::json& l : step_lines(dir.path)) {
    CHECK(l["steps_per_window"] == 3);  // 8 + 8 + 4
    CHECK(l["epoch"].get<double>() == l["step"].get<double>());
  }
}

TEST_CASE("Trainer: samples labelled -100 carry no loss and no weight, whatever the split") {
  // 16 samples of which only 2 carry a label: most micro-batches of the smaller splits have no
  // loss-bearing sample (a NaN mean loss of weight 0). The window's weights must still sum to one
  // over the 2 that count, and no split may log anything but the full batch's loss.
  manual_seed(3);
  Tensor x = rand({16, 28, 28});
  std::vector<double> y(16, -100.0);
  y[5] = 3;
  y[11] = 7;
  TensorDataset data(x, from_vector(y, {16}, {.dtype = DType::i64}));
  std::vector<std::vector<double>> weights;
  std::vector<double> logged;
  double expected = 0.0;
  for (std::int64_t micro : {16, 8, 4, 1}) {
    CAPTURE(micro);
    TempDir dir;
    TrainingArguments a = small_run(dir.path);
    a.per_device_train_batch_size = micro;
    a.gradient_accumulation_steps = 16 / micro;
    a.max_steps = 1;
    a.per_device_eval_batch_size = micro;  // evaluation batches with no labelled sample too
    std::ostringstream sink;
    Trainer trainer(small_mlp(), a, data, &data, ComputeMetrics());
    trainer.set_log_stream(&sink);
    {
      NoGradGuard no_grad;  // the initial model's loss over the 2 labelled samples
      expected = trainer.model()(x, from_vector(y, {16}, {.dtype = DType::i64})).loss.item();
    }
    CHECK(trainer.evaluate().at("eval_loss") == doctest::Approx(expected).epsilon(1e-6));
    trainer.train();
    const std::vector<nlohmann::json> lines = step_lines(dir.path);
    REQUIRE(lines.size() == 1);
    REQUIRE(lines[0]["loss"].is_number());
    logged.push_back(lines[0]["loss"].get<double>());
    CHECK(logged.back() == doctest::Approx(expected).epsilon(1e-6));
    std::vector<double> w;
    for (auto& [name, t] : trainer.model().named_parameters())
      for (double v : t.to_vector()) w.push_back(v);
    weights.push_back(w);
  }
  for (std::size_t s = 1; s < weights.size(); ++s) {
    CAPTURE(s);
    double diff = 0.0;
    for (std::size_t i = 0; i < weights[0].size(); ++i)
      diff = std::max(diff, std::abs(weights[s][i] - weights[0][i]));
    CHECK(diff < 1e-6);
  }
}
