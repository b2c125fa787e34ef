#include "train/fit.h"

#include <chrono>
#include <cmath>
#include <ostream>

#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/accelerator.h"

namespace microbatch::train {

void TrainingArguments::validate() const {
  MB_CHECK(per_device_train_batch_size >= 1, "[TrainingArguments] per_device_train_batch_size must be >= 1, got {}",
           per_device_train_batch_size);
  MB_CHECK(per_device_eval_batch_size >= 1, "[TrainingArguments] per_device_eval_batch_size must be >= 1, got {}",
           per_device_eval_batch_size);
  MB_CHECK(gradient_accumulation_steps >= 1, "[TrainingArguments] gradient_accumulation_steps must be >= 1, got {}",
           gradient_accumulation_steps);
  MB_CHECK(max_steps > 0 || num_train_epochs > 0,
           "[TrainingArguments] set max_steps > 0 or num_train_epochs > 0");
  MB_CHECK(learning_rate >= 0, "[TrainingArguments] learning_rate must be >= 0, got {}", learning_rate);
  MB_CHECK(max_grad_norm >= 0, "[TrainingArguments] max_grad_norm must be >= 0, got {}", max_grad_norm);
  MB_CHECK(warmup_ratio >= 0 && warmup_ratio <= 1, "[TrainingArguments] warmup_ratio must be in [0, 1], got {}",
           warmup_ratio);
  MB_CHECK(logging_steps >= 1, "[TrainingArguments] logging_steps must be >= 1, got {}", logging_steps);
  MB_CHECK(eval_strategy == "no" || eval_strategy == "steps" || eval_strategy == "epoch",
           "[TrainingArguments] eval_strategy must be no, steps or epoch, got '{}'", eval_strategy);
  optim::parse_schedule(lr_scheduler_type);
}

EvalResult evaluate(nn::Model& model, const Dataset& data, std::int64_t batch_size) {
  NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  DataLoader loader(data, {.batch_size = batch_size, .prefetch = 0});
  double loss_sum = 0.0;
  std::int64_t items = 0, correct = 0;
  bool classes = false;
  while (auto batch = loader.next()) {
    nn::ModelOutput out = model(batch->inputs, batch->labels);
    loss_sum += out.loss.item() * static_cast<double>(batch->num_items);
    items += batch->num_items;
    if (batch->labels.dim() == 1) {
      classes = true;
      correct += static_cast<std::int64_t>(
          sum(eq(argmax(out.logits, -1), batch->labels.to(DType::i64)).to(DType::i64)).item());
    }
  }
  model.train(was_training);
  EvalResult r;
  r.items = items;
  r.loss = items > 0 ? loss_sum / static_cast<double>(items) : 0.0;
  r.perplexity = std::exp(r.loss);
  if (classes && items > 0) r.accuracy = static_cast<double>(correct) / static_cast<double>(items);
  return r;
}

namespace {

void log_eval(std::ostream& log, const TrainingArguments& args, std::int64_t step, const EvalResult& e) {
  if (args.json) {
    log << fmt::format("{{\"event\": \"eval\", \"step\": {}, \"eval_loss\": {:.6f}", step, e.loss);
    if (e.accuracy) log << fmt::format(", \"eval_accuracy\": {:.6f}", *e.accuracy);
    log << fmt::format(", \"eval_perplexity\": {:.6f}}}\n", e.perplexity);
  } else {
    log << fmt::format("eval  step {:>6} | loss {:.4f}", step, e.loss);
    if (e.accuracy) log << fmt::format(" | accuracy {:.2f}%", *e.accuracy * 100.0);
    else log << fmt::format(" | perplexity {:.3f}", e.perplexity);
    log << "\n";
  }
  log.flush();
}

}  // namespace

FitResult fit(nn::Model& model, const Dataset& train_set, const Dataset* eval_set,
              const TrainingArguments& args, std::ostream& log) {
  args.validate();
  const auto t0 = std::chrono::steady_clock::now();
  model.train();
  optim::ParamStore store(model);
  optim::AdamW adamw(store, {.lr = args.learning_rate,
                             .beta1 = args.adam_beta1,
                             .beta2 = args.adam_beta2,
                             .eps = args.adam_epsilon,
                             .weight_decay = args.weight_decay});
  DataLoader loader(train_set, {.batch_size = args.per_device_train_batch_size, .shuffle = true, .seed = args.seed});
  const std::int64_t steps_per_epoch =
      (loader.num_batches() + args.gradient_accumulation_steps - 1) / args.gradient_accumulation_steps;
  const std::int64_t total_steps =
      args.max_steps > 0 ? args.max_steps
                         : static_cast<std::int64_t>(std::ceil(args.num_train_epochs * static_cast<double>(steps_per_epoch)));
  const std::int64_t warmup = args.warmup_steps > 0
                                  ? args.warmup_steps
                                  : static_cast<std::int64_t>(std::ceil(args.warmup_ratio * static_cast<double>(total_steps)));
  optim::LRScheduler schedule(adamw, {.type = optim::parse_schedule(args.lr_scheduler_type),
                                      .warmup_steps = warmup,
                                      .total_steps = total_steps});
  Accelerator accelerator({.gradient_accumulation_steps = args.gradient_accumulation_steps});
  auto optimizer = accelerator.prepare(adamw);
  auto scheduler = accelerator.prepare(schedule);
  auto batches = accelerator.prepare([&] { return loader.next(); });

  FitResult result;
  std::int64_t epoch = 0, tokens = 0;
  double window_loss = 0.0;
  const std::int64_t eval_every = args.eval_steps > 0 ? args.eval_steps : args.logging_steps;
  adamw.zero_grad();
  while (result.steps < total_steps) {
    std::optional<WindowBatch> wb = batches.next();
    if (!wb) {
      if (eval_set && args.eval_strategy == "epoch") {
        result.eval = evaluate(model, *eval_set, args.per_device_eval_batch_size);
        log_eval(log, args, result.steps, *result.eval);
      }
      loader.set_epoch(++epoch);
      continue;
    }
    auto scope = accelerator.accumulate(*wb);
    nn::ModelOutput out = model(wb->batch.inputs, wb->batch.labels);
    accelerator.backward(out.loss);
    window_loss += wb->weight * out.loss.item();  // the window's mean loss over its items
    result.samples += wb->batch.size();
    tokens += wb->batch.labels.dim() > 1 ? wb->batch.num_items : 0;
    if (!accelerator.sync_gradients()) continue;

    const optim::ParamStore::GradNorm norm = store.grad_norm();
    const double clip = args.max_grad_norm > 0 ? std::min(1.0, args.max_grad_norm / (norm.norm + 1e-6)) : 1.0;
    const double lr = adamw.lr();
    optimizer.step({.grad_scale = clip});
    scheduler.step();
    optimizer.zero_grad();
    ++result.steps;
    result.last_loss = window_loss;
    if (result.steps % args.logging_steps == 0 || result.steps == total_steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double epoch_f = static_cast<double>(result.steps) / static_cast<double>(steps_per_epoch);
      if (args.json) {
        log << fmt::format("{{\"step\": {}, \"epoch\": {:.4f}, \"loss\": {:.6f}, \"learning_rate\": {:.6e}, "
                           "\"grad_norm\": {:.6f}, \"samples\": {}, \"tokens\": {}, \"seconds\": {:.3f}}}\n",
                           result.steps, epoch_f, window_loss, lr, norm.norm, result.samples, tokens, secs);
      } else {
        log << fmt::format("step {:>6}/{} | epoch {:.2f} | loss {:.4f} | lr {:.2e} | grad_norm {:.3f} | "
                           "{:.0f} samples/s\n",
                           result.steps, total_steps, epoch_f, window_loss, lr, norm.norm,
                           static_cast<double>(result.samples) / std::max(secs, 1e-9));
      }
      log.flush();
    }
    if (eval_set && args.eval_strategy == "steps" && result.steps % eval_every == 0) {
      result.eval = evaluate(model, *eval_set, args.per_device_eval_batch_size);
      log_eval(log, args, result.steps, *result.eval);
    }
    window_loss = 0.0;
  }
  if (eval_set && args.eval_strategy != "no" &&
      !(args.eval_strategy == "steps" && result.steps % eval_every == 0)) {
    result.eval = evaluate(model, *eval_set, args.per_device_eval_batch_size);
    log_eval(log, args, result.steps, *result.eval);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace microbatch::train
