// The `microbatch` command (cli/main.cpp) run as a user runs it: flags over the config file over
// the command's defaults, bad input refused with a message and exit status 2, --help, --json, and
// scripts/train.sh (kill-and-resume through the command is test_trainer.cpp's).
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "nn/models.h"
#include "tests/core/harness.h"
#include "train/fashion_mnist.h"
#include "train/training_args.h"

using namespace microbatch;
using namespace microbatch::testing;
namespace fs = std::filesystem;

#ifdef MB_CLI_PATH
namespace {
struct CommandResult {
  int status = -1;     // the exit status, or 128 + the signal that ended it
  std::string output;  // stdout and stderr
};

// Runs the command with `args` in the folder `cwd` (default: this one), for at most two minutes
// (a hang exits 124).
CommandResult run_command(const std::string& args, const fs::path& out, const fs::path& cwd = {}) {
  const std::string cmd =
      fmt::format("{}timeout 120 {} {} > {} 2>&1", cwd.empty() ? "" : "cd " + cwd.string() + " && ",
                  MB_CLI_PATH, args, out.string());
  const int raw = std::system(cmd.c_str());
  CommandResult r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  std::ifstream in(out);
  r.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return r;
}

// Runs each case's arguments, expecting exit status 2 and the case's message.
void expect_refusals(const std::vector<std::pair<std::string, std::string>>& cases,
                     const fs::path& out, const fs::path& cwd = {}) {
  for (const auto& [args, message] : cases) {
    INFO(args);
    const CommandResult r = run_command(args, out, cwd);
    INFO(r.output);
    CHECK(r.status == 2);
    CHECK(r.output.find(message) != std::string::npos);
  }
}


// A small GPT on synthetic tokens, one step on the CPU, into dir/run.
std::string tiny_gpt(const std::string& command, const fs::path& dir) {
  return fmt::format(
      "{} --model gpt --dataset synthetic --synthetic-size 32 --vocab-size 16 --n-layer 1 "
      "--n-head 2 --n-embd 8 --block-size 8 --use-cpu --max-steps 1 --output-dir {}",
      command, (dir / "run").string());
}
}  // namespace

TEST_CASE("the command: a config file's keys go over the command's defaults, the rest stay") {
  TempDir dir;
  const fs::path config = dir.path / "args.json";
  std::ofstream(config) << R"({"max_steps": 1, "logging_steps": 1})";
  const std::string cmd = fmt::format(
      "{} train --model gpt --dataset synthetic --synthetic-size 128 --vocab-size 32 --n-layer 1 --n-head 2 "
      "--n-embd 16 --block-size 16 --use-cpu --config {} --output-dir {} > /dev/null 2>&1",
      MB_CLI_PATH, config.string(), dir.path.string());
  // Synthetic tokens have no evaluation split: the command's per-epoch evaluation is off for them.
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::vector<nlohmann::json> lines = step_lines(dir.path);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0]["micro_batch_size"] == 64);  // the command's default, not the library's 8
}

