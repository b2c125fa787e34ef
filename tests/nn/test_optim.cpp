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

TEST_CASE("clip_grad_norm_ with non-finite gradients does what torch does, or refuses") {
  Tiny m;
  optim::ParamStore store(m);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  Tensor grads(store.grads());
  auto values = [&] { return grads.to_vector(); };
  // torch 1.13: an infinite norm gives the coefficient 0, so finite gradients become 0 and the
  // infinite one 0 * inf = NaN; a NaN norm is not clamped and makes every gradient NaN.
  grads.copy_(from_vector({3, inf, 0, 0, 0, 1}, {6}, {.dtype = DType::f64}));
  CHECK(std::isinf(optim::clip_grad_norm_(store, 1.0)));
  std::vector<double> v = values();
  CHECK(std::isnan(v[1]));
  for (int i : {0, 2, 3, 4, 5}) CHECK(v[i] == 0.0);
  grads.copy_(from_vector({3, nan, 0, 0, 0, 1}, {6}, {.dtype = DType::f64}));
  CHECK(std::isnan(optim::clip_grad_norm_(store, 1.0)));
  for (double x : values()) CHECK(std::isnan(x));
  // error_if_nonfinite: refused, naming the parameter, and the gradients are left as they were.
  // The arena is [w (4) | b (2)], the decay group first: element 4 is b's first.
  REQUIRE(store.entries()[1].name == "b");
  grads.copy_(from_vector({3, 4, 0, 0, nan, 1}, {6}, {.dtype = DType::f64}));
  check_throws_with([&] { optim::clip_grad_norm_(store, 1.0, optim::NonFiniteNorm::Error); },
                    "total norm is nan ('b' holds the first non-finite gradient)");
  v = values();
  CHECK(v[0] == 3.0);
  CHECK(v[1] == 4.0);
  CHECK(std::isnan(v[4]));
  // Finite gradients are clipped as before with the check on.
  grads.copy_(from_vector({3, 4, 0, 0, 0, 0}, {6}, {.dtype = DType::f64}));
  CHECK(optim::clip_grad_norm_(store, 1.0, optim::NonFiniteNorm::Error) == doctest::Approx(5.0));
  // Finite gradients whose squares overflow the f64 sum: the norm is infinite, refused as torch
  // refuses it, and nothing is scaled.
  grads.copy_(from_vector({1e200, 1e200, 0, 0, 0, 0}, {6}, {.dtype = DType::f64}));
  check_throws_with([&] { optim::clip_grad_norm_(store, 1.0, optim::NonFiniteNorm::Error); },
                    "total norm is inf (every gradient is finite, but their sum of squares overflows)");
  CHECK(values()[0] == 1e200);
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

namespace {
// One f32 parameter of two elements, for the rounding of f32 steps.
class Pair32 : public nn::Module {
 public:
  Pair32() {
    w = from_vector({0.5, -1.0}, {2}, {.dtype = DType::f32});
    register_parameter("w", &w);
  }
  Tensor w;
};
}  // namespace

TEST_CASE("f32 optimizers round 1 - beta and 1 - dampening as torch does") {
  // torch.optim passes alpha = 1 - beta1, value = 1 - beta2 and alpha = 1 - dampening as Python
  // floats: computed in double, rounded once to f32. Rounding beta first and subtracting in f32
  // gives 1 - 0.999f = 0.00099998713 instead of 0.001f, a 1.3e-5 bias in every exp_avg_sq.
  {
    Pair32 m;
    optim::ParamStore store(m);
    optim::AdamW opt(store, {.lr = 1.0, .weight_decay = 0.0});
    Tensor(store.grads()).copy_(from_vector({1.0, -2.0}, {2}, {.dtype = DType::f32}));
    opt.step();  // from zero moments: m = (1 - b1) g, v = (1 - b2) g^2, each rounded to f32
    const auto state = opt.state_dict();
    const float a1 = static_cast<float>(1.0 - 0.9), a2 = static_cast<float>(1.0 - 0.999);
    CHECK(state.at("exp_avg").to_vector() ==
          std::vector<double>{a1 * 1.0f, a1 * -2.0f});
    CHECK(state.at("exp_avg_sq").to_vector() ==
          std::vector<double>{a2 * 1.0f * 1.0f, a2 * -2.0f * -2.0f});
  }
  {
    Pair32 m;
    optim::ParamStore store(m);
    optim::SGD opt(store, {.lr = 1.0, .momentum = 0.5, .dampening = 0.99});
    // buf = g1, then 0.5 buf + (1 - 0.99) g2; a small g1 keeps the second term's bits visible.
    for (double g : {0.0009765625, 1.0}) {
      Tensor(store.grads()).copy_(from_vector({g, g}, {2}, {.dtype = DType::f32}));
      opt.step();
    }
    const float buf = 0.5f * 0.0009765625f + static_cast<float>(1.0 - 0.99) * 1.0f;
    CHECK(opt.state_dict().at("momentum_buffer").to_vector() == std::vector<double>{buf, buf});
  }
}

TEST_CASE("optimizers refuse the hyperparameters torch.optim refuses") {
  Tiny m;
  optim::ParamStore store(m);
  check_throws_with([&] { optim::AdamW(store, {.weight_decay = -0.1}); },
                    "[AdamW] weight_decay must be >= 0, got -0.1");
  check_throws_with([&] { optim::AdamW(store, {.weight_decay = std::nan("")}); },
                    "[AdamW] weight_decay must be >= 0");
  check_throws_with([&] { optim::SGD(store, {.momentum = -0.5}); },
                    "[SGD] momentum must be >= 0, got -0.5");
  check_throws_with([&] { optim::SGD(store, {.weight_decay = -0.1}); },
                    "[SGD] weight_decay must be >= 0, got -0.1");
}

TEST_CASE("an optimizer state's step must be a whole number >= 0") {
  Tiny m;
  optim::ParamStore store(m);
  optim::AdamW adamw(store);
  optim::SGD sgd(store, {.momentum = 0.9});
  for (optim::Optimizer* opt : {static_cast<optim::Optimizer*>(&adamw),
                                static_cast<optim::Optimizer*>(&sgd)}) {
    const std::string name = opt == &adamw ? "AdamW" : "SGD";
    CAPTURE(name);
    auto state = opt->state_dict();
    for (double bad : {-1.0, 0.5, std::nan(""), 1e300}) {
      CAPTURE(bad);
      state["step"] = scalar_tensor(bad, {.dtype = DType::f64});
      check_throws_with([&] { opt->load_state_dict(state); },
                        "[" + name + "] state 'step' must be a whole number >= 0");
    }
    state["step"] = from_vector({1, 2}, {2}, {.dtype = DType::i64});
    check_throws_with([&] { opt->load_state_dict(state); }, "must hold one value");
    state["step"] = scalar_tensor(7, {.dtype = DType::i64});
    opt->load_state_dict(state);
    CHECK(opt->step_count() == 7);
  }
}

TEST_CASE("a second LRScheduler starts from the optimizer's initial lr, as torch's initial_lr") {
  Tiny m;
  optim::ParamStore store(m);
  optim::AdamW opt(store, {.lr = 0.1});
  optim::LRScheduler warm(opt, {.type = optim::ScheduleType::Linear, .warmup_steps = 5,
                                .total_steps = 10});
  CHECK(opt.lr() == 0.0);  // step 0 of the warm-up
  optim::LRScheduler cosine(opt, {.type = optim::ScheduleType::Cosine, .total_steps = 10});
  CHECK(opt.lr() == 0.1);
  for (int i = 0; i < 3; ++i) cosine.step();
  CHECK(opt.lr() == doctest::Approx(0.1 * 0.5 * (1.0 + std::cos(M_PI * 0.3))));

  auto state = cosine.state_dict();
  state["steps"] = scalar_tensor(-5, {.dtype = DType::i64});
  check_throws_with([&] { cosine.load_state_dict(state); },
                    "[LRScheduler] state 'steps' must be a whole number >= 0, got -5");
  state = cosine.state_dict();
  state["base_lr"] = scalar_tensor(-0.1, {.dtype = DType::f64});
  check_throws_with([&] { cosine.load_state_dict(state); },
                    "[LRScheduler] state 'base_lr' must be a finite lr >= 0, got -0.1");
}

namespace {
std::vector<double> values(const Tensor& t) { return t.to_vector(); }
}  // namespace

TEST_CASE("ParamStore: a frozen parameter stays frozen, gets no gradient and no update") {
  // torch: a parameter with requires_grad False has grad None and AdamW and SGD skip it.
  for (DType compute : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(compute));
    for (int optimizer = 0; optimizer < 2; ++optimizer) {
      CAPTURE(optimizer);
      manual_seed(3);
      nn::Linear lin(2, 2);
      lin.weight.requires_grad_(false);
      const std::vector<double> weight = values(lin.weight), bias = values(lin.bias);
      optim::ParamStore store(lin, {.decay = optim::DecayRule::All, .compute_dtype = compute});
      CHECK_FALSE(lin.weight.requires_grad());
      CHECK_FALSE(lin.weight.grad().defined());
      CHECK(lin.weight.dtype() == compute);  // converted, so the forward reads one dtype
      CHECK(lin.bias.requires_grad());
      CHECK(store.numel() == 6);
      CHECK(store.trainable_numel() == 2);
      CHECK(store.grads().numel() == 2);
      CHECK(store.entries().back().name == "weight");
      CHECK(store.entries().back().frozen);
      check_throws_with([&] { store.grad_of(store.entries().back()); }, "'weight' is frozen");
      std::unique_ptr<optim::Optimizer> opt;
      if (optimizer == 0) {
        opt = std::make_unique<optim::AdamW>(store,
                                             optim::AdamWConfig{.lr = 0.1, .weight_decay = 0.5});
      } else {
        opt = std::make_unique<optim::SGD>(
            store, optim::SGDConfig{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.5});
      }
      for (int step = 0; step < 2; ++step) {
        sum(lin.forward(ones({1, 2}, {.dtype = compute}))).backward();
        CHECK_FALSE(lin.weight.grad().defined());
        CHECK(store.grad_norm().norm == doctest::Approx(std::sqrt(2.0)));
        CHECK(optim::clip_grad_norm_(store, 1.0) == doctest::Approx(std::sqrt(2.0)));
        CHECK(store.first_non_finite().empty());
        opt->step();
        opt->zero_grad();
      }
      // Bit for bit: no update and no weight decay (its master, unrounded, likewise).
      CHECK(values(store.master_state().at("weight")) == weight);
      CHECK(values(lin.weight) == values(from_vector(weight, {2, 2}).to(compute)));
      CHECK(values(store.master_state().at("bias")) != bias);
    }
  }
}

