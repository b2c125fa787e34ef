// The autograd engine: gradients of composite graphs against hand-derived formulas, accumulation
// (plain and weighted, into arena views), retain_graph, grad mode, the in-place and version
// checks, microbatch::grad, and activation checkpointing (with parameters and dropout inside).
#include <cmath>

#include "core/allocator.h"
#include "core/rng.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

Tensor leaf(const std::vector<double>& values, const Shape& shape, DType dtype = DType::f64) {
  return from_vector(values, shape, {.dtype = dtype, .requires_grad = true});
}

void clear_grads(std::initializer_list<Tensor> tensors) {
  for (const Tensor& t : tensors) t.set_grad({});
}

}  // namespace

// ---- gradients ---------------------------------------------------------------------------------

TEST_CASE("backward: scalar chain and diamond against hand-derived derivatives") {
  // y = a b + a^2, z = y^2: dz/da = 2y (b + 2a), dz/db = 2y a. At a = 2, b = 3: y = 10.
  Tensor a = leaf({2}, {});
  Tensor b = leaf({3}, {});
  Tensor y = a * b + a * a;
  Tensor z = y * y;
  z.backward();
  CHECK(z.item() == 100.0);
  CHECK(a.grad().item() == 140.0);
  CHECK(b.grad().item() == 40.0);
  CHECK(a.grad().dtype() == DType::f64);
  CHECK(a.grad().shape() == Shape{});

  // Two paths from x meet again: c = (2x)(3x) = 6x^2, dc/dx = 12x.
  Tensor x = leaf({1, -2, 0.5}, {3});
  sum((x * 2.0) * (x * 3.0)).backward();
  CHECK(x.grad().to_vector() == std::vector<double>{12, -24, 6});

  // A broadcast scalar parameter collects the sum over the elements it touched.
  Tensor s = leaf({0.5}, {1});
  Tensor v = leaf({1, 2, 3}, {3});
  sum((v + s) * v).backward();  // d/ds = sum(v) = 6, d/dv = 2v + s
  CHECK(s.grad().to_vector() == std::vector<double>{6});
  CHECK(v.grad().to_vector() == std::vector<double>{2.5, 4.5, 6.5});
}

TEST_CASE("backward: a small network against hand-derived gradients") {
  // loss = sum(relu(x W^T + b) * c) + sum(x * x), with x (2, 3), W (2, 3), b (2,), c (2, 2).
  const std::vector<double> xv = {1, 2, -1, 0.5, -1, 2};
  const std::vector<double> wv = {1, 0, 2, -1, 1, 1};
  const std::vector<double> bv = {0.5, 0.25};
  const std::vector<double> cv = {1, -2, 0.5, 3};
  Tensor x = leaf(xv, {2, 3}), w = leaf(wv, {2, 3}), b = leaf(bv, {2});
  Tensor c = from_vector(cv, {2, 2}, {.dtype = DType::f64});
  Tensor loss = sum(relu(linear(x, w, b)) * c) + sum(x * x);
  loss.backward();

  // The same by hand: h = x W^T + b, dh = c * (h > 0), dW = dh^T x, db = sum_i dh, dx = dh W + 2x.
  double h[2][2], dh[2][2], expect_loss = 0;
  for (int i = 0; i < 2; ++i) {
    for (int o = 0; o < 2; ++o) {
      h[i][o] = bv[o];
      for (int k = 0; k < 3; ++k) h[i][o] += xv[i * 3 + k] * wv[o * 3 + k];
      REQUIRE(std::abs(h[i][o]) > 0.1);  // away from relu's kink
      dh[i][o] = h[i][o] > 0 ? cv[i * 2 + o] : 0.0;
      expect_loss += std::max(h[i][o], 0.0) * cv[i * 2 + o];
    }
  }
  std::vector<double> dx(6), dw(6, 0.0), db(2, 0.0);
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 3; ++k) {
      dx[i * 3 + k] = 2 * xv[i * 3 + k];
      expect_loss += xv[i * 3 + k] * xv[i * 3 + k];
      for (int o = 0; o < 2; ++o) {
        dx[i * 3 + k] += dh[i][o] * wv[o * 3 + k];
        dw[o * 3 + k] += dh[i][o] * xv[i * 3 + k];
      }
    }
    for (int o = 0; o < 2; ++o) db[o] += dh[i][o];
  }
  check_close(loss, {expect_loss}, 1e-12, 1e-12, "loss");
  check_close(x.grad(), dx, 1e-12, 1e-12, "dx");
  check_close(w.grad(), dw, 1e-12, 1e-12, "dW");
  check_close(b.grad(), db, 1e-12, 1e-12, "db");
  // One relu is off (h[0][0] = -0.5), so its row of c must not reach W's gradient.
  CHECK(h[0][0] < 0);
  CHECK(c.grad().defined() == false);  // a constant gets no gradient
}

