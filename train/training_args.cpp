#include "train/training_args.h"

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <type_traits>

#include "core/error.h"
#include "core/json_text.h"
#include "optim/schedule.h"

namespace microbatch::train {

std::int64_t parse_bytes(const std::string& text) {
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    MB_CHECK(false, "[memory_budget] cannot read '{}' as a size (e.g. 512MiB, 2GB, 1000000)", text);
  }
  std::string unit = text.substr(pos);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KB" || unit == "kB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "TB") scale = 1e12;
  else if (unit == "KiB") scale = 1024.0;
  else if (unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  else MB_CHECK(false, "[memory_budget] unknown unit '{}' in '{}': use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB", unit, text);
  MB_CHECK(std::isfinite(value), "[memory_budget] size must be a finite number of bytes, got '{}'", text);
  MB_CHECK(value >= 0, "[memory_budget] size must be non-negative, got '{}'", text);
  // llround of a size past 2^63 bytes is undefined (it came back as INT64_MIN).
  MB_CHECK(value * scale < std::ldexp(1.0, 63),
           "[memory_budget] '{}' is too large: a size must be less than 8 EiB (2^63 bytes)", text);
  const auto bytes = static_cast<std::int64_t>(std::llround(value * scale));
  // 0 means no budget: a size that only rounds to it is refused rather than lifting the budget.
  MB_CHECK(bytes > 0 || value == 0,
           "[memory_budget] '{}' is less than one byte (0 means no budget at all)", text);
  return bytes;
}

namespace {

// The path as text a terminal shows: bytes outside printable ASCII as \xNN.
std::string printable(const std::string& s) {
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    out += u >= 0x20 && u < 0x7F ? std::string(1, c) : fmt::format("\\x{:02X}", u);
  }
  return out;
}

// Paths the Trainer writes into JSON (checkpoints' trainer state, log.jsonl) must be UTF-8, which
// JSON can hold; a POSIX path may be any bytes. Refused when the arguments are checked rather than
// when the first checkpoint is written, after training has begun.
void check_json_text(const char* name, const std::string& value) {
  try {
    (void)nlohmann::json(value).dump();
  } catch (const nlohmann::json::type_error& e) {
    MB_CHECK(false,
             "[TrainingArguments] {} '{}' is not valid UTF-8, which the run's JSON files (its log "
             "and checkpoints) need: {}",
             name, printable(value), e.what());
  }
}

}  // namespace

