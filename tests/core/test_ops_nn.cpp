// softmax, log_softmax, cross_entropy, layer_norm and dropout: values from the math or from a
// composition of simpler ops, gradchecks, 16-bit against f32, and the error cases.
#include <cmath>
#include <limits>

#include "core/rng.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

OpFn on_first(Tensor (*f)(const Tensor&, std::int64_t), std::int64_t dim) {
  return [f, dim](const std::vector<Tensor>& in) { return f(in[0], dim); };
}

// Cross-entropy from log_softmax and a one-hot built with eq (no fused kernel):
// loss_i = (1 - s) * -logp[i, t_i] + s * -mean_c logp[i, c], 0 for ignored rows.
Tensor reference_cross_entropy(const Tensor& logits, const Tensor& target, CrossEntropyOptions o) {
  const std::int64_t c = logits.shape()[1];
  Tensor logp = log_softmax(logits, 1);
  Tensor classes = arange(0, static_cast<double>(c), 1, {.dtype = target.dtype()}).reshape({1, c});
  Tensor onehot = eq(classes, target.unsqueeze(1)).to(logits.dtype());
  Tensor nll = -sum(logp * onehot, {1});
  Tensor smooth = -mean(logp, {1});
  Tensor valid =
      ne(target, scalar_tensor(static_cast<double>(o.ignore_index), {.dtype = target.dtype()}))
          .to(logits.dtype());
  Tensor rows = (nll * (1.0 - o.label_smoothing) + smooth * o.label_smoothing) * valid;
  switch (o.reduction) {
    case Reduction::None:
      return rows;
    case Reduction::Sum:
      return sum(rows);
    case Reduction::Mean:
      return sum(rows) / sum(valid);
  }
  return rows;
}

Tensor targets(const std::vector<double>& values, DType dt = DType::i64) {
  return from_vector(values, {static_cast<std::int64_t>(values.size())}, {.dtype = dt});
}

// The gradient of sum(f(x) * w) with respect to x, for a fixed weight w of f(x)'s shape.
Tensor grad_of(const std::function<Tensor(const Tensor&)>& f, const Tensor& x0, const Tensor& w) {
  Tensor x = x0.detach().clone();
  x.requires_grad_(true);
  sum(f(x) * w).backward();
  return x.grad();
}

}  // namespace

// ---- softmax and log_softmax -------------------------------------------------------------------

TEST_CASE("softmax and log_softmax forward values") {
  // softmax(0, ln 2, ln 3) = (1, 2, 3) / 6.
  Tensor x = from_vector({0.0, std::log(2.0), std::log(3.0)}, {1, 3}, {.dtype = DType::f64});
  check_close(softmax(x, -1), {1.0 / 6, 2.0 / 6, 3.0 / 6}, 1e-12, 1e-12, "softmax by hand");
  check_close(log_softmax(x, 1), {std::log(1.0 / 6), std::log(2.0 / 6), std::log(3.0 / 6)}, 1e-12,
              1e-12, "log_softmax by hand");

  // Any dim, against exp(x) / sum(exp(x)); rows sum to 1.
  Tensor a = input({2, 5, 3}, -3, 3, 11).detach();
  for (std::int64_t d : {0, 1, 2, -1}) {
    Tensor e = exp(a);
    Tensor expected = e / sum(e, {d}, {.keepdim = true});
    Tensor y = softmax(a, d);
    CHECK(y.shape() == a.shape());
    check_close(y, expected, 1e-12, 1e-12, "softmax vs exp / sum");
    check_close(sum(y, {d}), std::vector<double>(a.numel() / a.shape()[(d + 3) % 3], 1.0), 1e-12,
                1e-12, "rows sum to 1");
    check_close(log_softmax(a, d), log(expected), 1e-12, 1e-12, "log_softmax vs log(softmax)");
  }
  // A 0-d input is one row of one element.
  CHECK(softmax(scalar_tensor(3.0), 0).item() == 1.0);
  CHECK(log_softmax(scalar_tensor(3.0), -1).item() == 0.0);
}

TEST_CASE("softmax, log_softmax and cross_entropy stay finite for large logits") {
  Tensor x = from_vector({1e4, 0, -1e4, 1e4, 1e4, 1e4}, {2, 3});
  check_close(softmax(x, 1), {1, 0, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3}, 1e-6, 1e-7, "softmax at 1e4");
  check_close(log_softmax(x, 1), {0, -1e4, -2e4, -std::log(3.0), -std::log(3.0), -std::log(3.0)},
              1e-6, 1e-5, "log_softmax at 1e4");
  for (double v : softmax(x * -1.0, 0).to_vector()) CHECK(std::isfinite(v));
  // Row 0 puts all its mass on class 0: -log p = 0 for target 0, 1e4 for target 1, and
  // dlogits = softmax - onehot.
  Tensor logits = x.detach().slice(0, 0, 1);
  logits.requires_grad_(true);
  Tensor ce = cross_entropy(logits, from_vector({1}, {1}, {.dtype = DType::i64}));
  check_close(ce, {1e4}, 1e-6, 0, "cross_entropy at 1e4");
  ce.backward();
  check_close(logits.grad(), {1, -1, 0}, 0, 1e-6, "dlogits at 1e4");
  check_close(cross_entropy(logits, from_vector({0}, {1}, {.dtype = DType::i64})), {0.0}, 0, 1e-6,
              "easy row");
}