TEST_CASE("backward: an explicit gradient for a non-scalar output, and its checks") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = x * 3.0;
  check_throws_with([&] { y.backward(); },
                    "grad can be created implicitly only for a one-element output, got shape (3,)");
  const Tensor wrong_shape = from_vector({1, 1}, {2}, {.dtype = DType::f64});
  check_throws_with([&] { y.backward(wrong_shape); },
                    "gradient shape (2,) differs from output shape (3,)");
  y.backward(from_vector({1, -1, 0.5}, {3}, {.dtype = DType::f64}));
  CHECK(x.grad().to_vector() == std::vector<double>{3, -3, 1.5});

  Tensor plain = from_vector({1, 2}, {2});
  check_throws_with([&] { sum(plain).backward(); }, "does not require grad");
}

TEST_CASE("backward: gradients accumulate over two backward calls") {
  Tensor x = leaf({1, -2, 3}, {3});
  Tensor w = leaf({0.5, 0.5, 2}, {3});
  sum(x * w * x).backward();
  const std::vector<double> once = x.grad().to_vector();
  CHECK(once == std::vector<double>{1, -2, 12});  // 2 w x
  const Tensor grad_tensor = x.grad();
  sum(x * w * x).backward();  // a new graph, same leaves
  CHECK(x.grad().to_vector() == std::vector<double>{2, -4, 24});
  CHECK(x.grad().same_storage(grad_tensor));  // added in place, not replaced
  // 2 x^2, twice
  CHECK(w.grad().to_vector() == std::vector<double>{2, 8, 18});
}

TEST_CASE("GradWeightGuard: grad += w * g, exactly") {
  // Dyadic values keep every product and sum exact in f32, so equality must hold bit for bit.
  auto losses = [](const Tensor& x) {
    return std::vector<Tensor>{sum(x * x), sum(x * 3.0), sum(x * x * x)};
  };
  Tensor x = leaf({0.5, -1.25, 2.0}, {3}, DType::f32);
  const double weights[] = {0.25, 0.25, 0.5};
  for (int i = 0; i < 3; ++i) {
    GradWeightGuard weight(weights[i]);
    CHECK(grad_weight() == weights[i]);
    losses(x)[i].backward();
  }
  CHECK(grad_weight() == 1.0);
  const std::vector<double> weighted = x.grad().to_vector();

  Tensor y = leaf({0.5, -1.25, 2.0}, {3}, DType::f32);
  std::vector<Tensor> l = losses(y);
  (l[0] * 0.25 + l[1] * 0.25 + l[2] * 0.5).backward();
  CHECK(weighted == y.grad().to_vector());
  // By hand: 0.25 (2x) + 0.25 (3) + 0.5 (3x^2).
  CHECK(weighted == std::vector<double>{1.375, 2.46875, 7.75});

  // Nested guards restore the outer weight.
  {
    GradWeightGuard outer(0.5);
    {
      GradWeightGuard inner(0.125);
      CHECK(grad_weight() == 0.125);
    }
    CHECK(grad_weight() == 0.5);
  }
  CHECK(grad_weight() == 1.0);
}

TEST_CASE("gradients land in place in a view of a flat arena") {
  Tensor arena = zeros({6}, {.dtype = DType::f64});
  Tensor x = leaf({1, 2, 3}, {3});
  x.set_grad(arena.slice(0, 2, 5));
  {
    GradWeightGuard half(0.5);
    sum(x * x).backward();  // g = 2x, w = 1/2
  }
  CHECK(arena.to_vector() == std::vector<double>{0, 0, 1, 2, 3, 0});
  CHECK(x.grad().same_storage(arena));
  sum(x * 4.0).backward();
  CHECK(arena.to_vector() == std::vector<double>{0, 0, 5, 6, 7, 0});
  check_throws_with([&] { x.set_grad(zeros({2}, {.dtype = DType::f64})); },
                    "[set_grad] grad shape (2,) differs from tensor shape (3,)");
}

TEST_CASE("backward adds a second gradient into the first only when nothing else holds it") {
  // Note [Summing gradients in place]. x gets two gradients: 2 from x * 2, and from `through`,
  // a node whose backward returns a fresh tensor of `values`, which the test may also keep (a
  // handle the engine must not write through). The node made last runs first, so its gradient is
  // the one the other is added to.
  std::vector<double> values;
  for (int i = 0; i < 37; ++i) values.push_back(0.1 * i - 1.3);
  auto run = [&](DType dt, bool through_first, bool keep, Tensor* kept) {
    Tensor x = from_vector(std::vector<double>(values.size(), 0.7), {37},
                           {.dtype = dt, .requires_grad = true});
    auto through = [&](const Tensor& in) {
      Tensor out = in.detach().clone();
      record("through", {in}, out, [&, dt, keep, kept](const Tensor&) {
        Tensor g = from_vector(values, {37}, {.dtype = dt});
        if (keep) *kept = g;
        return std::vector<Tensor>{g};
      });
      return out;
    };
    // Separate statements: the operands of + are evaluated in no set order.
    Tensor first = through_first ? sum(through(x)) : sum(x * 2.0);
    Tensor second = through_first ? sum(x * 2.0) : sum(through(x));
    Tensor loss = first + second;
    first = second = Tensor();
    const std::int64_t before = memory_stats(kCPU).num_allocs;
    loss.backward();
    return std::pair{x.grad(), memory_stats(kCPU).num_allocs - before};
  };
  for (DType dt : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    for (bool through_first : {false, true}) {
      CAPTURE(through_first);
      Tensor kept;
      const auto [shared_grad, shared_allocs] = run(dt, through_first, true, &kept);
      const auto [own_grad, own_allocs] = run(dt, through_first, false, nullptr);
      // The kept gradient is untouched, and the sums agree bit for bit with the out-of-place one
      // (to_vector is exact for every dtype here, and no value is NaN or -0).
      const Tensor given = from_vector(values, {37}, {.dtype = dt});
      CHECK(kept.to_vector() == given.to_vector());
      CHECK(own_grad.to_vector() == shared_grad.to_vector());
      CHECK(own_grad.to_vector() == (given + full({37}, 2.0, {.dtype = dt})).to_vector());
      // A gradient that `through` hands over first is written in place only when the test does
      // not keep it; one that arrives second is never the target.
      CHECK(shared_allocs - own_allocs == (through_first ? 0 : 1));
    }
  }
}

