// Mixed precision: 16-bit working weights over f32 master weights, the fused boundary step, skipped
// steps that change nothing, and the loss-scale floor that stops a poisoned run cleanly.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "tests/core/harness.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

class Pair : public nn::Module {
 public:
  Pair() {
    manual_seed(11);
    w = randn({8, 5});
    b = randn({5});
    register_parameter("w", &w);
    register_parameter("b", &b);
  }
  Tensor w, b;
};

std::vector<std::uint16_t> bits_of(const Tensor& t) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(t.numel()));
  std::memcpy(out.data(), t.contiguous().raw_data(), out.size() * 2);
  return out;
}

}  // namespace

TEST_CASE("mixed precision arenas: 16-bit working weights are the rounded f32 master") {
  for (DType dt : {DType::f16, DType::bf16}) {
    Pair m;
    Tensor w0 = m.w.clone();
    optim::ParamStore store(m, {.compute_dtype = dt});
    CHECK(store.has_master());
    CHECK(m.w.dtype() == dt);
    CHECK(store.master().dtype() == DType::f32);
    CHECK(store.grads().dtype() == DType::f32);
    check_close(store.master_of(store.entries()[0]), w0, 0, 0, "master keeps the f32 values");
    CHECK(bits_of(m.w) == bits_of(w0.to(dt)));
  }
  Pair f64;
  f64.to(DType::f64);
  check_throws_with([&] { optim::ParamStore(f64, {.compute_dtype = DType::f16}); }, "needs f32 parameters");
}

TEST_CASE("the fused boundary step matches a per-tensor reference bitwise for 7 steps, one skipped") {
  Pair m;
  optim::ParamStore store(m, {.compute_dtype = DType::f16});
  const optim::AdamWConfig cfg{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW adamw(store, cfg);
  // The reference: the formula of REFERENCE.md per tensor in f32, with its own master and moments.
  std::map<std::string, std::vector<float>> master, mom, var;
  for (const auto& e : store.entries()) {
    std::vector<double> v = store.master_of(e).to_vector();
    master[e.name] = std::vector<float>(v.begin(), v.end());
    mom[e.name].assign(v.size(), 0.0f);
    var[e.name].assign(v.size(), 0.0f);
  }
  const float scale = 1024.0f, inv_scale = static_cast<float>(1.0 / 1024.0), clip = 0.5f;
  int t = 0;
  for (int step = 0; step < 7; ++step) {
    manual_seed(100 + step);
    Tensor g = randn({store.numel()}) * 1024.0;  // scaled gradients
    const bool skip = step == 3;
    if (skip) {
      std::vector<double> v = g.to_vector();
      v[7] = std::numeric_limits<double>::infinity();
      g = from_vector(v, {store.numel()});
    }
    Tensor(store.grads()).copy_(g);
    const auto before_master = store.master().to_vector();
    const auto before_work = bits_of(store.weights());
    const auto norm = store.grad_norm();
    CHECK(norm.non_finite == skip);
    adamw.step({.grad_scale = static_cast<double>(inv_scale) * clip, .found_inf = norm.non_finite});
    if (skip) {
      CHECK(store.master().to_vector() == before_master);
      CHECK(bits_of(store.weights()) == before_work);
      CHECK(adamw.step_count() == t);
      for (const auto& e : store.entries()) {  // the moments too
        std::vector<double> m1 = adamw.state_dict().at("exp_avg").slice(0, e.offset, e.offset + e.numel).to_vector();
        for (std::size_t i = 0; i < m1.size(); ++i) CHECK(static_cast<float>(m1[i]) == mom[e.name][i]);
      }
      continue;
    }
    ++t;
    std::vector<double> gv = g.to_vector();
    for (const auto& e : store.entries()) {
      auto& p = master[e.name];
      auto& m1 = mom[e.name];
      auto& m2 = var[e.name];
      const bool decay = e.decay;
      const float step_size = static_cast<float>(cfg.lr / (1.0 - std::pow(cfg.beta1, t)));
      const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(cfg.beta2, t)));
      for (std::size_t i = 0; i < p.size(); ++i) {
        const float grad = static_cast<float>(gv[e.offset + i]) * static_cast<float>(static_cast<double>(inv_scale) * clip);
        float w = p[i];
        if (decay) w *= static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
        m1[i] = 0.9f * m1[i] + static_cast<float>(1.0 - 0.9) * grad;  // torch's alpha = 1 - beta1
        m2[i] = 0.999f * m2[i] + static_cast<float>(1.0 - 0.999) * grad * grad;
        w -= step_size * m1[i] / (std::sqrt(m2[i]) / bias2_sqrt + 1e-8f);
        p[i] = w;
      }
      std::vector<double> got = store.master_of(e).to_vector();
      for (std::size_t i = 0; i < p.size(); ++i) REQUIRE(static_cast<float>(got[i]) == p[i]);
      std::vector<float> ref(p.begin(), p.end());
      Tensor expected_work = from_vector(std::vector<double>(ref.begin(), ref.end()), e.shape).to(DType::f16);
      CHECK(bits_of(store.weight_of(e)) == bits_of(expected_work));
    }
  }
  CHECK(adamw.step_count() == 6);
  (void)scale;
}

