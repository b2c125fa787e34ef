#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

TEST_CASE("matmul forward values") {
  Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector({7, 8, 9, 10, 11, 12}, {3, 2});
  check_close(matmul(a, b), {58, 64, 139, 154}, 0, 0, "2-d");
  check_close(matmul(a.t(), a), {17, 22, 27, 22, 29, 36, 27, 36, 45}, 0, 0, "transposed view");
  check_close(matmul(from_vector({1, 2, 3}, {3}), b), {58, 64}, 0, 0, "1-d @ 2-d");
  CHECK(matmul(from_vector({1, 2, 3}, {3}), from_vector({1, 2, 3}, {3})).item() == 14);
}

TEST_CASE("matmul gradcheck: 2-d, batched, broadcast batch, 1-d, non-contiguous") {
  auto f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  gradcheck("matmul 2-d", f, {input({3, 4}), input({4, 5}, -1, 1, 2)});
  gradcheck("matmul batched", f, {input({2, 3, 4}), input({2, 4, 5}, -1, 1, 2)});
  gradcheck("matmul broadcast batch", f, {input({2, 1, 3, 4}), input({3, 4, 2}, -1, 1, 2)});
  gradcheck("matmul (..., K) @ (K, N)", f, {input({2, 3, 4}), input({4, 2}, -1, 1, 2)});
  gradcheck("matmul 1-d", f, {input({4}), input({4, 3}, -1, 1, 2)});
  Tensor wt = input({5, 4}, -1, 1, 2).detach().t();  // a leaf with transposed strides
  wt.requires_grad_(true);
  gradcheck("matmul non-contiguous", f, {non_contiguous(input({3, 4})), wt});
}

TEST_CASE("linear gradcheck and errors") {
  auto f = [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); };
  gradcheck("linear", f, {input({2, 3, 4}), input({5, 4}, -1, 1, 2), input({5}, -1, 1, 3)});
  check_throws_with([] { matmul(zeros({4, 3}), zeros({5, 2})); }, "[matmul] inner dimensions differ: (4, 3) @ (5, 2)");
  check_throws_with([] { linear(zeros({2, 3}), zeros({4, 5})); }, "[linear]");
}

TEST_CASE("matmul in 16-bit accumulates in f32") {
  Tensor a = ones({1, 4096}, {.dtype = DType::bf16});
  Tensor b = full({4096, 1}, 1.0 / 64, {.dtype = DType::bf16});
  CHECK(matmul(a, b).item() == 64.0);
}

TEST_CASE("linear matches its composition x @ w^T + b, also in bf16 where it rounds once") {
  Tensor x = input({2, 3, 4}), w = input({5, 4}, -1, 1, 2), b = input({5}, -1, 1, 3);
  check_close(linear(x, w, b), matmul(x, w.t()) + b, 1e-15, 1e-15, "f64");
  Tensor xb = x.to(DType::bf16), wb = w.to(DType::bf16), bb = b.to(DType::bf16);
  Tensor once = (matmul(xb.to(DType::f32), wb.to(DType::f32).t()) + bb.to(DType::f32)).to(DType::bf16);
  check_close(linear(xb, wb, bb), once, 0, 0, "bf16 rounds once");
}