// ---- graph lifetime and grad mode --------------------------------------------------------------

TEST_CASE("retain_graph allows a second backward; without it a second backward throws") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = sum(x * x);
  y.backward(BackwardOptions{.retain_graph = true});
  y.backward();  // allowed: the graph was kept; this one releases it
  CHECK(x.grad().to_vector() == std::vector<double>{4, 8, 12});
  check_throws_with([&] { y.backward(); }, "a second time");
  check_throws_with([&] { y.backward(); }, "retain_graph");
  CHECK(x.grad().to_vector() == std::vector<double>{4, 8, 12});  // the failed call added nothing

  Tensor z = sum(exp(x));
  z.backward();
  check_throws_with([&] { z.backward(); }, "saved tensors were freed");
}

TEST_CASE("NoGradGuard records nothing; EnableGradGuard turns recording back on") {
  Tensor x = leaf({1, 2}, {2});
  CHECK(grad_mode_enabled());
  {
    NoGradGuard no_grad;
    CHECK_FALSE(grad_mode_enabled());
    Tensor y = exp(x * 2.0);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.grad_fn() == nullptr);
    CHECK(y.is_leaf());
    CHECK_FALSE(x.view({2, 1}).requires_grad());  // views of x: no history either
    CHECK(x.view({2, 1}).grad_fn() == nullptr);
    check_throws_with([&] { sum(y).backward(); }, "does not require grad");
    {
      EnableGradGuard enable;
      CHECK(grad_mode_enabled());
      CHECK((x * 2.0).grad_fn() != nullptr);
    }
    CHECK_FALSE(grad_mode_enabled());
  }
  CHECK(grad_mode_enabled());
  Tensor r = x * 2.0;
  CHECK(r.requires_grad());
  CHECK(r.grad_fn() != nullptr);
  CHECK(r.grad_fn()->name() == "mul");
  CHECK_FALSE(r.is_leaf());
  // Integer results never carry history.
  CHECK_FALSE(gt(x, scalar_tensor(1.5, {.dtype = DType::f64})).requires_grad());
  // detach() cuts the history.
  CHECK_FALSE(r.detach().requires_grad());
  check_throws_with([&] { r.requires_grad_(false); }, "non-leaf");
}

// ---- in-place checks ---------------------------------------------------------------------------

TEST_CASE("modifying a saved tensor in place makes backward throw the version error") {
  SUBCASE("fill_ on a saved leaf") {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor y = sum(x * x);  // mul saves x
    {
      NoGradGuard no_grad;
      x.fill_(2.0);
    }
    check_throws_with([&] { y.backward(); }, "mul saved for backward was modified in place");
  }
  SUBCASE("copy_ into a saved output") {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor e = exp(x);  // exp saves its output
    Tensor y = sum(e);
    {
      NoGradGuard no_grad;
      e.copy_(from_vector({0, 0, 0}, {3}, {.dtype = DType::f64}));
    }
    check_throws_with([&] { y.backward(); }, "exp saved for backward was modified in place");
  }
  SUBCASE("through a view of a saved tensor") {
    Tensor x = leaf({1, 2, 3, 4}, {4});
    Tensor a = x * 1.0;
    Tensor y = sum(a * a);
    {
      NoGradGuard no_grad;
      a.slice(0, 1, 2).fill_(0.0);  // the shared version counter sees it
    }
    check_throws_with([&] { y.backward(); }, "modified in place");
  }
  SUBCASE("a tensor no backward saved may change") {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor a = x * 1.0;
    Tensor y = sum(a + 1.0);  // add keeps only shapes
    {
      NoGradGuard no_grad;
      a.fill_(5.0);
    }
    y.backward();
    CHECK(x.grad().to_vector() == std::vector<double>{1, 1, 1});
  }
}

TEST_CASE("in-place changes of tensors that require grad are refused while grad mode is on") {
  Tensor x = leaf({1, 2}, {2});
  check_throws_with([&] { x.fill_(1.0); },
                    "[fill_] in-place change of a tensor that requires grad");
  check_throws_with([&] { x.zero_(); }, "[fill_] in-place change");
  check_throws_with([&] { x.copy_(zeros({2}, {.dtype = DType::f64})); }, "[copy_] in-place change");
  Tensor a = x * 2.0;
  check_throws_with([&] { a.fill_(0.0); }, "requires grad");
  check_throws_with([&] { x.slice(0, 0, 1).fill_(0.0); }, "requires grad");
  CHECK(x.to_vector() == std::vector<double>{1, 2});
  {
    NoGradGuard no_grad;  // an optimizer step, say
    x.fill_(3.0);
  }
  CHECK(x.to_vector() == std::vector<double>{3, 3});
}

