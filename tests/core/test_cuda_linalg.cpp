// matmul, linear, conv2d and max_pool2d on CUDA against the CPU (cuBLAS, cuDNN or im2col, and the
// pooling kernels), the weight-gradient GEMM into an f32 arena on CUDA, and, on the CPU, the
// layout rules those paths rest on and what meta predicts for them.
#include <cmath>

#include "core/ops/dispatch.h"
#include "kernels/conv.h"
#include "kernels/gemm.h"
#include "kernels/reduce.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

constexpr DType kFloatTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64};

// A leaf of the given dtype requiring grad, with input()'s deterministic values.
Tensor leaf(const Shape& shape, DType dtype, std::uint64_t seed) {
  return input(shape, -1, 1, seed).detach().to(dtype).requires_grad_(true);
}

// A leaf whose last two dims are stored transposed (row stride 1).
Tensor transposed_leaf(const Shape& shape, DType dtype, std::uint64_t seed) {
  Shape swapped = shape;
  std::swap(swapped[swapped.size() - 1], swapped[swapped.size() - 2]);
  Tensor t = input(swapped, -1, 1, seed).detach().to(dtype).transpose(-1, -2);
  return t.requires_grad_(true);
}

Tensor to_dtype(const Tensor& t, DType dtype) {
  return t.defined() ? t.detach().to(dtype).requires_grad_(t.requires_grad()) : Tensor();
}

std::string label(const std::string& what, DType dtype) { return what + " " + dtype_name(dtype); }

// The (d, d) f32 identity.
Tensor eye_matrix(std::int64_t d) {
  std::vector<double> v(static_cast<std::size_t>(d * d), 0.0);
  for (std::int64_t i = 0; i < d; ++i) v[static_cast<std::size_t>(i * d + i)] = 1.0;
  return from_vector(v, {d, d}, {.dtype = DType::f32});
}

}  // namespace

// ---- CPU: the layout rules and meta's predictions ---------------------------------------------

TEST_CASE("blas_matrix: which layout a BLAS reads a view in, and when it needs a copy") {
  using kernels::blas_matrix;
  auto same = [](kernels::BlasMatrix m, bool row_major, std::int64_t ld) {
    return m.ok && m.row_major == row_major && m.ld == ld;
  };
  CHECK(same(blas_matrix(3, 4, 4, 1), true, 4));   // contiguous
  CHECK(same(blas_matrix(3, 4, 7, 1), true, 7));   // rows of a wider matrix
  CHECK(same(blas_matrix(3, 4, 1, 3), false, 3));  // a transposed contiguous (4, 3)
  CHECK(same(blas_matrix(3, 4, 1, 5), false, 5));
  CHECK(same(blas_matrix(1, 4, 0, 1), true, 4));  // one row: its stride is free
  CHECK(same(blas_matrix(1, 4, 99, 1), true, 4));
  CHECK(same(blas_matrix(3, 1, 1, 0), true, 1));  // one column, unit row stride
  CHECK(same(blas_matrix(3, 1, 5, 7), true, 5));  // one column, spaced rows
  CHECK(same(blas_matrix(1, 1, 0, 0), true, 1));
  CHECK(same(blas_matrix(1, 4, 1, 6), false, 6));  // one row, strided columns: column-major
  CHECK_FALSE(blas_matrix(3, 4, 8, 2).ok);         // no unit stride
  CHECK_FALSE(blas_matrix(3, 4, 0, 1).ok);         // broadcast rows overlap
  CHECK_FALSE(blas_matrix(3, 4, 2, 1).ok);         // overlapping rows
  CHECK_FALSE(blas_matrix(3, 4, 1, 0).ok);         // broadcast columns
  CHECK_FALSE(blas_matrix(3, 1, 0, 1).ok);         // a broadcast column vector
}

TEST_CASE("covering_windows agrees with the windows' definition") {
  for (std::int64_t size = 1; size <= 9; ++size)
    for (std::int64_t kernel = 1; kernel <= 4; ++kernel)
      for (std::int64_t stride = 1; stride <= 3; ++stride)
        for (std::int64_t padding = 0; padding <= 2; ++padding) {
          if (kernel > size + 2 * padding) continue;
          const std::int64_t out = (size + 2 * padding - kernel) / stride + 1;
          for (std::int64_t x = 0; x < size; ++x) {
            std::int64_t first = 0, last = 0;
            kernels::covering_windows(x, kernel, stride, padding, out, &first, &last);
            std::int64_t want_first = -1, want_last = -2;
            for (std::int64_t o = 0; o < out; ++o) {
              if (o * stride - padding <= x && x < o * stride - padding + kernel) {
                if (want_first < 0) want_first = o;
                want_last = o;
              }
            }
            INFO("size " << size << " kernel " << kernel << " stride " << stride << " padding "
                         << padding << " x " << x);
            if (want_first < 0) {
              CHECK(first > last);
            } else {
              CHECK(first == want_first);
              CHECK(last == want_last);
            }
          }
        }
}

namespace {

// Equal values, NaN equal to NaN.
bool same_values(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

kernels::Window2d window(const Shape& x, std::int64_t kh, std::int64_t kw, std::int64_t stride,
                         std::int64_t padding) {
  kernels::Window2d w;
  w.channels = x[x.size() - 3], w.height = x[x.size() - 2], w.width = x[x.size() - 1];
  w.kernel_h = kh, w.kernel_w = kw, w.stride = stride, w.padding = padding;
  w.out_h = (w.height + 2 * padding - kh) / stride + 1;
  w.out_w = (w.width + 2 * padding - kw) / stride + 1;
  return w;
}

// Values from a few levels, so that windows hold ties; one NaN where `nan` is set.
Tensor levels(const Shape& shape, DType dtype, std::uint64_t seed, bool nan = false) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<double>((i * 7 + seed * 3) % 5) - 2.0;
  if (nan && v.size() > 3) v[3] = std::nan("");
  return from_vector(v, shape).to(dtype);
}

struct WindowCase {
  Shape x;
  std::int64_t kh, kw, stride, padding;
};

const WindowCase kWindowCases[] = {
    {{2, 3, 6, 6}, 3, 3, 1, 1}, {{1, 2, 7, 5}, 2, 3, 2, 0}, {{2, 1, 5, 5}, 3, 3, 2, 1},
    {{1, 2, 5, 5}, 2, 2, 3, 1}, {{1, 1, 1, 1}, 1, 1, 1, 0}, {{1, 2, 9, 9}, 4, 4, 3, 2},
    {{2, 2, 4, 7}, 5, 5, 1, 2}, {{1, 2, 6, 6}, 3, 1, 1, 1},
};

}  // namespace