TEST_CASE("the command: bad input is a message and exit status 2, never an abort or a hang") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt", file = dir.path / "a_file";
  std::ofstream(file) << "x";
  const std::string gpt = tiny_gpt("train", dir.path);
  const std::pair<std::string, std::string> cases[] = {
      {"--output-dir /proc/microbatch_test",
       "error: [Trainer] cannot create output_dir '/proc/microbatch_test'"},
      {"--output-dir " + file.string(),
       "error: [Trainer] cannot create output_dir '" + file.string() + "'"},
      {"--output-dir ''", "error: [--output-dir] needs a value, got an empty one"},
      {"--data ''", "error: [--data] needs a value"},
      {"--n-head 0", "error: [GPT] n_head must be >= 1, got 0"},
      {"--n-head -4", "error: [GPT] n_head must be >= 1, got -4"},
      {"--n-layer 0", "error: [GPT] n_layer must be >= 1, got 0"},
      {"--n-layer -1", "error: [GPT] n_layer must be >= 1, got -1"},
      {"--block-size 0", "error: [--block-size] must be >= 1, got 0"},
      {"--memory-budget 1e30", "error: [memory_budget] '1e30' is too large"},
      {"--memory-budget 0.4", "error: [memory_budget] '0.4' is less than one byte"},
      // Failing at the first checkpoint, after training, lost the run: refused before it starts.
      {"--save-strategy steps --save-steps 1 --output-dir " + (dir.path / "out\xff").string(),
       "output_dir '" + (dir.path / "out").string() + "\\xFF' is not valid UTF-8"},
      // A flag the parser refuses exits 2 as well, as every error.
      {"--no-such-flag", "--no-such-flag"},
      {"--text-level BYTE", "--text-level"},
      {"--n-layer", "--n-layer"},
      {"--per-device-train-batch-size 0",
       "per_device_train_batch_size must be >= 1 or \"auto\", got 0"},
      {"--gradient-accumulation-steps 3 --train-batch-size 32",
       "train_batch_size 32 is not divisible by gradient_accumulation_steps 3"},
      {"--gradient-accumulation-steps 4 --train-batch-size 32 --per-device-train-batch-size 64",
       "per_device_train_batch_size 64 x gradient_accumulation_steps 4 = 256 does not equal "
       "train_batch_size 32"},
      // One accumulation step given is a step count like any other, not the default's "derive it".
      {"--per-device-train-batch-size 4 --gradient-accumulation-steps 1 --train-batch-size 8",
       "per_device_train_batch_size 4 x gradient_accumulation_steps 1 = 4 does not equal "
       "train_batch_size 8"},
  };
  std::vector<std::pair<std::string, std::string>> full;
  for (const auto& [args, message] : cases) full.emplace_back(gpt + " " + args, message);
  expect_refusals(full, out);
}

TEST_CASE("the command: any two of the batch triad give the third; a huge effective batch trains") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt";
  auto train = [&](const std::string& name, const std::string& args) {
    const std::string a = fmt::format(
        "train --model gpt --dataset synthetic --synthetic-size 40 --vocab-size 16 --n-layer 1 "
        "--n-head 2 --n-embd 8 --block-size 8 --use-cpu --max-steps 1 --logging-steps 1 "
        "--output-dir {} {}",
        (dir.path / name).string(), args);
    const CommandResult r = run_command(a, out);
    INFO(r.output);
    REQUIRE(r.status == 0);
    const std::vector<nlohmann::json> lines = step_lines(dir.path / name);
    REQUIRE(lines.size() == 1);
    return lines[0];
  };
  // The command's default micro-batch (64) does not count as given.
  nlohmann::json l =
      train("steps_and_total", "--gradient-accumulation-steps 4 --train-batch-size 20");
  CHECK(l["micro_batch_size"] == 5);
  CHECK(l["steps_per_window"] == 4);
  l = train("micro_and_total", "--per-device-train-batch-size 4 --train-batch-size 20");
  CHECK(l["steps_per_window"] == 5);
  l = train("micro_and_steps", "--per-device-train-batch-size 4 --gradient-accumulation-steps 2");
  CHECK(l["samples"] == 8);
  l = train("all_three", "--per-device-train-batch-size 4 --gradient-accumulation-steps 1 "
                         "--train-batch-size 4");
  CHECK(l["steps_per_window"] == 1);
  CHECK(l["samples"] == 4);
  l = train("total_only", "--train-batch-size 12");  // the default micro-batch, capped by the batch
  CHECK(l["micro_batch_size"] == 12);
  // Past the 40 sequences: one window of all of them, at once rather than never.
  l = train("huge", "--train-batch-size 9223372036854775807 --per-device-train-batch-size 16");
  CHECK(l["samples"] == 40);
  CHECK(l["steps_per_window"] == 3);
}

TEST_CASE("the command: check-accumulation --json prints JSON lines only") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt";
  const CommandResult r = run_command("check-accumulation --json", out);
  REQUIRE(r.status == 0);
  std::istringstream lines(r.output);
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(lines, line)) {
    INFO(line);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    REQUIRE_FALSE(j.is_discarded());
    rows.push_back(j);
  }
  REQUIRE(rows.size() > 1);
  CHECK(rows.back() == nlohmann::json{{"result", "accumulation is exact"}, {"pass", true}});
  int naive = 0;
  for (std::size_t i = 0; i + 1 < rows.size(); ++i) {
    CHECK(rows[i]["pass"] == true);
    if (!rows[i].contains("naive_max_grad_rel")) continue;
    ++naive;
    CHECK(rows[i]["naive_max_grad_rel"].get<double>() > 0.0);
  }
  CHECK(naive > 0);
  CHECK(naive < static_cast<int>(rows.size()) - 1);  // the rows without the figure leave it out
}