TEST_CASE("fp16 and bf16 training through the Trainer: loss falls, memory plan holds") {
  manual_seed(5);
  Tensor x = rand({256, 28, 28});
  Tensor y = gt(sum(x.reshape({256, 784}).slice(1, 0, 392), {1}), sum(x.reshape({256, 784}).slice(1, 392, 784), {1}))
                 .to(DType::i64);
  train::TensorDataset data(x, y);
  for (bool fp16 : {true, false}) {
    TempDir dir;
    std::ostringstream sink;
    train::Trainer trainer([] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64}, .num_classes = 2}); },
                           {.output_dir = dir.path.string(), .per_device_train_batch_size = train::kAutoBatch,
                            .train_batch_size = 32, .memory_budget = 2 << 20, .num_train_epochs = 4,
                            .learning_rate = 3e-3, .logging_steps = 1, .fp16 = fp16, .bf16 = !fp16, .use_cpu = true},
                           data);
    trainer.set_log_stream(&sink);
    train::TrainOutput out = trainer.train();
    CHECK(trainer.model().parameters()[0].dtype() == (fp16 ? DType::f16 : DType::bf16));
    std::ifstream in(dir.path / "log.jsonl");
    std::string line;
    double first = -1, last = -1;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("event")) continue;
      if (first < 0) first = j["loss"];
      last = j["loss"];
      CHECK(j["measured_peak"].get<std::int64_t>() <= 2 << 20);
      CHECK(std::abs(j["measured_peak"].get<double>() - trainer.plan().predicted_peak) <=
            0.05 * trainer.plan().predicted_peak);
      CHECK(j.contains("loss_scale") == fp16);
    }
    CHECK(last < first);
    CHECK(out.skipped_steps <= 2);
  }
}