void TrainingArguments::validate() const {
  MB_CHECK(!output_dir.empty(), "[TrainingArguments] output_dir must name a folder, got ''");
  check_json_text("output_dir", output_dir);
  check_json_text("resume_from_checkpoint", resume_from_checkpoint);
  MB_CHECK(per_device_train_batch_size >= 1 || per_device_train_batch_size == kAutoBatch,
           "[TrainingArguments] per_device_train_batch_size must be >= 1 or auto, got {}",
           per_device_train_batch_size);
  MB_CHECK(per_device_eval_batch_size >= 1, "[TrainingArguments] per_device_eval_batch_size must be >= 1, got {}",
           per_device_eval_batch_size);
  MB_CHECK(gradient_accumulation_steps >= 1, "[TrainingArguments] gradient_accumulation_steps must be >= 1, got {}",
           gradient_accumulation_steps);
  MB_CHECK(train_batch_size >= 0, "[TrainingArguments] train_batch_size must be >= 0, got {}", train_batch_size);
  MB_CHECK(memory_budget >= 0, "[TrainingArguments] memory_budget must be >= 0, got {}", memory_budget);
  MB_CHECK(per_device_train_batch_size != kAutoBatch || memory_budget > 0,
           "[TrainingArguments] per_device_train_batch_size = auto needs a memory_budget to plan against");
  MB_CHECK(max_steps > 0 || num_train_epochs > 0, "[TrainingArguments] set max_steps > 0 or num_train_epochs > 0");
  MB_CHECK(std::isfinite(num_train_epochs) && num_train_epochs >= 0 && num_train_epochs <= 1e9,
           "[TrainingArguments] num_train_epochs must be in [0, 1e9], got {}", num_train_epochs);
  MB_CHECK(learning_rate >= 0, "[TrainingArguments] learning_rate must be >= 0, got {}", learning_rate);
  MB_CHECK(weight_decay >= 0, "[TrainingArguments] weight_decay must be >= 0, got {}", weight_decay);
  MB_CHECK(adam_beta1 >= 0 && adam_beta1 < 1, "[TrainingArguments] adam_beta1 must be in [0, 1), got {}",
           adam_beta1);
  MB_CHECK(adam_beta2 >= 0 && adam_beta2 < 1, "[TrainingArguments] adam_beta2 must be in [0, 1), got {}",
           adam_beta2);
  MB_CHECK(adam_epsilon >= 0, "[TrainingArguments] adam_epsilon must be >= 0, got {}", adam_epsilon);
  MB_CHECK(warmup_steps >= 0, "[TrainingArguments] warmup_steps must be >= 0, got {}", warmup_steps);
  MB_CHECK(eval_steps >= 0, "[TrainingArguments] eval_steps must be >= 0 (0: logging_steps), got {}",
           eval_steps);
  MB_CHECK(save_total_limit >= 0, "[TrainingArguments] save_total_limit must be >= 0 (0: keep all), got {}",
           save_total_limit);
  MB_CHECK(max_grad_norm >= 0, "[TrainingArguments] max_grad_norm must be >= 0, got {}", max_grad_norm);
  MB_CHECK(warmup_ratio >= 0 && warmup_ratio <= 1, "[TrainingArguments] warmup_ratio must be in [0, 1], got {}",
           warmup_ratio);
  MB_CHECK(logging_steps >= 1, "[TrainingArguments] logging_steps must be >= 1, got {}", logging_steps);
  MB_CHECK(eval_strategy == "no" || eval_strategy == "steps" || eval_strategy == "epoch",
           "[TrainingArguments] eval_strategy must be no, steps or epoch, got '{}'", eval_strategy);
  MB_CHECK(save_strategy == "no" || save_strategy == "steps" || save_strategy == "epoch",
           "[TrainingArguments] save_strategy must be no, steps or epoch, got '{}'", save_strategy);
  MB_CHECK(save_steps >= 1, "[TrainingArguments] save_steps must be >= 1, got {}", save_steps);
  MB_CHECK(!(fp16 && bf16), "[TrainingArguments] fp16 and bf16 are exclusive: choose one");
  MB_CHECK(gradient_accumulation_dtype == "f32" || gradient_accumulation_dtype == "f16" ||
               gradient_accumulation_dtype == "bf16",
           "[TrainingArguments] gradient_accumulation_dtype must be f32, f16 or bf16, got '{}'",
           gradient_accumulation_dtype);
  // f16 holds gradients only between 6e-8 and 65504; loss scaling moves them into that range.
  MB_CHECK(gradient_accumulation_dtype != "f16" || fp16,
           "[TrainingArguments] gradient_accumulation_dtype f16 needs fp16: without loss scaling, "
           "gradients below 6e-8 vanish and sums above 65504 overflow in f16; use bf16 or f32");
  MB_CHECK(loss_scale_hysteresis >= 1,
           "[TrainingArguments] loss_scale_hysteresis must be >= 1 (1 backs off on every overflow), "
           "got {}", loss_scale_hysteresis);
  MB_CHECK(max_overflows_at_floor >= 0,
           "[TrainingArguments] max_overflows_at_floor must be >= 0 (0 never stops), got {}",
           max_overflows_at_floor);
  // The scaler's own range (optim::DynamicLossScaler): an f32 whose inverse is finite.
  MB_CHECK(loss_scale_floor >= 0x1p-126 && std::isfinite(static_cast<float>(loss_scale_floor)),
           "[TrainingArguments] loss_scale_floor must be in [2^-126, FLT_MAX], got {}",
           loss_scale_floor);
  optim::parse_schedule(lr_scheduler_type);
  MB_CHECK(ddp_backend == "auto" || ddp_backend == "mpi" || ddp_backend == "nccl",
           "[TrainingArguments] ddp_backend must be auto, mpi or nccl, got '{}'", ddp_backend);
  resolve_batch_triad(*this);
  requested_device();
}