TEST_CASE("softmax and log_softmax gradcheck: last, middle and first dims, non-contiguous") {
  for (auto f : {&softmax, &log_softmax}) {
    const std::string name = f == &softmax ? "softmax" : "log_softmax";
    gradcheck(name + " last dim", on_first(f, -1), {input({3, 4}, -2, 2, 1)});
    gradcheck(name + " middle dim", on_first(f, 1), {input({2, 3, 4}, -2, 2, 2)});
    gradcheck(name + " first dim", on_first(f, 0), {input({3, 2, 2}, -2, 2, 3)});
    gradcheck(name + " non-contiguous, last dim", on_first(f, -1),
              {non_contiguous(input({3, 4}, -2, 2, 4))});
    gradcheck(name + " non-contiguous, middle dim", on_first(f, 1),
              {non_contiguous(input({2, 3, 2}, -2, 2, 5))});
  }
}

TEST_CASE(
    "softmax, log_softmax, layer_norm and cross_entropy in 16-bit match f32 within tolerance") {
  struct Tol {
    DType dtype;
    double rtol, atol;
  };
  for (Tol t : {Tol{DType::f16, 1e-3, 1e-5}, Tol{DType::bf16, 1.6e-2, 1e-5}}) {
    // The f32 reference runs on the 16-bit values, so only the op's own rounding is measured.
    // 300 columns: the kernels widen 16-bit rows in chunks of 256, so this crosses a chunk edge.
    Tensor h = (input({4, 300}, -4, 4, 21).detach().to(DType::f32)).to(t.dtype);
    Tensor f = h.to(DType::f32);
    const std::string name = dtype_name(t.dtype);
    check_close(softmax(h, -1), softmax(f, -1), t.rtol, t.atol, name + " softmax");
    check_close(softmax(h, 0), softmax(f, 0), t.rtol, t.atol, name + " softmax dim 0");
    check_close(log_softmax(h, -1), log_softmax(f, -1), t.rtol, t.atol, name + " log_softmax");
    Tensor w = input({300}, 0.5, 1.5, 22).detach().to(t.dtype),
           b = input({300}, -1, 1, 23).detach().to(t.dtype);
    check_close(layer_norm(h, {300}, w, b),
                layer_norm(f, {300}, w.to(DType::f32), b.to(DType::f32)), t.rtol, t.atol,
                name + " layer_norm");
    Tensor tg = targets({3, 0, 299, 270});
    CHECK(cross_entropy(h, tg).dtype() == t.dtype);
    check_close(cross_entropy(h, tg), cross_entropy(f, tg), t.rtol, t.atol,
                name + " cross_entropy");
    // dlogits = softmax - onehot is computed in f32 and rounded once.
    Tensor g16 = grad_of([&](const Tensor& x) { return cross_entropy(x, tg); }, h,
                         ones({}, {.dtype = t.dtype}));
    Tensor g32 = grad_of([&](const Tensor& x) { return cross_entropy(x, tg); }, f, ones({}));
    check_close(g16, g32, t.rtol, t.atol, name + " cross_entropy dlogits");
  }
}

TEST_CASE("long rows (several kernel chunks) match the compositions, forward and backward") {
  // The kernels work in chunks of 256 elements; 600 columns gives two full chunks and a partial
  // one.
  Tensor x = input({3, 600}, -3, 3, 25).detach();
  Tensor w = input({3, 600}, -1, 1, 26).detach();  // weights of the outputs, for the gradients
  auto composed_softmax = [](const Tensor& v) {
    Tensor e = exp(v - 3.0);  // inputs are below 3: no overflow, and no max needed
    return e / sum(e, {1}, {.keepdim = true});
  };
  auto fused_softmax = [](const Tensor& v) { return softmax(v, 1); };
  check_close(fused_softmax(x), composed_softmax(x), 1e-12, 1e-15, "softmax");
  check_close(grad_of(fused_softmax, x, w), grad_of(composed_softmax, x, w), 1e-10, 1e-14,
              "softmax dx");
  auto fused_log = [](const Tensor& v) { return log_softmax(v, 1); };
  auto composed_log = [&](const Tensor& v) { return log(composed_softmax(v)); };
  check_close(fused_log(x), composed_log(x), 1e-12, 1e-12, "log_softmax");
  check_close(grad_of(fused_log, x, w), grad_of(composed_log, x, w), 1e-10, 1e-12,
              "log_softmax dx");

  const Tensor t = targets({599, -100, 256});
  const CrossEntropyOptions o{.reduction = Reduction::None, .label_smoothing = 0.3};
  Tensor wr = input({3}, -1, 1, 27).detach();
  auto fused_ce = [&](const Tensor& v) { return cross_entropy(v, t, o); };
  auto composed_ce = [&](const Tensor& v) { return reference_cross_entropy(v, t, o); };
  check_close(fused_ce(x), composed_ce(x), 1e-12, 1e-12, "cross_entropy");
  check_close(grad_of(fused_ce, x, wr), grad_of(composed_ce, x, wr), 1e-10, 1e-14,
              "cross_entropy dlogits");

  // layer_norm: all three gradients against the composition's.
  Tensor gamma = input({600}, 0.5, 1.5, 28), beta = input({600}, -1, 1, 29),
         xl = input({3, 600}, -3, 3, 25);
  sum(layer_norm(xl, {600}, gamma, beta) * w).backward();
  const Tensor dx = xl.grad(), dgamma = gamma.grad(), dbeta = beta.grad();
  for (Tensor* p : {&gamma, &beta, &xl}) p->set_grad({});
  Tensor centered = xl - mean(xl, {1}, {.keepdim = true});
  Tensor composed =
      centered / sqrt(var(xl, {1}, {.correction = 0, .keepdim = true}) + 1e-5) * gamma + beta;
  check_close(layer_norm(xl, {600}, gamma, beta), composed, 1e-12, 1e-12, "layer_norm");
  sum(composed * w).backward();
  check_close(dx, xl.grad(), 1e-9, 1e-12, "layer_norm dx");
  check_close(dgamma, gamma.grad(), 1e-9, 1e-12, "layer_norm dweight");
  check_close(dbeta, beta.grad(), 1e-9, 1e-12, "layer_norm dbias");
}