TEST_CASE("fp16 and bf16 Trainers evaluate before training, in f32, and after it, in 16 bits") {
  // Before train() the model holds its f32 weights (the masters train() will start from): its
  // evaluation runs in f32, as the f32 Trainer's does. Image inputs, which the Trainer casts.
  manual_seed(9);
  Tensor x = rand({48, 28, 28});
  Tensor y = gt(sum(x.reshape({48, 784}), {1}), scalar_tensor(392.0)).to(DType::i64);
  train::TensorDataset data(x, y);
  auto model = [] {
    manual_seed(10);
    return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {32}, .num_classes = 2});
  };
  auto arguments = [](const TempDir& dir, bool fp16, bool bf16) {
    return train::TrainingArguments{.output_dir = dir.path.string(),
                                    .per_device_train_batch_size = 16,
                                    .per_device_eval_batch_size = 16,
                                    .max_steps = 2,
                                    .fp16 = fp16,
                                    .bf16 = bf16,
                                    .use_cpu = true};
  };
  TempDir f32_dir;
  train::Trainer in_f32(model, arguments(f32_dir, false, false), data, &data);
  const double f32_loss = in_f32.evaluate().at("eval_loss");
  for (bool fp16 : {true, false}) {
    CAPTURE(fp16);
    TempDir dir;
    std::ostringstream sink;
    train::Trainer trainer(model, arguments(dir, fp16, !fp16), data, &data);
    trainer.set_log_stream(&sink);
    CHECK(trainer.evaluate().at("eval_loss") == f32_loss);
    trainer.train();
    REQUIRE(trainer.model().parameters()[0].dtype() == (fp16 ? DType::f16 : DType::bf16));
    const double after = trainer.evaluate().at("eval_loss");
    CHECK(std::isfinite(after));
    CHECK(after != f32_loss);
  }
}

TEST_CASE("a poisoned sample ends at the loss-scale floor with a clear error and the last good state") {
  manual_seed(6);
  Tensor x = rand({64, 28, 28});
  {
    NoGradGuard no_grad;
    x.select(0, 0).fill_(std::numeric_limits<double>::quiet_NaN());  // one poisoned image, in every window
  }
  Tensor y = (rand({64}) * 10.0).to(DType::i64);
  train::TensorDataset data(x, y);
  TempDir dir;
  std::ostringstream sink;
  train::Trainer trainer([] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {32}}); },
                         {.output_dir = dir.path.string(), .per_device_train_batch_size = 64,
                          .max_steps = 100, .learning_rate = 1e-3, .logging_steps = 1, .fp16 = true,
                          .loss_scale_floor = 1.0, .max_overflows_at_floor = 3, .use_cpu = true},
                         data);
  trainer.set_log_stream(&sink);
  Tensor w0 = trainer.model().parameters()[0].clone();
  check_throws_with([&] { trainer.train(); }, "the last good state is saved in");
  // Every step overflowed: 16 halvings from 65536 to the floor of 1, then 3 at the floor.
  std::vector<std::string> saved = train::list_checkpoints(dir.path.string());
  REQUIRE(saved.size() == 1);
  train::CheckpointData state = train::load_checkpoint(saved[0]);
  CHECK(state.trainer_state["scaler"]["scale"].get<double>() == 1.0);
  CHECK(state.trainer_state["skipped_steps"].get<std::int64_t>() == 19);
  CHECK(state.trainer_state["scheduler_steps"].get<std::int64_t>() == 0);  // the schedule never moved
  CHECK(state.optimizer.at("step").item() == 0);                          // nor AdamW's step count
  for (auto& [name, t] : state.model)
    for (double v : t.to_vector()) REQUIRE(std::isfinite(v));
  // No update was ever applied: the saved weights are the initial ones.
  check_close(state.model.at("net.1.weight"), w0.to(DType::f32), 1e-3, 1e-3, "weights unchanged");
}

