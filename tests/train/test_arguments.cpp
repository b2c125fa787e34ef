// TrainingArguments and the model configs on their own: parsing (JSON, sizes, "auto"), the batch
// triad, and every bad value refused with a message that names it. Running them is
// test_trainer.cpp's.
#include <limits>
#include <string>

#include "nn/models.h"
#include "tests/core/harness.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::train;

TEST_CASE("memory sizes and the batch triad") {
  CHECK(parse_bytes("512MiB") == 512LL << 20);
  CHECK(parse_bytes("2GB") == 2000000000LL);
  CHECK(parse_bytes("1.5GiB") == 3LL << 29);
  CHECK(parse_bytes("4096") == 4096);
  check_throws_with([] { parse_bytes("12 parsecs"); }, "unknown unit 'parsecs'");
  check_throws_with([] { parse_bytes("lots"); }, "cannot read 'lots' as a size");

  BatchTriad t = resolve_batch_triad({.per_device_train_batch_size = 8, .gradient_accumulation_steps = 4});
  CHECK((t.effective == 32 && t.micro == 8 && t.accumulation == 4));
  t = resolve_batch_triad({.per_device_train_batch_size = 8, .train_batch_size = 30});
  CHECK((t.effective == 30 && t.micro == 8 && t.accumulation == 4));  // the last micro-batch holds 6
  t = resolve_batch_triad({.per_device_train_batch_size = kAutoBatch, .train_batch_size = 256, .memory_budget = 1 << 20});
  CHECK((t.effective == 256 && t.micro == 0));
  check_throws_with([] { resolve_batch_triad({.per_device_train_batch_size = 8, .gradient_accumulation_steps = 3,
                                              .train_batch_size = 32}); },
                    "per_device_train_batch_size 8 x gradient_accumulation_steps 3 = 24 does not equal train_batch_size 32");
  check_throws_with([] { TrainingArguments{.per_device_train_batch_size = kAutoBatch}.validate(); },
                    "auto needs a memory_budget");
}

TEST_CASE("TrainingArguments from JSON: names, \"auto\", sizes, unknown keys refused") {
  TrainingArguments a = TrainingArguments::from_json(nlohmann::json::parse(
      R"({"per_device_train_batch_size": "auto", "train_batch_size": 64, "memory_budget": "8MiB",
          "learning_rate": 0.01, "eval_strategy": "epoch", "save_total_limit": 2})"));
  CHECK(a.per_device_train_batch_size == kAutoBatch);
  CHECK(a.memory_budget == 8 << 20);
  CHECK(a.learning_rate == 0.01);
  CHECK(TrainingArguments::from_json(a.to_json()).to_json() == a.to_json());
  check_throws_with([] { TrainingArguments::from_json(nlohmann::json::parse(R"({"learning_rat": 1})")); },
                    "unknown argument 'learning_rat'");
  check_throws_with([] { TrainingArguments::from_json(nlohmann::json::parse(R"({"max_steps": "ten"})")); },
                    "'max_steps' has the wrong type");
  check_throws_with([] { TrainingArguments{.eval_strategy = "sometimes"}.validate(); }, "eval_strategy must be");
}

TEST_CASE("TrainingArguments: out-of-range numbers, deep values and overflowing batches are refused") {
  auto from = [](const std::string& text) { return TrainingArguments::from_json(nlohmann::json::parse(text)); };
  check_throws_with([&] { from(R"({"max_steps": 1e19})"); }, "'max_steps' is out of range: 1e+19");
  check_throws_with([&] { from(R"({"max_steps": 18446744073709551615})"); }, "'max_steps' is out of range");
  check_throws_with([&] { from(R"({"seed": 1e20})"); }, "'seed' is out of range");
  // Below the range too: casting -1e300 to int64 is undefined (it read as INT64_MIN).
  check_throws_with([&] { from(R"({"warmup_steps": -1e300})"); }, "'warmup_steps' is out of range: -1e+300");
  check_throws_with([&] { from(R"({"max_steps": -1e300})"); }, "'max_steps' is out of range");
  // A value nested 200,000 deep: named by its type, never printed whole.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  check_throws_with([&] { from(R"({"max_steps": )" + deep + "}"); }, "'max_steps' has the wrong type: a JSON array");
  check_throws_with([&] { from(R"({"output_dir": )" + deep + "}"); }, "'output_dir' has the wrong type: a JSON array");
  check_throws_with([] { resolve_batch_triad({.per_device_train_batch_size = std::int64_t{1} << 62,
                                              .gradient_accumulation_steps = 4}); },
                    "per_device_train_batch_size 4611686018427387904 x gradient_accumulation_steps 4 overflows");
  TempDir dir;
  check_throws_with([&] { TrainingArguments::load(dir.path.string()); }, "is not a readable file");
  check_throws_with([&] { TrainingArguments::load((dir.path / "none.json").string()); }, "(it does not exist)");
}