// Note [Views made under no_grad] in core/autograd.h; torch 1.13 raises "A view was created in
// no_grad mode and is being modified inplace with grad mode enabled" for the refused cases.
TEST_CASE("no_grad views of tensors that require grad refuse in-place changes with grad mode on") {
  Tensor x = leaf({1, 2, 3, 4}, {4});
  const std::vector<double> before = x.to_vector();
  const Tensor zero2 = zeros({2}, {.dtype = DType::f64});
  SUBCASE("each view op, and each in-place op") {
    Tensor v, r, s, t, sel;
    std::vector<Tensor> pieces, chunks;
    {
      NoGradGuard no_grad;
      v = x.slice(0, 0, 2);
      r = x.view({2, 2});
      s = x.reshape({4, 1}).squeeze(1);
      t = x.view({2, 2}).t();
      sel = x.select(0, 3);
      pieces = split(x, 2);
      chunks = chunk(x, 2);
    }
    CHECK_FALSE(v.requires_grad());
    check_throws_with([&] { v.fill_(0.0); },
                      "[fill_] in-place change, with grad mode on, of a view made under "
                      "NoGradGuard of a tensor that requires grad");
    check_throws_with([&] { v.zero_(); }, "view made under NoGradGuard");
    check_throws_with([&] { v.copy_(zero2); }, "[copy_] in-place change, with grad mode on");
    check_throws_with([&] { r.fill_(0.0); }, "view made under NoGradGuard");
    check_throws_with([&] { s.fill_(0.0); }, "view made under NoGradGuard");
    check_throws_with([&] { t.fill_(0.0); }, "view made under NoGradGuard");
    check_throws_with([&] { sel.fill_(0.0); }, "view made under NoGradGuard");
    check_throws_with([&] { pieces[1].copy_(zero2); }, "view made under NoGradGuard");
    check_throws_with([&] { chunks[0].zero_(); }, "view made under NoGradGuard");
    check_throws_with([&] { accumulate_(v, zero2, 1.0); }, "[accumulate_] in-place change, with");
    // accumulate_ is in place and unrecorded as copy_ is: the tensor itself is refused too.
    check_throws_with([&] { accumulate_(x, zeros({4}, {.dtype = DType::f64}), 1.0); },
                      "[accumulate_] in-place change of a tensor that requires grad");
    CHECK(x.to_vector() == before);
  }
  SUBCASE("of a non-leaf") {
    Tensor a = x * 2.0;
    Tensor v;
    {
      NoGradGuard no_grad;
      v = a.view({2, 2});
    }
    check_throws_with([&] { v.fill_(0.0); }, "view made under NoGradGuard");
    CHECK(a.to_vector() == std::vector<double>{2, 4, 6, 8});
  }
  SUBCASE("a view of such a view, even one made with grad mode on") {
    Tensor v;
    {
      NoGradGuard no_grad;
      v = x.slice(0, 1, 4);
    }
    Tensor w = v.slice(0, 0, 1).unsqueeze(0);
    CHECK_FALSE(w.requires_grad());
    check_throws_with([&] { w.fill_(0.0); }, "view made under NoGradGuard");
    CHECK(x.to_vector() == before);
  }
  SUBCASE("allowed under NoGradGuard, as the view was made") {
    Tensor v;
    {
      NoGradGuard no_grad;
      v = x.slice(0, 0, 2);
      v.fill_(0.0);
    }
    CHECK(x.to_vector() == std::vector<double>{0, 0, 3, 4});
  }
  SUBCASE("allowed when the base does not require grad, then or now") {
    Tensor y = from_vector({1, 2, 3}, {3}, {.dtype = DType::f64});
    Tensor v, u;
    {
      NoGradGuard no_grad;
      v = y.slice(0, 0, 2);
      u = x.slice(0, 0, 2);
    }
    v.fill_(0.0);
    CHECK(y.to_vector() == std::vector<double>{0, 0, 3});
    x.requires_grad_(false);  // as torch, the base's flag when the view is written counts
    u.fill_(0.0);
    CHECK(x.to_vector() == std::vector<double>{0, 0, 3, 4});
  }
  SUBCASE("a detached copy of such a view may be written") {
    Tensor v;
    {
      NoGradGuard no_grad;
      v = x.slice(0, 0, 2);
    }
    v.detach().fill_(0.0);
    CHECK(x.to_vector() == std::vector<double>{0, 0, 3, 4});
  }
}

// As torch 1.13: detach() gives the same memory and version counter without history.
TEST_CASE("in-place changes through detach() reach the base and trip the version check") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = sum(x * x);  // mul saves x
  Tensor d = x.detach();
  d.fill_(0.0);  // grad mode on: allowed, d requires no grad and is no view made under no_grad
  CHECK(x.to_vector() == std::vector<double>{0, 0, 0});
  check_throws_with([&] { y.backward(); }, "mul saved for backward was modified in place");
}

// ---- gradients returned instead of accumulated -------------------------------------------------