TEST_CASE("the CUDA kernels' per-element math matches the CPU kernels bit for bit") {
  for (const WindowCase& wc : kWindowCases) {
    const kernels::Window2d w = window(wc.x, wc.kh, wc.kw, wc.stride, wc.padding);
    const std::int64_t batch = wc.x[0], image = w.channels * w.height * w.width;
    INFO("x " << shape_str(wc.x) << " kernel " << wc.kh << "x" << wc.kw << " stride " << wc.stride
              << " padding " << wc.padding);
    for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
      INFO(dtype_name(dt));
      dispatch_float(dt, "test", [&]<class T>() {
        using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
        const DType col_dtype = std::is_same_v<C, double> ? DType::f64 : DType::f32;
        // im2col of one image from a strided x, and from a contiguous one (the CPU's paths for
        // contiguous runs and, with stride 1 and "same" padding, for a tap's rows as one run).
        std::vector<double> got;
        for (const Tensor& x : {non_contiguous(levels(wc.x, dt, 1)).select(0, 0),  // (C, H, W)
                                levels(wc.x, dt, 1).select(0, 0)}) {
          Tensor col = empty({w.col_rows(), w.col_cols()}, {.dtype = col_dtype});
          kernels::cpu::im2col(x.kview(), col.kview(), w);
          got.clear();
          for (std::int64_t e = 0; e < col.numel(); ++e)
            got.push_back(kernels::im2col_element<T, C>(x.kview(), w, e));
          CHECK(same_values(got, col.to_vector()));
        }

        // col2im onto a non-zero image.
        const Tensor dcol = input({w.col_rows(), w.col_cols()}, -1, 1, 2).detach().to(col_dtype);
        const Tensor start =
            input({w.channels, w.height, w.width}, -1, 1, 3).detach().to(col_dtype);
        Tensor dx = start.clone();
        kernels::cpu::col2im(dcol.kview(), dx.kview(), w);
        got.clear();
        for (std::int64_t e = 0; e < image; ++e)
          got.push_back(kernels::col2im_element(dcol.kview().ptr<const C>(),
                                                start.kview().ptr<const C>()[e], w, e));
        CHECK(same_values(got, dx.to_vector()));

        // max_pool2d over ties and a NaN, from a strided x, then its backward onto a non-zero dx.
        if (wc.padding > std::min(wc.kh, wc.kw) / 2 || wc.kh != wc.kw) return;
        const Tensor xp = non_contiguous(levels(wc.x, dt, 4, true));
        const Shape out_shape{batch, w.channels, w.out_h, w.out_w};
        Tensor out = empty(out_shape, {.dtype = dt}),
               indices = empty(out_shape, {.dtype = DType::i64});
        kernels::cpu::max_pool2d(xp.kview(), out.kview(), indices.kview(), w);
        std::vector<double> got_out, got_at;
        for (std::int64_t e = 0; e < out.numel(); ++e) {
          std::int64_t at = -2;
          got_out.push_back(static_cast<T>(kernels::max_pool2d_element<T>(xp.kview(), w, e, &at)));
          got_at.push_back(static_cast<double>(at));
        }
        CHECK(same_values(got_out, out.to_vector()));
        CHECK(same_values(got_at, indices.to_vector()));

        const Tensor dy = non_contiguous(input(out_shape, -1, 1, 5).detach().to(dt));
        const Tensor dx_start = input(wc.x, -1, 1, 6).detach().to(dt);
        Tensor dxp = dx_start.clone();
        kernels::cpu::max_pool2d_backward(dy.kview(), indices.kview(), dxp.kview(), w);
        got.clear();
        for (std::int64_t e = 0; e < dxp.numel(); ++e) {
          const T acc = dx_start.kview().ptr<const T>()[e];
          got.push_back(static_cast<double>(static_cast<compute_t<T>>(
              kernels::max_pool2d_backward_element<T>(dy.kview(), indices.kview(), acc, w, e))));
        }
        CHECK(same_values(got, dxp.to_vector()));
      });
    }
  }
}

TEST_CASE("meta mirroring CUDA: a bf16 linear makes no f32 operand copies") {
  constexpr std::int64_t m = 64, k = 256, n = 256;
  // Peak bytes above the start of a forward and backward of a bf16 linear on meta, with the
  // weight's gradient in a preset f32 buffer (an arena slot), under the given backend.
  auto peak = [&](Backend backend, bool backward) {
    MetaBackendGuard mirror(backend);
    Tensor x = empty({m, k}, {.dtype = DType::bf16, .device = kMeta}).requires_grad_(true);
    Tensor w = empty({n, k}, {.dtype = DType::bf16, .device = kMeta}).requires_grad_(true);
    Tensor b = empty({n}, {.dtype = DType::bf16, .device = kMeta});
    w.set_grad(empty({n, k}, {.dtype = DType::f32, .device = kMeta}));
    reset_peak_memory_stats(kMeta);
    const std::int64_t start = memory_stats(kMeta).allocated.current;
    {
      Tensor y = linear(x, w, b);
      if (backward) sum(y).backward();
    }
    return memory_stats(kMeta).allocated.peak - start;
  };
  const std::int64_t cpu_forward = peak(Backend::cpu, false),
                     cuda_forward = peak(Backend::cuda, false);
  INFO("forward peaks: cpu " << cpu_forward << ", cuda " << cuda_forward);
  CHECK(cuda_forward < cpu_forward);
  // On CUDA the forward allocates its bf16 output and nothing else: no f32 x, w or output.
  CHECK(cuda_forward < m * n * 2 + m * k * 4);
  const std::int64_t cpu_step = peak(Backend::cpu, true), cuda_step = peak(Backend::cuda, true);
  INFO("forward + backward peaks: cpu " << cpu_step << ", cuda " << cuda_step);
  CHECK(cuda_step < cpu_step);
}