TEST_CASE("ParamStore: frozen parameters go through master_state and load_master_state") {
  manual_seed(4);
  nn::Linear lin(2, 2);
  lin.bias.requires_grad_(false);
  optim::ParamStore store(lin, {.compute_dtype = DType::bf16});
  std::map<std::string, Tensor> saved;
  for (auto& [name, t] : store.master_state()) saved[name] = t.clone();
  REQUIRE(saved.size() == 2);
  CHECK(saved.at("bias").dtype() == DType::f32);
  saved.at("bias") = from_vector({1.0 + 1.0 / 1024, -3.0}, {2});  // not a bf16 value
  store.load_master_state(saved);
  check_close(store.master_state().at("bias"), {1.0 + 1.0 / 1024, -3.0}, 0, 0, "frozen master");
  check_close(lin.bias, {1.0, -3.0}, 0, 0, "frozen working copy, rounded");
  CHECK_FALSE(lin.bias.requires_grad());
}

TEST_CASE("Module::zero_grad zeroes in place, so gradients stay in the store's arena") {
  // torch 1.13: Module.zero_grad() defaults to set_to_none=False.
  nn::Linear lin(2, 1, {.bias = false});
  const std::vector<double> before = values(lin.weight);
  {
    optim::ParamStore store(lin);
    optim::SGD opt(store, {.lr = 1.0});
    lin.zero_grad();
    CHECK(lin.weight.grad().same_storage(store.grads()));
    sum(lin.forward(ones({1, 2}))).backward();
    opt.step();
    // w - lr * 1 per element, in f32.
    const std::vector<double> stepped{static_cast<float>(before[0]) - 1.0f,
                                      static_cast<float>(before[1]) - 1.0f};
    check_close(lin.weight, stepped, 0, 0, "stepped on the gradient");
    sum(lin.forward(ones({1, 2}))).backward();
    lin.zero_grad();
    check_close(store.grads(), {0, 0}, 0, 0, "zeroed in place");
    check_throws_with([&] { lin.zero_grad(nn::GradReset::SetToNone); },
                      "[Module::zero_grad] the gradient of 'weight' is a view of a ParamStore's "
                      "arena");
    CHECK(lin.weight.grad().same_storage(store.grads()));
  }
  // Without a store, SetToNone drops the gradient as torch's set_to_none=True.
  sum(lin.forward(ones({1, 2}))).backward();
  lin.zero_grad(nn::GradReset::SetToNone);
  CHECK_FALSE(lin.weight.grad().defined());
}

