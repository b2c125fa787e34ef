// The Trainer: logging, evaluation, the end of training, frozen layers, checkpoints and
// kill-and-resume through the command (training under a memory budget is
// test_trainer_budget.cpp's; the metrics and predictions, test_metrics.cpp's; the arguments and
// model configs alone, test_arguments.cpp's; the command's flags, test_cli.cpp's).
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
#include "tests/train/trainer_fixtures.h"
#include "train/accumulation_check.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::train;
namespace fs = std::filesystem;

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

TEST_CASE("Trainer: resuming refuses a model whose weights would mean something else, naming the setting") {
  // Two heads of 8 or four of 4: the same weights, the same shapes, another function.
  Sequences data(std::vector<std::int64_t>(24, 8), 13);
  auto gpt = [](std::int64_t n_head, std::int64_t ignore_index) -> ModelInit {
    return [=] {
      return std::make_unique<nn::GPT>(nn::GPTConfig{.vocab_size = 13, .block_size = 16, .n_layer = 1,
                                                     .n_head = n_head, .n_embd = 16,
                                                     .ignore_index = ignore_index});
    };
  };
  TempDir dir;
  TrainingArguments a = small_run(dir.path);
  a.max_steps = 2;
  a.save_strategy = "steps";
  a.save_steps = 2;
  auto run = [&](const ModelInit& init, const TrainingArguments& args) {
    std::ostringstream sink;
    Trainer trainer(init, args, data);
    trainer.set_log_stream(&sink);
    trainer.train();
  };
  run(gpt(2, -100), a);
  const nlohmann::json saved = load_checkpoint((dir.path / "checkpoint-2").string()).trainer_state;
  CHECK(saved.at("model") == nlohmann::json{{"model", "gpt"}, {"vocab_size", 13}, {"block_size", 16},
                                         {"n_layer", 1}, {"n_head", 2}, {"n_embd", 16},
                                         {"ignore_index", -100}});
  a.max_steps = 4;
  a.resume_from_checkpoint = (dir.path / "checkpoint-2").string();
  check_throws_with([&] { run(gpt(4, -100), a); },
                    "it was trained with another model: n_head = 2 in the checkpoint, 4 here");
  check_throws_with([&] { run(gpt(2, 0), a); },
                    "ignore_index = -100 in the checkpoint, 0 here");
  // Another kind of model is named before its weights' shapes are compared.
  check_throws_with([&] { run(small_mlp(), a); },
                    "model = \"gpt\" in the checkpoint, \"mlp\" here");
  run(gpt(2, -100), a);  // the same model goes on
  CHECK(checkpoint_steps(dir.path).back() == 4);
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
  check_throws_with([&] { resume_with("model", "mlp"); }, "'model' must be a JSON object, got \"mlp\"");
  check_throws_with(
      [&] {
        resume_with("rng_ranks", nlohmann::json::array({{1, -2}}));
      },
      "'rng_ranks' must be a list of [seed, offset] pairs");
  check_throws_with([&] { resume_with("effective_batch", "16"); },
                    "'effective_batch' must be a whole number");
  check_throws_with([&] { resume_with("effective_batch", 32); },
                    "trained with an effective batch of 32, this run has 16");
  {
    // A checkpoint from before data-parallel runs (no effective batch, processes or per-rank
    // streams) resumes on its plan's batch.
    CheckpointData older = good;
    for (const char* field : {"effective_batch", "world_size", "rng_ranks"})
      older.trainer_state.erase(field);
    resume_from(older, dir.path / "older", train_set);
    older.trainer_state["plan"]["effective_batch"] = 8;
    check_throws_with([&] { resume_from(older, dir.path / "older-8", train_set); },
                      "trained with an effective batch of 8, this run has 16");
  }
  // An architecture's list of widths is shown whole.
  nlohmann::json other = good.trainer_state.at("model");
  other["hidden"] = {64, 16};
  check_throws_with([&] { resume_with("model", other); },
                    "another model: hidden = [64,16] in the checkpoint, [64,32] here");
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
  gpu.device = test_gpu().str();
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