bool TrainingArguments::evaluates_after(std::int64_t step) const {
  const std::int64_t every = eval_steps > 0 ? eval_steps : logging_steps;
  return eval_strategy == "steps" && step % every == 0;
}

bool TrainingArguments::saves_after(std::int64_t step) const {
  return save_strategy == "steps" && step % save_steps == 0;
}

std::optional<DType> TrainingArguments::accumulation_dtype() const {
  if (gradient_accumulation_dtype == "f32") return std::nullopt;
  return parse_dtype(gradient_accumulation_dtype);
}

Device TrainingArguments::requested_device() const {
  if (device.empty()) return !use_cpu && cuda_available() ? cuda_device(0) : kCPU;
  Device d;
  try {
    d = parse_device(device);
  } catch (const Error&) {
    d = kMeta;  // refused just below, with the arguments' own message
  }
  MB_CHECK(!d.is_meta(), "[TrainingArguments] device must be cpu, cuda or cuda:N, got '{}'", device);
  MB_CHECK(!(use_cpu && d.is_cuda()), "[TrainingArguments] use_cpu and device = '{}' disagree: give one of them",
           device);
  return d;
}

std::int64_t TrainingArguments::get_warmup_steps(std::int64_t num_training_steps) const {
  MB_CHECK(num_training_steps >= 0, "[TrainingArguments] num_training_steps must be >= 0, got {}",
           num_training_steps);
  if (warmup_steps > 0) return warmup_steps;
  // In doubles, ratio x steps can round past the run (and past INT64_MAX, whose cast is undefined):
  // a warmup is never longer than the run.
  const double steps = std::ceil(warmup_ratio * static_cast<double>(num_training_steps));
  return steps >= static_cast<double>(num_training_steps) ? num_training_steps
                                                          : static_cast<std::int64_t>(steps);
}

Device TrainingArguments::training_device() const {
  const Device d = requested_device();
  if (d.is_cuda()) {
    const int count = cuda_device_count();
    MB_CHECK(d.index < count, "[TrainingArguments] device {} is not present: {}; train with use_cpu or device = cpu",
             d.str(), count == 0 ? std::string("no CUDA device here (or this build has no CUDA backend)")
                                 : fmt::format("this machine has {} CUDA device(s)", count));
  }
  return d;
}

BatchTriad split_effective_batch(std::int64_t effective, std::int64_t micro) {
  // ceil(effective / micro), written so that it cannot overflow near INT64_MAX.
  return {effective, std::min(micro, effective), effective / micro + (effective % micro != 0)};
}

BatchTriad resolve_batch_triad(const TrainingArguments& a) {
  const std::int64_t micro = a.per_device_train_batch_size, steps = a.gradient_accumulation_steps;
  if (a.train_batch_size == 0) {
    MB_CHECK(micro != kAutoBatch, "[TrainingArguments] per_device_train_batch_size = auto needs train_batch_size "
             "(the effective batch to hold fixed)");
    std::int64_t effective = 0;
    MB_CHECK(!__builtin_mul_overflow(micro, steps, &effective),
             "[TrainingArguments] per_device_train_batch_size {} x gradient_accumulation_steps {} overflows",
             micro, steps);
    return {effective, micro, steps};
  }
  const std::int64_t effective = a.train_batch_size;
  if (micro == kAutoBatch) {
    if (steps == 1) return {effective, 0, 0};  // the planner chooses the split
    MB_CHECK(effective % steps == 0, "[TrainingArguments] train_batch_size {} is not divisible by "
             "gradient_accumulation_steps {}", effective, steps);
    return {effective, effective / steps, steps};
  }
  // Derive the accumulation steps; the window's last micro-batch may be smaller.
  if (steps == 1) return split_effective_batch(effective, micro);
  std::int64_t product = 0;
  MB_CHECK(!__builtin_mul_overflow(micro, steps, &product) && product == effective,
           "[TrainingArguments] per_device_train_batch_size {} x gradient_accumulation_steps {} = {} "
           "does not equal train_batch_size {}; give two of the three", micro, steps, product, effective);
  return {effective, micro, steps};
}