TEST_CASE("TrainingArguments: whole numbers, ranges and types are checked, naming the argument") {
  auto from = [](const char* text) { return TrainingArguments::from_json(nlohmann::json::parse(text)); };
  check_throws_with([&] { from(R"({"max_steps": 2.7})"); }, "'max_steps' must be a whole number, got 2.7");
  check_throws_with([&] { from(R"({"seed": -1})"); }, "'seed' must be >= 0, got -1");
  check_throws_with([&] { from(R"({"memory_budget": true})"); }, "'memory_budget' has the wrong type: true");
  CHECK(from(R"({"max_steps": 3.0})").max_steps == 3);
  check_throws_with([] { TrainingArguments{.warmup_steps = -5}.validate(); }, "warmup_steps must be >= 0, got -5");
  check_throws_with([] { TrainingArguments{.eval_steps = -1}.validate(); }, "eval_steps must be >= 0");
  check_throws_with([] { TrainingArguments{.weight_decay = -1}.validate(); }, "weight_decay must be >= 0");
  check_throws_with([] { TrainingArguments{.adam_beta1 = 1.0}.validate(); }, "adam_beta1 must be in [0, 1)");
  check_throws_with([] { TrainingArguments{.num_train_epochs = 1e300}.validate(); },
                    "num_train_epochs must be in [0, 1e9]");
}

TEST_CASE("TrainingArguments: paths the run writes into JSON must be UTF-8, refused up front") {
  // Any bytes make a POSIX path, but the log and the checkpoints' trainer state are JSON.
  check_throws_with([] { TrainingArguments{.output_dir = "out\xff"}.validate(); },
                    "output_dir 'out\\xFF' is not valid UTF-8");
  check_throws_with([] { TrainingArguments{.resume_from_checkpoint = "ck\xc3"}.validate(); },
                    "resume_from_checkpoint 'ck\\xC3' is not valid UTF-8");
  TrainingArguments{.output_dir = "r\xc3\xa9sultats"}.validate();  // UTF-8 beyond ASCII is fine
}