TEST_CASE("softmax errors") {
  check_throws_with([] { softmax(zeros({2, 3}), 2); }, "[softmax] dim 2 out of range");
  check_throws_with([] { log_softmax(zeros({2, 3}), -3); }, "[log_softmax] dim -3 out of range");
  check_throws_with([] { softmax(zeros({2}, {.dtype = DType::i64}), 0); },
                    "[softmax] expected a floating-point");
}

// ---- cross-entropy -----------------------------------------------------------------------------

TEST_CASE("cross_entropy forward values by hand") {
  Tensor x = from_vector({1, 2, 3, 0, 0, 0}, {2, 3}, {.dtype = DType::f64});
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  // Row 0: nll = lse - 3, mean_c(-log p) = lse - 2; row 1: every class has p = 1/3.
  check_close(cross_entropy(x, targets({2, 1}), {.reduction = Reduction::None}),
              {lse - 3, std::log(3.0)}, 1e-12, 1e-12, "none");
  check_close(cross_entropy(x, targets({2, 1})), {(lse - 3 + std::log(3.0)) / 2}, 1e-12, 1e-12,
              "mean");
  check_close(cross_entropy(x, targets({2, 1}), {.reduction = Reduction::Sum}),
              {lse - 3 + std::log(3.0)}, 1e-12, 1e-12, "sum");
  // Label smoothing 0.2 with the second row ignored: mean over the one remaining row
  // (torch 1.13 gives 0.6076 for this case).
  const double smoothed = 0.8 * (lse - 3) + 0.2 * (lse - 2);
  check_close(cross_entropy(x, targets({2, -100}), {.label_smoothing = 0.2}), {smoothed}, 1e-12,
              1e-12, "smoothing + ignore");
  CHECK(smoothed == doctest::Approx(0.6076).epsilon(1e-4));
  // ignore_index other than -100; i32 targets.
  check_close(cross_entropy(x, targets({0, 2}, DType::i32), {.ignore_index = 2}), {lse - 1}, 1e-12,
              1e-12, "ignore_index 2, i32");
}

TEST_CASE(
    "cross_entropy matches log_softmax + one-hot for every reduction, ignore_index and smoothing") {
  Tensor x = input({6, 5}, -3, 3, 31).detach();
  Tensor t = targets({4, -100, 0, 2, -100, 1});
  for (Reduction r : {Reduction::None, Reduction::Sum, Reduction::Mean}) {
    for (double s : {0.0, 0.1, 1.0}) {
      const CrossEntropyOptions o{.reduction = r, .label_smoothing = s};
      auto fused = [&](const Tensor& v) { return cross_entropy(v, t, o); };
      auto composed = [&](const Tensor& v) { return reference_cross_entropy(v, t, o); };
      check_close(fused(x), composed(x), 1e-12, 1e-12, "forward");
      Tensor w = input(fused(x).shape(), -1, 1, 32).detach();
      Tensor g = grad_of(fused, x, w);
      check_close(g, grad_of(composed, x, w), 1e-12, 1e-12, "dlogits");
      for (int c = 0; c < 5; ++c) {  // ignored rows get no gradient
        CHECK(g.to_vector()[5 + c] == 0.0);
        CHECK(g.to_vector()[20 + c] == 0.0);
      }
    }
  }
}

TEST_CASE("cross_entropy gradcheck") {
  Tensor t = targets({2, -100, 0, 3});
  for (Reduction r : {Reduction::None, Reduction::Sum, Reduction::Mean}) {
    for (double s : {0.0, 0.25}) {
      const CrossEntropyOptions o{.reduction = r, .label_smoothing = s};
      auto f = [&](const std::vector<Tensor>& in) { return cross_entropy(in[0], t, o); };
      gradcheck("cross_entropy", f, {input({4, 4}, -2, 2, 41)});
      gradcheck("cross_entropy non-contiguous", f, {non_contiguous(input({4, 4}, -2, 2, 42))});
    }
  }
  Tensor t3 = from_vector({1, 0, 2, -100, 2, 1}, {2, 3}, {.dtype = DType::i64});
  gradcheck("cross_entropy (N, C, d)",
            [&](const std::vector<Tensor>& in) { return cross_entropy(in[0], t3); },
            {input({2, 4, 3}, -2, 2, 43)});
}

