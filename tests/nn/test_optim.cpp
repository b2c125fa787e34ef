#include <cmath>

#include "nn/models.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {
// Two parameters: a matrix (decays) and a bias (does not).
class Tiny : public nn::Module {
 public:
  Tiny() {
    w = from_vector({0.5, -1.0, 2.0, 0.25}, {2, 2}, {.dtype = DType::f64});
    b = from_vector({0.1, -0.2}, {2}, {.dtype = DType::f64});
    register_parameter("b", &b);
    register_parameter("w", &w);
  }
  Tensor w, b;
};
}  // namespace

TEST_CASE("ParamStore: one arena, decay group first, grads land in the arena") {
  Tiny m;
  optim::ParamStore store(m);
  CHECK(store.numel() == 6);
  CHECK(store.decay_numel() == 4);
  CHECK(store.entries()[0].name == "w");
  CHECK(m.w.same_storage(store.weights()));
  CHECK(m.b.same_storage(store.weights()));
  check_close(store.weights(), {0.5, -1.0, 2.0, 0.25, 0.1, -0.2}, 0, 0, "arena");
  Tensor x = from_vector({1.0, 2.0}, {2}, {.dtype = DType::f64});
  sum(matmul(m.w, x) + m.b).backward();
  // d/dw = outer(ones, x), d/db = ones; the arena holds them without any copy.
  check_close(store.grads(), {1, 2, 1, 2, 1, 1}, 0, 0, "grads");
  sum(matmul(m.w, x) + m.b).backward();
  check_close(store.grads(), {2, 4, 2, 4, 2, 2}, 0, 0, "grads accumulate");
  store.zero_grad();
  check_close(store.grads(), {0, 0, 0, 0, 0, 0}, 0, 0, "zero_grad");
}

TEST_CASE("AdamW follows torch.optim.AdamW element by element") {
  Tiny m;
  optim::ParamStore store(m);
  optim::AdamW opt(store, {.lr = 0.1, .weight_decay = 0.5});
  std::vector<double> p = store.weights().to_vector(), mom(6, 0.0), var(6, 0.0);
  const std::vector<std::vector<double>> grads = {{1, -2, 3, 0.5, -1, 0.25}, {0.1, 0.2, -0.3, 4, 2, -1}};
  for (int t = 1; t <= 2; ++t) {
    Tensor(store.grads()).copy_(from_vector(grads[t - 1], {6}, {.dtype = DType::f64}));
    opt.step();
    for (int i = 0; i < 6; ++i) {  // the formula of REFERENCE.md
      const double g = grads[t - 1][i];
      if (i < 4) p[i] -= 0.1 * 0.5 * p[i];
      mom[i] = 0.9 * mom[i] + 0.1 * g;
      var[i] = 0.999 * var[i] + 0.001 * g * g;
      const double denom = std::sqrt(var[i]) / std::sqrt(1 - std::pow(0.999, t)) + 1e-8;
      p[i] -= 0.1 / (1 - std::pow(0.9, t)) * mom[i] / denom;
    }
    check_close(store.weights(), p, 1e-14, 1e-15, "adamw step " + std::to_string(t));
  }
  CHECK(opt.step_count() == 2);
  auto state = opt.state_dict();
  check_close(state.at("exp_avg"), mom, 1e-14, 1e-15, "exp_avg");
  // A fresh optimizer loaded from the state continues identically.
  optim::AdamW again(store, {.lr = 0.1, .weight_decay = 0.5});
  again.load_state_dict(state);
  CHECK(again.step_count() == 2);
}

TEST_CASE("SGD with momentum, dampening, Nesterov and weight decay follows torch.optim.SGD") {
  for (bool nesterov : {false, true}) {
    Tiny m;
    optim::ParamStore store(m);
    optim::SGD opt(store, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = nesterov});
    std::vector<double> p = store.weights().to_vector(), buf(6, 0.0);
    const std::vector<double> g = {1, -2, 3, 0.5, -1, 0.25};
    for (int t = 0; t < 3; ++t) {
      Tensor(store.grads()).copy_(from_vector(g, {6}, {.dtype = DType::f64}));
      opt.step();
      for (int i = 0; i < 6; ++i) {
        double d = g[i] + (i < 4 ? 0.01 * p[i] : 0.0);
        buf[i] = t == 0 ? d : 0.9 * buf[i] + d;
        d = nesterov ? d + 0.9 * buf[i] : buf[i];
        p[i] -= 0.1 * d;
      }
      check_close(store.weights(), p, 1e-14, 1e-15, "sgd");
    }
  }
}

TEST_CASE("LR schedules match Hugging Face's formulas") {
  using optim::ScheduleType;
  optim::ScheduleConfig lin{.type = ScheduleType::Linear, .warmup_steps = 10, .total_steps = 110};
  CHECK(optim::lr_multiplier(lin, 0) == 0.0);
  CHECK(optim::lr_multiplier(lin, 5) == 0.5);
  CHECK(optim::lr_multiplier(lin, 10) == 1.0);
  CHECK(optim::lr_multiplier(lin, 60) == doctest::Approx(0.5));
  CHECK(optim::lr_multiplier(lin, 110) == 0.0);
  optim::ScheduleConfig cos{.type = ScheduleType::Cosine, .warmup_steps = 0, .total_steps = 100};
  CHECK(optim::lr_multiplier(cos, 50) == doctest::Approx(0.5));
  CHECK(optim::lr_multiplier(cos, 100) == doctest::Approx(0.0));
  CHECK(optim::lr_multiplier({.type = ScheduleType::Constant}, 1000) == 1.0);
  check_throws_with([] { optim::parse_schedule("bogus"); }, "unknown schedule 'bogus'");
}

TEST_CASE("clip_grad_norm_ scales to max_norm and returns the norm") {
  Tiny m;
  optim::ParamStore store(m);
  Tensor(store.grads()).copy_(from_vector({3, 4, 0, 0, 0, 0}, {6}, {.dtype = DType::f64}));
  const double norm = optim::clip_grad_norm_(store, 1.0);
  CHECK(norm == doctest::Approx(5.0));
  CHECK(store.grad_norm().norm == doctest::Approx(1.0).epsilon(1e-6));
}

TEST_CASE("LRScheduler state_dict restores the position and the learning rate") {
  Tiny m;
  optim::ParamStore store(m);
  optim::AdamW opt(store, {.lr = 0.1});
  optim::LRScheduler sched(opt, {.type = optim::ScheduleType::Cosine, .warmup_steps = 2, .total_steps = 10});
  for (int i = 0; i < 5; ++i) sched.step();
  auto state = sched.state_dict();
  optim::AdamW opt2(store, {.lr = 0.1});
  optim::LRScheduler again(opt2, {.type = optim::ScheduleType::Cosine, .warmup_steps = 2, .total_steps = 10});
  again.load_state_dict(state);
  CHECK(again.steps() == 5);
  CHECK(opt2.lr() == opt.lr());
  check_throws_with([&] { again.load_state_dict({}); }, "[LRScheduler] state needs");
}