nlohmann::json TrainingArguments::to_json() const {
  nlohmann::json j;
  j["output_dir"] = output_dir;
  j["overwrite_output_dir"] = overwrite_output_dir;
  j["per_device_train_batch_size"] =
      per_device_train_batch_size == kAutoBatch ? nlohmann::json("auto") : nlohmann::json(per_device_train_batch_size);
  j["per_device_eval_batch_size"] = per_device_eval_batch_size;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["train_batch_size"] = train_batch_size;
  j["memory_budget"] = memory_budget;
  j["num_train_epochs"] = num_train_epochs;
  j["max_steps"] = max_steps;
  j["learning_rate"] = learning_rate;
  j["weight_decay"] = weight_decay;
  j["adam_beta1"] = adam_beta1;
  j["adam_beta2"] = adam_beta2;
  j["adam_epsilon"] = adam_epsilon;
  j["max_grad_norm"] = max_grad_norm;
  j["lr_scheduler_type"] = lr_scheduler_type;
  j["warmup_steps"] = warmup_steps;
  j["warmup_ratio"] = warmup_ratio;
  j["logging_steps"] = logging_steps;
  j["logging_nan_inf_filter"] = logging_nan_inf_filter;
  j["eval_strategy"] = eval_strategy;
  j["eval_steps"] = eval_steps;
  j["save_strategy"] = save_strategy;
  j["save_steps"] = save_steps;
  j["save_total_limit"] = save_total_limit;
  j["resume_from_checkpoint"] = resume_from_checkpoint;
  j["fp16"] = fp16;
  j["gradient_accumulation_dtype"] = gradient_accumulation_dtype;
  j["bf16"] = bf16;
  j["loss_scale_floor"] = loss_scale_floor;
  j["max_overflows_at_floor"] = max_overflows_at_floor;
  j["loss_scale_hysteresis"] = loss_scale_hysteresis;
  j["loss_scale_consecutive_hysteresis"] = loss_scale_consecutive_hysteresis;
  j["gradient_checkpointing"] = gradient_checkpointing;
  j["pack_by_tokens"] = pack_by_tokens;
  j["seed"] = seed;
  j["use_cpu"] = use_cpu;
  j["device"] = device;
  j["ddp_backend"] = ddp_backend;
  return j;
}