// Note [Reusing an input's memory]: logits made by an op (x * 2, whose backward keeps nothing of
// its output) that only cross_entropy holds get their gradient written over them. The same gradient,
// bit for bit, as when the caller keeps the logits (which stay intact), and one logits' worth less
// memory at the backward's peak.
TEST_CASE("cross_entropy writes its gradient over logits that nothing else holds") {
  struct Run {
    Tensor grad;
    std::int64_t peak = 0;  // allocated bytes above those before the backward
  };
  // keep: the caller holds the logits through the backward; retain: the graph is retained and
  // the backward run twice (the second must see the logits unchanged).
  auto run = [](const Tensor& x0, const Tensor& t, const CrossEntropyOptions& o, bool keep,
                bool retain) {
    Tensor x = x0.detach().clone();
    x.requires_grad_(true);
    Tensor logits = x * 2.0;
    Tensor loss = cross_entropy(logits, t, o);
    if (o.reduction == Reduction::None) loss = sum(loss);
    if (!keep) logits = Tensor();
    reset_peak_memory_stats(kCPU);
    const std::int64_t before = memory_stats(kCPU).allocated.current;
    if (retain) {
      loss.backward({}, {.retain_graph = true});
      x.grad().zero_();
    }
    loss.backward();
    Run r{x.grad().clone(), memory_stats(kCPU).allocated.peak - before};
    if (keep) check_close(logits, x0.to(logits.dtype()) * 2.0, 0, 0, "logits kept intact");
    return r;
  };
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    for (Reduction r : {Reduction::None, Reduction::Sum, Reduction::Mean}) {
      for (double s : {0.0, 0.2}) {
        const CrossEntropyOptions o{.reduction = r, .label_smoothing = s};
        const std::string name = std::string(dtype_name(dt)) + " reduction " +
                                 std::to_string(static_cast<int>(r)) + " smoothing " +
                                 std::to_string(s);
        CAPTURE(name);
        // Odd widths: the values.
        Tensor x0 = input({6, 37}, -3, 3, 61).detach().to(dt);
        Tensor t = targets({36, -100, 0, 5, 17, 2});
        const Run kept = run(x0, t, o, true, false), dropped = run(x0, t, o, false, false);
        check_close(dropped.grad, kept.grad, 0, 0, name + " dlogits written over the logits");
        check_close(run(x0, t, o, false, true).grad, kept.grad, 0, 0, name + " retained graph");
        // Rows of 512-byte multiples (the allocator's rounding): the memory.
        Tensor y0 = input({8, 64}, -3, 3, 62).detach().to(dt);
        Tensor ty = targets({63, 0, -100, 5, 17, 2, 40, 1});
        const Run big_kept = run(y0, ty, o, true, false);
        const Run big_dropped = run(y0, ty, o, false, false);
        const auto logits_bytes = 8 * 64 * static_cast<std::int64_t>(dtype_size(dt));
        CHECK(big_kept.peak - big_dropped.peak == logits_bytes);
        check_close(big_dropped.grad, big_kept.grad, 0, 0, name + " (8, 64)");
      }
    }
  }
}

// A backward that fails part-way can be run again: the node gives up its saved logits only once
// nothing that can throw is left. Here the caller keeps the logits (no reuse) and the gradient's
// allocation (2 MiB, a new block) is refused by the memory budget the first time.
TEST_CASE("cross_entropy's backward runs again after it ran out of memory") {
  Tensor x0 = input({64, 8192}, -3, 3, 63).detach();
  std::vector<double> labels(64);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<double>(i * 97 % 8192);
  Tensor t = targets(labels);
  Tensor want = grad_of([&](const Tensor& v) { return cross_entropy(v * 2.0, t); }, x0, ones({}));
  Tensor x = x0.clone();
  x.requires_grad_(true);
  Tensor logits = x * 2.0;
  Tensor loss = cross_entropy(logits, t);
  empty_cache(kCPU);
  {  // cached small blocks: the backward's small tensors fit, the gradient does not
    std::vector<Tensor> small;
    for (int i = 0; i < 8; ++i) small.push_back(empty({1}));
  }
  set_memory_budget(kCPU, static_cast<std::size_t>(memory_stats(kCPU).reserved.current));
  std::string refusal;
  try {
    loss.backward();
  } catch (const OutOfMemoryError& e) {
    refusal = e.what();
  }
  clear_memory_budget(kCPU);
  CAPTURE(refusal);
  // The refused request is the gradient's (MiB), not one of the small tensors' before it.
  REQUIRE(refusal.find(" MiB; allocated") != std::string::npos);
  loss.backward();
  check_close(x.grad(), want, 0, 0, "gradient after the rerun");
  check_close(logits, x0 * 2.0, 0, 0, "logits kept intact");
}

