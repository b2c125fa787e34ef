// TrainingArguments: Hugging Face's names and defaults, so that a Trainer user reads them as they
// would in Python, plus `train_batch_size` (the effective batch to hold fixed) and `memory_budget`.
// Set them from C++ with designated initializers, from a JSON file, or from CLI flags of the same
// names:
//   TrainingArguments{.per_device_train_batch_size = 16, .gradient_accumulation_steps = 4}
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/dtype.h"

namespace microbatch::train {

/// per_device_train_batch_size = kAutoBatch: the memory planner chooses it. Spelled "auto" in JSON
/// and on the command line; 0, as in Hugging Face, is not a batch size and is refused.
inline constexpr std::int64_t kAutoBatch = -1;

struct TrainingArguments {
  std::string output_dir = "runs/microbatch";
  bool overwrite_output_dir = false;  // a fresh run deletes checkpoints already in output_dir
  std::int64_t per_device_train_batch_size = 8;  // the micro-batch (>= 1), or kAutoBatch ("auto")
  std::int64_t per_device_eval_batch_size = 8;
  std::int64_t gradient_accumulation_steps = 1;
  std::int64_t train_batch_size = 0;             // effective batch; 0 = micro x accumulation steps
  std::int64_t memory_budget = 0;                // bytes; 0 = none ("512MiB", "2GB" in JSON/CLI)
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
  std::int64_t logging_steps = 500;              // counts optimizer steps, as every *_steps
  /// A window whose loss is NaN or inf counts, in its place, the logging window's loss so far over
  /// 1 + its windows (Hugging Face's rule), so that logged losses and loss sums stay finite.
  bool logging_nan_inf_filter = true;
  std::string eval_strategy = "no";              // no, steps, epoch
  std::int64_t eval_steps = 0;                   // for eval_strategy = steps (0: logging_steps)
  std::string save_strategy = "no";              // no, steps, epoch
  std::int64_t save_steps = 500;
  std::int64_t save_total_limit = 0;             // keep at most this many checkpoints; 0 = all
  std::string resume_from_checkpoint;            // a checkpoint folder, or "latest" in output_dir
  bool fp16 = false;                             // f16 weights and activations, f32 master, loss scaling
  std::string gradient_accumulation_dtype = "f32";  // f32, or f16 / bf16 accumulators (half the bytes)
  bool bf16 = false;                             // bf16 weights and activations, f32 master
  double loss_scale_floor = 1.0;                 // fp16: the dynamic scale never goes below this
  std::int64_t max_overflows_at_floor = 20;      // fp16: consecutive overflows at the floor that stop the run
  std::int64_t loss_scale_hysteresis = 1;        // fp16: overflows tolerated before backing off (DeepSpeed)
  bool loss_scale_consecutive_hysteresis = false;  // fp16: only overflows in a row count (DeepSpeed's
                                                   // consecutive_hysteresis)
  bool gradient_checkpointing = false;           // force activation checkpointing on
  /// With a memory_budget and variable-length token sequences: pack each window's micro-batches by
  /// padded tokens (rows x longest row <= the plan's tokens) rather than by a count of sequences.
  bool pack_by_tokens = true;
  std::uint64_t seed = 42;
  bool use_cpu = false;                          // train on the CPU even when a CUDA device is present
  std::string device;                            // "cpu", "cuda" or "cuda:N" (not a Hugging Face name);
                                                 // empty: cuda:0 when present and not use_cpu, else cpu
  bool json = false;                             // log lines as JSON (not a Hugging Face name)
  /// How the ranks of a data-parallel run (`mpirun -np W ...`) sum their gradients: "auto" (nccl
  /// on CUDA, mpi on the CPU), "mpi" or "nccl" (Note [Data parallel] in train/distributed.h).
  std::string ddp_backend = "auto";

  /// Throws microbatch::Error naming the first inconsistent or out-of-range argument.
  void validate() const;
  /// Where the run goes, as asked: `device` when given, else cuda:0 when a CUDA device is present
  /// and use_cpu is false, else the CPU. Whether a named CUDA device exists is not checked here:
  /// planning for it needs none.
  Device requested_device() const;
  /// requested_device(), checked to be present on this machine: where training runs.
  Device training_device() const;
  /// Warmup steps for a run of num_training_steps optimizer steps (Hugging Face's name): warmup_steps
  /// when set, else ceil(warmup_ratio * num_training_steps), at most the run.
  std::int64_t get_warmup_steps(std::int64_t num_training_steps) const;
  /// Whether the steps strategies evaluate / save after optimizer step `step` (eval_steps, or
  /// logging_steps when it is 0; save_steps). The epoch strategies act at an epoch's end instead.
  bool evaluates_after(std::int64_t step) const;
  bool saves_after(std::int64_t step) const;
  /// The gradient arena's dtype: none for "f32", which means full-precision accumulators (f32, or
  /// f64 for an f64 model: the ParamStore's default), else gradient_accumulation_dtype's.
  std::optional<DType> accumulation_dtype() const;
  nlohmann::json to_json() const;
  /// Reads the arguments from JSON objects with these names; unknown names are refused.
  static TrainingArguments from_json(const nlohmann::json& j);
  /// from_json of an arguments file (read_arguments_file).
  static TrainingArguments load(const std::string& path);
};

/// The JSON of an arguments file: a regular file of at most 1 MiB holding valid JSON, else an
/// error naming the path and what is wrong.
nlohmann::json read_arguments_file(const std::string& path);

/// "512MiB", "2GB", "1.5GiB", "1000000" -> bytes (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024).
std::int64_t parse_bytes(const std::string& text);

/// The effective batch and its split, from the DeepSpeed-style triad
/// train_batch_size = micro x accumulation steps (single process): given two, the third follows;
/// an inconsistent triple is refused. With an automatic micro-batch only the effective batch is fixed.
struct BatchTriad {
  std::int64_t effective = 0;
  std::int64_t micro = 0;           // 0 when automatic
  std::int64_t accumulation = 0;    // 0 when automatic
};
BatchTriad resolve_batch_triad(const TrainingArguments& args);
/// The triad of `effective` items in micro-batches of at most `micro` (>= 1): ceil(effective /
/// micro) steps, the window's last micro-batch possibly smaller.
BatchTriad split_effective_batch(std::int64_t effective, std::int64_t micro);

}  // namespace microbatch::train