TEST_CASE("the command: a flag with no value is refused, not given the next flag as its value") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt";
  // Run in dir: a swallowed flag would train into dir/--fp16.
  const std::string gpt = tiny_gpt("train", dir.path);
  expect_refusals(
      {
          {gpt + " --eval-strategy no --output-dir --fp16",
           "error: [--output-dir] needs a value; got the flag --fp16"},
          {gpt + " --output_dir --use_cpu",
           "error: [--output-dir] needs a value; got the flag --use_cpu"},
          {gpt + " --learning-rate --bf16",
           "error: [--learning-rate] needs a value; got the flag --bf16"},
          {gpt + " --data --pack-by-tokens=false",
           "error: [--data] needs a value; got the flag --pack-by-tokens"},
          {tiny_gpt("plan", dir.path) + " --memory-budget --json",
           "error: [--memory-budget] needs a value; got the flag --json"},
          // Negative numbers are values, refused (or not) by what reads them.
          {gpt + " --seed -1", "'seed' must be >= 0, got -1"},
          {gpt + " --weight-decay -0.5", "weight_decay must be >= 0, got -0.5"},
      },
      out, dir.path);
  CHECK_FALSE(fs::exists(dir.path / "--fp16"));
  CHECK_FALSE(fs::exists(dir.path / "--use_cpu"));
}

TEST_CASE("the command: flags the model or the dataset does not read are refused by name") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt";
  // Refused before any data is read: a missing --data is never reached.
  const std::string rest = fmt::format("--data {} --use-cpu --max-steps 1 --output-dir {}",
                                       (dir.path / "missing").string(), (dir.path / "run").string());
  expect_refusals(
      {
          {"plan --model gpt2 --n-layer 2 --n-embd 64 --n-head 2 --memory-budget 1GiB",
           "error: [--model gpt2] does not use --n-layer, --n-head, --n-embd (gpt2 is GPT-2 small"},
          {"plan --model gpt2 --dataset synthetic --vocab-size 100 --memory-budget 1GiB",
           "error: [--model gpt2 --dataset synthetic] does not use --vocab-size"},
          {"train --model mlp --n-layer 7 --block-size 3 --text-level byte --vocab-size 5 " + rest,
           "error: [--model mlp] does not use --vocab-size, --block-size, --n-layer, --text-level"},
          {"train --model cnn --dataset file --synthetic-size 8 " + rest,
           "error: [--model cnn] does not use --synthetic-size"},
          {"train --model gpt --dataset synthetic --text-level byte " + rest,
           "error: [--model gpt --dataset synthetic] does not use --data, --text-level"},
          {"train --model gpt --synthetic-size 8 --vocab-size 5 " + rest,
           "error: [--model gpt] does not use --synthetic-size, --vocab-size"},
          // The flags a model does read are still checked.
          {"plan --model gpt2 --dataset synthetic --memory-budget 1GiB --block-size 2000",
           "error: [--block-size] must be in [1, 1024] for gpt2"},
      },
      out);
}

TEST_CASE("the command: an out-of-range number, a non-UTF-8 text, a short validation split") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt", binary = dir.path / "binary.txt",
                 short_text = dir.path / "short.txt";
  std::ofstream(binary) << "abc\xff\xfe def";
  {
    std::ofstream text(short_text);  // 360 tokens to train on, 40 to validate
    for (int i = 0; i < 400; ++i) text << static_cast<char>('a' + i % 26);
  }
  const std::string gpt = fmt::format(
      "train --model gpt --n-layer 1 --n-head 2 --n-embd 8 --use-cpu --max-steps 1 --output-dir {}",
      (dir.path / "run").string());
  expect_refusals(
      {
          {tiny_gpt("train", dir.path) + " --learning-rate 1e999",
           "error: [learning_rate] '1e999' is out of range"},
          {tiny_gpt("train", dir.path) + " --max-steps -1e999",
           "error: [max_steps] '-1e999' is out of range"},
          {gpt + " --block-size 4 --data " + binary.string(),
           "invalid UTF-8 at byte offset 3: invalid byte 0xFF (TextLevel::Byte, the command's "
           "--text-level byte, reads any file)"},
          {gpt + " --block-size 64 --data " + short_text.string(),
           "the val split has 40 tokens, fewer than block_size + 1 = 65; train without evaluation "
           "(--eval-strategy no) or with a smaller --block-size"},
      },
      out);
}