TEST_CASE("linear adds its bias gradient straight into a preset buffer, as the summing loop") {
  // Note [Bias gradients in place]: grad += w * (dy's column sums in f64, rounded to the buffer's
  // compute type), the product rounded, then the sum, and no bias gradient returned. The expected
  // buffer is that loop, written out here in the buffer's arithmetic, to the bit.
  struct Case {
    DType param, buffer;
  };
  const std::int64_t m = 37, k = 5, n = 6;
  for (Case c : {Case{DType::f32, DType::f32}, Case{DType::bf16, DType::f32}, Case{DType::f16, DType::f32},
                 Case{DType::f64, DType::f64}, Case{DType::bf16, DType::bf16}}) {
    CAPTURE(std::string(dtype_name(c.param)));
    CAPTURE(std::string(dtype_name(c.buffer)));
    const Tensor x = input({m, k}).detach().to(c.param), w = input({n, k}, -1, 1, 2).detach().to(c.param);
    Tensor b = input({n}, -1, 1, 3).detach().to(c.param).requires_grad_(true);
    Tensor buffer = full({n}, 0.5, {.dtype = c.buffer});
    b.set_grad(buffer);
    // Values of mixed magnitude, so that the column sums round; the second stored transposed,
    // which the CPU reads where it lies.
    const Tensor dy1 = input({m, n}, -1, 1, 4).detach().to(c.param);
    const Tensor dy2 = (input({n, m}, -1, 1, 5).detach() * 1000.0 + 0.1).to(c.param).t();
    {
      GradWeightGuard weight(0.3);
      for (const Tensor& dy : {dy1, dy2}) linear(x, w, b).backward(dy);
    }
    CHECK(b.grad().same_storage(buffer));  // written in place
    std::vector<double> want(static_cast<std::size_t>(n), 0.5);
    for (const Tensor& dy : {dy1, dy2}) {
      const std::vector<double> g = dy.to_vector();
      for (std::int64_t col = 0; col < n; ++col) {
        double column = 0.0;  // f64, in row order
        for (std::int64_t r = 0; r < m; ++r) column += g[static_cast<std::size_t>(r * n + col)];
        double& t = want[static_cast<std::size_t>(col)];
        t = weighted_add_reference(t, column, 0.3, c.buffer);
      }
    }
    check_close(buffer.to(DType::f64), want, 0.0, 0.0, "the buffer after two weighted backward passes (to the bit)");
  }
  // On the CPU that takes no tensor memory, dy in rows or transposed: no copy of dy, no (N)
  // temporary (the sums live in the kernel's scratch).
  for (bool transposed : {false, true}) {
    CAPTURE(transposed);
    const Tensor x = input({256, 8}).detach().to(DType::f32), w = input({64, 8}, -1, 1, 2).detach().to(DType::f32);
    Tensor b = zeros({64}).requires_grad_(true);
    b.set_grad(zeros({64}));
    const Tensor dy = transposed ? input({64, 256}, -1, 1, 3).detach().to(DType::f32).t()
                                 : input({256, 64}, -1, 1, 3).detach().to(DType::f32);
    Tensor y = linear(x, w, b);
    reset_peak_memory_stats(kCPU);
    const std::int64_t before = memory_stats(kCPU).allocated.current;
    y.backward(dy);
    CHECK(memory_stats(kCPU).allocated.peak == before);
    check_close(b.grad(), sum(dy, {0}), 1e-6, 1e-6, "the bias gradient");
  }
  // grad() capturing the bias gets the column sums returned, and the buffer is left alone.
  Tensor x = input({7, 3}).detach(), w = input({4, 3}, -1, 1, 2).detach();
  Tensor b = zeros({4}).to(DType::f64).requires_grad_(true);
  Tensor buffer = zeros({4}, {.dtype = DType::f64});
  b.set_grad(buffer);
  const Tensor dy = input({7, 4}, -1, 1, 3).detach();
  const Tensor db = grad({sum(linear(x, w, b) * dy)}, {Tensor()}, {b})[0];
  CHECK_FALSE(db.same_storage(buffer));
  check_close(db, sum(dy, {0}), 1e-15, 1e-15, "captured bias gradient");
  CHECK(sum(buffer).item() == 0.0);
}

TEST_CASE("linear writes the weight gradient straight into a preset buffer: grad += w * dy^T x") {
  Tensor x = input({6, 4}), w = input({3, 4}, -1, 1, 2), b = input({3}, -1, 1, 3);
  Tensor dy = input({6, 3}, -1, 1, 4).detach();
  Tensor reference = matmul(dy.t(), x.detach());  // dL/dw for L = sum(linear(x, w, b) * dy)
  Tensor buffer = zeros({3, 4}, {.dtype = DType::f64});
  w.set_grad(buffer);
  {
    GradWeightGuard weight(0.25);
    sum(linear(x, w, b) * dy).backward();
    sum(linear(x, w, b) * dy).backward();
  }
  CHECK(w.grad().same_storage(buffer));  // no new gradient tensor was made
  check_close(buffer, reference * 0.5, 1e-14, 1e-14, "0.25 + 0.25 of dw");
  check_close(b.grad(), sum(dy, {0}) * 0.5, 1e-14, 1e-14, "bias gradient, weighted");
  // grad() that captures the weight gets dw returned and leaves the buffer alone.
  std::vector<Tensor> got = grad({sum(linear(x, w, b) * dy)}, {Tensor()}, {w});
  check_close(got[0], reference, 1e-14, 1e-14, "captured dw");
  check_close(buffer, reference * 0.5, 1e-14, 1e-14, "buffer unchanged by grad()");
}

