// The `microbatch` command: train, eval, bench, plan, and check-accumulation. Training flags carry
// Hugging Face TrainingArguments names, accepted with dashes or underscores; `--config FILE.json`
// reads them from a file first, and flags given on the command line win. Training goes to cuda:0
// when a CUDA device is present (--use-cpu or --device choose otherwise); `plan --device cuda`
// plans for a GPU on any machine. `train --profile` (or MB_PROFILE=1) prints the time per op after
// training. Exit status: 0 on success, 1 when check-accumulation finds a mismatch, 2 on any error
// (a bad flag or value, or a failure while running).
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/profiler.h"
#include "nn/models.h"
#include "train/accumulation_check.h"
#include "train/distributed.h"
#include "train/fashion_mnist.h"
#include "train/text.h"
#include "train/trainer.h"
#include "train/weights.h"

namespace mb = microbatch;

namespace {

// "--per-device-train-batch-size,--per_device_train_batch_size"
std::string both_spellings(const std::string& name) {
  std::string dashed = "--" + name;
  for (char& c : dashed) c = c == '_' ? '-' : c;
  std::string underscored = "--" + name;
  return underscored == dashed ? dashed : dashed + "," + underscored;
}

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

struct Options {
  std::string model = "mlp";
  std::string data;
  std::string dataset = "file";        // or "synthetic" (token models)
  std::int64_t synthetic_size = 10000;  // examples of the synthetic dataset
  std::int64_t vocab_size = 256;        // gpt on synthetic tokens
  CLI::Option* block_size_option = nullptr;
  std::string config;
  std::map<std::string, std::string> given;  // TrainingArguments given as flags, as text
  std::map<std::string, CLI::Option*> given_options;  // count() > 0: the flag was given
  std::map<std::string, bool> switches;      // boolean TrainingArguments (--fp16, --pack-by-tokens=false)
  std::map<std::string, CLI::Option*> switch_options;
  bool json = false;  // TrainingArguments.json (not in to_json): a switch of its own
  CLI::Option* json_option = nullptr;
  std::vector<CLI::Option*> model_options;  // read by some models or datasets only
  bool eval_strategy_given = false;  // by a flag or the config file
  bool profile = false;  // train only
  std::int64_t processes = 1;  // plan only: the processes of a data-parallel run
  std::string weights;         // eval only: a weights file or a checkpoint folder
  std::int64_t steps = 20;     // bench only: timed optimizer steps
  std::int64_t warmup = 3;     // bench only: untimed optimizer steps before them
  mb::nn::GPTConfig gpt{};
  std::string text_level = "char";
  double dropout = 0.0;
};

// "TrainingArguments.learning_rate (default 0.001)": the command's default, as JSON spells it.
std::string describe_argument(const std::string& name, const nlohmann::json& value) {
  const std::string shown = value.is_string() ? value.get<std::string>() : value.dump();
  return fmt::format("TrainingArguments.{} (default {})", name, shown.empty() ? "none" : shown);
}

// The value's kind in --help, rather than CLI11's TEXT for every flag read as text.
std::string argument_type(const std::string& name, const nlohmann::json& value) {
  if (name == "per_device_train_batch_size") return "INT|auto";
  if (name == "memory_budget") return "SIZE";  // 512MiB, 2GB or bytes
  return value.is_number_integer() ? "INT" : value.is_number() ? "FLOAT" : "TEXT";
}

void add_model_flags(CLI::App& cmd, Options& o) {
  // A flag given twice takes its last value, so wrappers such as scripts/train.sh can be overridden.
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
  model_option("--data", o.data,
               "Fashion-MNIST folder (mlp, cnn; default /usr/share/datasets/fashion-mnist) or a UTF-8 "
               "text file (gpt, gpt2; default ../shared/data/tinyshakespeare.txt)");
  cmd.add_option("--dataset", o.dataset,
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
  model_option(both_spellings("text_level"), o.text_level,
               fmt::format("gpt, gpt2 on a text file: byte or char vocabulary (default {})",
                           o.text_level))
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

// Given any two of per_device_train_batch_size, gradient_accumulation_steps and train_batch_size,
// the third follows (resolve_batch_triad). The command's own micro-batch of 64 is a default, not a
// given: when the user gave the other two, the micro-batch is their quotient.
void derive_micro_batch(mb::train::TrainingArguments& args, const std::set<std::string>& given) {
  if (given.count("per_device_train_batch_size") || !given.count("gradient_accumulation_steps") ||
      !given.count("train_batch_size"))
    return;
  const std::int64_t effective = args.train_batch_size, steps = args.gradient_accumulation_steps;
  if (effective <= 0 || steps < 1) return;  // no effective batch to split, or refused by validate()
  MB_CHECK(effective % steps == 0,
           "[TrainingArguments] train_batch_size {} is not divisible by gradient_accumulation_steps "
           "{}: give per_device_train_batch_size instead of one of them",
           effective, steps);
  args.per_device_train_batch_size = effective / steps;
}

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

mb::train::TrainingArguments training_arguments(Options& o) {
  nlohmann::json j = command_defaults().to_json();
  std::set<std::string> given;  // the arguments the user set, in the config file or by a flag
  if (!o.config.empty()) {
    // The file's own keys over the command's defaults (from_json checks them; its result would
    // carry the library's defaults for every key the file leaves out).
    const nlohmann::json file = mb::train::read_arguments_file(o.config);
    (void)mb::train::TrainingArguments::from_json(file);
    j.update(file);
    for (auto& [name, value] : file.items()) given.insert(name);
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

struct Job {
  std::unique_ptr<mb::train::Dataset> train_set, eval_set;
  double weight_bytes = 0.0;  // a GPT's f32 weights, which are made in host memory first
  mb::train::ModelInit model_init;
  mb::train::ComputeMetrics metrics;
};

// Refuses, by name, the model and data flags given that the chosen model and dataset do not read,
// rather than ignoring them (plan --model gpt2 --n-layer 2 would plan GPT-2 small).
void refuse_unused_flags(const Options& o) {
  const bool gpt = o.model == "gpt", gpt2 = o.model == "gpt2", synthetic = o.dataset == "synthetic";
  std::set<std::string> read;
  if (!synthetic) read.insert("--data");
  if (gpt || gpt2) read.insert({"--block-size", synthetic ? "--synthetic-size" : "--text-level"});
  if (gpt) read.insert({"--n-layer", "--n-head", "--n-embd"});
  if (gpt && synthetic) read.insert("--vocab-size");  // gpt2 keeps GPT-2's 50257 tokens
  std::string unused;  // "--n-layer, --n-head"
  for (const CLI::Option* option : o.model_options)
    if (option->count() > 0 && !read.count(option->get_name()))
      unused += (unused.empty() ? "" : ", ") + option->get_name();
  MB_CHECK(unused.empty(), "[--model {}{}] does not use {}{}", o.model,
           synthetic ? " --dataset synthetic" : "", unused,
           gpt2 ? " (gpt2 is GPT-2 small, of fixed sizes; --model gpt takes them)" : "");
}

// The datasets and the model of a run; the evaluation split is read only when `need_eval` (a run
// that evaluates), so that a short text with no room for one trains without evaluation, as a
// Hugging Face Trainer needs no eval_dataset under eval_strategy "no", and a plan reads none.
Job make_job(Options& o, bool need_eval) {
  MB_CHECK(o.dataset == "file" || o.model == "gpt" || o.model == "gpt2",
           "[--dataset] synthetic data is token sequences, for gpt and gpt2; {} reads Fashion-MNIST",
           o.model);
  refuse_unused_flags(o);
  Job job;
  if (o.model == "gpt" || o.model == "gpt2") {
    // gpt2 keeps GPT-2 small's 1024 positions and 50257 tokens whatever the data: its sequences may be
    // shorter, and byte or char ids of a text file are ids of that vocabulary too.
    const bool gpt2 = o.model == "gpt2";
    mb::nn::GPTConfig cfg = gpt2 ? mb::nn::GPTConfig::gpt2_small() : o.gpt;
    cfg.dropout = o.dropout;
    const std::int64_t length = gpt2 && o.block_size_option->count() == 0 ? cfg.block_size : o.gpt.block_size;
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
      job.train_set = std::make_unique<mb::train::SyntheticTokens>(mb::train::SyntheticTokensOptions{
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
          MB_CHECK(false, "{}; train without evaluation (--eval-strategy no) or with a smaller "
                   "--block-size", e.what());
        }
      }
      if (!gpt2) cfg.vocab_size = train_text->vocab_size();
      MB_CHECK(train_text->vocab_size() <= cfg.vocab_size, "[gpt2] {} has {} distinct tokens, more than GPT-2's {}",
               path, train_text->vocab_size(), cfg.vocab_size);
      job.train_set = std::move(train_text);
    }
    job.weight_bytes = cfg.parameter_count() * 4.0;
    job.model_init = [cfg] { return std::make_unique<mb::nn::GPT>(cfg); };
  } else {
    const std::string root = o.data.empty() ? mb::train::kFashionMnistRoot : o.data;
    job.train_set = std::make_unique<mb::train::FashionMNIST>(root, mb::train::Split::Train);
    if (need_eval) job.eval_set = std::make_unique<mb::train::FashionMNIST>(root, mb::train::Split::Test);
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

int run_train(Options& o) {
  mb::train::TrainingArguments args = training_arguments(o);
  Job job = make_job(o, args.eval_strategy != "no");
  // The weights are made in host memory before anything else: sizes whose weights alone could not
  // fit (a mistyped --n-layer 4294967297) are refused here rather than allocated layer by layer.
  const double host_bytes =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  MB_CHECK(host_bytes <= 0 || job.weight_bytes <= host_bytes,
           "[{}] the model's f32 weights alone would take {}, more than this machine's memory ({})",
           o.model, mb::format_bytes(static_cast<std::int64_t>(std::min(job.weight_bytes, 9e18))),
           mb::format_bytes(static_cast<std::int64_t>(host_bytes)));
  // The command evaluates each epoch by default; data with no evaluation split (synthetic tokens)
  // is not evaluated unless asked, and then the Trainer says what is missing.
  if (!job.eval_set && !o.eval_strategy_given) args.eval_strategy = "no";
  mb::train::Trainer trainer(job.model_init, args, *job.train_set, job.eval_set.get(), job.metrics);
  const mb::train::MemoryPlan& plan = trainer.plan();
  // In a data-parallel run (`mpirun -np W microbatch train ...`) rank 0 alone prints.
  const mb::train::ProcessGroup& world = mb::train::ProcessGroup::world();
  std::ostream no_output(nullptr);
  std::ostream& out = world.is_main() ? std::cout : no_output;
  if (!args.json) {
    out << "model " << o.model << " on " << trainer.device().str() << ": "
        << trainer.model().num_parameters() << " parameters; " << job.train_set->size()
        << " training examples; micro-batch " << plan.micro_batch_size << " x "
        << plan.accumulation_steps << " accumulation steps"
        << (world.size() > 1 ? fmt::format(" on each of {} processes ({})", world.size(),
                                           mb::train::ddp_backend_name(world.backend()))
                             : std::string())
        << (plan.gradient_checkpointing ? ", activation checkpointing" : "");
    if (args.memory_budget > 0)
      out << "; predicted peak " << mb::format_bytes(plan.predicted_peak) << " of "
          << mb::format_bytes(args.memory_budget);
    out << "\n";
  }
  // Started after the model and the plan are made, so the table holds train() alone: its steps, and
  // the evaluations the eval strategy runs inside it (--eval-strategy no leaves them out).
  const bool profile = o.profile || mb::profiler::requested_by_env();
  if (profile) mb::profiler::start();
  mb::train::TrainOutput r = trainer.train();
  mb::profiler::ProfileReport profile_report;
  if (profile) {
    mb::profiler::stop();
    profile_report = mb::profiler::report();
  }
  if (!args.json) {
    out << fmt::format("done: {} steps, training loss {:.4f}", r.global_step, r.training_loss);
    if (r.metrics.count("eval_accuracy"))
      out << fmt::format(", test accuracy {:.2f}%", r.metrics["eval_accuracy"] * 100);
    if (r.metrics.count("eval_f1")) out << fmt::format(", macro F1 {:.4f}", r.metrics["eval_f1"]);
    if (r.metrics.count("eval_loss") && !r.metrics.count("eval_accuracy"))
      out << fmt::format(", validation loss {:.4f}", r.metrics["eval_loss"]);
    out << "; weights in " << args.output_dir << "/model.safetensors\n";
  }
  if (profile && args.json) {
    out << nlohmann::json{{"profile", profile_report.to_json()}}.dump() << "\n";
  } else if (profile) {
    out << "\ntime per op during training (README: Profiling):\n" << profile_report.table();
  }
  return 0;
}

// `microbatch eval`: trained weights (--weights: a weights file or a checkpoint folder; by default
// the output_dir/model.safetensors that train wrote) evaluated on the evaluation split of the data,
// as the Trainer evaluates during training: the same loss, metrics, batches and memory budget, and
// on a GPU in the precision that --fp16 / --bf16 name (the weights are cast to it, as training's
// working copy is). The model is built from the same flags as the run that trained it; the weights
// record its architecture, and other flags are refused naming the setting that differs.
int run_eval(Options& o) {
  namespace fs = std::filesystem;
  mb::train::TrainingArguments args = training_arguments(o);
  MB_CHECK(args.resume_from_checkpoint.empty(),
           "[eval] --resume-from-checkpoint is for train: name a checkpoint folder with --weights");
  MB_CHECK(o.dataset == "file",
           "[eval] synthetic tokens have no evaluation split: evaluate on the text file the model "
           "was trained on (--data)");
  const std::string weights =
      o.weights.empty() ? (fs::path(args.output_dir) / "model.safetensors").string() : o.weights;
  std::error_code ec;
  MB_CHECK(fs::exists(weights, ec),
           "[eval] no trained weights at {}: train into {} first, or name a weights file or a "
           "checkpoint folder with --weights",
           weights, o.weights.empty() ? args.output_dir : fs::path(weights).parent_path().string());
  Job job = make_job(o, true);
  // Evaluation only: nothing is trained, saved or logged (train() alone opens output_dir).
  args.eval_strategy = "epoch";
  args.save_strategy = "no";
  // 16-bit evaluation runs on 16-bit weights: the models are built in that dtype, for the plan too.
  const std::optional<mb::DType> dtype = args.bf16   ? std::optional(mb::DType::bf16)
                                         : args.fp16 ? std::optional(mb::DType::f16)
                                                     : std::nullopt;
  mb::train::ModelInit model_init = [init = job.model_init, dtype] {
    std::unique_ptr<mb::nn::Model> model = init();
    if (dtype) model->to(*dtype);
    return model;
  };
  mb::train::Trainer trainer(model_init, args, *job.train_set, job.eval_set.get(), job.metrics);
  const mb::train::TrainedWeights loaded =
      mb::train::load_trained_weights(trainer.model(), weights);
  const mb::train::ProcessGroup& world = mb::train::ProcessGroup::world();
  std::ostream no_output(nullptr);
  std::ostream& out = world.is_main() ? std::cout : no_output;
  mb::reset_peak_memory_stats(trainer.device());
  const auto start = std::chrono::steady_clock::now();
  mb::train::Metrics metrics = trainer.evaluate();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::int64_t examples = job.eval_set->size();
  const std::int64_t peak = mb::memory_stats(trainer.device()).reserved.peak;
  if (args.json) {
    nlohmann::ordered_json j{{"weights", loaded.path}};
    if (loaded.checkpoint_step >= 0) j["checkpoint_step"] = loaded.checkpoint_step;
    j["eval_examples"] = examples;
    for (const auto& [name, value] : metrics) j[name] = value;
    j["eval_runtime"] = seconds;
    j["eval_samples_per_second"] = seconds > 0 ? static_cast<double>(examples) / seconds : 0.0;
    j["peak_reserved_bytes"] = peak;
    out << j.dump() << "\n";
    return 0;
  }
  out << "model " << o.model << " on " << trainer.device().str() << ": "
      << trainer.model().num_parameters() << " parameters from " << loaded.path
      << (loaded.checkpoint_step >= 0 ? fmt::format(" (step {})", loaded.checkpoint_step) : "")
      << "; " << examples << " evaluation examples\n";
  for (const auto& [name, value] : metrics) out << fmt::format("  {:<24} {:.6g}\n", name, value);
  out << fmt::format("  {:<24} {:.3f} s ({:.0f} examples/s), peak memory {}\n", "eval_runtime",
                     seconds, seconds > 0 ? static_cast<double>(examples) / seconds : 0.0,
                     mb::format_bytes(peak));
  return 0;
}

// `microbatch bench`: the Trainer's own steps, timed. It trains --warmup + --steps optimizer steps
// as `train` would (the same model, data, plan, precision and budget), logging every step, and
// reads the run's log back: each timed step's time (between two log lines, each of which waits for
// the device), samples and tokens a second at the median, and the run's peak memory against the
// plan's prediction. Nothing is evaluated or saved beyond the run's log and weights, into
// --output-dir if given, else into a temporary folder removed afterwards.
int run_bench(Options& o) {
  namespace fs = std::filesystem;
  MB_CHECK(o.steps >= 1, "[bench] --steps must be >= 1, got {}", o.steps);
  MB_CHECK(o.warmup >= 0, "[bench] --warmup must be >= 0, got {}", o.warmup);
  for (const char* name : {"max_steps", "num_train_epochs", "logging_steps", "eval_strategy",
                           "eval_steps", "save_strategy", "save_steps", "resume_from_checkpoint"}) {
    MB_CHECK(
        o.given_options.at(name)->count() == 0,
        "[bench] {} is the benchmark's own: it trains --warmup + --steps steps, logs each, and "
        "neither evaluates nor saves",
        o.given_options.at(name)->get_name());
  }
  mb::train::TrainingArguments args = training_arguments(o);
  args.max_steps = o.warmup + o.steps;
  args.logging_steps = 1;
  args.eval_strategy = "no";
  args.save_strategy = "no";
  const bool temporary = o.given_options.at("output_dir")->count() == 0 && o.config.empty();
  mb::train::ProcessGroup& world = mb::train::ProcessGroup::world();
  if (temporary) {
    // Rank 0's folder, shared with the other ranks, which write nothing into it.
    std::string folder;
    if (world.is_main()) {
      std::string pattern = (fs::temp_directory_path() / "microbatch-bench-XXXXXX").string();
      MB_CHECK(::mkdtemp(pattern.data()) != nullptr, "[bench] cannot make a temporary folder in {}",
               fs::temp_directory_path().string());
      folder = pattern;
    }
    world.broadcast(folder, 0);
    args.output_dir = folder;
  }
  struct RemoveFolder {
    std::string path;
    ~RemoveFolder() {
      std::error_code ec;
      if (!path.empty()) fs::remove_all(path, ec);
    }
  } cleanup{temporary && world.is_main() ? args.output_dir : std::string()};
  Job job = make_job(o, false);
  mb::train::Trainer trainer(job.model_init, args, *job.train_set, nullptr, {});
  std::ostream no_output(nullptr);
  trainer.set_log_stream(&no_output);
  const mb::train::TrainOutput r = trainer.train();
  if (!world.is_main()) return 0;
  // The steps' lines, cumulative seconds, samples and tokens; peaks since the previous line.
  std::vector<nlohmann::json> lines;
  std::ifstream log(fs::path(args.output_dir) / "log.jsonl");
  for (std::string line; std::getline(log, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("event")) lines.push_back(std::move(j));
  }
  MB_CHECK(static_cast<std::int64_t>(lines.size()) == args.max_steps,
           "[bench] the run logged {} steps, not {}", lines.size(), args.max_steps);
  std::vector<double> ms;
  std::int64_t samples = 0, tokens = 0, peak = 0;
  for (std::int64_t i = o.warmup; i < args.max_steps; ++i) {
    const nlohmann::json& now = lines[i];
    const double before = i > 0 ? lines[i - 1].at("seconds").get<double>() : 0.0;
    ms.push_back((now.at("seconds").get<double>() - before) * 1e3);
    samples += now.at("samples").get<std::int64_t>() -
               (i > 0 ? lines[i - 1].at("samples").get<std::int64_t>() : 0);
    tokens += now.at("tokens").get<std::int64_t>() -
              (i > 0 ? lines[i - 1].at("tokens").get<std::int64_t>() : 0);
  }
  // The run's peak, warm-up included (its first step allocates the optimizer's state), as the plan
  // predicts it.
  for (const nlohmann::json& line : lines)
    peak = std::max(peak, line.at("measured_peak").get<std::int64_t>());
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  // Per second at the median step, of the timed steps' mean samples and tokens a step.
  const double per_step = static_cast<double>(o.steps);
  const double samples_per_s = median > 0 ? samples / per_step / median * 1e3 : 0.0;
  const double tokens_per_s = median > 0 ? tokens / per_step / median * 1e3 : 0.0;
  const mb::train::MemoryPlan& plan = trainer.plan();
  if (args.json) {
    nlohmann::ordered_json j{{"model", o.model},
                             {"device", trainer.device().str()},
                             {"parameters", trainer.model().num_parameters()},
                             {"processes", world.size()},
                             {"micro_batch_size", plan.micro_batch_size},
                             {"accumulation_steps", plan.accumulation_steps},
                             {"gradient_checkpointing", plan.gradient_checkpointing},
                             {"warmup_steps", o.warmup},
                             {"steps", o.steps},
                             {"step_ms", ms},
                             {"step_ms_median", median},
                             {"step_ms_min", sorted.front()},
                             {"step_ms_max", sorted.back()},
                             {"samples_per_second", samples_per_s},
                             {"tokens_per_second", tokens_per_s},
                             {"peak_bytes", peak},
                             {"predicted_peak_bytes", plan.predicted_peak},
                             {"memory_budget", args.memory_budget},
                             {"training_loss", r.training_loss}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::cout << "model " << o.model << " on " << trainer.device().str() << ": "
            << trainer.model().num_parameters() << " parameters; micro-batch "
            << plan.micro_batch_size << " x " << plan.accumulation_steps << " accumulation steps"
            << (world.size() > 1 ? fmt::format(" on each of {} processes", world.size()) : "")
            << (plan.gradient_checkpointing ? ", activation checkpointing" : "") << "\n";
  std::cout << fmt::format(
      "{} steps after {} warm-up: {:.2f} ms a step (median; {:.2f} to {:.2f}), {:.0f} samples/s",
      o.steps, o.warmup, median, sorted.front(), sorted.back(), samples_per_s);
  if (tokens > 0) std::cout << fmt::format(", {:.0f} tokens/s", tokens_per_s);
  std::cout << "\npeak memory " << mb::format_bytes(peak);
  if (args.memory_budget > 0)
    std::cout << " (predicted " << mb::format_bytes(plan.predicted_peak) << ", budget "
              << mb::format_bytes(args.memory_budget) << ")";
  std::cout << "\n";
  return 0;
}

int run_plan(Options& o) {
  mb::train::TrainingArguments args = training_arguments(o);
  MB_CHECK(args.memory_budget > 0, "[plan] give --memory-budget (e.g. 512MiB)");
  args.validate();
  MB_CHECK(o.processes >= 1, "[plan] --processes must be >= 1, got {}", o.processes);
  const int processes = static_cast<int>(std::min<std::int64_t>(o.processes, 1 << 20));
  Job job = make_job(o, false);
  // Planned on the meta device only: a plan for cuda needs no GPU here. For a data-parallel run,
  // the plan every rank follows (its batch counts are rank 0's, whose shares are the largest).
  const mb::train::MemoryPlan plan =
      mb::train::plan_training(job.model_init, mb::train::rank_arguments(args, processes),
                               *job.train_set, args.requested_device(), processes);
  if (processes > 1 && !args.json)
    std::cout << "the plan of every rank of " << processes
              << " processes (the batch counts are rank 0's share of a window, the largest):\n";
  if (args.json) std::cout << plan.to_json().dump(2) << "\n";
  else std::cout << plan.str();
  return 0;
}

int run_check_accumulation(const std::string& dtypes, bool json) {
  bool ok = true;
  for (const std::string& name : {std::string("f64"), std::string("f32")}) {
    if (dtypes != "both" && dtypes != name) continue;
    const mb::DType dt = mb::parse_dtype(name);
    const double tol = mb::train::accumulation_tolerance(dt);
    for (const auto& c : mb::train::check_accumulation({.dtype = dt})) {
      const bool pass = c.max_gradient <= tol && c.max_weight <= tol;
      ok = ok && pass;
      if (json) {
        nlohmann::ordered_json row{{"model", c.model},
                                   {"dtype", name},
                                   {"split", c.split},
                                   {"max_grad_rel", c.max_gradient},
                                   {"max_weight_rel", c.max_weight}};
        // Only GPT's token batches have a naive figure (a negative one means none).
        if (c.naive_max_gradient >= 0) row["naive_max_grad_rel"] = c.naive_max_gradient;
        row["pass"] = pass;
        std::cout << row.dump() << "\n";
        continue;
      }
      std::cout << fmt::format("{:<4} {:<4} split {:<12} max rel. diff: gradients {:.2e}, weights {:.2e}  [{}]\n",
                               c.model, name, c.split, c.max_gradient, c.max_weight,
                               pass ? "ok" : fmt::format("FAIL > {:.0e}", tol));
      for (std::size_t i = 0; i < c.gradients.size(); ++i) {
        std::cout << fmt::format("       {:<28} grad {:.2e}  weight {:.2e}\n", c.gradients[i].name,
                                 c.gradients[i].max_relative, c.weights[i].max_relative);
      }
      if (c.naive_max_gradient >= 0) {
        std::cout << fmt::format("       for contrast, mean-per-micro-batch / N: gradients off by {:.2e}\n",
                                 c.naive_max_gradient);
      }
    }
  }
  const char* result = ok ? "accumulation is exact" : "accumulation check FAILED";
  if (json) {
    std::cout << nlohmann::ordered_json{{"result", result}, {"pass", ok}}.dump() << "\n";
  } else {
    std::cout << result << "\n";
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"microbatch: memory-efficient training"};
  app.require_subcommand(1);
  Options train, plan;
  CLI::App* train_cmd =
      app.add_subcommand("train", "train a model (mlp, cnn on Fashion-MNIST; gpt, gpt2 on text or synthetic tokens)");
  add_model_flags(*train_cmd, train);
  train_cmd->add_flag("--profile", train.profile,
                      "after training, print each op's calls and self time, forward and backward (also "
                      "MB_PROFILE=1)");
  Options eval;
  CLI::App* eval_cmd = app.add_subcommand(
      "eval",
      "evaluate trained weights on the evaluation split (the flags of the run that trained them)");
  add_model_flags(*eval_cmd, eval);
  eval_cmd->add_option(
      "--weights", eval.weights,
      "a weights file or a checkpoint folder (default OUTPUT_DIR/model.safetensors, "
      "as train writes it)");
  Options bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "time training steps: median step time, samples and tokens a second, peak memory");
  add_model_flags(*bench_cmd, bench);
  bench_cmd->add_option("--steps", bench.steps,
                        fmt::format("timed optimizer steps (default {})", bench.steps));
  bench_cmd->add_option(
      "--warmup", bench.warmup,
      fmt::format("optimizer steps before them, untimed (default {})", bench.warmup));
  CLI::App* plan_cmd = app.add_subcommand("plan", "the micro-batch plan for a memory budget, without training");
  add_model_flags(*plan_cmd, plan);
  plan_cmd->add_option("--processes", plan.processes,
                       "plan every rank of a data-parallel run of this many processes "
                       "(default 1)");
  std::string dtypes = "both";
  bool json = false;
  CLI::App* check_cmd = app.add_subcommand("check-accumulation",
                                           "one step on a full batch vs. the same batch in micro-batches");
  check_cmd->add_option("--dtype", dtypes, "f64, f32 or both")->check(CLI::IsMember({"f64", "f32", "both"}));
  check_cmd->add_flag("--json", json, "print one JSON object per check, then one with the result");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" whose exit code is 0; a bad flag exits 2, as any error.
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    for (const CLI::App* cmd : {train_cmd, eval_cmd, bench_cmd, plan_cmd, check_cmd})
      if (cmd->parsed()) refuse_missing_values(*cmd);
    int status = 0;
    if (train_cmd->parsed()) status = run_train(train);
    if (eval_cmd->parsed()) status = run_eval(eval);
    if (bench_cmd->parsed()) status = run_bench(bench);
    if (plan_cmd->parsed()) status = run_plan(plan);
    if (check_cmd->parsed()) status = run_check_accumulation(dtypes, json);
    // A data-parallel run's MPI and NCCL end here, while everything they use is still alive.
    if (train_cmd->parsed() || eval_cmd->parsed() || bench_cmd->parsed())
      mb::train::ProcessGroup::world().finalize();
    return status;
  } catch (const std::exception& e) {
    // The library's own errors, and any other (a filesystem or allocation failure, say): a message
    // and an exit status, never an abort.
    if (mb::train::ProcessGroup::shared(std::current_exception())) {
      // Every rank of a data-parallel run has this error (Note [Failing together] in
      // train/distributed.h): rank 0 says it, and each rank ends on its own.
      if (mb::train::launch_info().rank == 0) std::cerr << "error: " << e.what() << "\n";
      mb::train::ProcessGroup::world().finalize(mb::train::ProcessGroup::Ending::AfterError);
      return 2;
    }
    std::cerr << "error: " << e.what() << "\n";
    // The other ranks of a data-parallel run would wait for this one: end them all.
    mb::train::ProcessGroup::abort_if_distributed(2);
    return 2;
  }
  return 0;
}
