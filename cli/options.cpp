// The flags the `microbatch` subcommands share (the model, its data, and every TrainingArguments
// field under its own name) and what they make: the run's arguments, its datasets and its model.
#include "cli/options.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "train/fashion_mnist.h"
#include "train/text.h"

namespace mb = microbatch;

namespace microbatch::cli {

namespace {

// "--per-device-train-batch-size,--per_device_train_batch_size"
std::string both_spellings(const std::string& name) {
  std::string dashed = "--" + name;
  for (char& c : dashed) c = c == '_' ? '-' : c;
  std::string underscored = "--" + name;
  return underscored == dashed ? dashed : dashed + "," + underscored;
}

}  // namespace

namespace {

// The command's own defaults: a useful first run rather than Hugging Face's fine-tuning values.
mb::train::TrainingArguments command_defaults() {
  return {.output_dir = "runs/microbatch",
          .per_device_train_batch_size = 64,
          .per_device_eval_batch_size = 256,
          .num_train_epochs = 5,
          .learning_rate = 1e-3,
          .logging_steps = 100,
          .eval_strategy = "epoch"};
}

}  // namespace

namespace {

// "TrainingArguments.learning_rate (default 0.001)": the command's default, as JSON spells it.
std::string describe_argument(const std::string& name, const nlohmann::json& value) {
  const std::string shown = value.is_string() ? value.get<std::string>() : value.dump();
  return fmt::format("TrainingArguments.{} (default {})", name, shown.empty() ? "none" : shown);
}

}  // namespace

namespace {

// The value's kind in --help, rather than CLI11's TEXT for every flag read as text.
std::string argument_type(const std::string& name, const nlohmann::json& value) {
  if (name == "per_device_train_batch_size") return "INT|auto";
  if (name == "memory_budget") return "SIZE";  // 512MiB, 2GB or bytes
  return value.is_number_integer() ? "INT" : value.is_number() ? "FLOAT" : "TEXT";
}

}  // namespace

void add_model_flags(CLI::App& cmd, Options& o) {
  // A flag given twice takes its last value, so wrappers such as scripts/train.sh can be
  // overridden.
  cmd.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Each description names its default, read from the values set before parsing.
  cmd.add_option("--model", o.model,
                 fmt::format("mlp, cnn, gpt (sized by the flags below) or gpt2 (GPT-2 small, 124M) "
                             "(default {})",
                             o.model))
      ->check(CLI::IsMember({"mlp", "cnn", "gpt", "gpt2"}));
  // The flags only some models or datasets read (refuse_unused_flags).
  auto model_option = [&](const std::string& name, auto& value, const std::string& description) {
    o.model_options.push_back(cmd.add_option(name, value, description));
    return o.model_options.back();
  };
  model_option(
      "--data", o.data,
      "Fashion-MNIST folder (mlp, cnn; default /usr/share/datasets/fashion-mnist) or a UTF-8 "
      "text file (gpt, gpt2; default ../shared/data/tinyshakespeare.txt)");
  cmd.add_option(
         "--dataset", o.dataset,
         fmt::format("file: the data --data names; synthetic: seeded uniform random tokens "
                     "(gpt, gpt2), for speed and memory benchmarks only (there is nothing in "
                     "them to learn) (default {})",
                     o.dataset))
      ->check(CLI::IsMember({"file", "synthetic"}));
  model_option(both_spellings("synthetic_size"), o.synthetic_size,
               fmt::format("synthetic: number of sequences (default {})", o.synthetic_size));
  model_option(both_spellings("vocab_size"), o.vocab_size,
               fmt::format("gpt on synthetic tokens: vocabulary size (default {})", o.vocab_size));
  cmd.add_option("--config", o.config, "TrainingArguments as a JSON file");
  const std::int64_t gpt2_positions = mb::nn::GPTConfig::gpt2_small().block_size;
  o.block_size_option = model_option(
      both_spellings("block_size"), o.gpt.block_size,
      fmt::format("gpt: sequence length (default {}); gpt2: training sequence length (default and "
                  "at most {})",
                  o.gpt.block_size, gpt2_positions));
  model_option(both_spellings("n_layer"), o.gpt.n_layer,
               fmt::format("gpt: blocks (default {})", o.gpt.n_layer));
  model_option(both_spellings("n_head"), o.gpt.n_head,
               fmt::format("gpt: attention heads (default {})", o.gpt.n_head));
  model_option(both_spellings("n_embd"), o.gpt.n_embd,
               fmt::format("gpt: width (default {})", o.gpt.n_embd));
  model_option(
      both_spellings("text_level"), o.text_level,
      fmt::format("gpt, gpt2 on a text file: byte or char vocabulary (default {})", o.text_level))
      ->check(CLI::IsMember({"byte", "char"}));
  cmd.add_option("--dropout", o.dropout, "dropout probability, any model (default 0)");
  // Every TrainingArguments field is a flag of the same name.
  const nlohmann::json defaults = command_defaults().to_json();
  for (auto& [name, value] : defaults.items()) {
    if (value.is_boolean()) {
      o.switch_options[name] =
          cmd.add_flag(both_spellings(name), o.switches[name], describe_argument(name, value));
    } else {
      o.given_options[name] =
          cmd.add_option(both_spellings(name), o.given[name], describe_argument(name, value))
              ->type_name(argument_type(name, value));
    }
  }
  o.json_option = cmd.add_flag("--json", o.json,
                               "print one JSON object per log line (plan: the plan as JSON); "
                               "TrainingArguments.json (default false)");
}

// A flag given no value is a mistake, not a request for the default: an empty value
// (--output-dir "") or another of the command's flags, which CLI11 takes as the value
// (--output-dir --fp16 would train in f32 into ./--fp16/). A negative number is a value.
void refuse_missing_values(const CLI::App& cmd) {
  std::set<std::string> flags;
  for (const CLI::Option* option : cmd.get_options()) {
    for (const std::string& name : option->get_lnames()) flags.insert("--" + name);
    for (const std::string& name : option->get_snames()) flags.insert("-" + name);
  }
  for (const CLI::Option* option : cmd.get_options()) {
    if (option->get_expected_min() == 0) continue;  // a switch: it takes no value
    for (const std::string& value : option->results()) {
      MB_CHECK(!value.empty(), "[{}] needs a value, got an empty one", option->get_name());
      const std::string flag = value.substr(0, value.find('='));  // --bf16=true names --bf16
      MB_CHECK(!flags.count(flag), "[{}] needs a value; got the flag {}", option->get_name(), flag);
    }
  }
}

namespace {

// Given any two of per_device_train_batch_size, gradient_accumulation_steps and train_batch_size,
// the third follows (resolve_batch_triad). The command's own micro-batch of 64 is a default, not a
// given: when the user gave the other two, the micro-batch is their quotient.
void derive_micro_batch(mb::train::TrainingArguments& args, const std::set<std::string>& given) {
  if (given.count("per_device_train_batch_size") || !given.count("gradient_accumulation_steps") ||
      !given.count("train_batch_size"))
    return;
  const std::int64_t effective = args.train_batch_size, steps = args.gradient_accumulation_steps;
  if (effective <= 0 || steps < 1) return;  // no effective batch to split, or refused by validate()
  MB_CHECK(
      effective % steps == 0,
      "[TrainingArguments] train_batch_size {} is not divisible by gradient_accumulation_steps "
      "{}: give per_device_train_batch_size instead of one of them",
      effective, steps);
  args.per_device_train_batch_size = effective / steps;
}

}  // namespace

namespace {

// resolve_batch_triad reads gradient_accumulation_steps = 1, its default, as not given, and derives
// the steps from the other two. Here it is known to be given: a triple with it is checked whole, as
// a triple with any other step count is.
void check_given_triple(const mb::train::TrainingArguments& args,
                        const std::set<std::string>& given) {
  const bool all_three = given.count("per_device_train_batch_size") &&
                         given.count("gradient_accumulation_steps") &&
                         given.count("train_batch_size");
  const std::int64_t micro = args.per_device_train_batch_size, effective = args.train_batch_size;
  // 0 (derive it) and auto ask for a value rather than give one; resolve_batch_triad checks the
  // other step counts.
  if (!all_three || args.gradient_accumulation_steps != 1 || effective == 0 ||
      micro == mb::train::kAutoBatch)
    return;
  MB_CHECK(micro == effective,
           "[TrainingArguments] per_device_train_batch_size {} x gradient_accumulation_steps 1 = "
           "{} does not equal train_batch_size {}; give two of the three",
           micro, micro, effective);
}

}  // namespace

mb::train::TrainingArguments training_arguments(Options& o) {
  nlohmann::json j = command_defaults().to_json();
  std::set<std::string> given;  // the arguments the user set, in the config file or by a flag
  if (!o.config.empty()) {
    // The file's own keys over the command's defaults (from_json checks them; its result would
    // carry the library's defaults for every key the file leaves out).
    const nlohmann::json file = mb::train::read_arguments_file(o.config);
    (void)mb::train::TrainingArguments::from_json(file);
    j.update(file);
    for (auto& [name, value] : file.items()) o.config_keys.insert(name);
    given = o.config_keys;
  }
  const nlohmann::json defaults = command_defaults().to_json();
  for (auto& [name, text] : o.given) {
    if (o.given_options.at(name)->count() == 0) continue;
    given.insert(name);
    const nlohmann::json& d = defaults.at(name);
    if (name == "per_device_train_batch_size" && text == "auto") {
      j[name] = "auto";
    } else if (name == "memory_budget") {
      j[name] = mb::train::parse_bytes(text);
    } else if (d.is_string()) {
      j[name] = text;
    } else {
      try {
        j[name] = nlohmann::json::parse(text);
      } catch (const nlohmann::json::out_of_range&) {  // 1e999: past a double's 1.8e308
        MB_CHECK(false, "[{}] '{}' is out of range", name, text);
      } catch (const nlohmann::json::exception&) {
        MB_CHECK(false, "[{}] expected a number, got '{}'", name, text);
      }
    }
  }
  for (auto& [name, option] : o.switch_options)
    if (option->count() > 0) j[name] = o.switches[name];
  if (o.json_option->count() > 0) j["json"] = o.json;  // else the config file's, or false
  o.eval_strategy_given = given.count("eval_strategy") > 0;
  mb::train::TrainingArguments args = mb::train::TrainingArguments::from_json(j);
  derive_micro_batch(args, given);
  check_given_triple(args, given);
  return args;
}

namespace {

// Refuses, by name, the model and data flags given that the chosen model and dataset do not read,
// rather than ignoring them (plan --model gpt2 --n-layer 2 would plan GPT-2 small).
void refuse_unused_flags(const Options& o) {
  const bool gpt = o.model == "gpt", gpt2 = o.model == "gpt2", synthetic = o.dataset == "synthetic";
  std::set<std::string> read;
  if (!synthetic) read.insert("--data");
  if (gpt || gpt2) read.insert({"--block-size", synthetic ? "--synthetic-size" : "--text-level"});
  if (gpt) read.insert({"--n-layer", "--n-head", "--n-embd"});
  if (gpt && synthetic) read.insert("--vocab-size");  // gpt2 keeps GPT-2's 50257 tokens
  std::string unused;                                 // "--n-layer, --n-head"
  for (const CLI::Option* option : o.model_options)
    if (option->count() > 0 && !read.count(option->get_name()))
      unused += (unused.empty() ? "" : ", ") + option->get_name();
  MB_CHECK(unused.empty(), "[--model {}{}] does not use {}{}", o.model,
           synthetic ? " --dataset synthetic" : "", unused,
           gpt2 ? " (gpt2 is GPT-2 small, of fixed sizes; --model gpt takes them)" : "");
}

}  // namespace

// The datasets and the model of a run; the evaluation split is read only when `need_eval` (a run
// that evaluates), so that a short text with no room for one trains without evaluation, as a
// Hugging Face Trainer needs no eval_dataset under eval_strategy "no", and a plan reads none.
Job make_job(Options& o, bool need_eval) {
  MB_CHECK(
      o.dataset == "file" || o.model == "gpt" || o.model == "gpt2",
      "[--dataset] synthetic data is token sequences, for gpt and gpt2; {} reads Fashion-MNIST",
      o.model);
  refuse_unused_flags(o);
  Job job;
  if (o.model == "gpt" || o.model == "gpt2") {
    // gpt2 keeps GPT-2 small's 1024 positions and 50257 tokens whatever the data: its sequences may
    // be shorter, and byte or char ids of a text file are ids of that vocabulary too.
    const bool gpt2 = o.model == "gpt2";
    mb::nn::GPTConfig cfg = gpt2 ? mb::nn::GPTConfig::gpt2_small() : o.gpt;
    cfg.dropout = o.dropout;
    const std::int64_t length =
        gpt2 && o.block_size_option->count() == 0 ? cfg.block_size : o.gpt.block_size;
    if (gpt2) {
      MB_CHECK(length >= 1 && length <= cfg.block_size,
               "[--block-size] must be in [1, {}] for gpt2 (GPT-2's positions), got {}",
               cfg.block_size, length);
    } else {
      MB_CHECK(length >= 1, "[--block-size] must be >= 1, got {}", length);
    }
    if (o.dataset == "synthetic" && !gpt2) cfg.vocab_size = o.vocab_size;
    cfg.validate();  // before any data is read; a text's own vocabulary replaces vocab_size below
    if (o.dataset == "synthetic") {
      job.train_set =
          std::make_unique<mb::train::SyntheticTokens>(mb::train::SyntheticTokensOptions{
              .vocab_size = cfg.vocab_size, .block_size = length, .size = o.synthetic_size});
      // Random tokens hold nothing to validate: no evaluation set.
    } else {
      const std::string path = o.data.empty() ? "../shared/data/tinyshakespeare.txt" : o.data;
      mb::train::TextOptions text{.block_size = length,
                                  .level = o.text_level == "byte" ? mb::train::TextLevel::Byte
                                                                  : mb::train::TextLevel::Char};
      auto train_text = std::make_unique<mb::train::TextDataset>(path, text);
      if (need_eval) {
        text.split = mb::train::Split::Val;
        try {
          job.eval_set = std::make_unique<mb::train::TextDataset>(path, text);
        } catch (const mb::Error& e) {  // the training split was read: the last tenth is too short
          MB_CHECK(false,
                   "{}; train without evaluation (--eval-strategy no) or with a smaller "
                   "--block-size",
                   e.what());
        }
      }
      if (!gpt2) cfg.vocab_size = train_text->vocab_size();
      MB_CHECK(train_text->vocab_size() <= cfg.vocab_size,
               "[gpt2] {} has {} distinct tokens, more than GPT-2's {}", path,
               train_text->vocab_size(), cfg.vocab_size);
      job.train_set = std::move(train_text);
    }
    job.weight_bytes = cfg.parameter_count() * 4.0;
    job.model_init = [cfg] { return std::make_unique<mb::nn::GPT>(cfg); };
  } else {
    const std::string root = o.data.empty() ? mb::train::kFashionMnistRoot : o.data;
    job.train_set = std::make_unique<mb::train::FashionMNIST>(root, mb::train::Split::Train);
    if (need_eval)
      job.eval_set = std::make_unique<mb::train::FashionMNIST>(root, mb::train::Split::Test);
    if (o.model == "mlp") {
      const mb::nn::MLPConfig cfg{.dropout = o.dropout};  // checked by the model's constructor
      job.model_init = [cfg] { return std::make_unique<mb::nn::MLP>(cfg); };
    } else {
      const mb::nn::CNNConfig cfg{.dropout = o.dropout};
      job.model_init = [cfg] { return std::make_unique<mb::nn::CNN>(cfg); };
    }
    job.metrics = mb::train::classification_metrics;
  }
  return job;
}

}  // namespace microbatch::cli