namespace {

// A text of `n` characters from a fixed stream over 16 letters and spaces, with room for a
// validation split (its last tenth) of a few blocks.
void write_text(const fs::path& path, int n) {
  std::ofstream text(path);
  std::uint32_t x = 12345;
  for (int i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    const std::uint32_t k = (x >> 24) % 20;
    text << (k < 16 ? static_cast<char>('a' + k) : ' ');
  }
}

// The "eval" lines of a run's log.jsonl, by step.
std::map<std::int64_t, nlohmann::json> eval_lines(const fs::path& run) {
  std::map<std::int64_t, nlohmann::json> out;
  std::ifstream in(run / "log.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("event", "") == "eval") out[j.at("step").get<std::int64_t>()] = j;
  }
  return out;
}

// The one JSON line eval --json prints.
nlohmann::json eval_json(const CommandResult& r) {
  INFO(r.output);
  REQUIRE(r.status == 0);
  const nlohmann::json j = nlohmann::json::parse(r.output, nullptr, false);
  REQUIRE(j.is_object());
  return j;
}

}  // namespace

TEST_CASE(
    "the command: eval gives what training's evaluations gave, from its weights file and "
    "from a checkpoint") {
  TempDir dir;
  const fs::path text = dir.path / "text.txt", run = dir.path / "run", out = dir.path / "out.txt";
  write_text(text, 3000);
  for (const std::string precision : {"", " --bf16"}) {
    CAPTURE(precision);
    const std::string model = fmt::format(
        "--model gpt --data {} --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --use-cpu "
        "--per-device-eval-batch-size 8 --output-dir {}{}",
        text.string(), run.string(), precision);
    const CommandResult trained =
        run_command("train " + model +
                        " --max-steps 4 --eval-strategy steps --eval-steps 2 --save-strategy steps "
                        "--save-steps 2 --overwrite-output-dir --json",
                    out);
    INFO(trained.output);
    REQUIRE(trained.status == 0);
    const std::map<std::int64_t, nlohmann::json> logged = eval_lines(run);
    REQUIRE(logged.count(2) == 1);
    REQUIRE(logged.count(4) == 1);
    // The same weights, data and batches: the same sums in the same order, to the bit.
    const nlohmann::json last = eval_json(run_command("eval " + model + " --json", out));
    CHECK(last.at("weights") == (run / "model.safetensors").string());
    CHECK(!last.contains("checkpoint_step"));
    CHECK(last.at("eval_loss").get<double>() == logged.at(4).at("eval_loss").get<double>());
    CHECK(last.at("eval_perplexity").get<double>() ==
          logged.at(4).at("eval_perplexity").get<double>());
    CHECK(last.at("eval_examples").get<std::int64_t>() > 8);  // more than one batch
    // A checkpoint holds the f32 master weights, which the run's working copy was made from.
    const nlohmann::json second = eval_json(
        run_command("eval " + model + " --json --weights " + (run / "checkpoint-2").string(), out));
    CHECK(second.at("checkpoint_step") == 2);
    CHECK(second.at("eval_loss").get<double>() == logged.at(2).at("eval_loss").get<double>());
    CHECK(second.at("eval_loss").get<double>() != last.at("eval_loss").get<double>());
  }
  // Without --json: every metric and the time, on lines of their own.
  const CommandResult shown = run_command(
      fmt::format("eval --model gpt --data {} --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 "
                  "--use-cpu --output-dir {}",
                  text.string(), run.string()),
      out);
  INFO(shown.output);
  CHECK(shown.status == 0);
  CHECK(shown.output.find("parameters from " + (run / "model.safetensors").string()) !=
        std::string::npos);
  CHECK(shown.output.find("eval_perplexity") != std::string::npos);
  CHECK(shown.output.find("examples/s), peak memory") != std::string::npos);
}