TrainingArguments TrainingArguments::from_json(const nlohmann::json& j) {
  MB_CHECK(j.is_object(), "[TrainingArguments] expected a JSON object");
  TrainingArguments a;
  const nlohmann::json known = a.to_json();
  for (auto it = j.begin(); it != j.end(); ++it) {
    MB_CHECK(known.contains(it.key()) || it.key() == "json", "[TrainingArguments] unknown argument '{}'", it.key());
  }
  auto get = [&](const char* name, auto& field) {
    if (!j.contains(name)) return;
    const nlohmann::json& v = j.at(name);
    using Field = std::decay_t<decltype(field)>;
    if constexpr (std::is_integral_v<Field> && !std::is_same_v<Field, bool>) {
      MB_CHECK(v.is_number(), "[TrainingArguments] '{}' has the wrong type: {}", name, shown_json(v));
      // JSON's get_to would truncate 2.7 to 2, wrap -1 into an unsigned seed and 1e19 into a
      // negative count: refuse all three.
      MB_CHECK(v.is_number_integer() || (v.is_number_float() && std::isfinite(v.get<double>()) &&
                                         std::trunc(v.get<double>()) == v.get<double>()),
               "[TrainingArguments] '{}' must be a whole number, got {}", name, shown_json(v));
      MB_CHECK(!std::is_unsigned_v<Field> || v.get<double>() >= 0,
               "[TrainingArguments] '{}' must be >= 0, got {}", name, shown_json(v));
      const bool fits = v.is_number_unsigned()
                            ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(
                                                            std::numeric_limits<Field>::max())
                            : v.get<double>() < std::ldexp(1.0, std::numeric_limits<Field>::digits) &&
                                  v.get<double>() >= static_cast<double>(
                                                         std::numeric_limits<Field>::lowest());
      MB_CHECK(fits, "[TrainingArguments] '{}' is out of range: {}", name, shown_json(v));
    }
    try {
      v.get_to(field);
    } catch (const nlohmann::json::exception&) {
      MB_CHECK(false, "[TrainingArguments] '{}' has the wrong type: {}", name, shown_json(v));
    }
  };
  get("output_dir", a.output_dir);
  get("overwrite_output_dir", a.overwrite_output_dir);
  if (j.contains("per_device_train_batch_size")) {
    const auto& v = j.at("per_device_train_batch_size");
    if (v.is_string()) {
      MB_CHECK(v.get<std::string>() == "auto", "[TrainingArguments] per_device_train_batch_size must be a number "
               "or \"auto\", got {}", shown_json(v));
      a.per_device_train_batch_size = kAutoBatch;
    } else {
      get("per_device_train_batch_size", a.per_device_train_batch_size);
      // "auto" is the one spelling of an automatic micro-batch: kAutoBatch's number is not another.
      MB_CHECK(a.per_device_train_batch_size >= 1,
               "[TrainingArguments] per_device_train_batch_size must be >= 1 or \"auto\", got {}",
               shown_json(v));
    }
  }
  get("per_device_eval_batch_size", a.per_device_eval_batch_size);
  get("gradient_accumulation_steps", a.gradient_accumulation_steps);
  get("train_batch_size", a.train_batch_size);
  if (j.contains("memory_budget") && j.at("memory_budget").is_string()) {
    a.memory_budget = parse_bytes(j.at("memory_budget").get<std::string>());  // "2GiB"
  } else {
    get("memory_budget", a.memory_budget);
  }
  get("num_train_epochs", a.num_train_epochs);
  get("max_steps", a.max_steps);
  get("learning_rate", a.learning_rate);
  get("weight_decay", a.weight_decay);
  get("adam_beta1", a.adam_beta1);
  get("adam_beta2", a.adam_beta2);
  get("adam_epsilon", a.adam_epsilon);
  get("max_grad_norm", a.max_grad_norm);
  get("lr_scheduler_type", a.lr_scheduler_type);
  get("warmup_steps", a.warmup_steps);
  get("warmup_ratio", a.warmup_ratio);
  get("logging_steps", a.logging_steps);
  get("logging_nan_inf_filter", a.logging_nan_inf_filter);
  get("eval_strategy", a.eval_strategy);
  get("eval_steps", a.eval_steps);
  get("save_strategy", a.save_strategy);
  get("save_steps", a.save_steps);
  get("save_total_limit", a.save_total_limit);
  get("resume_from_checkpoint", a.resume_from_checkpoint);
  get("fp16", a.fp16);
  get("gradient_accumulation_dtype", a.gradient_accumulation_dtype);
  get("bf16", a.bf16);
  get("loss_scale_floor", a.loss_scale_floor);
  get("max_overflows_at_floor", a.max_overflows_at_floor);
  get("loss_scale_hysteresis", a.loss_scale_hysteresis);
  get("loss_scale_consecutive_hysteresis", a.loss_scale_consecutive_hysteresis);
  get("gradient_checkpointing", a.gradient_checkpointing);
  get("pack_by_tokens", a.pack_by_tokens);
  get("seed", a.seed);
  get("use_cpu", a.use_cpu);
  get("device", a.device);
  get("ddp_backend", a.ddp_backend);
  get("json", a.json);
  return a;
}

nlohmann::json read_arguments_file(const std::string& path) {
  std::error_code ec;
  MB_CHECK(std::filesystem::is_regular_file(path, ec), "[TrainingArguments] '{}' is not a readable file{}",
           path, std::filesystem::exists(path, ec) ? "" : " (it does not exist)");
  std::ifstream in(path);
  MB_CHECK(in.good(), "[TrainingArguments] cannot open '{}'", path);
  // An arguments file is one flat object: anything past a few hundred kilobytes is not one.
  MB_CHECK(std::filesystem::file_size(path, ec) <= (1 << 20), "[TrainingArguments] '{}' is {} bytes: too large "
           "for an arguments file", path, std::filesystem::file_size(path, ec));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    MB_CHECK(false, "[TrainingArguments] '{}' is not valid JSON: {}", path, e.what());
  } catch (const std::ios_base::failure& e) {
    MB_CHECK(false, "[TrainingArguments] cannot read '{}': {}", path, e.what());
  }
  return {};
}

TrainingArguments TrainingArguments::load(const std::string& path) {
  return from_json(read_arguments_file(path));
}

}  // namespace microbatch::train