TEST_CASE("cross_entropy with (N, C, d) logits and (B, T, C) reshaped by the caller") {
  Tensor x = input({2, 4, 3}, -2, 2, 51).detach();  // (N, C, d)
  Tensor t = from_vector({1, 0, 3, -100, 2, 1}, {2, 3}, {.dtype = DType::i64});
  Tensor rows = x.permute({0, 2, 1}).reshape({6, 4});  // (N * d, C)
  check_close(cross_entropy(x, t), reference_cross_entropy(rows, t.reshape({6}), {}), 1e-12, 1e-12,
              "(N, C, d)");
  Tensor none = cross_entropy(x, t, {.reduction = Reduction::None});
  CHECK(none.shape() == Shape{2, 3});
  check_close(none.reshape({6}),
              reference_cross_entropy(rows, t.reshape({6}), {.reduction = Reduction::None}), 1e-12,
              1e-12, "(N, C, d) none");
  // A language model's (B, T, V) logits with (B, T) targets: flatten both.
  Tensor btv = input({2, 3, 4}, -2, 2, 52).detach();
  check_close(cross_entropy(btv.reshape({-1, 4}), t.reshape({-1})),
              reference_cross_entropy(btv.reshape({6, 4}), t.reshape({6}), {}), 1e-12, 1e-12,
              "(B, T, V)");
}

TEST_CASE("cross_entropy with every target ignored: mean is NaN (as torch), sum is 0, gradient 0") {
  Tensor t = targets({-100, -100});
  Tensor x = input({2, 3});
  Tensor m = cross_entropy(x, t);
  CHECK(std::isnan(m.item()));
  m.backward();
  check_close(x.grad(), std::vector<double>(6, 0.0), 0, 0, "zero gradient");
  CHECK(cross_entropy(x, t, {.reduction = Reduction::Sum}).item() == 0.0);
  CHECK(std::isnan(cross_entropy(x, t, {.label_smoothing = 0.1}).item()));
}

TEST_CASE("cross_entropy of 16-bit logits with an f32 loss equals the loss of their f32 copy") {
  // The kernels compute in f32 either way: asking for an f32 loss gives the upcast path's loss and
  // the same 16-bit gradient (the cast's backward rounds it once, as the kernel's store does),
  // without the f32 copy of the logits.
  for (DType dt : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dt));
    for (double smoothing : {0.0, 0.1}) {
      Tensor x = input({5, 37}, -4, 4, 7).detach().to(dt);
      x.requires_grad_(true);
      Tensor t = targets({3, -100, 36, 0, 11});
      Tensor direct = cross_entropy(x, t, {.label_smoothing = smoothing, .loss_dtype = DType::f32});
      CHECK(direct.dtype() == DType::f32);
      const Tensor g_direct = grad({direct}, {Tensor()}, {x})[0];
      Tensor upcast = cross_entropy(x.to(DType::f32), t, {.label_smoothing = smoothing});
      const Tensor g_upcast = grad({upcast}, {Tensor()}, {x})[0];
      CHECK(direct.item() == upcast.item());
      CHECK(g_direct.dtype() == dt);
      CHECK(g_direct.to_vector() == g_upcast.to_vector());
      // The default keeps PyTorch's rule: the loss in the logits' dtype.
      CHECK(cross_entropy(x, t).dtype() == dt);
    }
  }
}

TEST_CASE("cross_entropy errors") {
  Tensor x = zeros({3, 4});
  check_throws_with(
      [&] {
        cross_entropy(x, targets({0, 4, 1}));
      },
      "target 4 (row 1) is out of range for 4 classes");
  check_throws_with(
      [&] {
        cross_entropy(x, targets({0, -3, 1}));
      },
      "[cross_entropy] target -3 (row 1)");
  check_throws_with(
      [&] {
        cross_entropy(x, targets({0, 1, 1}, DType::f32));
      },
      "[cross_entropy] target must hold");
  check_throws_with(
      [&] {
        cross_entropy(x, targets({0, 1}));
      },
      "[cross_entropy] target (2,) does not match logits (3, 4): expected (3)");
  check_throws_with(
      [&] {
        cross_entropy(x, targets({0, 1, 1}), {.label_smoothing = 1.5});
      },
      "[cross_entropy] label_smoothing must be in [0, 1], got 1.5");
  check_throws_with([&] { cross_entropy(zeros({4}), targets({0})); },
                    "[cross_entropy] logits must be (N, C)");
  check_throws_with(
      [&] {
        cross_entropy(zeros({2, 4, 3}), zeros({2, 4}, {.dtype = DType::i64}));
      },
      "[cross_entropy] target (2, 4) does not match logits (2, 4, 3): expected (2, 3)");
  check_throws_with(
      [&] {
        cross_entropy(zeros({3, 4}, {.dtype = DType::i64}), targets({0, 1, 1}));
      },
      "[cross_entropy] expected a floating-point");
  check_throws_with([&] { cross_entropy(x, targets({0, 1, 1}), {.loss_dtype = DType::i32}); },
                    "[cross_entropy] loss_dtype must be a floating dtype, got i32");
}

// ---- layer norm --------------------------------------------------------------------------------