TEST_CASE("the command: eval refuses weights of another model, missing or damaged weights") {
  TempDir dir;
  const fs::path text = dir.path / "text.txt", run = dir.path / "run", out = dir.path / "out.txt";
  write_text(text, 3000);
  const std::string model = fmt::format(
      "--model gpt --data {} --n-layer 1 --n-embd 16 --block-size 16 --use-cpu --output-dir {}",
      text.string(), run.string());
  const CommandResult trained = run_command(
      "train " + model + " --n-head 2 --max-steps 2 --save-strategy steps --save-steps 2", out);
  INFO(trained.output);
  REQUIRE(trained.status == 0);
  const fs::path garbage = dir.path / "garbage.safetensors", broken = dir.path / "checkpoint-2";
  std::ofstream(garbage) << "not a safetensors file";
  fs::copy(run / "checkpoint-2", broken, fs::copy_options::recursive);
  fs::resize_file(broken / "model.safetensors", fs::file_size(broken / "model.safetensors") - 4);
  const std::string checkpoint = " --weights " + (run / "checkpoint-2").string();
  expect_refusals(
      {
          // n_head is what the weights' shapes do not show.
          {"eval " + model + " --n-head 4",
           fmt::format("error: [weights] {} was trained with another model: n_head = 2 in the "
                       "weights file, 4 here",
                       (run / "model.safetensors").string())},
          {"eval " + model + " --n-head 4" + checkpoint,
           "was trained with another model: n_head = 2 in the checkpoint, 4 here"},
          {"eval " + model + " --n-head 2 --block-size 32",
           "block_size = 16 in the weights file, 32 here"},
          {"eval " + model + " --n-head 2 --output-dir " + (dir.path / "none").string(),
           fmt::format("error: [eval] no trained weights at {}: train into {} first",
                       (dir.path / "none" / "model.safetensors").string(),
                       (dir.path / "none").string())},
          {"eval " + model + " --n-head 2 --weights " + garbage.string(), garbage.string()},
          {"eval " + model + " --n-head 2 --weights " + broken.string(),
           fmt::format("[checkpoint] {}", broken.string())},
          {"eval " + model + " --n-head 2 --resume-from-checkpoint latest",
           "error: [eval] --resume-from-checkpoint is for train: name a checkpoint folder with "
           "--weights"},
          {fmt::format("eval --model gpt --dataset synthetic --use-cpu --output-dir {}",
                       run.string()),
           "error: [eval] synthetic tokens have no evaluation split"},
      },
      out);
  // Another kind of model (its data, Fashion-MNIST, is read first).
  if (fs::exists(fs::path(train::kFashionMnistRoot) / "t10k-labels-idx1-ubyte.gz")) {
    expect_refusals({{fmt::format("eval --model mlp --use-cpu --output-dir {}", run.string()),
                      "model = \"gpt\" in the weights file, \"mlp\" here"}},
                    out);
  } else {
    MESSAGE("SKIPPED: eval of a GPT's weights as an MLP's: no Fashion-MNIST at "
            << train::kFashionMnistRoot);
  }
}

TEST_CASE("the command: train --init-weights starts from a weights file or a checkpoint") {
  TempDir dir;
  const fs::path text = dir.path / "text.txt", out = dir.path / "out.txt";
  write_text(text, 3000);
  const std::string model = fmt::format(
      "--model gpt --data {} --n-layer 1 --n-embd 16 --block-size 16 --use-cpu", text.string());
  auto run_in = [&](const std::string& folder, const std::string& more) {
    const CommandResult r =
        run_command(fmt::format("train {} --eval-strategy no --output-dir {} {}", model,
                                (dir.path / folder).string(), more),
                    out);
    INFO(r.output);
    REQUIRE(r.status == 0);
  };
  auto weights = [&](const fs::path& file) { return load_safetensors(file.string()).tensors; };
  auto same = [](const NamedTensorMap& a, const NamedTensorMap& b) {
    if (a.size() != b.size()) return false;
    for (const auto& [name, t] : a)
      if (!b.count(name) || t.to_vector() != b.at(name).to_vector()) return false;
    return true;
  };
  run_in("trained", "--n-head 2 --max-steps 3 --save-strategy steps --save-steps 2");
  const NamedTensorMap trained = weights(dir.path / "trained" / "model.safetensors");
  // A step at learning rate 0 changes no weight (AdamW's decay is scaled by it too): each run
  // ends with the weights it started from.
  run_in("fresh", "--n-head 2 --max-steps 1 --learning-rate 0");
  CHECK(!same(weights(dir.path / "fresh" / "model.safetensors"), trained));
  run_in("from_file", "--n-head 2 --max-steps 1 --learning-rate 0 --init-weights " +
                          (dir.path / "trained" / "model.safetensors").string());
  CHECK(same(weights(dir.path / "from_file" / "model.safetensors"), trained));
  const fs::path checkpoint = dir.path / "trained" / "checkpoint-2";
  run_in("from_checkpoint",
         "--n-head 2 --max-steps 1 --learning-rate 0 --init-weights " + checkpoint.string());
  CHECK(same(weights(dir.path / "from_checkpoint" / "model.safetensors"),
             weights(checkpoint / "model.safetensors")));
  CHECK(!same(weights(checkpoint / "model.safetensors"), trained));
  const std::string from =
      " --init-weights " + (dir.path / "trained" / "model.safetensors").string();
  const CommandResult bench =
      run_command(fmt::format("bench {} --n-head 2 --steps 1 --warmup 0{}", model, from), out);
  INFO(bench.output);
  CHECK(bench.status == 0);
  expect_refusals(
      {{fmt::format("train {} --n-head 4 --max-steps 1 --output-dir {}{}", model,
                    (dir.path / "other").string(), from),
        "was trained with another model: n_head = 2 in the weights file, 4 here"},
       {fmt::format("train {} --n-head 2 --max-steps 1 --output-dir {} "
                    "--resume-from-checkpoint latest{}",
                    model, (dir.path / "trained").string(), from),
        "error: [--init-weights] a run resumed from a checkpoint continues from the checkpoint's "
        "weights"}},
      out);
}

