// A training run with the Accelerator: exact accumulation, AdamW, LR schedule, clipping folded into
// the optimizer pass, logging per optimizer step, evaluation per epoch or per N steps.
#pragma once

#include <iosfwd>
#include <optional>

#include "nn/models.h"
#include "train/data.h"
#include "train/training_args.h"

namespace microbatch::train {

struct EvalResult {
  double loss = 0.0;                   // mean over loss-bearing items
  std::optional<double> accuracy;      // classification only
  double perplexity = 0.0;             // exp(loss)
  std::int64_t items = 0;
};

struct FitResult {
  std::int64_t steps = 0;              // optimizer steps taken
  double last_loss = 0.0;              // the last window's loss
  std::optional<EvalResult> eval;      // the last evaluation
  double seconds = 0.0;
  std::int64_t samples = 0;
};

/// Mean loss (and accuracy for class labels) of the model on a dataset, without gradients.
EvalResult evaluate(nn::Model& model, const Dataset& data, std::int64_t batch_size);

/// Trains `model` on `train_set`; logs to `log` (plain lines, or JSON with args.json).
FitResult fit(nn::Model& model, const Dataset& train_set, const Dataset* eval_set,
              const TrainingArguments& args, std::ostream& log);

}  // namespace microbatch::train
