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
#include <array>
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

#include "cli/options.h"
#include "core/profiler.h"
#include "nn/models.h"
#include "train/accumulation_check.h"
#include "train/distributed.h"
#include "train/trainer.h"
#include "train/weights.h"

namespace mb = microbatch;

namespace {

using mb::cli::add_model_flags;
using mb::cli::Job;
using mb::cli::make_job;
using mb::cli::Options;
using mb::cli::refuse_missing_values;
using mb::cli::training_arguments;

// --init-weights: training starts from these weights (a weights file, or a checkpoint folder's f32
// master weights) rather than from the model's initialization, with a fresh optimizer state, as
// fine-tuning does. The Trainer's store takes the model's values when train() starts, so they are
// loaded after the Trainer is made. A resumed run continues from its checkpoint's weights instead.
void load_initial_weights(mb::train::Trainer& trainer, const Options& o,
                          const mb::train::TrainingArguments& args) {
  if (o.init_weights.empty()) return;
  MB_CHECK(args.resume_from_checkpoint.empty(),
           "[--init-weights] a run resumed from a checkpoint continues from the checkpoint's "
           "weights: give --init-weights or --resume-from-checkpoint, not both");
  mb::train::load_trained_weights(trainer.model(), o.init_weights);
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
  load_initial_weights(trainer, o, args);
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
        << (plan.gradient_checkpointing ? ", activation checkpointing" : "")
        << (o.init_weights.empty() ? "" : "; starting from " + o.init_weights);
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
// in the precision that --fp16 / --bf16 name (the weights are cast to it, as training's
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
  // The arguments the benchmark sets itself, refused by flag and, once the config file is read,
  // as its keys (the lines below would otherwise override them unannounced).
  constexpr std::array kOwn = {
      "max_steps",  "num_train_epochs", "logging_steps", "eval_strategy",
      "eval_steps", "save_strategy",    "save_steps",    "resume_from_checkpoint"};
  constexpr const char* kWhy =
      "is the benchmark's own: it trains --warmup + --steps steps, logs each, and neither "
      "evaluates nor saves";
  for (const char* name : kOwn)
    MB_CHECK(o.given_options.at(name)->count() == 0, "[bench] {} {}",
             o.given_options.at(name)->get_name(), kWhy);
  mb::train::TrainingArguments args = training_arguments(o);
  for (const char* name : kOwn)
    MB_CHECK(!o.config_keys.count(name), "[bench] {} in {} {}", name, o.config, kWhy);
  args.max_steps = o.warmup + o.steps;
  args.logging_steps = 1;
  args.eval_strategy = "no";
  args.save_strategy = "no";
  // Into a temporary folder unless the flag or the config file names one.
  const bool temporary =
      o.given_options.at("output_dir")->count() == 0 && !o.config_keys.count("output_dir");
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
  load_initial_weights(trainer, o, args);
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
  // Line i's cumulative count of `key` after step i + 1; 0 before the first step.
  auto after = [&](std::int64_t i, const char* key) {
    return i < 0 ? 0.0 : lines[i].at(key).get<double>();
  };
  std::vector<double> ms;
  for (std::int64_t i = o.warmup; i < args.max_steps; ++i)
    ms.push_back((after(i, "seconds") - after(i - 1, "seconds")) * 1e3);
  const std::int64_t last = args.max_steps - 1, before = o.warmup - 1;
  const double samples = after(last, "samples") - after(before, "samples");
  const double tokens = after(last, "tokens") - after(before, "tokens");
  // The run's peak, warm-up included (its first step allocates the optimizer's state), as the plan
  // predicts it.
  std::int64_t peak = 0;
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
  for (auto [cmd, options] : {std::pair{train_cmd, &train}, std::pair{bench_cmd, &bench}}) {
    cmd->add_option("--init-weights", options->init_weights,
                    "start from these weights (a weights file or a checkpoint folder) rather than "
                    "from the model's initialization, with a fresh optimizer state");
  }
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
