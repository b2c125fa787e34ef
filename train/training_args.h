// TrainingArguments: Hugging Face's names and defaults, so that a Trainer user reads them as they
// would in Python. Set them from C++ with designated initializers:
//   TrainingArguments{.per_device_train_batch_size = 16, .gradient_accumulation_steps = 4}
#pragma once

#include <cstdint>
#include <string>

namespace microbatch::train {

struct TrainingArguments {
  std::string output_dir = "runs/microbatch";
  std::int64_t per_device_train_batch_size = 8;  // the micro-batch
  std::int64_t per_device_eval_batch_size = 8;
  std::int64_t gradient_accumulation_steps = 1;
  double num_train_epochs = 3.0;
  std::int64_t max_steps = -1;                   // > 0 overrides num_train_epochs
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;                    // 0 turns clipping off
  std::string lr_scheduler_type = "linear";      // constant, constant_with_warmup, linear, cosine
  std::int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;                     // used when warmup_steps == 0
  std::int64_t logging_steps = 500;              // counts optimizer steps
  std::string eval_strategy = "no";              // no, steps, epoch
  std::int64_t eval_steps = 0;                   // for eval_strategy = steps (0: logging_steps)
  std::uint64_t seed = 42;
  bool json = false;                             // log lines as JSON (not a Hugging Face name)

  /// Throws microbatch::Error naming the first inconsistent or out-of-range argument.
  void validate() const;
};

}  // namespace microbatch::train