TEST_CASE("Module::to is refused while a ParamStore owns the parameters, and free again after") {
  nn::Linear lin(2, 2);
  {
    optim::ParamStore store(lin);
    CHECK(lin.has_parameter_owner());
    check_throws_with([&] { lin.to(DType::f64); },
                      "move or cast the model before building its ParamStore and optimizer");
    check_throws_with([&] { lin.to(kMeta); }, "belongs to a ParamStore");
    lin.to(DType::f32);  // nothing would change: allowed
    lin.to(kCPU);
    CHECK(lin.weight.same_storage(store.weights()));
  }
  CHECK_FALSE(lin.has_parameter_owner());
  lin.to(DType::f64);  // the store is gone: the module is free
  CHECK(lin.weight.dtype() == DType::f64);
  CHECK(lin.weight.requires_grad());

  // A module destroyed before its store leaves a store that still works on its own arena.
  auto owned = std::make_unique<nn::Linear>(2, 2);
  optim::ParamStore store(*owned);
  optim::AdamW opt(store);
  sum(owned->forward(ones({1, 2}))).backward();
  owned.reset();
  opt.step();
  store.zero_grad();
  CHECK(store.master_state().size() == 2);
}

TEST_CASE("Module::load_state_dict under f32 masters loads the masters, unrounded") {
  nn::Linear lin(2, 1, {.bias = false});
  optim::ParamStore store(lin, {.compute_dtype = DType::bf16});
  optim::SGD opt(store, {.lr = 0.0});
  nn::StateDict sd;
  sd["weight"] = full({1, 2}, 7.0);
  lin.load_state_dict(sd);
  sum(lin.forward(ones({1, 2}, {.dtype = DType::bf16}))).backward();
  opt.step();
  check_close(lin.weight, {7.0, 7.0}, 0, 0, "working copy after a step");
  // An f32 value goes to the master as it is; the working copy is its bf16 rounding.
  sd["weight"] = from_vector({1.0 + 1.0 / 1024, -2.0}, {1, 2});
  lin.load_state_dict(sd);
  check_close(store.master_state().at("weight"), {1.0 + 1.0 / 1024, -2.0}, 0, 0, "master");
  check_close(lin.weight, {1.0, -2.0}, 0, 0, "working copy");
  opt.step();
  check_close(store.master_state().at("weight"), {1.0 + 1.0 / 1024, -2.0}, 0, 0, "master kept");
}