TEST_CASE("layer_norm forward values") {
  // Row (1, 2, 3, 4): mean 2.5, biased variance 1.25.
  Tensor x = from_vector({1, 2, 3, 4}, {1, 4}, {.dtype = DType::f64});
  const double r = 1.0 / std::sqrt(1.25 + 1e-5);
  check_close(layer_norm(x, {4}), {-1.5 * r, -0.5 * r, 0.5 * r, 1.5 * r}, 1e-12, 1e-12,
              "no affine");
  Tensor w = from_vector({1, 2, 3, 4}, {4}, {.dtype = DType::f64});
  Tensor b = from_vector({0, 1, 0, -1}, {4}, {.dtype = DType::f64});
  check_close(layer_norm(x, {4}, w, b), {-1.5 * r, -1 * r + 1, 1.5 * r, 6 * r - 1}, 1e-12, 1e-12,
              "affine");

  // Against the composition (x - mean) / sqrt(var + eps) * w + b, over one and two trailing dims.
  Tensor a = input({3, 2, 5}, -2, 2, 61).detach();
  Tensor w2 = input({2, 5}, 0.5, 1.5, 62).detach(), b2 = input({2, 5}, -1, 1, 63).detach();
  auto composed = [](const Tensor& v, const std::vector<std::int64_t>& dims) {
    return (v - mean(v, dims, {.keepdim = true})) /
           sqrt(var(v, dims, {.correction = 0, .keepdim = true}) + 1e-3);
  };
  check_close(layer_norm(a, {5}, {}, {}, 1e-3), composed(a, {-1}), 1e-12, 1e-12, "one dim");
  check_close(layer_norm(a, {2, 5}, w2, b2, 1e-3), composed(a, {1, 2}) * w2 + b2, 1e-12, 1e-12,
              "two dims");
  check_close(layer_norm(a, {2, 5}, {}, b2, 1e-3), composed(a, {1, 2}) + b2, 1e-12, 1e-12,
              "bias only");
}

TEST_CASE("layer_norm in f32 is accurate far from zero") {
  // Mean 1e4, std ~0.6: a one-pass E[x^2] - E[x]^2 in f32 would lose the variance entirely, and
  // centering with an f32 mean would be off by ~1e-3 (torch 1.13 on CPU: 3e-3 here).
  Tensor base = input({2, 64}, -1, 1, 64).detach();
  Tensor far = (base + 1e4).to(DType::f32);
  Tensor exact = layer_norm(far.to(DType::f64), {64});
  check_close(layer_norm(far, {64}), exact, 1.3e-6, 1e-5, "offset 1e4");
}

TEST_CASE("layer_norm gradcheck: with and without weight and bias, 1 and 2 trailing dims") {
  using V = std::vector<Tensor>;
  gradcheck("layer_norm plain", [](const V& in) { return layer_norm(in[0], {4}); },
            {input({3, 4}, -2, 2, 71)});
  gradcheck("layer_norm affine", [](const V& in) { return layer_norm(in[0], {4}, in[1], in[2]); },
            {input({2, 3, 4}, -2, 2, 72), input({4}, 0.5, 1.5, 73), input({4}, -1, 1, 74)});
  gradcheck("layer_norm weight only", [](const V& in) { return layer_norm(in[0], {4}, in[1]); },
            {input({3, 4}, -2, 2, 75), input({4}, 0.5, 1.5, 76)});
  gradcheck("layer_norm bias only", [](const V& in) { return layer_norm(in[0], {4}, {}, in[1]); },
            {input({3, 4}, -2, 2, 77), input({4}, -1, 1, 78)});
  gradcheck("layer_norm two dims",
            [](const V& in) {
              return layer_norm(in[0], {3, 4}, in[1], in[2]);
            },
            {input({2, 3, 4}, -2, 2, 79), input({3, 4}, 0.5, 1.5, 80), input({3, 4}, -1, 1, 81)});
  gradcheck("layer_norm non-contiguous",
            [](const V& in) { return layer_norm(in[0], {4}, in[1], in[2]); },
            {non_contiguous(input({3, 4}, -2, 2, 82)), non_contiguous(input({4}, 0.5, 1.5, 83)),
             input({4}, -1, 1, 84)});
  // Only the weight requires grad.
  Tensor x = input({3, 4}, -2, 2, 85).detach();
  gradcheck("layer_norm weight grad only", [&](const V& in) { return layer_norm(x, {4}, in[0]); },
            {input({4}, 0.5, 1.5, 86)});
}