TEST_CASE("the last good state saved at the loss-scale floor counts its windows and resumes") {
  // The poisoned run above: 19 windows overflow, the 19th stops the run. Its checkpoint counts that
  // window as a step and a skipped one, as its scaler state does (Note [Stopping at the loss-scale
  // floor]): 19 steps, 19 skipped, no update.
  manual_seed(6);
  Tensor x = rand({64, 28, 28});
  const Tensor clean_x = x.clone();
  {
    NoGradGuard no_grad;
    x.select(0, 0).fill_(std::numeric_limits<double>::quiet_NaN());
  }
  Tensor y = (rand({64}) * 10.0).to(DType::i64);
  train::TensorDataset poisoned(x, y), clean(clean_x, y);
  TempDir dir;
  train::TrainingArguments args{.output_dir = dir.path.string(), .per_device_train_batch_size = 64,
                                .max_steps = 25, .learning_rate = 1e-3, .logging_steps = 1,
                                .save_strategy = "steps", .save_steps = 1000, .fp16 = true,
                                .loss_scale_floor = 1.0, .max_overflows_at_floor = 3,
                                .use_cpu = true};
  auto train_on = [&](const train::TrainingArguments& a, const train::Dataset& data) {
    std::ostringstream sink;
    train::Trainer trainer(
        [] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {32}}); }, a, data);
    trainer.set_log_stream(&sink);
    return trainer.train();
  };
  const std::string saved = (dir.path / "checkpoint-19").string();
  check_throws_with([&] { train_on(args, poisoned); }, "the last good state is saved in " + saved);
  const train::CheckpointData state = train::load_checkpoint(saved);
  CHECK(state.trainer_state["global_step"] == 19);
  CHECK(state.trainer_state["skipped_steps"] == 19);
  CHECK(state.trainer_state["scaler"]["skipped_steps"] == 19);
  CHECK(state.trainer_state["scheduler_steps"] == 0);
  CHECK(state.optimizer.at("step").item() == 0);
  CHECK(state.trainer_state["loss_sum"].is_number());  // NaN losses filtered out

  // It resumes. On the same data the scaler's state, three overflows at the floor, stops the run
  // at its next overflow, one window on.
  args.resume_from_checkpoint = saved;
  check_throws_with([&] { train_on(args, poisoned); },
                    "the last good state is saved in " + (dir.path / "checkpoint-20").string());
  // With the sample fixed (the same size and order), the run goes on from the last good state.
  const train::TrainOutput out = train_on(args, clean);
  CHECK(out.global_step == 25);
  CHECK(out.skipped_steps == 19);
  const train::CheckpointData end = train::load_checkpoint((dir.path / "checkpoint-25").string());
  CHECK(end.optimizer.at("step").item() == 6);
  CHECK(end.trainer_state["scheduler_steps"] == 6);
}

TEST_CASE("16-bit gradient accumulators are selectable and the planner charges them") {
  manual_seed(8);
  train::TensorDataset data(rand({64, 28, 28}), (rand({64}) * 10.0).to(DType::i64));
  auto plan_for = [&](const std::string& grad_dtype) {
    TempDir dir;
    train::Trainer trainer([] { return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64}}); },
                           {.output_dir = dir.path.string(), .per_device_train_batch_size = 16, .memory_budget = 64 << 20,
                            .max_steps = 2, .gradient_accumulation_dtype = grad_dtype, .bf16 = true, .use_cpu = true},
                           data);
    std::ostringstream sink;
    trainer.set_log_stream(&sink);
    trainer.train();
    // The plan holds in both cases: what the run measured is what the planner predicted.
    std::ifstream in(dir.path / "log.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (!j.contains("event")) CHECK(j["measured_peak"].get<std::int64_t>() == trainer.plan().predicted_peak);
    }
    return trainer.plan();
  };
  const train::MemoryPlan f32 = plan_for("f32"), bf16 = plan_for("bf16");
  const std::int64_t params = 784 * 64 + 64 + 64 * 10 + 10;
  CHECK(f32.breakdown.gradients >= params * 4);
  CHECK(bf16.breakdown.gradients >= params * 2);
  CHECK(bf16.breakdown.gradients < params * 2 + 1024);
  check_throws_with([] { train::TrainingArguments{.gradient_accumulation_dtype = "f8"}.validate(); },
                    "gradient_accumulation_dtype must be f32, f16 or bf16");
  // f16 sums hold gradients only under loss scaling.
  for (const bool bf16 : {false, true}) {
    check_throws_with([&] { train::TrainingArguments{.gradient_accumulation_dtype = "f16", .bf16 = bf16}.validate(); },
                      "gradient_accumulation_dtype f16 needs fp16");
  }
  train::TrainingArguments{.fp16 = true, .gradient_accumulation_dtype = "f16"}.validate();
}