TEST_CASE("meta mirroring CUDA: 16-bit linear rows are padded to 16 bytes, and the loss keeps them") {
  // Note [Padded rows]: the (M, N) output of a 16-bit linear on CUDA lies in rows of a multiple of
  // 8 elements; cross_entropy reads them in place and gives dlogits the same rows, which the
  // linear's backward reads in place too. f32, one row, whole rows and the CPU stay dense.
  struct Case {
    Backend backend;
    DType dt;
    std::int64_t m, n, row;  // row: the expected row stride of the output
  };
  for (Case c : {Case{Backend::cuda, DType::bf16, 64, 1001, 1008}, Case{Backend::cuda, DType::f16, 6, 1, 8},
                 Case{Backend::cuda, DType::bf16, 64, 1000, 1000}, Case{Backend::cuda, DType::bf16, 1, 33, 33},
                 Case{Backend::cuda, DType::f32, 64, 1001, 1001}, Case{Backend::cpu, DType::bf16, 64, 1001, 1001}}) {
    CAPTURE(static_cast<int>(c.backend));
    CAPTURE(std::string(dtype_name(c.dt)));
    CAPTURE(c.m);
    CAPTURE(c.n);
    MetaBackendGuard mirror(c.backend);
    Tensor x = empty({c.m, 16}, {.dtype = c.dt, .device = kMeta}).requires_grad_(true);
    Tensor w = empty({c.n, 16}, {.dtype = c.dt, .device = kMeta}).requires_grad_(true);
    Tensor b = empty({c.n}, {.dtype = c.dt, .device = kMeta}).requires_grad_(true);
    Tensor y = linear(x, w, b);
    CHECK(y.shape() == Shape{c.m, c.n});
    if (c.m > 1) CHECK(y.strides()[0] == c.row);
    CHECK(y.strides()[1] == 1);
    // The loss's backward hands linear's backward a gradient with the same rows, and no copy of
    // the logits is made: the step allocates the logits and dlogits (padded) and small things.
    Tensor target = zeros({c.m}, {.dtype = DType::i64, .device = kMeta});
    reset_peak_memory_stats(kMeta);
    const std::int64_t start = memory_stats(kMeta).allocated.current;
    Tensor loss = cross_entropy(y, target, {.loss_dtype = DType::f32});
    loss.backward();
    CHECK(x.grad().shape() == x.shape());
    CHECK(w.grad().shape() == w.shape());
    const std::int64_t step = memory_stats(kMeta).allocated.peak - start;
    const std::int64_t rows_bytes = c.m * c.row * static_cast<std::int64_t>(dtype_size(c.dt));
    const std::int64_t grads_bytes = (c.n * 16 + c.n + c.m * 16) * static_cast<std::int64_t>(dtype_size(c.dt));
    INFO("peak above the logits " << step << " bytes; one copy of the rows is " << rows_bytes
                                  << ", the parameter and input gradients " << grads_bytes);
    // dlogits and the gradients, plus per-row statistics and the allocator's rounding; a copy of
    // the logits (dense or f32) would add at least rows_bytes.
    if (c.backend == Backend::cuda && c.m > 1) CHECK(step < rows_bytes + grads_bytes + 16384);
  }
}

TEST_CASE("meta mirroring CUDA: gelu_mlp is one node that makes no GELU-gradient temporary") {
  // Note [MLP in GEMM epilogues]: a bf16 MLP step on meta standing in for CUDA peaks below the
  // composition's, which holds GELU's output gradient and its input gradient at once, and the
  // gradients keep their shapes; the CPU composes the MLP, so there the two are the same.
  const std::int64_t m = 1024, k = 128, hidden = 512, n = 128;  // activations outweigh weights
  auto peak = [&](Backend backend, bool fused) {
    MetaBackendGuard mirror(backend);
    const TensorOptions o{.dtype = DType::bf16, .device = kMeta};
    Tensor x = empty({m, k}, o).requires_grad_(true);
    Tensor w1 = empty({hidden, k}, o).requires_grad_(true), b1 = empty({hidden}, o).requires_grad_(true);
    Tensor w2 = empty({n, hidden}, o).requires_grad_(true), b2 = empty({n}, o).requires_grad_(true);
    reset_peak_memory_stats(kMeta);
    const std::int64_t start = memory_stats(kMeta).allocated.current;
    {
      Tensor y = fused ? gelu_mlp(x, w1, b1, w2, b2)
                       : linear(gelu(linear(x, w1, b1), GeluApproximate::Tanh), w2, b2);
      CHECK(y.shape() == Shape{m, n});
      sum(y).backward();
      for (const Tensor* t : {&x, &w1, &b1, &w2, &b2}) CHECK(t->grad().shape() == t->shape());
    }
    return memory_stats(kMeta).allocated.peak - start;
  };
  // With retain_graph the node keeps GELU's input and output for a second backward.
  {
    MetaBackendGuard mirror(Backend::cuda);
    const TensorOptions o{.dtype = DType::bf16, .device = kMeta};
    Tensor x = empty({m, k}, o).requires_grad_(true);
    Tensor w1 = empty({hidden, k}, o).requires_grad_(true), w2 = empty({n, hidden}, o).requires_grad_(true);
    Tensor y = gelu_mlp(x, w1, empty({hidden}, o), w2, empty({n}, o));
    sum(y).backward({.retain_graph = true});
    CHECK(retaining_graph() == false);  // only while a backward runs
    sum(y).backward();
    CHECK(x.grad().shape() == x.shape());
  }
  const std::int64_t fused = peak(Backend::cuda, true), composed = peak(Backend::cuda, false);
  INFO("peaks on meta mirroring CUDA: fused " << fused << ", composed " << composed);
  CHECK(fused + m * hidden * 2 <= composed);  // one (M, hidden) bf16 temporary fewer
  CHECK(peak(Backend::cpu, true) == peak(Backend::cpu, false));
}