TEST_CASE("the command: bench times the Trainer's steps and reads back its own log") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt", tmp = dir.path / "tmp", kept = dir.path / "kept";
  const fs::path own = dir.path / "own.json", plain = dir.path / "plain.json",
                 named = dir.path / "named.json";
  std::ofstream(own) << R"({"save_steps": 5})";
  fs::create_directories(tmp);
  const std::string model =
      "bench --model gpt --dataset synthetic --synthetic-size 256 --vocab-size 32 --n-layer 1 "
      "--n-head 2 --n-embd 16 --block-size 16 --use-cpu --steps 3 --warmup 1";
  // Its temporary folder (in TMPDIR) is gone afterwards.
  ::setenv("TMPDIR", tmp.c_str(), 1);
  const CommandResult r = run_command(model + " --memory-budget 8MiB --json", out);
  ::unsetenv("TMPDIR");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(fs::is_empty(tmp));
  const nlohmann::json j = nlohmann::json::parse(r.output);
  CHECK(j.at("steps") == 3);
  CHECK(j.at("warmup_steps") == 1);
  const std::vector<double> ms = j.at("step_ms").get<std::vector<double>>();
  REQUIRE(ms.size() == 3);
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted.front() > 0);
  CHECK(j.at("step_ms_min").get<double>() == sorted.front());
  CHECK(j.at("step_ms_max").get<double>() == sorted.back());
  CHECK(j.at("step_ms_median").get<double>() == sorted[1]);
  // A step is a window of 64 sequences of 16 tokens, every one of which bears loss.
  CHECK(j.at("micro_batch_size").get<std::int64_t>() *
            j.at("accumulation_steps").get<std::int64_t>() ==
        64);
  const double per_second = 1e3 / sorted[1];
  CHECK(j.at("samples_per_second").get<double>() ==
        doctest::Approx(64 * per_second).epsilon(1e-12));
  CHECK(j.at("tokens_per_second").get<double>() ==
        doctest::Approx(64 * 16 * per_second).epsilon(1e-12));
  // The plan's prediction and the measured peak, under the budget.
  CHECK(j.at("predicted_peak_bytes").get<std::int64_t>() > 0);
  CHECK(j.at("peak_bytes").get<std::int64_t>() > 0);
  CHECK(j.at("peak_bytes").get<std::int64_t>() <= 8 << 20);
  // With --output-dir the run's folder stays: a log line for every step, warm-up included.
  const CommandResult shown = run_command(model + " --output-dir " + kept.string(), out);
  INFO(shown.output);
  REQUIRE(shown.status == 0);
  CHECK(step_lines(kept).size() == 4);
  CHECK(shown.output.find("3 steps after 1 warm-up: ") != std::string::npos);
  CHECK(shown.output.find(" tokens/s\npeak memory ") != std::string::npos);
  expect_refusals({{model + " --steps 0", "error: [bench] --steps must be >= 1, got 0"},
                   {model + " --warmup -1", "error: [bench] --warmup must be >= 0, got -1"},
                   {model + " --max-steps 9",
                    "error: [bench] --max-steps is the benchmark's own: it trains --warmup + "
                    "--steps steps"},
                   {model + " --eval-strategy steps",
                    "error: [bench] --eval-strategy is the "
                    "benchmark's own"},
                   {model + " --config " + own.string(),
                    "error: [bench] save_steps in " + own.string() + " is the benchmark's own"}},
                  out);
  // A config file without output_dir leaves the run in a temporary folder, as no flag does; one
  // that names it keeps the run there.
  std::ofstream(plain) << R"({"seed": 3})";
  ::setenv("TMPDIR", tmp.c_str(), 1);
  const CommandResult configured =
      run_command(model + " --config " + plain.string(), out, dir.path);
  ::unsetenv("TMPDIR");
  INFO(configured.output);
  CHECK(configured.status == 0);
  CHECK(fs::is_empty(tmp));
  CHECK(!fs::exists(dir.path / "runs"));  // the command's default output_dir, runs/microbatch
  std::ofstream(named) << fmt::format(R"({{"output_dir": "{}"}})", (dir.path / "named").string());
  const CommandResult kept_by_file = run_command(model + " --config " + named.string(), out);
  INFO(kept_by_file.output);
  CHECK(kept_by_file.status == 0);
  CHECK(step_lines(dir.path / "named").size() == 4);
}

