// The flags the `microbatch` subcommands share (cli/main.cpp) and what they make: the run's
// TrainingArguments, its datasets and its model (cli/options.cpp).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "nn/models.h"
#include "train/trainer.h"

namespace microbatch::cli {

/// One subcommand's flags as parsed, and the options that say which were given.
struct Options {
  std::string model = "mlp";
  std::string data;
  std::string dataset = "file";         // or "synthetic" (token models)
  std::int64_t synthetic_size = 10000;  // examples of the synthetic dataset
  std::int64_t vocab_size = 256;        // gpt on synthetic tokens
  CLI::Option* block_size_option = nullptr;
  std::string config;
  std::map<std::string, std::string> given;           // TrainingArguments given as flags, as text
  std::map<std::string, CLI::Option*> given_options;  // count() > 0: the flag was given
  std::map<std::string, bool>
      switches;  // boolean TrainingArguments (--fp16, --pack-by-tokens=false)
  std::map<std::string, CLI::Option*> switch_options;
  bool json = false;  // TrainingArguments.json (not in to_json): a switch of its own
  CLI::Option* json_option = nullptr;
  std::vector<CLI::Option*> model_options;  // read by some models or datasets only
  bool eval_strategy_given = false;         // by a flag or the config file
  std::set<std::string> config_keys;        // the arguments the config file sets
  bool profile = false;                     // train only
  std::int64_t processes = 1;               // plan only: the processes of a data-parallel run
  std::string weights;                      // eval only: a weights file or a checkpoint folder
  std::string init_weights;  // train, bench: weights to start from (a file or a checkpoint folder)
  std::int64_t steps = 20;                  // bench only: timed optimizer steps
  std::int64_t warmup = 3;                  // bench only: untimed optimizer steps before them
  microbatch::nn::GPTConfig gpt{};
  std::string text_level = "char";
  double dropout = 0.0;
};

/// What a run needs besides its arguments.
struct Job {
  std::unique_ptr<microbatch::train::Dataset> train_set, eval_set;
  double weight_bytes = 0.0;  // a GPT's f32 weights, which are made in host memory first
  microbatch::train::ModelInit model_init;
  microbatch::train::ComputeMetrics metrics;
};

/// The model and data flags, and every TrainingArguments field as a flag of the same name (with
/// dashes or underscores), each described with the command's default.
void add_model_flags(CLI::App& cmd, Options& o);

/// Refuses a flag given an empty value or another flag as its value, naming it.
void refuse_missing_values(const CLI::App& cmd);

/// The command's defaults, under the --config file's keys, under the flags given.
microbatch::train::TrainingArguments training_arguments(Options& o);

/// The datasets and the model of a run; the evaluation split is read only when `need_eval`.
Job make_job(Options& o, bool need_eval);

}  // namespace microbatch::cli