TEST_CASE("meta mirroring CUDA: gelu_mlp keeps what the composition keeps, whatever needs grad") {
  // Note [Saving only what a gradient reads]: with frozen weights, or an input that is data, the
  // fused node holds after its forward exactly the bytes the composition's nodes hold, and its
  // backward gives a gradient to exactly the inputs that need one. The input is an activation
  // (made by an op, no other handle on it), so that keeping it costs bytes too.
  const std::int64_t m = 256, k = 64, hidden = 256, n = 64;
  struct Needs {
    bool x, w1, b1, w2, b2;
    const char* name;
  };
  for (const Needs& r : {Needs{true, true, true, true, true, "everything"},
                         Needs{true, false, false, false, false, "x alone (frozen weights)"},
                         Needs{false, true, true, true, true, "the weights (x is data)"},
                         Needs{false, false, false, true, true, "the second layer alone"},
                         Needs{false, true, true, false, false, "the first layer alone"},
                         Needs{true, false, false, true, false, "x and w2"},
                         Needs{false, false, true, false, false, "b1 alone"},
                         Needs{false, false, false, false, true, "b2 alone"}}) {
    INFO("needing a gradient: " << std::string(r.name));
    auto held = [&](bool fused) {
      MetaBackendGuard mirror(Backend::cuda);
      const TensorOptions o{.dtype = DType::bf16, .device = kMeta};
      Tensor x0 = empty({m, k}, o).requires_grad_(r.x);
      Tensor w1 = empty({hidden, k}, o).requires_grad_(r.w1);
      Tensor b1 = empty({hidden}, o).requires_grad_(r.b1);
      Tensor w2 = empty({n, hidden}, o).requires_grad_(r.w2);
      Tensor b2 = empty({n}, o).requires_grad_(r.b2);
      const std::int64_t start = memory_stats(kMeta).allocated.current;
      Tensor y;
      {
        Tensor x = x0 * 2.0;
        y = fused ? gelu_mlp(x, w1, b1, w2, b2)
                  : linear(gelu(linear(x, w1, b1), GeluApproximate::Tanh), w2, b2);
      }
      const std::int64_t kept = memory_stats(kMeta).allocated.current - start;
      sum(y).backward();
      for (const Tensor* t : {&x0, &w1, &b1, &w2, &b2}) {
        CHECK(t->grad().defined() == t->requires_grad());
        if (t->requires_grad()) CHECK(t->grad().shape() == t->shape());
      }
      return kept;
    };
    const std::int64_t fused = held(true), composed = held(false);
    INFO("held after the forward: fused " << fused << ", composed " << composed);
    CHECK(fused == composed);
  }
}

TEST_CASE("meta mirroring CUDA: a bias with a gradient buffer takes its sums without a temporary") {
  // Note [Bias gradients in place]: with the input and the weight needing no gradient, linear's
  // backward allocates the column sums' f64 partials and nothing else where the bias has a
  // buffer; without one it also makes the (N) gradient it returns.
  const std::int64_t m = 4096, k = 64, n = 4096;
  const std::int64_t partials = kernels::column_split(m, n).chunks * n * 8;
  auto extra = [&](bool buffer) {
    MetaBackendGuard mirror(Backend::cuda);
    const TensorOptions o{.dtype = DType::bf16, .device = kMeta};
    Tensor x = empty({m, k}, o), w = empty({n, k}, o), b = empty({n}, o).requires_grad_(true);
    if (buffer) b.set_grad(empty({n}, {.device = kMeta}));
    Tensor y = linear(x, w, b);
    Tensor g = empty({m, n}, o);
    reset_peak_memory_stats(kMeta);
    const std::int64_t before = memory_stats(kMeta).allocated.current;
    y.backward(g);
    CHECK(b.grad().shape() == Shape{n});
    return memory_stats(kMeta).allocated.peak - before;
  };
  const std::int64_t with = extra(true), without = extra(false);
  INFO("peak above the backward's start: with a buffer " << with << ", without " << without);
  CHECK(with >= partials);
  CHECK(with < partials + n * 2);  // no (N) gradient
  CHECK(without >= partials + n * 2);
}

TEST_CASE("meta mirroring CUDA: conv2d and max_pool2d give shapes and run no kernel") {
  MetaBackendGuard mirror(Backend::cuda);
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor x = empty({2, 3, 9, 9}, {.dtype = dt, .device = kMeta}).requires_grad_(true);
    Tensor w = empty({4, 3, 3, 3}, {.dtype = dt, .device = kMeta}).requires_grad_(true);
    Tensor b = empty({4}, {.dtype = dt, .device = kMeta}).requires_grad_(true);
    Tensor y = max_pool2d(conv2d(x, w, b, {.stride = 2, .padding = 1}), {.kernel_size = 2});
    CHECK(y.shape() == Shape{2, 4, 2, 2});
    sum(y).backward();
    CHECK(x.grad().shape() == x.shape());
    CHECK(w.grad().shape() == w.shape());
    CHECK(w.grad().dtype() == dt);
  }
}

// ---- CUDA against the CPU -----------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda matmul: every shape rule, layout and dtype") {
  auto f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  for (DType dt : kFloatTypes) {
    const ParityOptions tol = parity_tolerance(dt);
    check_cuda_parity(label("matmul 2-d", dt), f, {leaf({3, 4}, dt, 1), leaf({4, 5}, dt, 2)}, tol);
    check_cuda_parity(label("matmul odd", dt), f, {leaf({31, 33}, dt, 1), leaf({33, 1}, dt, 2)},
                      tol);
    check_cuda_parity(label("matmul 1-d @ 2-d", dt), f, {leaf({4}, dt, 1), leaf({4, 3}, dt, 2)},
                      tol);
    check_cuda_parity(label("matmul 2-d @ 1-d", dt), f, {leaf({3, 4}, dt, 1), leaf({4}, dt, 2)},
                      tol);
    check_cuda_parity(label("matmul 1-d @ 1-d", dt), f, {leaf({33}, dt, 1), leaf({33}, dt, 2)},
                      tol);
    check_cuda_parity(label("matmul batched", dt), f,
                      {leaf({2, 3, 4}, dt, 1), leaf({2, 4, 5}, dt, 2)}, tol);
    check_cuda_parity(label("matmul broadcast batch", dt), f,
                      {leaf({2, 1, 3, 4}, dt, 1), leaf({3, 4, 2}, dt, 2)}, tol);
    check_cuda_parity(label("matmul (..., K) @ (K, N)", dt), f,
                      {leaf({2, 3, 4}, dt, 1), leaf({4, 2}, dt, 2)}, tol);
    check_cuda_parity(label("matmul transposed operands", dt), f,
                      {transposed_leaf({5, 6}, dt, 1), transposed_leaf({6, 7}, dt, 2)}, tol);
    check_cuda_parity(label("matmul batched transposed", dt), f,
                      {transposed_leaf({3, 5, 6}, dt, 1), leaf({3, 6, 7}, dt, 2)}, tol);
    check_cuda_parity(label("matmul non-contiguous", dt), f,
                      {non_contiguous(leaf({5, 6}, dt, 1)), non_contiguous(leaf({6, 3}, dt, 2))},
                      tol);
    check_cuda_parity(label("matmul empty inner dim", dt), f,
                      {leaf({3, 0}, dt, 1), leaf({0, 4}, dt, 2)}, tol);
    check_cuda_parity(label("matmul one row", dt), f, {leaf({1, 1}, dt, 1), leaf({1, 9}, dt, 2)},
                      tol);
  }
  // A broadcast (stride-0) operand is copied before cuBLAS sees it.
  auto g = [](const std::vector<Tensor>& in) { return matmul(in[0].expand({4, 5}), in[1]); };
  check_cuda_parity("matmul expanded rows", g,
                    {leaf({1, 5}, DType::f32, 1), leaf({5, 3}, DType::f32, 2)});
  // A long dot product: f32 accumulation over 1,000,003 products.
  check_cuda_parity("matmul long dot", f,
                    {leaf({1000003}, DType::f32, 1), leaf({1000003}, DType::f32, 2)},
                    {.rtol = 1e-3, .atol = 1e-2});
}