TEST_CASE("layer_norm adds its weight and bias gradients straight into preset buffers") {
  // Note [Bias gradients in place] (core/ops/linalg.cpp): grad += w * (the sums over rows in the
  // math dtype), the product rounded, then the sum; nothing is returned for them. The expected
  // buffers are that update applied to the sums the op returns where it cannot add in place
  // (grad() capturing the parameters), to the bit. A 16-bit model's f32 buffers take f32 sums:
  // those of the same layer norm in f32 on the same values, not their 16-bit roundings.
  const std::int64_t rows = 23, cols = 70;
  for (DType param : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(std::string(dtype_name(param)));
    const DType math = param == DType::f64 ? DType::f64 : DType::f32;
    const Tensor x = input({rows, cols}, -3, 3, 1).detach().to(param);
    Tensor gamma = input({cols}, 0.5, 1.5, 2).detach().to(param).requires_grad_(true);
    Tensor beta = input({cols}, -1, 1, 3).detach().to(param).requires_grad_(true);
    const Tensor dy1 = input({rows, cols}, -1, 1, 4).detach().to(param);
    const Tensor dy2 = (input({rows, cols}, -1, 1, 5).detach() * 300.0).to(param);
    // The sums over rows, in the math dtype, as the op returns them without buffers: of the
    // math-dtype layer norm on the same values.
    std::vector<std::vector<Tensor>> sums;
    for (const Tensor& dy : {dy1, dy2}) {
      Tensor gm = gamma.detach().to(math).requires_grad_(true), bm = beta.detach().to(math).requires_grad_(true);
      sums.push_back(grad({layer_norm(x.to(math), {cols}, gm, bm)}, {dy.to(math)}, {gm, bm}));
    }
    Tensor dgamma = full({cols}, 0.5, {.dtype = math}), dbeta = full({cols}, -0.25, {.dtype = math});
    gamma.set_grad(dgamma);
    beta.set_grad(dbeta);
    {
      GradWeightGuard weight(0.3);
      for (const Tensor& dy : {dy1, dy2}) layer_norm(x, {cols}, gamma, beta).backward(dy);
    }
    CHECK(gamma.grad().same_storage(dgamma));
    CHECK(beta.grad().same_storage(dbeta));
    for (int p = 0; p < 2; ++p) {
      std::vector<double> want(static_cast<std::size_t>(cols), p == 0 ? 0.5 : -0.25);
      for (const auto& s : sums) {
        const std::vector<double> v = s[static_cast<std::size_t>(p)].to_vector();
        for (std::size_t j = 0; j < want.size(); ++j) want[j] = weighted_add_reference(want[j], v[j], 0.3, math);
      }
      check_close((p == 0 ? dgamma : dbeta).to(DType::f64), want, 0.0, 0.0,
                  p == 0 ? "weight's buffer (to the bit)" : "bias's buffer (to the bit)");
    }
  }
  // In place, the backward allocates only dx; returning the sums takes two (cols) buffers more.
  {
    const std::int64_t wide = 4096;
    const Tensor x = input({8, wide}, -1, 1, 7).detach().to(DType::f32);
    const Tensor dy = input({8, wide}, -1, 1, 8).detach().to(DType::f32);
    auto extra = [&](bool buffers) {
      Tensor gamma = ones({wide}).requires_grad_(true), beta = zeros({wide}).requires_grad_(true);
      if (buffers) {
        gamma.set_grad(zeros({wide}));
        beta.set_grad(zeros({wide}));
      }
      Tensor y = layer_norm(x, {wide}, gamma, beta);
      reset_peak_memory_stats(kCPU);
      const std::int64_t before = memory_stats(kCPU).allocated.current;
      y.backward(dy);
      return memory_stats(kCPU).allocated.peak - before;
    };
    const std::int64_t in_place = extra(true), returned = extra(false);
    INFO("peak above the backward's start: in place " << in_place << ", returned " << returned);
    CHECK(in_place + 2 * wide * 4 <= returned);
  }
  // A buffer that cannot take the sums in place (a 16-bit buffer of a 16-bit weight) sends both
  // through the returned gradients, weighted once.
  Tensor gamma = ones({8}, {.dtype = DType::bf16}).requires_grad_(true);
  Tensor beta = zeros({8}, {.dtype = DType::bf16}).requires_grad_(true);
  Tensor g16 = zeros({8}, {.dtype = DType::bf16}), b32 = zeros({8});
  gamma.set_grad(g16);
  beta.set_grad(b32);
  const Tensor x = input({4, 8}, -1, 1, 6).detach().to(DType::bf16);
  {
    GradWeightGuard weight(0.5);
    layer_norm(x, {8}, gamma, beta).backward(ones({4, 8}, {.dtype = DType::bf16}));
  }
  check_close(beta.grad(), std::vector<double>(8, 2.0), 0, 0, "bias: 0.5 * 4 rows of 1");
  check_close(gamma.grad().to(DType::f32),
              sum(layer_norm(x.to(DType::f32), {8}), {0}).detach() * 0.5, 1e-2, 1e-2,
              "weight: 0.5 * sum of xhat");
}

TEST_CASE("layer_norm errors") {
  Tensor x = zeros({2, 3, 4});
  check_throws_with(
      [&] { layer_norm(x, {3}); },
      "[layer_norm] normalized_shape (3,) does not match the trailing dims of input (2, 3, 4)");
  check_throws_with([&] { layer_norm(x, {}); }, "[layer_norm] normalized_shape () does not match");
  check_throws_with(
      [&] {
        layer_norm(x, {1, 2, 3, 4});
      },
      "[layer_norm] normalized_shape (1, 2, 3, 4)");
  check_throws_with([&] { layer_norm(x, {4}, zeros({3})); },
                    "[layer_norm] weight has shape (3,), expected normalized_shape (4,)");
  check_throws_with(
      [&] {
        layer_norm(x, {4}, {}, zeros({4, 1}));
      },
      "[layer_norm] bias has shape (4, 1)");
  check_throws_with([&] { layer_norm(x, {4}, zeros({4}, {.dtype = DType::f64})); },
                    "[layer_norm] weight is f64 but input is f32");
  check_throws_with(
      [&] {
        layer_norm(zeros({2, 4}, {.dtype = DType::i32}), {4});
      },
      "[layer_norm] expected a floating-point");
}

