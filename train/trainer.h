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
// enforces baseline + memory_budget, and logged peaks are measured above that baseline. All of it
// is the training device's memory (its allocator; on a GPU, not the host's), less what the device
// holds outside the allocator (Note [Outside the allocator] in train/planner.cpp).
//
// Note [Training on a device]: the model, its arenas, the optimizer state and every micro-batch live
// on args.training_device() (cuda:0 when present unless use_cpu, as Hugging Face's Trainer). Batches
// are collated on the host and copied once per micro-batch; losses are summed on the device and read
// only when a log line or a checkpoint needs them, so the host never waits for the device between
// micro-batches. Evaluation reads its losses as it goes, and hands compute_metrics host tensors.
#pragma once

#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "nn/models.h"
#include "train/data.h"
#include "train/metrics.h"
#include "train/planner.h"
#include "train/training_args.h"

namespace microbatch::train {

class ProcessGroup;

/// Builds the model (as Hugging Face's model_init): the Trainer calls it once for training (and
/// moves what it returns to the training device), and the planner calls it to measure copies on the
/// meta device (under nn::DeviceScope(kMeta)).
using ModelInit = std::function<std::unique_ptr<nn::Model>()>;

/// Each rank's arguments in a data-parallel run of `world` processes: train_batch_size, the
/// effective batch over all ranks as DeepSpeed counts it, becomes the rank's share (it must divide
/// evenly); without it each rank's window is per_device_train_batch_size x
/// gradient_accumulation_steps, as Hugging Face counts the total batch (that x world).
TrainingArguments rank_arguments(const TrainingArguments& args, int world);

/// The samples of a window when each of `world` ranks takes up to `rank_effective` of a training
/// set of `samples`: min(rank_effective x world, samples).
std::int64_t global_window(std::int64_t rank_effective, std::int64_t samples, int world);

/// The micro-batch schedule a Trainer with these arguments uses on `device`: planned on the meta
/// device against memory_budget when one is set, else args' own split. It touches no device, so a
/// plan for a GPU can be made on a machine without one (`microbatch plan --device cuda`). For a
/// data-parallel run of `world` processes, give rank_arguments(): the plan is the one every rank
/// follows, fitted to every rank's shares of the windows (Note [Agreed plans] in
/// train/planner.cpp); its effective_batch and accumulation_steps are rank 0's, the largest.
MemoryPlan plan_training(const ModelInit& model_init, const TrainingArguments& args,
                         const Dataset& train_set, Device device, int world = 1);

/// Refuses, on every rank of `group`, a data-parallel run whose ranks were given other arguments
/// than rank 0's, naming them; where each rank trains and how it sums (device, use_cpu,
/// ddp_backend) are left to prepare_rank. A collective; nothing in a world of one.
void check_arguments_agree(ProcessGroup& group, const TrainingArguments& args);

/// What else a rank of a data-parallel run must share with the others.
struct RankInputs {
  std::string train_fingerprint;    // label_fingerprint() of the training set
  std::int64_t window = 0;          // samples in a window, over every rank
  std::int64_t eval_examples = -1;  // the evaluation set's size; -1 without one
  bool compute_metrics = false;     // whether evaluation gathers predictions for compute_metrics
};
/// Refuses, on every rank of `group`, a data-parallel run whose ranks differ in these or in their
/// plan (Note [Agreed plans] in train/planner.cpp). A collective; nothing in a world of one.
void check_ranks_agree(ProcessGroup& group, const RankInputs& inputs, const MemoryPlan& plan);

struct TrainOutput {
  std::int64_t global_step = 0;
  double training_loss = 0.0;  // mean of the windows' losses
  Metrics metrics;             // the last evaluation, eval_ prefixed
  std::int64_t oom_splits = 0;     // micro-batches split after running out of memory (this rank's)
  std::int64_t skipped_steps = 0;  // windows whose gradients were not finite (no update)
};

struct PredictionOutput {
  Tensor predictions;  // logits, as EvalPrediction's (Note [Padding across batches])
  Tensor label_ids;
  Metrics metrics;
};

/// Called after every optimizer step with the global step (for tests and custom logging). In a
/// data-parallel run it may be set on some ranks only (to log from rank 0, say), and an exception
/// it throws is thrown on every rank (Note [Failing together] in train/distributed.h).
using StepCallback = std::function<void(std::int64_t step)>;

class Trainer {
 public:
  /// group: the processes that train together (Note [Data parallel] in train/distributed.h);
  /// nullptr is ProcessGroup::world(), those the launcher started. In a world of more than one the
  /// constructor, train(), evaluate() and predict() are collectives: every rank calls them, in the
  /// same order, and an error on one rank is thrown on every rank (Note [Failing together]).
  /// model_init, compute_metrics and the step callback run inside such a shared stretch and must
  /// call no collective of their own. compute_metrics and the evaluation set must be the same on
  /// every rank (both are compared).
  Trainer(ModelInit model_init, TrainingArguments args, const Dataset& train_set,
          const Dataset* eval_set = nullptr, ComputeMetrics compute_metrics = {},
          ProcessGroup* group = nullptr);
  ~Trainer();