TEST_CASE("matmul broadcasts a batch of 1 against an empty batch, as torch") {
  // (0, 2, 3) @ (1, 3, 4) and its mirror: the batch of 1 broadcasts to 0, not 0 to 1.
  for (bool mirror : {false, true}) {
    CAPTURE(mirror);
    Tensor a = ones({mirror ? 1 : 0, 2, 3}, {.dtype = DType::f64}).requires_grad_(true);
    Tensor b = ones({mirror ? 0 : 1, 3, 4}, {.dtype = DType::f64}).requires_grad_(true);
    Tensor y = matmul(a, b);
    CHECK(y.shape() == Shape{0, 2, 4});
    sum(y).backward();
    // The broadcast operand's gradient sums over no batches: zeros of its own shape.
    const Tensor& broadcast = mirror ? a : b;
    const Tensor& emptied = mirror ? b : a;
    CHECK(broadcast.grad().shape() == broadcast.shape());
    check_close(broadcast.grad(), zeros(broadcast.shape(), {.dtype = DType::f64}), 0, 0,
                "zero grad");
    CHECK(emptied.grad().shape() == emptied.shape());
  }
  CHECK(matmul(ones({2, 0, 2, 3}), ones({1, 3, 4})).shape() == Shape{2, 0, 2, 4});
  CHECK(matmul(ones({3}), ones({0, 3, 4})).shape() == Shape{0, 4});
  CHECK(matmul(ones({0, 2, 3}), ones({3})).shape() == Shape{0, 2});
  // K = 0 with a broadcast batch still writes zeros.
  check_close(matmul(ones({2, 2, 0}), ones({1, 0, 4})), std::vector<double>(16, 0.0), 0, 0,
              "K = 0");
  check_throws_with([] { matmul(ones({0, 2, 3}), ones({2, 3, 4})); }, "[matmul]");
}

TEST_CASE("linear with no output features or no rows gives empty outputs and zero gradients") {
  // torch: linear((3, 4), (0, 4), (0)) is (3, 0), and the input's gradient is zeros.
  for (const Shape& xs : {Shape{3, 4}, Shape{2, 3, 4}, Shape{4}}) {
    CAPTURE(shape_str(xs));
    Tensor x = ones(xs, {.dtype = DType::f64}).requires_grad_(true);
    Tensor w = ones({0, 4}, {.dtype = DType::f64}).requires_grad_(true);
    Tensor b = ones({0}, {.dtype = DType::f64}).requires_grad_(true);
    Tensor y = linear(x, w, b);
    Shape want(xs.begin(), xs.end() - 1);
    want.push_back(0);
    CHECK(y.shape() == want);
    sum(y).backward();
    check_close(x.grad(), zeros(xs, {.dtype = DType::f64}), 0, 0, "dx");
    CHECK(w.grad().shape() == Shape{0, 4});
    CHECK(b.grad().shape() == Shape{0});
  }
  // No rows: (0, 4) -> (0, 2), with zero weight and bias gradients.
  Tensor x = ones({0, 4}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor w = ones({2, 4}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor b = ones({2}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor y = linear(x, w, b);
  CHECK(y.shape() == Shape{0, 2});
  sum(y).backward();
  check_close(w.grad(), zeros({2, 4}, {.dtype = DType::f64}), 0, 0, "dw");
  check_close(b.grad(), zeros({2}, {.dtype = DType::f64}), 0, 0, "db");
  // Preset gradient buffers take the in-place path, which adds nothing for either empty case.
  for (std::int64_t n : {0, 2}) {
    CAPTURE(n);
    Tensor xi = ones({n == 0 ? 3 : 0, 4});
    Tensor wi = ones({n, 4}).requires_grad_(true), bi = ones({n}).requires_grad_(true);
    Tensor wbuf = full({n, 4}, 0.5), bbuf = full({n}, 0.5);
    wi.set_grad(wbuf);
    bi.set_grad(bbuf);
    sum(linear(xi, wi, bi)).backward();
    CHECK(wi.grad().same_storage(wbuf));
    CHECK(bi.grad().same_storage(bbuf));
    check_close(wbuf, full({n, 4}, 0.5), 0, 0, "weight buffer unchanged");
    check_close(bbuf, full({n}, 0.5), 0, 0, "bias buffer unchanged");
  }
  // The MLP composition with an empty output layer, and meta.
  Tensor h = ones({3, 4}).requires_grad_(true);
  Tensor out = gelu_mlp(h, ones({5, 4}), ones({5}), ones({0, 5}), ones({0}));
  CHECK(out.shape() == Shape{3, 0});
  sum(out).backward();
  check_close(h.grad(), zeros({3, 4}), 0, 0, "gelu_mlp dx");
  CHECK(linear(empty({3, 4}, {.device = kMeta}), empty({0, 4}, {.device = kMeta})).shape() ==
        Shape{3, 0});
}