MB_CUDA_TEST_CASE("cuda matmul: 16-bit accumulates in f32 and gives 16-bit") {
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor a = ones({1, 4096}, {.dtype = dt, .device = test_gpu()});
    Tensor b = full({4096, 1}, 1.0 / 64, {.dtype = dt, .device = test_gpu()});
    Tensor c = matmul(a, b);
    CHECK(c.dtype() == dt);
    CHECK(c.to(kCPU).item() == 64.0);
  }
}

MB_CUDA_TEST_CASE("cuda linear: with and without bias, forward and backward") {
  auto with_bias = [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); };
  auto without = [](const std::vector<Tensor>& in) { return linear(in[0], in[1]); };
  for (DType dt : kFloatTypes) {
    const ParityOptions tol = parity_tolerance(dt);
    check_cuda_parity(label("linear bias", dt), with_bias,
                      {leaf({2, 3, 33}, dt, 1), leaf({31, 33}, dt, 2), leaf({31}, dt, 3)}, tol);
    check_cuda_parity(label("linear no bias", dt), without,
                      {leaf({7, 4}, dt, 1), leaf({5, 4}, dt, 2)}, tol);
    check_cuda_parity(label("linear 1-d input", dt), with_bias,
                      {leaf({4}, dt, 1), leaf({5, 4}, dt, 2), leaf({5}, dt, 3)}, tol);
    check_cuda_parity(
        label("linear transposed weight", dt), with_bias,
        {non_contiguous(leaf({6, 4}, dt, 1)), transposed_leaf({5, 4}, dt, 2), leaf({5}, dt, 3)},
        tol);
  }
}

MB_CUDA_TEST_CASE("cuda linear: the bias in cuBLASLt's epilogue equals bias rows plus the product") {
  // The same linear with the epilogue and without it (bias rows written first, beta = 1), for
  // packed and 2-byte-aligned biases, one row or one column, and a transposed input.
  struct Restore {
    bool was = kernels::cuda::gemm_bias_epilogue();
    ~Restore() { kernels::cuda::set_gemm_bias_epilogue(was); }
  } restore;
  struct Shape3 {
    std::int64_t m, k, n;
  };
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    // The last is deep enough along K for a split-K algorithm, whose partial sums must stay f32.
    for (Shape3 s : {Shape3{1, 1, 1}, Shape3{5, 33, 31}, Shape3{1, 64, 129}, Shape3{257, 96, 1},
                     Shape3{512, 768, 2304}, Shape3{16, 24576, 768}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(s.m);
      CAPTURE(s.n);
      const Device gpu = test_gpu();
      const Tensor x = input({s.m, s.k}, -1, 1, 1).to(gpu, dt);
      const Tensor xt = input({s.k, s.m}, -1, 1, 1).to(gpu, dt).t();
      const Tensor w = input({s.n, s.k}, -1, 1, 2).to(gpu, dt);
      const Tensor wide = input({s.n + 1}, -1, 1, 3).to(gpu, dt);
      for (const Tensor& b : {wide.slice(0, 0, s.n), wide.slice(0, 1, s.n + 1)}) {
        for (const Tensor& in : {x, xt}) {
          kernels::cuda::set_gemm_bias_epilogue(true);
          const Tensor fused = linear(in, w, b).to(kCPU).to(DType::f64);
          kernels::cuda::set_gemm_bias_epilogue(false);
          const Tensor rows = linear(in, w, b).to(kCPU).to(DType::f64);
          const Tensor cpu = linear(in.to(kCPU), w.to(kCPU), b.to(kCPU)).to(DType::f64);
          const ParityOptions tol = parity_tolerance(dt);
          check_close(fused, rows, tol.rtol, tol.atol, "epilogue vs bias rows");
          check_close(fused, cpu, tol.rtol, tol.atol, "epilogue vs CPU");
        }
      }
    }
  }
}

