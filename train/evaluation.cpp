// The Trainer's evaluation: evaluate(), predict(), and the loop both run (Note [Sharded
// predictions] for a data-parallel run).
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "train/budget_guard.h"
#include "train/data.h"
#include "train/distributed.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace microbatch::train {

namespace {

// Note [Predictions outside the budget]: compute_metrics and predict() take the whole set's logits
// and labels on the host, where Hugging Face's Trainer gathers them too. On a GPU that is host
// memory, outside the device's budget (Note [What the budget covers]). On the CPU the host is the
// training device: held as tensors, the batches' logits and labels would take room that the
// planned micro-batch needs (the 10,000 Fashion-MNIST test images' come to 0.5 MB, and their cat
// as much again), and a run whose training fits would fail at its first evaluation. So each
// batch's share is kept as plain bytes outside the allocator, and the tensors are put together
// with the CPU's budget lifted once the last batch has run (BudgetLift); their blocks go back to
// the cache, which evaluation empties. Batches of different lengths are padded as they are put
// together (Note [Padding across batches] in train/metrics.cpp).

// Lifts the CPU allocator's budget in its scope.
struct BudgetLift {
  BudgetLift() : previous(allocator(kCPU).budget()) { allocator(kCPU).set_budget(std::nullopt); }
  ~BudgetLift() { allocator(kCPU).set_budget(previous); }
  std::optional<std::size_t> previous;
};

// Evaluation's mode in its scope: the model trains again afterwards, however evaluation ends.
struct EvalMode {
  explicit EvalMode(nn::Model& m) : model(m), was_training(m.is_training()) { model.eval(); }
  ~EvalMode() { model.train(was_training); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;
  nn::Model& model;
  bool was_training;
};

}  // namespace

Metrics Trainer::run_evaluation(const Dataset& data, PredictionOutput* keep) {
  NoGradGuard no_grad;
  const EvalMode mode(*model_);
  const bool collect = keep != nullptr || static_cast<bool>(compute_metrics_);
  // Note [Sharded predictions]: in a data-parallel run each rank evaluates its share (examples r,
  // r + W, ...) and the losses are summed. The predictions that compute_metrics and predict() take
  // whole are gathered after: every rank sends its rows to every other and puts them back in the
  // set's order (HostRows::gather_shares), as Accelerate's gather_for_metrics gives every process
  // the whole set's, with no example twice. Every rank then computes the same metrics.
  const bool shard = group_->size() > 1;
  const DatasetShard share(data, group_->rank(), group_->size());
  const Dataset& source = shard ? share : data;
  bool token_labels = false;
  const std::int64_t ignore_index = model_->ignore_index();
  double loss_sum = 0.0;
  std::int64_t items = 0;
  // Note [Predictions outside the budget]; Note [Padding across batches].
  std::optional<HostRows> logits, labels;
  bool any = false;
  // Every rank evaluates its share, or every rank stops (Note [Failing together]).
  group_->together("evaluating", [&] {
    token_labels = data.size() > 0 && data.get(0).label.dim() > 0;
    for (;;) {
      try {
        DataLoader loader(source, {.batch_size = eval_batch_size_,
                                   .prefetch = 0,
                                   .collate = {.ignore_index = ignore_index}});
        loss_sum = 0.0;
        items = 0;
        logits.emplace("logits", kLogitsPadding);
        labels.emplace("labels", static_cast<double>(ignore_index));
        any = false;
        while (auto host_batch = loader.next()) {
          const Batch batch = host_batch->to(device_);
          nn::ModelOutput o = model_->forward(model_inputs(batch.inputs), batch.labels);
          // A batch with no loss-bearing label has a NaN mean loss and no weight in the mean.
          if (batch.num_items > 0) loss_sum += o.loss.item() * static_cast<double>(batch.num_items);
          items += batch.num_items;
          if (collect) {
            logits->add(o.logits);
            labels->add(host_batch->labels);
            any = true;
          }
        }
        return;
      } catch (const OutOfMemoryError&) {
        // Evaluation shrinks its own batch; the training plan is never touched.
        MB_CHECK(eval_batch_size_ > 1,
                 "[Trainer] one evaluation sample does not fit in the memory budget");
        eval_batch_size_ /= 2;
      }
    }
  });
  eval_peak_ = memory_stats(device_).reserved.peak;
  if (shard) {
    loss_sum = group_->all_reduce_sum(loss_sum);
    items = group_->all_reduce_sum(items);
    if (collect) {
      logits->gather_shares(*group_, data.size());
      labels->gather_shares(*group_, data.size());
      any = logits->has_rows();
    }
  }
  Metrics m;
  m["eval_loss"] = items > 0 ? loss_sum / static_cast<double>(items) : 0.0;
  if (token_labels) m["eval_perplexity"] = std::exp(m["eval_loss"]);
  if (collect && any) {
    group_->together("computing its metrics", [&] {
      BudgetLift lift;
      EvalPrediction p{logits->tensor(), labels->tensor(), ignore_index};
      if (compute_metrics_)
        for (auto& [k, v] : compute_metrics_(p)) m["eval_" + k] = v;
      if (keep) {
        keep->predictions = p.logits;
        keep->label_ids = p.labels;
      }
    });
  }
  return m;
}

Metrics Trainer::evaluate() {
  MB_CHECK(eval_set_ != nullptr, "[Trainer] evaluate() needs an eval_dataset");
  BudgetGuard budget(device_, baseline_, args_.memory_budget);
  return run_evaluation(*eval_set_, nullptr);
}

PredictionOutput Trainer::predict(const Dataset& data) {
  BudgetGuard budget(device_, baseline_, args_.memory_budget);
  PredictionOutput out;
  Metrics m = run_evaluation(data, &out);
  for (auto& [k, v] : m) out.metrics["test_" + k.substr(5)] = v;
  return out;
}

}  // namespace microbatch::train