  TrainOutput train();
  /// eval_loss (and eval_perplexity, and compute_metrics' values with an eval_ prefix). In a
  /// data-parallel run each rank evaluates its share; compute_metrics sees the whole set's
  /// predictions, gathered on every rank (Note [Sharded predictions] in train/evaluation.cpp).
  Metrics evaluate();
  /// The whole set's predictions and labels (every rank's, in the set's order), and test_ metrics.
  PredictionOutput predict(const Dataset& data);

  nn::Model& model() { return *model_; }
  const TrainingArguments& args() const { return args_; }
  /// Where training runs (Note [Training on a device]).
  Device device() const { return device_; }
  /// The micro-batch schedule in use (planned when memory_budget is set). In a data-parallel run
  /// it is every rank's (Note [Agreed plans] in train/planner.cpp): its effective_batch is rank
  /// 0's share of a window, the largest.
  const MemoryPlan& plan() const { return plan_; }
  void set_step_callback(StepCallback callback) { on_step_ = std::move(callback); }
  /// Where log lines go besides output_dir/log.jsonl (stdout by default).
  void set_log_stream(std::ostream* stream) { log_stream_ = stream; }

 private:
  struct State;
  /// The plan for these arguments; a run resumed from `resume_from` when not empty (the checkpoint
  /// "latest" stands for).
  MemoryPlan make_plan(const std::string& resume_from);
  Metrics run_evaluation(const Dataset& data, PredictionOutput* keep);

  ModelInit model_init_;
  TrainingArguments args_;
  const Dataset& train_set_;
  const Dataset* eval_set_;
  ComputeMetrics compute_metrics_;
  std::unique_ptr<nn::Model> model_;
  MemoryPlan plan_;
  std::string fingerprint_;  // label_fingerprint(train_set_) (Note [Resuming the same run])
  StepCallback on_step_;
  std::ostream* log_stream_;
  std::int64_t eval_batch_size_;
  // The device's reserved peak over the last evaluation's batches, before its predictions were
  // put together outside the budget (Note [Predictions outside the budget] in evaluation.cpp).
  std::int64_t eval_peak_ = 0;
  Device device_ = kCPU;  // args.training_device(); a rank's own GPU in a data-parallel run
  ProcessGroup* group_;   // the processes of a data-parallel run (Note [Data parallel])
  std::int64_t global_batch_ = 0;  // the effective batch over every rank: a window's samples
  std::int64_t baseline_ = 0;  // device bytes reserved before the Trainer (Note [What the budget covers])
  std::optional<DType> compute_dtype_;  // f16 or bf16 with fp16 / bf16
  // Note [Inputs in the weights' dtype]: with fp16 / bf16, floating inputs are cast to the dtype of
  // the weights the model holds: the 16-bit working copy from the time train() puts the model under
  // its store, and f32 in an evaluate() or predict() before any train(), which runs in f32 rather
  // than on weights cast for it. Set where those weights change, not looked up per batch.
  std::optional<DType> input_dtype_;
  Tensor model_inputs(const Tensor& inputs) const;
  std::optional<DType> gradient_dtype() const;
};

}  // namespace microbatch::train