TEST_CASE("microbatch::grad returns gradients without touching the inputs' .grad") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor w = leaf({4, 5, 6}, {3});
  Tensor unrelated = leaf({0}, {1});
  x.set_grad(from_vector({7, 7, 7}, {3}, {.dtype = DType::f64}));
  std::vector<Tensor> g = grad({sum(x * w)}, {Tensor()}, {x, unrelated});
  REQUIRE(g.size() == 2);
  CHECK(g[0].to_vector() == std::vector<double>{4, 5, 6});
  CHECK_FALSE(g[1].defined());  // not reached from the root
  CHECK(x.grad().to_vector() == std::vector<double>{7, 7, 7});
  CHECK_FALSE(unrelated.grad().defined());
  // Leaves that were not asked for still accumulate (this is how checkpointed parameters get
  // their gradients from the inner backward).
  CHECK(w.grad().to_vector() == std::vector<double>{1, 2, 3});

  // An explicit root gradient, and the weight guard does not apply to returned gradients.
  Tensor y = x * 2.0;
  GradWeightGuard quarter(0.25);
  g = grad({y}, {from_vector({1, 0, -1}, {3}, {.dtype = DType::f64})}, {x});
  CHECK(g[0].to_vector() == std::vector<double>{2, 0, -2});
  check_throws_with([&] { grad({sum(y)}, {Tensor()}, {y}); }, "[grad] inputs must be leaf tensors");
}

// ---- activation checkpointing ------------------------------------------------------------------