TEST_CASE("the command: --json and a config file's json, flags over the file, for train and plan") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt", config = dir.path / "args.json";
  std::ofstream(config) << R"({"json": true, "logging_steps": 1})";
  auto is_json = [](const std::string& text) {
    return !nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false).is_discarded();
  };
  auto first_line = [](const std::string& text) { return text.substr(0, text.find('\n')); };
  const std::string with_config = " --config " + config.string();

  CommandResult r = run_command(tiny_gpt("train", dir.path) + with_config, out);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(is_json(first_line(r.output)));
  r = run_command(tiny_gpt("train", dir.path) + with_config + " --json=false", out);
  REQUIRE(r.status == 0);
  CHECK(first_line(r.output).rfind("model gpt on cpu: ", 0) == 0);

  const std::string plan = tiny_gpt("plan", dir.path) + " --memory-budget 64MiB";
  r = run_command(plan + with_config, out);
  REQUIRE(r.status == 0);
  CHECK(is_json(r.output));
  r = run_command(plan + with_config + " --json=false", out);
  REQUIRE(r.status == 0);
  CHECK(r.output.rfind("memory plan for cpu", 0) == 0);
  r = run_command(plan + " --json", out);
  REQUIRE(r.status == 0);
  CHECK(is_json(r.output));
}

TEST_CASE("the command: plan --processes plans rank 0's share of a data-parallel run") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt";
  const std::string plan =
      tiny_gpt("plan", dir.path) + " --memory-budget 64MiB --train-batch-size 32 --json";
  CommandResult r = run_command(plan + " --processes 2", out);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(nlohmann::json::parse(r.output).at("effective_batch") == 16);
  r = run_command(plan, out);
  REQUIRE(r.status == 0);
  CHECK(nlohmann::json::parse(r.output).at("effective_batch") == 32);
  expect_refusals(
      {{plan + " --processes 3", "train_batch_size 32 is not divisible by the 3 processes"},
       {plan + " --processes 0", "--processes must be >= 1, got 0"}},
      out);
}