namespace {
// A store may be built on a child: the guards hold from the parent too.
class Parent : public nn::Module {
 public:
  Parent() {
    child = register_module("child", std::make_shared<nn::Linear>(2, 1, nn::LinearOptions{.bias = false}));
    own = full({2}, 0.5);
    register_parameter("own", &own);
  }
  std::shared_ptr<nn::Linear> child;
  Tensor own;
};
}  // namespace

TEST_CASE("a ParamStore on a child is guarded from the parent, and one model takes one store") {
  Parent parent;
  optim::ParamStore store(*parent.child, {.compute_dtype = DType::bf16});
  optim::SGD opt(store, {.lr = 0.0});
  CHECK(parent.has_parameter_owner());
  // The parent's to() would move the child's weight out of the arena; its own parameter alone
  // is not the store's, but the move is of the whole tree.
  check_throws_with([&] { parent.to(DType::f64); }, "parameter 'child.weight'");
  CHECK(parent.child->weight.same_storage(store.weights()));
  // load_state_dict from the parent loads the child's master, unrounded, and the parent's own.
  nn::StateDict sd;
  sd["child.weight"] = from_vector({1.0 + 1.0 / 1024, -2.0}, {1, 2});
  sd["own"] = full({2}, 3.0);
  parent.load_state_dict(sd);
  check_close(store.master_state().at("weight"), {1.0 + 1.0 / 1024, -2.0}, 0, 0, "master");
  check_close(parent.own, {3.0, 3.0}, 0, 0, "the parent's own parameter");
  sum(parent.child->forward(ones({1, 2}, {.dtype = DType::bf16}))).backward();
  check_throws_with([&] { parent.zero_grad(nn::GradReset::SetToNone); },
                    "the gradient of 'child.weight' is a view of a ParamStore's arena");
  opt.step();
  check_close(parent.child->weight, {1.0, -2.0}, 0, 0, "working copy after a step");
  // The state_dict's own working copies loaded back leave the masters as they were.
  parent.load_state_dict(parent.state_dict());
  check_close(store.master_state().at("weight"), {1.0 + 1.0 / 1024, -2.0}, 0, 0,
              "master after a round trip");
  // A second store, on the child or on the parent, is refused.
  check_throws_with([&] { optim::ParamStore again(*parent.child); },
                    "[ParamStore] the model's parameters already belong to a live ParamStore");
  check_throws_with([&] { optim::ParamStore again(parent); },
                    "[ParamStore] the model's parameters already belong to a live ParamStore");
}