TEST_CASE("checkpoint gives the plain gradients, parameters captured inside included") {
  Tensor x = input({4, 3}, -1, 1, 11);
  Tensor w1 = input({5, 3}, -1, 1, 12), b1 = input({5}, -1, 1, 13);
  Tensor w2 = input({2, 5}, -1, 1, 14), b2 = input({2}, -1, 1, 15);
  int calls = 0;
  auto layer1 = [&](const Tensor& h) {
    ++calls;
    return tanh(linear(h, w1, b1));
  };
  auto layer2 = [&](const Tensor& h) { return sigmoid(linear(h, w2, b2)); };

  Tensor plain = sum(layer2(layer1(x)) * layer2(layer1(x)));
  plain.backward();
  const std::vector<Tensor> expected = {x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
  clear_grads({x, w1, b1, w2, b2});

  calls = 0;
  Tensor h = checkpoint(layer1, x);
  CHECK(calls == 1);
  CHECK(h.grad_fn() != nullptr);
  CHECK(h.grad_fn()->name() == "checkpoint");
  Tensor out = checkpoint(layer2, h);
  Tensor loss = sum(out * out);
  check_close(loss, plain.to_vector(), 1e-14, 0, "checkpointed loss");
  loss.backward();
  CHECK(calls == 2);  // re-run once, during backward
  const std::vector<Tensor> got = {x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
  const char* names[] = {"dx", "dw1", "db1", "dw2", "db2"};
  for (int i = 0; i < 5; ++i) {
    REQUIRE_MESSAGE(got[i].defined(), std::string(names[i]) << " missing");
    check_close(got[i], expected[i], 1e-12, 1e-14, names[i]);
  }

  // The accumulation weight reaches the parameters inside the segment too.
  clear_grads({x, w1, b1, w2, b2});
  {
    GradWeightGuard half(0.5);
    Tensor y = checkpoint(layer2, checkpoint(layer1, x));
    sum(y * y).backward();
  }
  check_close(w1.grad(), expected[1] * 0.5, 1e-12, 1e-14, "dw1 at w = 1/2");
  check_close(x.grad(), expected[0] * 0.5, 1e-12, 1e-14, "dx at w = 1/2");
}

TEST_CASE("grad() captures parameters used inside a checkpointed segment") {
  // The segment's backward is a grad() call of its own; the outer call's inputs reached in there
  // are still the outer call's to return, and their .grad stays untouched, in-place paths too.
  Tensor x = input({4, 3}, -1, 1, 31);
  Tensor w1 = input({5, 3}, -1, 1, 32), b1 = input({5}, -1, 1, 33);
  Tensor w2 = input({2, 5}, -1, 1, 34), b2 = input({2}, -1, 1, 35);
  auto layer1 = [&](const Tensor& h) { return tanh(linear(h, w1, b1)); };
  auto layer2 = [&](const Tensor& h) { return sigmoid(linear(h, w2, b2)); };
  Tensor y = layer2(layer1(x));
  const std::vector<Tensor> expected = grad({sum(y * y)}, {Tensor()}, {w1, b1, x});
  clear_grads({x, w1, b1, w2, b2});
  // Gradient buffers on every parameter: linear would add into them in place if allowed.
  for (Tensor* t : {&w1, &b1, &w2, &b2}) t->set_grad(zeros(t->shape(), {.dtype = DType::f64}));

  Tensor yc = checkpoint(layer2, checkpoint(layer1, x));
  const std::vector<Tensor> got = grad({sum(yc * yc)}, {Tensor()}, {w1, b1, x});
  const char* names[] = {"dw1", "db1", "dx"};
  for (int i = 0; i < 3; ++i) {
    REQUIRE_MESSAGE(got[i].defined(), std::string(names[i]) << " not returned");
    check_close(got[i], expected[i], 1e-12, 1e-14, names[i]);
  }
  CHECK(w1.grad().to_vector() == std::vector<double>(15, 0.0));
  CHECK(b1.grad().to_vector() == std::vector<double>(5, 0.0));
  // Parameters not asked for still accumulate, inside the segment as outside.
  CHECK(max(abs(w2.grad())).item() > 0.0);
}

TEST_CASE("checkpoint with several inputs and outputs") {
  Tensor a = input({3}, 0.5, 1.5, 21), b = input({3}, 0.5, 1.5, 22);
  auto fn = [](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{in[0] * in[1], log(in[0] + in[1])};
  };
  auto total = [](const std::vector<Tensor>& outs) { return sum(outs[0] * 2.0) + sum(outs[1]); };
  total(fn({a, b})).backward();
  const Tensor da = a.grad(), db = b.grad();
  clear_grads({a, b});
  total(checkpoint(fn, {a, b})).backward();
  check_close(a.grad(), da, 1e-12, 1e-14, "da");
  check_close(b.grad(), db, 1e-12, 1e-14, "db");

  // Only one output used: the other receives no gradient and that is fine.
  clear_grads({a, b});
  sum(checkpoint(fn, {a, b})[1]).backward();
  check_close(a.grad(), (1.0 / (a + b)).detach(), 1e-12, 1e-14, "d log(a + b) / da");

  // Outside grad mode, checkpoint just runs the function.
  NoGradGuard no_grad;
  CHECK_FALSE(checkpoint(fn, {a, b})[0].requires_grad());
}

TEST_CASE("checkpoint: modifying a saved input in place is caught") {
  Tensor x = leaf({1, 2}, {2});
  Tensor a = x * 1.0;
  Tensor y = sum(checkpoint([](const Tensor& t) { return t * t; }, a));
  {
    NoGradGuard no_grad;
    a.fill_(0.0);
  }
  check_throws_with([&] { y.backward(); }, "checkpoint saved for backward was modified in place");
}

TEST_CASE("checkpoint re-draws the same dropout mask during backward") {
  const GeneratorState saved = default_generator().state();
  Tensor x = input({8, 16}, -1, 1, 31);
  Tensor w = input({16}, 0.5, 1.5, 32);
  auto fn = [&](const Tensor& h) { return dropout(tanh(h * w), 0.5); };
  Tensor c = input({8, 16}, -1, 1, 33).detach();

  manual_seed(99);
  Tensor plain = sum(fn(x) * c);
  plain.backward();
  const GeneratorState after_plain = default_generator().state();
  const Tensor dx = x.grad(), dw = w.grad();
  clear_grads({x, w});

  manual_seed(99);
  Tensor loss = sum(checkpoint(fn, x) * c);
  loss.backward();
  CHECK(loss.item() == plain.item());
  check_close(x.grad(), dx, 1e-12, 1e-14, "dx through dropout");
  check_close(w.grad(), dw, 1e-12, 1e-14, "dw through dropout");
  // The recomputation rewinds the stream and puts it back: later draws are unaffected.
  CHECK(default_generator().state().offset == after_plain.offset);

  // The mask really dropped some elements (else this test would prove nothing).
  int dropped = 0;
  for (double g : dx.to_vector()) dropped += g == 0.0;
  CHECK(dropped > 20);
  CHECK(dropped < 108);
  default_generator().set_state(saved);
}

TEST_CASE("checkpoint puts the random stream back when its recomputation throws") {
  // Budgets rising from nothing until the backward runs: the smaller ones refuse a request before
  // the segment's re-run, inside it, or after it, and every way out must leave the stream where
  // the backward found it, not at the forward's draws (later dropout masks would repeat them).
  const GeneratorState saved = default_generator().state();
  struct BudgetRestore {  // the CPU allocator is the process's: its budget goes back on every exit
    std::optional<std::size_t> bytes = allocator(kCPU).budget();
    ~BudgetRestore() { allocator(kCPU).set_budget(bytes); }
  } cpu_budget;
  manual_seed(5);
  Tensor w = input({256, 256}, -0.1, 0.1, 41);
  int entered = 0, finished = 0;
  auto fn = [&](const Tensor& h) {
    ++entered;
    Tensor y = dropout(relu(matmul(h, w)), 0.5);
    ++finished;
    return y;
  };
  int refused_inside = 0;
  bool ran = false;
  for (std::size_t extra = 0; !ran && extra <= (std::size_t{4} << 20); extra += 4096) {
    Tensor x = randn({64, 256}, {.dtype = DType::f64});
    Tensor loss = sum(checkpoint(fn, x));
    Tensor later = rand({1000});  // the stream moves on past the segment's draws
    const GeneratorState before = default_generator().state();
    entered = finished = 0;
    empty_cache(kCPU);
    set_memory_budget(kCPU, static_cast<std::size_t>(memory_stats(kCPU).reserved.current) + extra);
    try {
      loss.backward();
      ran = true;
    } catch (const OutOfMemoryError&) {
      refused_inside += entered > finished;
    }
    allocator(kCPU).set_budget(cpu_budget.bytes);
    INFO("budget +" << extra << " bytes, re-run entered " << entered << ", finished " << finished);
    CHECK(default_generator().state().seed == before.seed);
    CHECK(default_generator().state().offset == before.offset);
    w.set_grad(Tensor());
  }
  CHECK(ran);
  CHECK(refused_inside > 0);  // else this test would prove nothing
  empty_cache(kCPU);
  default_generator().set_state(saved);
}

TEST_CASE("ops save only the operands their gradients read, as torch") {
  // Note [Saving only what a gradient reads]: an operand that is not saved may change before
  // backward, and the gradients are those of the values at the forward.
  const Tensor data = from_vector({1, 2, 3}, {3}, {.dtype = DType::f64});
  {
    Tensor w = leaf({4, 5, 6}, {3});
    Tensor y = sum(data * w);  // dw = data: w is not read
    { NoGradGuard no_grad; w.fill_(0.0); }
    y.backward();
    CHECK(w.grad().to_vector() == std::vector<double>{1, 2, 3});
  }
  {
    Tensor w = leaf({4, 5, 6}, {3});
    Tensor d = from_vector({4, 5, 8}, {3}, {.dtype = DType::f64});
    Tensor y = sum(w / d);  // dw = 1 / d
    { NoGradGuard no_grad; w.fill_(0.0); }
    y.backward();
    CHECK(w.grad().to_vector() == std::vector<double>{0.25, 0.2, 0.125});
  }
  for (bool as_linear : {true, false}) {
    CAPTURE(as_linear);
    Tensor w = leaf({1, 2, 3, 4}, {2, 2});
    Tensor x = from_vector({1, 2, 3, 4, 5, 6}, {3, 2}, {.dtype = DType::f64});
    Tensor y = sum(as_linear ? linear(x, w) : matmul(x, w));  // dw reads x only
    { NoGradGuard no_grad; w.fill_(0.0); }
    y.backward();
    // linear: dW[o][i] = sum_rows x[:, i]; matmul: dW[i][o] = sum_rows x[:, i]
    CHECK(w.grad().to_vector() == (as_linear ? std::vector<double>{9, 12, 9, 12}
                                             : std::vector<double>{9, 9, 12, 12}));
  }
  // What is read is still checked: x * w with both requiring grad saves both.
  Tensor a = leaf({1, 2}, {2}), b = leaf({3, 4}, {2});
  Tensor y = sum(a * b);
  { NoGradGuard no_grad; a.fill_(0.0); }
  check_throws_with([&] { y.backward(); }, "modified in place");
  // An activation multiplied by a constant is not kept for the product's backward.
  Tensor x = leaf(std::vector<double>(100000, 1.0), {100000});
  const Tensor c = full({100000}, 2.0, {.dtype = DType::f64});
  const std::int64_t before = memory_stats(kCPU).allocated.current;
  Tensor z;
  {
    Tensor h = x + 1.0;  // add saves nothing; mul by a constant saves only the constant
    z = h * c;
  }
  // z's block alone (rounded up to the allocator's block size): h, as large, was freed.
  const auto live = static_cast<std::size_t>(memory_stats(kCPU).allocated.current - before);
  CHECK(live >= z.storage()->nbytes);
  CHECK(live < 2 * z.storage()->nbytes);
}

TEST_CASE("a leaf whose requires_grad was turned off after the forward takes no gradient") {
  for (bool as_linear : {true, false}) {
    CAPTURE(as_linear);
    Tensor w = leaf({1, 2, 3, 4}, {2, 2});
    w.set_grad(zeros({2, 2}, {.dtype = DType::f64}));
    Tensor x = from_vector({1, 2, 3, 4}, {2, 2}, {.dtype = DType::f64});
    Tensor y = sum(as_linear ? linear(x, w) : w * 3.0);
    w.requires_grad_(false);
    y.backward();
    CHECK(w.grad().to_vector() == std::vector<double>{0, 0, 0, 0});
  }
}

TEST_CASE("grad() gives an input named twice its gradient at both places") {
  Tensor x = leaf({1, 2, 3}, {3}), u = leaf({1, 1, 1}, {3});
  Tensor w = from_vector({2, 2, 2}, {3}, {.dtype = DType::f64});
  const std::vector<Tensor> g = grad({sum(x * w * x)}, {Tensor()}, {x, u, x});
  REQUIRE(g.size() == 3);
  REQUIRE(g[0].defined());
  CHECK(g[0].to_vector() == std::vector<double>{4, 8, 12});  // 2 w x
  CHECK_FALSE(g[1].defined());                                 // not reached
  CHECK(g[2].to_vector() == g[0].to_vector());
}

TEST_CASE("an explicit root gradient of another dtype is cast to the output's, as torch") {
  Tensor w = leaf({1, 2, 3, 4}, {2, 2}, DType::f32);
  Tensor x = from_vector({1, 2}, {1, 2}, {.dtype = DType::f32});
  Tensor y = linear(x, w);
  y.backward(ones({1, 2}, {.dtype = DType::f64}));
  CHECK(w.grad().dtype() == DType::f32);
  CHECK(w.grad().to_vector() == std::vector<double>{1, 2, 1, 2});
}

TEST_CASE("checkpoint: an output that is an input, as is, leaves the input a leaf") {
  const std::int64_t before = memory_stats(kCPU).allocated.current;
  {
    Tensor x = leaf(std::vector<double>(1000, 0.5), {1000});
    std::vector<Tensor> o = checkpoint(
        [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] * 2.0, in[0]}; }, {x});
    CHECK(x.is_leaf());
    CHECK(o[1].impl() != x.impl());
    (sum(o[0]) + sum(o[1])).backward();
    CHECK(x.grad().to_vector() == std::vector<double>(1000, 3.0));
    x.requires_grad_(false);  // a leaf's, allowed
  }
  CHECK(memory_stats(kCPU).allocated.current == before);  // no cycle keeps x alive
}