TEST_CASE("the command: --help gives every TrainingArguments flag's default and kind") {
  TempDir dir;
  const fs::path out = dir.path / "out.txt";
  const nlohmann::json arguments = train::TrainingArguments{}.to_json();
  for (const char* command : {"train", "plan"}) {
    const CommandResult r = run_command(std::string(command) + " --help", out);
    INFO(r.output);
    REQUIRE(r.status == 0);
    for (auto& [name, value] : arguments.items())
      CHECK(r.output.find("TrainingArguments." + name + " (default ") != std::string::npos);
    CHECK(r.output.find("TrainingArguments.learning_rate (default 0.001)") != std::string::npos);
    CHECK(r.output.find("TrainingArguments.per_device_train_batch_size (default 64)") !=
          std::string::npos);
    CHECK(r.output.find("TrainingArguments.eval_strategy (default epoch)") != std::string::npos);
    CHECK(r.output.find("TrainingArguments.json (default false)") != std::string::npos);
    CHECK(r.output.find("--learning-rate,--learning_rate FLOAT") != std::string::npos);
    CHECK(r.output.find("--max-steps,--max_steps INT") != std::string::npos);
    CHECK(r.output.find("--dropout FLOAT") != std::string::npos);
    CHECK(r.output.find("dropout probability") != std::string::npos);
    // The model and data flags name their defaults too (GPTConfig's for gpt).
    const nn::GPTConfig gpt{};
    for (const std::string& shown :
         {std::string("(default mlp)"), std::string("(default file)"),
          std::string("(default char)"), fmt::format("gpt: blocks (default {})", gpt.n_layer),
          fmt::format("gpt: attention heads (default {})", gpt.n_head),
          fmt::format("gpt: width (default {})", gpt.n_embd),
          fmt::format("gpt: sequence length (default {})", gpt.block_size),
          fmt::format("(default and at most {})", nn::GPTConfig::gpt2_small().block_size)}) {
      CAPTURE(shown);
      CHECK(r.output.find(shown) != std::string::npos);
    }
  }
  const CommandResult r = run_command("check-accumulation --help", out);
  INFO(r.output);
  CHECK(r.output.find("--json") != std::string::npos);
  CHECK(r.output.find("print one JSON object per check") != std::string::npos);
}

namespace {
// The training split scripts/train.sh trains on (Debian's dataset-fashion-mnist).
bool have_fashion_mnist() {
  return fs::exists(fs::path(train::kFashionMnistRoot) / "train-images-idx3-ubyte.gz") &&
         fs::exists(fs::path(train::kFashionMnistRoot) / "train-labels-idx1-ubyte.gz");
}


// Runs scripts/train.sh as it is, with its setup step stubbed and this build's command, in a copy
// of its folders under `dir`; returns its exit status.
int run_train_script(const TempDir& dir, const std::string& args) {
  const fs::path root = fs::path(MB_FIXTURES_DIR).parent_path().parent_path();
  fs::create_directories(dir.path / "scripts");
  fs::create_directories(dir.path / "build");
  fs::copy_file(root / "scripts" / "train.sh", dir.path / "scripts" / "train.sh",
                fs::copy_options::overwrite_existing);
  std::ofstream(dir.path / "scripts" / "setup.sh") << "true\n";
  if (!fs::exists(dir.path / "build" / "microbatch"))
    fs::create_symlink(MB_CLI_PATH, dir.path / "build" / "microbatch");
  const fs::path out = dir.path / "out.txt";
  const std::string cmd = fmt::format("BUILD_DIR=build timeout 120 bash {} {} > {} 2>&1",
                                      (dir.path / "scripts" / "train.sh").string(), args,
                                      out.string());
  const int status = std::system(cmd.c_str());
  std::ifstream in(out);
  INFO(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  CHECK(status == 0);
  return status;
}
}  // namespace

TEST_CASE("the command: scripts/train.sh leaves the micro-batch to the batch triad" *
          doctest::skip(!have_fashion_mnist())) {
  TempDir dir;
  const fs::path run = dir.path / "run";
  REQUIRE(run_train_script(dir, "--gradient-accumulation-steps 4 --train-batch-size 100 "
                                "--max-steps 1 --logging-steps 1 --eval-strategy no --use-cpu "
                                "--output-dir " + run.string()) == 0);
  const std::vector<nlohmann::json> lines = step_lines(run);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0]["micro_batch_size"] == 25);
  CHECK(lines[0]["steps_per_window"] == 4);
}

TEST_CASE("the command: scripts/train.sh's own flags do not override a config file" *
          doctest::skip(!have_fashion_mnist())) {
  // The script's 10 epochs and logging every 500 steps are flags, and flags win over a config
  // file: with --config they are left out, so the file's logging_steps holds.
  TempDir dir;
  const fs::path run = dir.path / "run", config = dir.path / "args.json";
  std::ofstream(config) << R"({"logging_steps": 1, "max_steps": 3, "eval_strategy": "no"})";
  REQUIRE(run_train_script(dir, "--config " + config.string() + " --use-cpu --output-dir " +
                                    run.string()) == 0);
  CHECK(step_lines(run).size() == 3);
  // Without a config file the script's own logging interval holds (one line, at the last step).
  const fs::path plain = dir.path / "plain";
  REQUIRE(run_train_script(dir, "--max-steps 3 --eval-strategy no --use-cpu --output-dir " +
                                    plain.string()) == 0);
  CHECK(step_lines(plain).size() == 1);
}
#endif