TEST_CASE("TrainingArguments: out-of-range sizes and batches say what is wrong") {
  check_throws_with([] { parse_bytes("1e30"); }, "'1e30' is too large");
  check_throws_with([] { parse_bytes("9EiB"); }, "unknown unit");
  CHECK(parse_bytes("7TiB") == std::int64_t{7} << 40);
  CHECK(parse_bytes("2TB") == std::int64_t{2000000000000});
  check_throws_with([] { parse_bytes("9EiB"); }, "use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB");
  // inf and nan are not sizes; a size that rounds to 0 bytes would silently mean "no budget".
  check_throws_with([] { parse_bytes("inf"); }, "size must be a finite number of bytes, got 'inf'");
  check_throws_with([] { parse_bytes("nan MiB"); }, "must be a finite number of bytes");
  check_throws_with([] { parse_bytes("-1KB"); }, "size must be non-negative, got '-1KB'");
  check_throws_with([] { parse_bytes("0.4"); }, "'0.4' is less than one byte (0 means no budget");
  check_throws_with([] { parse_bytes("0.0001KB"); }, "less than one byte");
  CHECK(parse_bytes("0") == 0);
  CHECK(parse_bytes("0 GiB") == 0);
  CHECK(parse_bytes("0.6") == 1);
  // 0 is not a batch size; "auto" is the one spelling of an automatic one.
  check_throws_with([] { TrainingArguments{.per_device_train_batch_size = 0}.validate(); },
                    "per_device_train_batch_size must be >= 1 or auto, got 0");
  auto from = [](const char* text) {
    return TrainingArguments::from_json(nlohmann::json::parse(text));
  };
  check_throws_with([&] { from(R"({"per_device_train_batch_size": 0})"); },
                    "must be >= 1 or \"auto\", got 0");
  check_throws_with([&] { from(R"({"per_device_train_batch_size": -1})"); },
                    "must be >= 1 or \"auto\", got -1");
  CHECK(from(R"({"per_device_train_batch_size": "auto"})").per_device_train_batch_size ==
        kAutoBatch);
  // ceil(effective / micro) next to INT64_MAX.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const BatchTriad t =
      resolve_batch_triad({.per_device_train_batch_size = 64, .train_batch_size = kMax});
  CHECK((t.effective == kMax && t.micro == 64 && t.accumulation == kMax / 64 + 1));
  // The loss scale's floor is an f32 whose inverse is finite.
  for (const double floor : {0.0, -1.0, 1e-39, 1e39}) {
    check_throws_with([&] { TrainingArguments{.loss_scale_floor = floor}.validate(); },
                      "loss_scale_floor must be in [2^-126, FLT_MAX]");
  }
  TrainingArguments{.loss_scale_floor = 0x1p-126}.validate();
  check_throws_with([] { TrainingArguments{.loss_scale_hysteresis = 0}.validate(); },
                    "loss_scale_hysteresis must be >= 1");
  check_throws_with([] { TrainingArguments{.max_overflows_at_floor = -1}.validate(); },
                    "max_overflows_at_floor must be >= 0");
  CHECK(from(R"({"loss_scale_consecutive_hysteresis": true})").loss_scale_consecutive_hysteresis);
}

TEST_CASE("model configs: sizes, heads and dropout are checked, naming the field") {
  const nn::GPTConfig ok{.vocab_size = 8, .block_size = 4, .n_layer = 1, .n_head = 2, .n_embd = 8};
  ok.validate();
  auto gpt_with = [&](auto change) {
    nn::GPTConfig c = ok;
    change(c);
    return [c] { nn::GPT model(c); };
  };
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.n_head = 0; }),
                    "[GPT] n_head must be >= 1, got 0");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.n_head = -4; }),
                    "[GPT] n_head must be >= 1, got -4");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.n_layer = 0; }),
                    "[GPT] n_layer must be >= 1, got 0");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.n_layer = -1; }),
                    "[GPT] n_layer must be >= 1, got -1");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.n_embd = 0; }),
                    "[GPT] n_embd must be >= 1, got 0");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.n_embd = 10, c.n_head = 4; }),
                    "[GPT] n_embd 10 is not divisible by n_head 4");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.block_size = 0; }),
                    "[GPT] block_size must be >= 1, got 0");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.vocab_size = 0; }),
                    "[GPT] vocab_size must be >= 1, got 0");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.dropout = 1.0; }),
                    "[GPT] dropout must be in [0, 1), got 1");
  check_throws_with(gpt_with([](nn::GPTConfig& c) { c.dropout = -0.1; }),
                    "[GPT] dropout must be in [0, 1)");
  const nn::MLPConfig zero_width{.hidden = {64, 0}};
  check_throws_with([&] { nn::MLP m(zero_width); }, "[MLP] every hidden width must be >= 1, got 0");
  check_throws_with([] { nn::MLP m({.num_classes = 0}); }, "[MLP] num_classes must be >= 1, got 0");
  check_throws_with([] { nn::MLP m({.dropout = 1.5}); },
                    "[MLP] dropout must be in [0, 1), got 1.5");
  check_throws_with([] { nn::CNN m({.channels2 = 0}); }, "[CNN] channels2 must be >= 1, got 0");
  check_throws_with([] { nn::CNN m({.image_size = 3}); }, "[CNN] image_size must be >= 4");
}