TEST_CASE("a recorded node's gradients are checked against its inputs, as torch's engine") {
  // Note [Checking returned gradients]. `custom` returns whatever `make` gives for its two inputs
  // (a (2, 3) leaf and a (3,) non-leaf made from a leaf).
  using Make = std::function<std::vector<Tensor>()>;
  auto run = [](const Make& make, Tensor* a_grad = nullptr, Tensor* b_grad = nullptr) {
    Tensor a = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
    Tensor b0 = leaf({1, 1, 1}, {3});
    Tensor b = b0 * 2.0;
    Tensor out = zeros({2, 3}, {.dtype = DType::f64});
    record("custom", {a, b}, out, [make](const Tensor&) { return make(); });
    sum(out).backward();
    if (a_grad) *a_grad = a.grad();
    if (b_grad) *b_grad = b0.grad();
  };
  const auto f64 = [](const Shape& shape, double v) {
    return full(shape, v, {.dtype = DType::f64});
  };
  SUBCASE("the right shapes pass through") {
    Tensor ga, gb;
    run([&] { return std::vector<Tensor>{f64({2, 3}, 1.0), f64({3}, 0.5)}; }, &ga, &gb);
    CHECK(ga.to_vector() == std::vector<double>(6, 1.0));
    CHECK(gb.to_vector() == std::vector<double>(3, 1.0));  // 0.5 through b = 2 b0
  }
  SUBCASE("a shape the input broadcasts to is summed back to the input's shape") {
    Tensor ga, gb;
    run([&] { return std::vector<Tensor>{f64({4, 2, 3}, 1.0), f64({2, 3}, 0.5)}; }, &ga, &gb);
    CHECK(ga.shape() == Shape{2, 3});
    CHECK(ga.to_vector() == std::vector<double>(6, 4.0));
    CHECK(gb.to_vector() == std::vector<double>(3, 2.0));  // two rows of 0.5, times 2
  }
  SUBCASE("a wrong number of gradients") {
    check_throws_with([&] { run([&] { return std::vector<Tensor>{f64({2, 3}, 1.0)}; }); },
                      "[backward] custom returned an incorrect number of gradients (expected 2, "
                      "got 1)");
  }
  SUBCASE("a shape the input does not broadcast to, at a leaf and at a non-leaf") {
    check_throws_with(
        [&] { run([&] { return std::vector<Tensor>{f64({3, 2}, 1.0), f64({3}, 1.0)}; }); },
        "[backward] custom returned an invalid gradient at index 0: got shape (3, 2) but expected "
        "a shape compatible with (2, 3)");
    check_throws_with(
        [&] { run([&] { return std::vector<Tensor>{f64({2, 3}, 1.0), f64({4}, 1.0)}; }); },
        "[backward] custom returned an invalid gradient at index 1: got shape (4,) but expected a "
        "shape compatible with (3,)");
  }
  SUBCASE("a gradient on another device, or of an integer dtype") {
    check_throws_with(
        [&] {
          run([&] {
            return std::vector<Tensor>{
                zeros({2, 3}, {.dtype = DType::f64, .device = kMeta}), f64({3}, 1.0)};
          });
        },
        "[backward] custom returned a gradient on meta at index 0 for an input on cpu");
    check_throws_with(
        [&] {
          run([&] {
            return std::vector<Tensor>{f64({2, 3}, 1.0), zeros({3}, {.dtype = DType::i64})};
          });
        },
        "[backward] custom returned a gradient of dtype i64 at index 1; gradients are floating");
  }
  SUBCASE("an undefined gradient is not checked, and the node below it does not run") {
    // As torch: b0 = leaf, b = b0 * 2 gets no gradient, so b0.grad stays undefined.
    Tensor ga, gb;
    run([&] { return std::vector<Tensor>{f64({2, 3}, 1.0), Tensor()}; }, &ga, &gb);
    CHECK(ga.to_vector() == std::vector<double>(6, 1.0));
    CHECK_FALSE(gb.defined());
  }
}

TEST_CASE("checkpoint: a segment that ignores its input leaves the input's graph unrun") {
  // The segment gives its input no gradient; y = exp(x) then receives none and must not run its
  // formula on an undefined gradient. As torch.utils.checkpoint: x.grad = 1, w.grad = 3.
  Tensor x = leaf({0.5, 0.5, 0.5}, {3}), w = leaf({2, 2, 2}, {3});
  Tensor y = exp(x);
  Tensor z = checkpoint([&](const Tensor&) { return w * 3.0; }, y);
  (sum(z) + sum(x)).backward();
  CHECK(x.grad().to_vector() == std::vector<double>{1, 1, 1});
  CHECK(w.grad().to_vector() == std::vector<double>{3, 3, 3});
}