// ---- dropout -----------------------------------------------------------------------------------

TEST_CASE("dropout draws its mask from Philox: element i keeps iff uniform_i >= p") {
  const double p = 0.3;
  manual_seed(7);
  std::vector<double> u = rand({1000}).to_vector();
  manual_seed(7);
  std::vector<double> y = dropout(ones({1000}), p).to_vector();
  std::int64_t kept = 0;
  for (std::size_t i = 0; i < u.size(); ++i) {
    CHECK(y[i] == doctest::Approx(u[i] >= p ? 1.0 / (1.0 - p) : 0.0));
    kept += y[i] != 0.0;
  }
  CHECK(kept > 650);  // about 700 expected; fixed seed, so this is a sanity bound, not a flaky one
  CHECK(kept < 750);
}

TEST_CASE("dropout: same seed, same mask; successive calls differ; p = 0 and p = 1") {
  Tensor x = input({8, 16}, 0.5, 1.5, 91).detach();
  manual_seed(3);
  Tensor a = dropout(x, 0.5), b = dropout(x, 0.5);
  manual_seed(3);
  Tensor c = dropout(x, 0.5);
  check_close(c, a, 0, 0, "same seed");
  CHECK(a.to_vector() != b.to_vector());
  check_close(dropout(x, 0.0), x, 0, 0, "p = 0");
  CHECK(dropout(x, 0.0).same_storage(x));
  Tensor xg = input({4}, 0.5, 1.5, 92);
  Tensor z = dropout(xg, 1.0);
  check_close(z, {0, 0, 0, 0}, 0, 0, "p = 1");
  sum(z).backward();
  check_close(xg.grad(), {0, 0, 0, 0}, 0, 0, "p = 1 gradient");
}

TEST_CASE("dropout gradient equals the mask, and gradcheck with a fixed seed") {
  Tensor x = input({5, 7}, 0.5, 1.5, 93);
  manual_seed(11);
  Tensor y = dropout(x, 0.4);
  sum(y).backward();
  // mask = y / x, each 0 or 1 / 0.6
  check_close(x.grad(), y.detach() / x.detach(), 1e-12, 1e-12, "dx = mask");
  for (double m : x.grad().to_vector()) CHECK((m == 0.0 || m == doctest::Approx(1.0 / 0.6)));
  gradcheck("dropout",
            [](const std::vector<Tensor>& in) {
              manual_seed(12);
              return dropout(in[0], 0.5);
            },
            {input({3, 4}, -1, 1, 94)});
  gradcheck("dropout non-contiguous",
            [](const std::vector<Tensor>& in) {
              manual_seed(13);
              return dropout(in[0], 0.25);
            },
            {non_contiguous(input({3, 4}, -1, 1, 95))});
}

TEST_CASE("dropout inside a checkpoint recomputes the same mask") {
  auto segment = [](const Tensor& v) { return dropout(v * 2.0, 0.5) * v; };
  Tensor x1 = input({6, 6}, 0.5, 1.5, 96), x2 = input({6, 6}, 0.5, 1.5, 96);
  manual_seed(21);
  sum(segment(x1)).backward();
  manual_seed(21);
  Tensor out = checkpoint(segment, x2);
  dropout(x2, 0.5);  // later draws move the generator on; the recompute must rewind it
  sum(out).backward();
  check_close(x2.grad(), x1.grad(), 0, 0, "checkpointed gradient");
}

TEST_CASE("dropout errors and 16-bit masks") {
  check_throws_with([] { dropout(zeros({3}), -0.1); },
                    "[dropout] probability p must be in [0, 1], got -0.1");
  check_throws_with([] { dropout(zeros({3}), 1.5); },
                    "[dropout] probability p must be in [0, 1], got 1.5");
  check_throws_with([] { dropout(zeros({3}), std::numeric_limits<double>::quiet_NaN()); },
                    "[dropout] probability p");
  check_throws_with([] { dropout(zeros({3}, {.dtype = DType::i64}), 0.5); },
                    "[dropout] expected a floating-point");
  manual_seed(5);
  Tensor h = dropout(ones({64}, {.dtype = DType::bf16}), 0.5);
  CHECK(h.dtype() == DType::bf16);
  for (double v : h.to_vector()) CHECK((v == 0.0 || v == 2.0));
}

TEST_CASE("nn ops on the meta device: shapes only") {
  const TensorOptions meta{.device = kMeta};
  CHECK(softmax(empty({2, 3, 4}, meta), 1).shape() == Shape{2, 3, 4});
  CHECK(log_softmax(empty({2, 3}, meta), -1).shape() == Shape{2, 3});
  CHECK(cross_entropy(empty({4, 5}, meta), empty({4}, {.dtype = DType::i64, .device = kMeta}))
            .shape() == Shape{});
  CHECK(layer_norm(empty({2, 8}, meta), {8}, empty({8}, meta), empty({8}, meta)).shape() ==
        Shape{2, 8});
  CHECK(dropout(empty({2, 8}, meta), 0.1).shape() == Shape{2, 8});
}
