// The Trainer: Hugging Face's Trainer shape (train / evaluate / predict, compute_metrics,
// TrainingArguments) over exact accumulation, with the micro-batch schedule planned against a
// memory budget. Note [Windows]: the data loader yields windows of `train_batch_size` samples;
// each window is split into micro-batches of the planned size (the last may be smaller), each
// weighted by its share of the window's loss-bearing items, so any split gives the full batch's
// step. A micro-batch that runs out of memory is split and re-run; the window's finished
// micro-batches are kept (Note [Out-of-memory recovery] in trainer.cpp).
//
// Note [What the budget covers]: memory_budget bounds the training's own memory — weights,
// gradients, optimizer state, activations, batches and the allocator's cache — counted from what
// was already reserved when the Trainer was made (the caller's dataset tensors, say). The allocator
// enforces baseline + memory_budget, and logged peaks are measured above that baseline.
#pragma once

#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "nn/models.h"
#include "train/data.h"
#include "train/planner.h"
#include "train/training_args.h"

namespace microbatch::train {

/// What compute_metrics sees: the logits of the whole evaluation set and its labels (CPU).
struct EvalPrediction {
  Tensor logits;  // (N, C) or (N, T, V)
  Tensor labels;  // (N) or (N, T)
};
using Metrics = std::map<std::string, double>;
using ComputeMetrics = std::function<Metrics(const EvalPrediction&)>;

/// accuracy, and macro-averaged precision, recall and F1 over the classes present in labels or
/// predictions, for class logits (N, C) and labels (N).
Metrics classification_metrics(const EvalPrediction& prediction);

/// Builds the model (as Hugging Face's model_init): the Trainer calls it once for training, and
/// the planner calls it to measure copies on the meta device.
using ModelInit = std::function<std::unique_ptr<nn::Model>()>;

struct TrainOutput {
  std::int64_t global_step = 0;
  double training_loss = 0.0;  // mean of the windows' losses
  Metrics metrics;             // the last evaluation, eval_ prefixed
  std::int64_t oom_splits = 0; // micro-batches split after running out of memory
  std::int64_t skipped_steps = 0;  // windows whose gradients were not finite (no update)
};

struct PredictionOutput {
  Tensor predictions;  // logits
  Tensor label_ids;
  Metrics metrics;
};

/// Called after every optimizer step with the global step (for tests and custom logging).
using StepCallback = std::function<void(std::int64_t step)>;

class Trainer {
 public:
  Trainer(ModelInit model_init, TrainingArguments args, const Dataset& train_set,
          const Dataset* eval_set = nullptr, ComputeMetrics compute_metrics = {});
  ~Trainer();

  TrainOutput train();
  /// eval_loss (and eval_perplexity, and compute_metrics' values with an eval_ prefix).
  Metrics evaluate();
  PredictionOutput predict(const Dataset& data);

  nn::Model& model() { return *model_; }
  const TrainingArguments& args() const { return args_; }
  /// The micro-batch schedule in use (planned when memory_budget is set).
  const MemoryPlan& plan() const { return plan_; }
  void set_step_callback(StepCallback callback) { on_step_ = std::move(callback); }
  /// Where log lines go besides output_dir/log.jsonl (stdout by default).
  void set_log_stream(std::ostream* stream) { log_stream_ = stream; }

 private:
  struct State;
  MemoryPlan make_plan();
  Metrics run_evaluation(const Dataset& data, PredictionOutput* keep);

  ModelInit model_init_;
  TrainingArguments args_;
  const Dataset& train_set_;
  const Dataset* eval_set_;
  ComputeMetrics compute_metrics_;
  std::unique_ptr<nn::Model> model_;
  MemoryPlan plan_;
  StepCallback on_step_;
  std::ostream* log_stream_;
  std::int64_t eval_batch_size_;
  std::int64_t baseline_ = 0;  // CPU bytes reserved before the Trainer (Note [What the budget covers])
  std::optional<DType> compute_dtype_;  // f16 or bf16 with fp16 / bf16
  Tensor model_inputs(const Tensor& inputs) const;
  std::optional<DType> gradient_dtype() const;
};

}  // namespace microbatch::train