MB_CUDA_TEST_CASE("cuda linear into cross_entropy: padded 16-bit rows, values and gradients") {
  // Note [Padded rows]: odd vocabularies (GPT-2's 50257 among them) give padded logits on the GPU;
  // the loss reads them in place, its gradient keeps the padding, the GEMMs read that in place.
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t v : {std::int64_t{1}, std::int64_t{33}, std::int64_t{50257}}) {
      CAPTURE(v);
      const std::int64_t rows = v > 1000 ? 16 : 37;
      std::vector<double> t(static_cast<std::size_t>(rows));
      for (std::int64_t i = 0; i < rows; ++i) t[static_cast<std::size_t>(i)] = static_cast<double>((i * 7919) % v);
      t[3] = -100.0;  // one ignored row
      const Tensor target = from_vector(t, {rows}, {.dtype = DType::i64});
      auto f = [target](const std::vector<Tensor>& in) {
        const Tensor logits = linear(in[0], in[1], in[2]);
        if (in[0].device().is_cuda() && is_16bit_float(logits.dtype()) && logits.shape()[1] % 8 != 0) {
          CHECK(logits.strides()[0] == (logits.shape()[1] + 7) / 8 * 8);  // the rows are padded
        }
        return cross_entropy(logits, target.to(in[0].device()), {.loss_dtype = DType::f32});
      };
      check_cuda_parity(label("linear + cross_entropy V=" + std::to_string(v), dt), f,
                        {leaf({rows, 64}, dt, 1), leaf({v, 64}, dt, 2), leaf({v}, dt, 3)},
                        parity_tolerance(dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda gelu_mlp matches the CPU's composition: values and gradients") {
  // Note [MLP in GEMM epilogues]. Hidden widths that are and are not a multiple of 8 (GELU's input
  // rows then padded), an odd output width (padded 16-bit rows), one row, a 3-d input.
  auto f = [](const std::vector<Tensor>& in) { return gelu_mlp(in[0], in[1], in[2], in[3], in[4]); };
  struct Shape4 {
    Shape x;
    std::int64_t hidden, n;
  };
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (const Shape4& c : {Shape4{{2, 5, 64}, 256, 64}, Shape4{{7, 48}, 100, 33},
                            Shape4{{1, 32}, 64, 16}, Shape4{{300, 96}, 384, 96}}) {
      const std::int64_t k = c.x.back();
      check_cuda_parity(label("gelu_mlp hidden " + std::to_string(c.hidden), dt), f,
                        {leaf(c.x, dt, 1), leaf({c.hidden, k}, dt, 2), leaf({c.hidden}, dt, 3),
                         leaf({c.n, c.hidden}, dt, 4), leaf({c.n}, dt, 5)},
                        parity_tolerance(dt));
    }
    // Frozen weights and data inputs: the node keeps and computes only what the gradients
    // needed read (Note [Saving only what a gradient reads]).
    const std::vector<std::pair<const char*, std::vector<bool>>> needs = {
        {"x alone", {true, false, false, false, false}},
        {"the weights", {false, true, true, true, true}},
        {"the second layer alone", {false, false, false, true, true}},
        {"the first layer alone", {false, true, true, false, false}}};
    for (const auto& [name, need] : needs) {
      std::vector<Tensor> in = {leaf({6, 48}, dt, 1), leaf({100, 48}, dt, 2), leaf({100}, dt, 3),
                                leaf({33, 100}, dt, 4), leaf({33}, dt, 5)};
      for (std::size_t i = 0; i < in.size(); ++i)
        if (!need[i]) in[i] = in[i].detach();
      check_cuda_parity(label(std::string("gelu_mlp, a gradient for ") + name, dt), f, in,
                        parity_tolerance(dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda gelu_mlp: GELU and its derivative through identity weights, both ways") {
  // Identity weights, zero biases: out = GELU(x) and dx = GELU'(x), with the epilogues and with the
  // element-wise kernels, against the CPU's tanh formulas over [-3, 3] (exact products). f32 takes
  // the element-wise kernels either way (kernels/cuda/gemm.cu) and is held to 1e-3; bf16 takes the
  // epilogues, whose wiring (bias, aux, which operand) this checks to bf16's parity tolerance: a
  // wrong operand is off by O(1). cuBLASLt's GELU may take tanh from the hardware's approximation
  // (relative error about 2^-11), well inside that.
  const std::int64_t d = 64;
  std::vector<double> xs(static_cast<std::size_t>(8 * d));
  for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = -3.0 + 6.0 * static_cast<double>(i % 97) / 96.0;
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const double tol = dt == DType::f32 ? 1e-3 : parity_tolerance(dt).atol;
    const Tensor x0 = from_vector(xs, {8, d}, {.dtype = dt});
    const Tensor eye = eye_matrix(d).to(dt);
    for (bool epilogue : {true, false}) {
      struct Restore {
        bool was = kernels::cuda::gemm_bias_epilogue();
        ~Restore() { kernels::cuda::set_gemm_bias_epilogue(was); }
      } restore;
      kernels::cuda::set_gemm_bias_epilogue(epilogue);
      CAPTURE(epilogue);
      auto run = [&](Device device) {
        Tensor x = x0.to(device).detach().requires_grad_(true);
        const Tensor zero = zeros({d}, {.dtype = dt, .device = device});
        Tensor y = gelu_mlp(x, eye.to(device), zero, eye.to(device), zero);
        sum(y).backward();
        return std::pair{y.to(kCPU), x.grad().to(kCPU)};
      };
      const auto [y_gpu, dx_gpu] = run(test_gpu());
      const auto [y_cpu, dx_cpu] = run(kCPU);
      check_close(y_gpu.to(DType::f64), y_cpu.to(DType::f64), 0.0, tol, "GELU");
      check_close(dx_gpu.to(DType::f64), dx_cpu.to(DType::f64), 0.0, tol, "GELU'");
    }
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda gelu_mlp: 16-bit MLPs take cuBLASLt's bias, GELU and DGELU epilogues") {
  // The epilogues are the point of the node: a bf16 MLP's forward and backward must run one of
  // each (a fallback would pass every other test, only slower).
  const Device gpu = cuda_device(0);
  using kernels::cuda::LtCall;
  using kernels::cuda::lt_epilogue_calls;
  const std::int64_t bias = lt_epilogue_calls(LtCall::bias), gelu_calls = lt_epilogue_calls(LtCall::gelu),
                     dgelu = lt_epilogue_calls(LtCall::dgelu);
  std::vector<Tensor> p = {leaf({256, 768}, DType::bf16, 1), leaf({3072, 768}, DType::bf16, 2),
                           leaf({3072}, DType::bf16, 3), leaf({768, 3072}, DType::bf16, 4),
                           leaf({768}, DType::bf16, 5)};
  for (Tensor& t : p) t = t.detach().to(gpu).requires_grad_(true);
  sum(gelu_mlp(p[0], p[1], p[2], p[3], p[4])).backward();
  if (kernels::cuda::gemm_bias_epilogue()) {
    INFO("cuBLASLt's last refusal: ", kernels::cuda::lt_last_refusal());
    CHECK(lt_epilogue_calls(LtCall::gelu) > gelu_calls);
    CHECK(lt_epilogue_calls(LtCall::bias) > bias);
    CHECK(lt_epilogue_calls(LtCall::dgelu) > dgelu);
  } else {
    MESSAGE("MB_CUBLASLT_EPILOGUE=0: the epilogues are off, nothing to count");
  }
}

MB_CUDA_TEST_CASE("cuda gelu_mlp: the epilogues and the separate passes agree") {
  struct Restore {
    bool was = kernels::cuda::gemm_bias_epilogue();
    ~Restore() { kernels::cuda::set_gemm_bias_epilogue(was); }
  } restore;
  for (DType dt : {DType::bf16, DType::f16}) {
    const Device gpu = test_gpu();
    std::vector<Tensor> in = {leaf({256, 128}, dt, 1), leaf({512, 128}, dt, 2), leaf({512}, dt, 3),
                              leaf({128, 512}, dt, 4), leaf({128}, dt, 5)};
    auto run = [&](bool epilogue) {
      kernels::cuda::set_gemm_bias_epilogue(epilogue);
      std::vector<Tensor> p;
      for (const Tensor& t : in) p.push_back(t.detach().to(gpu).requires_grad_(true));
      Tensor y = gelu_mlp(p[0], p[1], p[2], p[3], p[4]);
      sum(y * y).backward();
      std::vector<Tensor> out = {y.to(kCPU).to(DType::f64)};
      for (const Tensor& t : p) out.push_back(t.grad().to(kCPU).to(DType::f64));
      return out;
    };
    const std::vector<Tensor> fused = run(true), separate = run(false);
    const ParityOptions tol = parity_tolerance(dt);
    for (std::size_t i = 0; i < fused.size(); ++i)
      check_close(fused[i], separate[i], tol.rtol, tol.atol, label("output/gradient " + std::to_string(i), dt));
  }
}

MB_CUDA_TEST_CASE(
    "cuda linear: the weight gradient accumulates into an arena slot like the CPU's") {
  // Two micro-batches with weight 0.25 each, into a preset gradient buffer: grad += 0.25 * dy^T x.
  struct Case {
    DType input, grad;
  };
  for (Case c :
       {Case{DType::f32, DType::f32}, Case{DType::bf16, DType::f32}, Case{DType::f16, DType::f32},
        Case{DType::bf16, DType::bf16}, Case{DType::f16, DType::f16}}) {
    CAPTURE(dtype_name(c.input));
    CAPTURE(dtype_name(c.grad));
    const Tensor x1 = input({6, 33}, -1, 1, 1).detach(), x2 = input({6, 33}, -1, 1, 2).detach();
    const Tensor w0 = input({31, 33}, -1, 1, 3).detach(), b0 = input({31}, -1, 1, 4).detach();
    const Tensor dy = input({6, 31}, -1, 1, 5).detach();
    auto run = [&](Device device) {
      Tensor w = w0.to(device, c.input).detach().requires_grad_(true);
      Tensor b = b0.to(device, c.input).detach().requires_grad_(true);
      Tensor buffer = full({31, 33}, 0.5, {.dtype = c.grad, .device = device});
      w.set_grad(buffer);
      {
        GradWeightGuard weight(0.25);
        for (const Tensor& x : {x1, x2})
          sum(linear(x.to(device, c.input), w, b) * dy.to(device, c.input)).backward();
      }
      return std::pair{w.grad(), buffer};
    };
    const auto [cpu_grad, cpu_buffer] = run(kCPU);
    const auto [gpu_grad, gpu_buffer] = run(test_gpu());
    CHECK(gpu_grad.same_storage(gpu_buffer));  // written in place, no dw temporary
    CHECK(gpu_grad.dtype() == c.grad);
    const ParityOptions tol = parity_tolerance(c.input == DType::f32 ? c.grad : c.input);
    check_close(gpu_grad.to(kCPU).to(DType::f64), cpu_grad.to(DType::f64), tol.rtol, tol.atol,
                "weight gradient in the arena");
  }
}

MB_CUDA_TEST_CASE(
    "cuda linear, gelu_mlp and layer_norm add their bias and norm gradients into buffers as the CPU") {
  // Note [Bias gradients in place]: on both backends the column sums of linear's and gelu_mlp's
  // biases and layer norm's two sums go straight into preset buffers, weighted. CUDA adds in
  // another order than the CPU, so the buffers agree within the dtype's parity tolerance. The
  // head's 33 logits a row are padded on CUDA in 16 bits, and so is the cross-entropy's gradient
  // that its bias sums; a 1-wide head has a one-column bias.
  struct Case {
    DType param, buffer;
  };
  for (Case c : {Case{DType::f32, DType::f32}, Case{DType::bf16, DType::f32}, Case{DType::f16, DType::f32},
                 Case{DType::f64, DType::f64}, Case{DType::bf16, DType::bf16}}) {
    CAPTURE(dtype_name(c.param));
    CAPTURE(dtype_name(c.buffer));
    const std::int64_t m = 300, k = 24, hidden = 64, n = 33;
    auto run = [&](Device device) {
      std::vector<Tensor> params, buffers;
      auto param = [&](const Shape& shape, std::uint64_t seed) {
        Tensor p = input(shape, -1, 1, seed).detach().to(device, c.param).requires_grad_(true);
        buffers.push_back(full(shape, 0.5, {.dtype = c.buffer, .device = device}));
        p.set_grad(buffers.back());
        params.push_back(p);
        return p;
      };
      Tensor w = param({n, k}, 2), b = param({n}, 3), w1 = param({hidden, k}, 4),
             b1 = param({hidden}, 5), w2 = param({n, hidden}, 6), b2 = param({n}, 7),
             gamma = param({n}, 8), beta = param({n}, 9), head = param({n, n}, 12),
             head_b = param({n}, 13), one = param({1, n}, 14), one_b = param({1}, 15);
      {
        GradWeightGuard weight(0.3);
        for (std::uint64_t seed : {10, 11}) {
          const Tensor x = input({m, k}, -1, 1, seed).detach().to(device, c.param);
          const Tensor h =
              layer_norm(linear(x, w, b) + gelu_mlp(x, w1, b1, w2, b2), {n}, gamma, beta);
          std::vector<double> labels(static_cast<std::size_t>(m));
          for (std::int64_t i = 0; i < m; ++i) {
            labels[static_cast<std::size_t>(i)] = static_cast<double>((i * 7 + seed) % n);
          }
          const Tensor target = from_vector(labels, {m}, {.dtype = DType::i64}).to(device);
          const DType math = c.param == DType::f64 ? DType::f64 : DType::f32;
          const Tensor loss = cross_entropy(linear(h, head, head_b), target, {.loss_dtype = math}) +
                              sum(linear(h, one, one_b).to(math) * 0.01);
          loss.backward();
        }
      }
      std::vector<Tensor> out;
      for (std::size_t i = 0; i < params.size(); ++i) {
        CHECK(params[i].grad().same_storage(buffers[i]));
        out.push_back(buffers[i].to(kCPU).to(DType::f64));
      }
      return out;
    };
    const std::vector<Tensor> cpu = run(kCPU), gpu = run(test_gpu());
    const ParityOptions tol = parity_tolerance(c.param == DType::f32 ? c.buffer : c.param);
    const char* names[] = {"w",     "b",    "w1",   "b1",     "w2",  "b2",
                           "gamma", "beta", "head", "head_b", "one", "one_b"};
    for (std::size_t i = 0; i < cpu.size(); ++i)
      check_close(gpu[i], cpu[i], tol.rtol, tol.atol, label(std::string(names[i]) + "'s buffer", c.param));
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda gemm: a layout cuBLAS cannot take is refused with both operands named") {
  const Device gpu = cuda_device(0);
  Tensor a = zeros({1, 3, 4}, {.device = gpu}), b = zeros({1, 4, 5}, {.device = gpu});
  Tensor c = zeros({1, 5, 3}, {.device = gpu}).transpose(1, 2);  // (1, 3, 5), column-major
  check_throws_with([&] { kernels::cuda::gemm(a.kview(), b.kview(), c.kview(), 1.0, 0.0); },
                    "[gemm] c must be row-major");
  Tensor d = zeros({1, 3, 5}, {.dtype = DType::f64, .device = gpu});
  check_throws_with([&] { kernels::cuda::gemm(a.kview(), b.kview(), d.kview(), 1.0, 0.0); },
                    "[gemm] unsupported dtypes");
}

MB_CUDA_TEST_CASE("cuda conv2d: strides, padding, channel counts, bias, layouts and dtypes") {
  struct Case {
    Shape x, w;
    std::int64_t stride, padding;
    bool bias;
  };
  const Case cases[] = {
      {{2, 3, 8, 8}, {4, 3, 3, 3}, 1, 1, true},   // same-size output
      {{1, 1, 7, 7}, {1, 1, 3, 3}, 2, 0, false},  // one channel, stride 2
      {{3, 5, 9, 6}, {7, 5, 2, 3}, 2, 1, true},   // odd channel counts, rectangular kernel
      {{2, 4, 5, 5}, {6, 4, 1, 1}, 1, 0, true},   // 1x1
      {{1, 2, 5, 5}, {3, 2, 2, 2}, 3, 2, false},  // a stride larger than the kernel
      {{2, 16, 12, 12}, {33, 16, 3, 3}, 1, 1, true},
  };
  for (DType dt : kFloatTypes) {
    const ParityOptions tol = parity_tolerance(dt);
    for (const Case& c : cases) {
      const std::int64_t s = c.stride, p = c.padding;
      auto f = [s, p](const std::vector<Tensor>& in) {
        return conv2d(in[0], in[1], in[2], {.stride = s, .padding = p});
      };
      const std::string name = label("conv2d x" + shape_str(c.x) + " w" + shape_str(c.w) + " s" +
                                         std::to_string(s) + " p" + std::to_string(p),
                                     dt);
      check_cuda_parity(
          name, f, {leaf(c.x, dt, 1), leaf(c.w, dt, 2), c.bias ? leaf({c.w[0]}, dt, 3) : Tensor()},
          tol);
    }
    auto f = [](const std::vector<Tensor>& in) {
      return conv2d(in[0], in[1], in[2], {.padding = 1});
    };
    check_cuda_parity(label("conv2d non-contiguous", dt), f,
                      {non_contiguous(leaf({2, 3, 6, 6}, dt, 1)),
                       non_contiguous(leaf({4, 3, 3, 3}, dt, 2)), leaf({4}, dt, 3)},
                      tol);
    // Only the weight needs a gradient (x without grad), and only x.
    check_cuda_parity(
        label("conv2d weight only", dt), f,
        {to_dtype(input({2, 3, 6, 6}, -1, 1, 1).detach(), dt), leaf({4, 3, 3, 3}, dt, 2), Tensor()},
        tol);
    check_cuda_parity(
        label("conv2d input only", dt), f,
        {leaf({2, 3, 6, 6}, dt, 1), to_dtype(input({4, 3, 3, 3}, -1, 1, 2).detach(), dt), Tensor()},
        tol);
  }
}

MB_CUDA_TEST_CASE("cuda conv2d and max_pool2d backward are deterministic") {
  const Device gpu = test_gpu();
  for (DType dt : {DType::f32, DType::bf16}) {
    auto grads = [&] {
      Tensor x = input({4, 8, 16, 16}, -1, 1, 1).detach().to(gpu, dt).requires_grad_(true);
      Tensor w = input({16, 8, 3, 3}, -1, 1, 2).detach().to(gpu, dt).requires_grad_(true);
      Tensor y = max_pool2d(conv2d(x, w, {}, {.padding = 1}),
                            {.kernel_size = 3, .stride = 1, .padding = 1});
      sum(y * y).backward();
      return std::pair{x.grad().to(kCPU, DType::f64).to_vector(),
                       w.grad().to(kCPU, DType::f64).to_vector()};
    };
    const auto first = grads(), second = grads();
    CHECK(first.first == second.first);
    CHECK(first.second == second.second);
  }
}

MB_CUDA_TEST_CASE("cuda max_pool2d: forward and backward, overlapping windows, padding, dtypes") {
  struct Case {
    Shape x;
    MaxPool2dOptions options;
  };
  const Case cases[] = {
      {{2, 3, 8, 8}, {.kernel_size = 2}},
      {{2, 3, 9, 7}, {.kernel_size = 3, .stride = 1, .padding = 1}},  // overlapping windows
      {{1, 5, 11, 11}, {.kernel_size = 3, .stride = 2, .padding = 1}},
      {{3, 1, 1, 1}, {.kernel_size = 1}},
      {{1, 33, 31, 31}, {.kernel_size = 4, .stride = 3, .padding = 2}},
  };
  for (DType dt : kFloatTypes) {
    // The kernels mirror the CPU's scan and sums, so in f32 and f64 values and gradients agree
    // exactly; 16-bit gradients also pass through dtype conversions of the harness's own ops.
    const bool wide = dt == DType::f32 || dt == DType::f64;
    const ParityOptions tol = wide ? ParityOptions{.rtol = 0, .atol = 0} : parity_tolerance(dt);
    for (const Case& c : cases) {
      const MaxPool2dOptions o = c.options;
      auto f = [o](const std::vector<Tensor>& in) { return max_pool2d(in[0], o); };
      check_cuda_parity(
          label("max_pool2d x" + shape_str(c.x) + " k" + std::to_string(o.kernel_size), dt), f,
          {leaf(c.x, dt, 1)}, tol);
    }
    auto f = [](const std::vector<Tensor>& in) { return max_pool2d(in[0], {.kernel_size = 2}); };
    check_cuda_parity(label("max_pool2d non-contiguous", dt), f,
                      {non_contiguous(leaf({2, 3, 6, 6}, dt, 1))}, tol);
  }
}