namespace {
// Two layers of one shape: freezing one or the other leaves the same trainable size.
class TwoLayers : public nn::Module {
 public:
  TwoLayers() {
    a = register_module("a", std::make_shared<nn::Linear>(3, 3, nn::LinearOptions{.bias = false}));
    b = register_module("b", std::make_shared<nn::Linear>(3, 3, nn::LinearOptions{.bias = false}));
  }
  Tensor forward(const Tensor& x) { return b->forward(a->forward(x)); }
  std::shared_ptr<nn::Linear> a, b;
};
}  // namespace

TEST_CASE("an optimizer state loads only into the parameter layout it was saved in") {
  // Frozen a, then frozen b: the moment arenas have one size, and a's moments would become b's.
  TwoLayers first;
  first.a->weight.requires_grad_(false);
  optim::ParamStore first_store(first);
  optim::AdamW first_opt(first_store);
  sum(first.forward(ones({1, 3}))).backward();
  first_opt.step();
  const auto saved = first_opt.state_dict();
  CHECK(saved.at("exp_avg").numel() == 9);

  TwoLayers second;
  second.b->weight.requires_grad_(false);
  optim::ParamStore second_store(second);
  optim::AdamW second_opt(second_store);
  check_throws_with([&] { second_opt.load_state_dict(saved); },
                    "[AdamW] the state was saved for another parameter layout (which parameters "
                    "are frozen, or decay, differs): saved 'b.weight 0 9 decay', now 'a.weight 0 9 "
                    "decay'");
  // The same layout loads, and a state saved without a layout is taken as it is.
  TwoLayers same;
  same.a->weight.requires_grad_(false);
  optim::ParamStore same_store(same);
  optim::AdamW same_opt(same_store);
  same_opt.load_state_dict(saved);
  CHECK(same_opt.step_count() == 1);
  auto without = saved;
  without.erase("layout");
  second_opt.load_state_dict(without);
  // SGD's momentum is checked the same way.
  optim::SGD first_sgd(first_store, {.lr = 0.1, .momentum = 0.9});
  optim::SGD second_sgd(second_store, {.lr = 0.1, .momentum = 0.9});
  check_throws_with([&] { second_sgd.load_state_dict(first_sgd.state_dict()); },
                    "[SGD] the state was saved for another parameter layout");
}

TEST_CASE("unfreezing a parameter after its store was built is refused at the next step") {
  TwoLayers m;
  m.a->weight.requires_grad_(false);
  optim::ParamStore store(m);
  optim::AdamW opt(store);
  sum(m.forward(ones({1, 3}))).backward();
  opt.step();
  m.a->weight.requires_grad_(true);  // torch would need a new optimizer too
  sum(m.forward(ones({1, 3}))).backward();
  check_throws_with([&] { opt.step(); },
                    "[AdamW] 'a.weight' was frozen when its ParamStore was built and now requires "
                    "grad");
}

TEST_CASE("an optimizer over a model whose every parameter is frozen is refused") {
  TwoLayers m;
  m.a->weight.requires_grad_(false);
  m.b->weight.requires_grad_(false);
  optim::ParamStore store(m);
  CHECK(store.trainable_numel() == 0);
  check_throws_with([&] { optim::AdamW opt(store); },
                    "[AdamW] every parameter of the model is frozen (none requires grad): nothing "
                    "to optimize");
  check_throws_with([&] { optim::SGD opt(store); }, "[SGD] every parameter of the model is frozen");
}
