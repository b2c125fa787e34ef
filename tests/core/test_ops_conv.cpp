// conv2d and max_pool2d: forward values against direct nested-loop references written here,
// hand-computed cases, gradcheck over stride/padding/bias/layout, 16-bit rounding, meta, errors,
// and the CPU's images shared among threads.
#include <cmath>
#include <limits>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kernels/conv.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// out[n, o, oh, ow] = b[o] + sum_{c, i, j} x[n, c, oh*s - p + i, ow*s - p + j] * w[o, c, i, j],
// straight from the definition, in doubles.
std::vector<double> reference_conv(const Tensor& x, const Tensor& w, const Tensor& b, std::int64_t s,
                                   std::int64_t p) {
  const auto xv = x.to_vector(), wv = w.to_vector();
  const std::vector<double> bv = b.defined() ? b.to_vector() : std::vector<double>{};
  const std::int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const std::int64_t O = w.size(0), KH = w.size(2), KW = w.size(3);
  const std::int64_t OH = (H + 2 * p - KH) / s + 1, OW = (W + 2 * p - KW) / s + 1;
  std::vector<double> out;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t o = 0; o < O; ++o)
      for (std::int64_t oh = 0; oh < OH; ++oh)
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          double acc = bv.empty() ? 0.0 : bv[o];
          for (std::int64_t c = 0; c < C; ++c)
            for (std::int64_t i = 0; i < KH; ++i)
              for (std::int64_t j = 0; j < KW; ++j) {
                const std::int64_t h = oh * s - p + i, ww = ow * s - p + j;
                if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                acc += xv[((n * C + c) * H + h) * W + ww] * wv[((o * C + c) * KH + i) * KW + j];
              }
          out.push_back(acc);
        }
  return out;
}

// Window maxima with padding as -inf.
std::vector<double> reference_pool(const Tensor& x, std::int64_t k, std::int64_t s, std::int64_t p) {
  const auto xv = x.to_vector();
  const std::int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const std::int64_t OH = (H + 2 * p - k) / s + 1, OW = (W + 2 * p - k) / s + 1;
  std::vector<double> out;
  for (std::int64_t nc = 0; nc < N * C; ++nc)
    for (std::int64_t oh = 0; oh < OH; ++oh)
      for (std::int64_t ow = 0; ow < OW; ++ow) {
        double best = -std::numeric_limits<double>::infinity();
        for (std::int64_t i = 0; i < k; ++i)
          for (std::int64_t j = 0; j < k; ++j) {
            const std::int64_t h = oh * s - p + i, w = ow * s - p + j;
            if (h >= 0 && h < H && w >= 0 && w < W) best = std::max(best, xv[(nc * H + h) * W + w]);
          }
        out.push_back(best);
      }
  return out;
}

struct ConvCase {
  Shape x, w;
  std::int64_t stride, padding;
  bool bias;
};

}  // namespace

TEST_CASE("conv2d forward by hand") {
  // 2x2 ones kernel, stride 2: the sums of the four 2x2 blocks of 1..16.
  Tensor x = arange(1, 17, 1, {.dtype = DType::f64}).reshape({1, 1, 4, 4});
  Tensor w = ones({1, 1, 2, 2}, {.dtype = DType::f64});
  check_close(conv2d(x, w, {}, {.stride = 2}), {14, 22, 46, 54}, 0, 0, "block sums");
  // 1x1 kernel with padding 1: a zero border around 2 * x + 1 (the bias reaches the border too).
  Tensor y = conv2d(x.slice(2, 0, 2).slice(3, 0, 2), full({1, 1, 1, 1}, 2.0, {.dtype = DType::f64}),
                    ones({1}, {.dtype = DType::f64}), {.padding = 1});
  CHECK(y.shape() == Shape{1, 1, 4, 4});
  check_close(y, {1, 1, 1, 1, 1, 3, 5, 1, 1, 11, 13, 1, 1, 1, 1, 1}, 0, 0, "padded 1x1");
}

TEST_CASE("conv2d forward matches the direct definition") {
  const ConvCase cases[] = {
      {{2, 3, 5, 5}, {4, 3, 3, 3}, 1, 0, true},  {{2, 3, 5, 6}, {4, 3, 3, 3}, 1, 1, false},
      {{1, 2, 7, 7}, {3, 2, 3, 3}, 2, 1, true},  {{2, 2, 6, 5}, {2, 2, 2, 3}, 2, 0, true},
      {{1, 1, 4, 4}, {2, 1, 5, 5}, 1, 2, true},  {{3, 4, 5, 5}, {2, 4, 1, 1}, 3, 0, false},
  };
  std::uint64_t seed = 10;
  for (const auto& c : cases) {
    Tensor x = input(c.x, -1, 1, seed++).detach(), w = input(c.w, -1, 1, seed++).detach();
    Tensor b = c.bias ? input({c.w[0]}, -1, 1, seed++).detach() : Tensor();
    const auto expected = reference_conv(x, w, b, c.stride, c.padding);
    Tensor y = conv2d(x, w, b, {.stride = c.stride, .padding = c.padding});
    CHECK(y.shape() == Shape{c.x[0], c.w[0], (c.x[2] + 2 * c.padding - c.w[2]) / c.stride + 1,
                             (c.x[3] + 2 * c.padding - c.w[3]) / c.stride + 1});
    check_close(y, expected, 1e-12, 1e-12, "conv2d f64 " + shape_str(c.x) + " * " + shape_str(c.w));
    // f32 and a non-contiguous f32 input give the same values to f32 rounding.
    Tensor xf = x.to(DType::f32), wf = w.to(DType::f32), bf = b.defined() ? b.to(DType::f32) : Tensor();
    check_close(conv2d(xf, wf, bf, {.stride = c.stride, .padding = c.padding}), expected, 1e-5, 1e-5,
                "conv2d f32");
    check_close(conv2d(non_contiguous(xf), non_contiguous(wf), bf, {.stride = c.stride, .padding = c.padding}),
                expected, 1e-5, 1e-5, "conv2d f32 non-contiguous");
  }
}

TEST_CASE("conv2d gradcheck: stride, padding, bias, non-contiguous") {
  auto f = [](std::int64_t s, std::int64_t p) {
    return [s, p](const std::vector<Tensor>& in) {
      return conv2d(in[0], in[1], in[2], {.stride = s, .padding = p});
    };
  };
  gradcheck("conv2d s1 p0", f(1, 0), {input({2, 2, 4, 4}), input({3, 2, 3, 3}, -1, 1, 2), input({3}, -1, 1, 3)});
  gradcheck("conv2d s1 p1 no bias", f(1, 1), {input({1, 2, 4, 5}), input({2, 2, 3, 3}, -1, 1, 2), Tensor()});
  gradcheck("conv2d s2 p1", f(2, 1), {input({2, 1, 5, 5}), input({2, 1, 3, 3}, -1, 1, 2), input({2}, -1, 1, 3)});
  gradcheck("conv2d s2 p0 rect kernel", f(2, 0), {input({1, 3, 5, 6}), input({2, 3, 2, 3}, -1, 1, 2), input({2}, -1, 1, 3)});
  gradcheck("conv2d s3 p2 (kernel skips input)", f(3, 2), {input({1, 2, 5, 5}), input({2, 2, 2, 2}, -1, 1, 2), Tensor()});
  Tensor wt = input({2, 2, 3, 3}, -1, 1, 2).detach().permute({0, 1, 3, 2});  // a transposed-kernel leaf
  wt.requires_grad_(true);
  gradcheck("conv2d non-contiguous", f(1, 1),
            {non_contiguous(input({2, 2, 4, 4})), wt, non_contiguous(input({2}, -1, 1, 3))});
  // x without grad: only dweight and dbias run.
  Tensor x = input({1, 2, 4, 4}).detach();
  gradcheck("conv2d weight only", f(1, 0), {x, input({2, 2, 3, 3}, -1, 1, 2), input({2}, -1, 1, 3)});
}

TEST_CASE("conv2d in 16-bit computes in f32 and rounds once") {
  Tensor x = input({2, 3, 6, 6}, -1, 1, 5).detach(), w = input({4, 3, 3, 3}, -1, 1, 6).detach();
  Tensor b = input({4}, -1, 1, 7).detach();
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor x16 = x.to(dt), w16 = w.to(dt), b16 = b.to(dt);
    // The reference takes the rounded inputs exactly, so only the output rounding differs.
    const auto expected = reference_conv(x16.to(DType::f64), w16.to(DType::f64), b16.to(DType::f64), 1, 1);
    Tensor y = conv2d(x16, w16, b16, {.padding = 1});
    CHECK(y.dtype() == dt);
    const double rtol = dt == DType::f16 ? 1e-3 : 1.6e-2;
    check_close(y, expected, rtol, 1e-5, dtype_name(dt));
    // Its backward runs and returns gradients in the input dtype.
    Tensor xg = x16.detach().requires_grad_(true), wg = w16.detach().requires_grad_(true);
    sum(conv2d(xg, wg, {}, {.padding = 1})).backward();
    CHECK(xg.grad().dtype() == dt);
    CHECK(wg.grad().dtype() == dt);
    // d sum / dw[o, c, i, j] = sum of the x values that tap meets; for the centre tap, all of x[:, c].
    const auto gw = wg.grad().to_vector();
    const auto xs = x16.to_vector();
    double centre = 0;
    for (std::int64_t n = 0; n < 2; ++n)
      for (std::int64_t k = 0; k < 36; ++k) centre += xs[(n * 3 + 0) * 36 + k];
    CHECK(std::abs(gw[4] - centre) <= 1e-5 + rtol * 4 * std::abs(centre));
  }
}

TEST_CASE("conv2d on meta gives shapes and allocates, with no data") {
  Tensor x = empty({2, 3, 8, 8}, {.device = kMeta}), w = empty({4, 3, 3, 3}, {.device = kMeta});
  Tensor b = empty({4}, {.device = kMeta});
  reset_peak_memory_stats(kMeta);
  const std::int64_t before = memory_stats(kMeta).allocated.current;
  Tensor y = conv2d(x, w, b, {.stride = 2, .padding = 1});
  CHECK(y.shape() == Shape{2, 4, 4, 4});
  CHECK(y.device().is_meta());
  // The im2col buffer (C*kH*kW, H'*W') = (27, 16) floats is a real allocation, alive with the output.
  const std::int64_t col_bytes = 27 * 16 * 4;
  CHECK(memory_stats(kMeta).allocated.peak - before >= static_cast<std::int64_t>(y.nbytes()) + col_bytes);
}

TEST_CASE("conv2d errors") {
  Tensor x = zeros({1, 3, 5, 5}), w = zeros({2, 3, 3, 3});
  check_throws_with([&] { conv2d(x, zeros({2, 4, 3, 3})); }, "[conv2d] input (1, 3, 5, 5) has 3 channels but weight (2, 4, 3, 3) expects 4");
  check_throws_with([&] { conv2d(x, zeros({2, 3, 8, 8})); }, "[conv2d] kernel (8, 8) is larger than the padded input (5, 5)");
  check_throws_with([&] { conv2d(x, zeros({2, 3, 8, 7}), {}, {.padding = 1}); }, "kernel (8, 7) is larger than the padded input (7, 7)");
  check_throws_with([&] { conv2d(x, w, {}, {.stride = 0}); }, "[conv2d] stride must be positive, got 0");
  check_throws_with([&] { conv2d(x, w, {}, {.padding = -1}); }, "[conv2d] padding must be non-negative, got -1");
  check_throws_with([&] { conv2d(zeros({3, 5, 5}), w); }, "[conv2d] input must be (N, C, H, W), got shape (3, 5, 5)");
  check_throws_with([&] { conv2d(x, zeros({2, 3, 3})); }, "[conv2d] weight must be (O, C, kH, kW), got shape (2, 3, 3)");
  check_throws_with([&] { conv2d(x, w, zeros({3})); }, "[conv2d] bias must be (2,)");
  check_throws_with([&] { conv2d(x, zeros({2, 3, 3, 3}, {.dtype = DType::f64})); }, "[conv2d] input is f32 but weight is f64");
  check_throws_with([&] { conv2d(zeros({1, 3, 5, 5}, {.dtype = DType::i64}), w); }, "[conv2d]");
}

TEST_CASE("conv2d refuses a padding that takes the padded plane past int64") {
  // 4 + 2 * (2^62 - 1) = 2^63 + 2 overflowed: signed overflow, and a padded size below the kernel.
  const std::int64_t padding = std::numeric_limits<std::int64_t>::max() / 2;
  const Tensor x = ones({1, 2, 4, 4}), w = ones({3, 2, 3, 3});
  check_throws_with([&] { conv2d(x, w, {}, {.padding = padding}); },
                    "[conv2d] padding 4611686018427387903 makes the input (1, 2, 4, 4) larger "
                    "than int64 can count");
}

TEST_CASE("max_pool2d forward by hand and against the definition") {
  Tensor x = from_vector({1, 5, 2, 0,  //
                          3, 4, 8, 7,  //
                          9, 0, 1, 2,  //
                          6, 6, 3, 4},
                         {1, 1, 4, 4}, {.dtype = DType::f64});
  check_close(max_pool2d(x), {5, 8, 9, 4}, 0, 0, "2x2 blocks");
  check_close(max_pool2d(x, {.kernel_size = 3, .stride = 1}), {9, 8, 9, 8}, 0, 0, "3x3 overlapping");
  // Padding is -inf, not 0: an all-negative input keeps its negative maxima at the border.
  Tensor neg_x = x * -1.0 - 1.0;
  check_close(max_pool2d(neg_x, {.kernel_size = 2, .stride = 2, .padding = 1}),
              {-2, -3, -1, -4, -1, -3, -7, -4, -5}, 0, 0, "padding as -inf");
  struct PoolCase { Shape x; std::int64_t k, s, p; };
  const PoolCase cases[] = {{{2, 3, 6, 6}, 2, 0, 0}, {{1, 2, 7, 5}, 3, 2, 1}, {{2, 1, 5, 5}, 3, 1, 1},
                            {{1, 2, 6, 7}, 4, 3, 2}, {{1, 1, 3, 3}, 3, 0, 0}};
  std::uint64_t seed = 20;
  for (const auto& c : cases) {
    Tensor xi = input(c.x, -1, 1, seed++).detach();
    const auto expected = reference_pool(xi, c.k, c.s == 0 ? c.k : c.s, c.p);
    MaxPool2dOptions o{.kernel_size = c.k, .stride = c.s, .padding = c.p};
    check_close(max_pool2d(xi, o), expected, 0, 0, "max_pool2d " + shape_str(c.x));
    check_close(max_pool2d(non_contiguous(xi), o), expected, 0, 0, "max_pool2d non-contiguous");
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      Tensor xr = xi.to(dt);  // the max of rounded values is one of them: exact
      check_close(max_pool2d(xr, o), reference_pool(xr.to(DType::f64), c.k, c.s == 0 ? c.k : c.s, c.p), 0, 0,
                  dtype_name(dt));
    }
  }
  // NaN propagates, as torch.
  Tensor nan_x = from_vector({1, std::nan(""), 2, 3}, {1, 1, 2, 2});
  CHECK(std::isnan(max_pool2d(nan_x).item()));
}

TEST_CASE("max_pool2d backward scatters to the argmax and adds over overlapping windows") {
  // The centre is the maximum of all four 2x2 windows (stride 1): its gradient is 4.
  Tensor x = from_vector({0, 1, 0, 2, 9, 3, 0, 4, 0}, {1, 1, 3, 3}, {.dtype = DType::f64});
  x.requires_grad_(true);
  sum(max_pool2d(x, {.kernel_size = 2, .stride = 1})).backward();
  check_close(x.grad(), {0, 0, 0, 0, 4, 0, 0, 0, 0}, 0, 0, "overlap");
  // Ties go to the first maximum in window order, as torch.
  Tensor t = zeros({1, 1, 2, 2}, {.dtype = DType::f64}).requires_grad_(true);
  sum(max_pool2d(t)).backward();
  check_close(t.grad(), {1, 0, 0, 0}, 0, 0, "tie");
  // bf16 gradients sum in f32 and round once.
  Tensor b = from_vector({0, 1, 0, 2, 9, 3, 0, 4, 0}, {1, 1, 3, 3}, {.dtype = DType::bf16}).requires_grad_(true);
  max_pool2d(b, {.kernel_size = 2, .stride = 1}).backward(full({1, 1, 2, 2}, 0.25, {.dtype = DType::bf16}));
  CHECK(b.grad().dtype() == DType::bf16);
  check_close(b.grad(), {0, 0, 0, 0, 1, 0, 0, 0, 0}, 0, 0, "bf16");
}

TEST_CASE("max_pool2d gradcheck") {
  auto f = [](std::int64_t k, std::int64_t s, std::int64_t p) {
    return [k, s, p](const std::vector<Tensor>& in) {
      return max_pool2d(in[0], {.kernel_size = k, .stride = s, .padding = p});
    };
  };
  // Random inputs have no ties, so no window sits on a kink.
  gradcheck("max_pool2d k2", f(2, 0, 0), {input({2, 2, 4, 4})});
  gradcheck("max_pool2d k3 s1 p1 (overlap)", f(3, 1, 1), {input({1, 2, 5, 5}, -1, 1, 2)});
  gradcheck("max_pool2d k3 s2 p1", f(3, 2, 1), {input({2, 1, 7, 6}, -1, 1, 3)});
  gradcheck("max_pool2d k2 s1 non-contiguous", f(2, 1, 0), {non_contiguous(input({1, 3, 4, 5}, -1, 1, 4))});
}

TEST_CASE("max_pool2d errors") {
  Tensor x = zeros({1, 1, 4, 4});
  check_throws_with([&] { max_pool2d(x, {.kernel_size = 0}); }, "[max_pool2d] kernel_size must be positive, got 0");
  check_throws_with([&] { max_pool2d(x, {.kernel_size = 2, .stride = -1}); }, "[max_pool2d] stride must be positive");
  check_throws_with([&] { max_pool2d(x, {.kernel_size = 2, .padding = -1}); }, "[max_pool2d] padding must be non-negative");
  check_throws_with([&] { max_pool2d(x, {.kernel_size = 2, .padding = 2}); }, "[max_pool2d] padding 2 is more than half the kernel size 2");
  check_throws_with([&] { max_pool2d(x, {.kernel_size = 5}); }, "[max_pool2d] kernel (5, 5) is larger than the padded input (4, 4)");
  check_throws_with([&] { max_pool2d(zeros({4, 4})); }, "[max_pool2d] input must be (N, C, H, W), got shape (4, 4)");
  check_throws_with([&] { max_pool2d(zeros({1, 1, 4, 4}, {.dtype = DType::i32})); }, "[max_pool2d]");
  Tensor meta = max_pool2d(empty({2, 3, 9, 9}, {.device = kMeta}), {.kernel_size = 3, .stride = 2, .padding = 1});
  CHECK(meta.shape() == Shape{2, 3, 5, 5});
}

TEST_CASE("conv2d and max_pool2d refuse an empty kernel or plane, as torch") {
  Tensor x = ones({1, 1, 3, 3});
  check_throws_with([&] { conv2d(x, ones({1, 1, 0, 2})); },
                    "[conv2d] kernel size must be greater than zero, got (0, 2)");
  check_throws_with([&] { conv2d(x, ones({1, 1, 2, 0}), ones({1})); },
                    "[conv2d] kernel size must be greater than zero, got (2, 0)");
  check_throws_with([&] { conv2d(x, ones({1, 1, 2, 2}), {}, {.stride = -1}); },
                    "[conv2d] stride must be positive, got -1");
  // An empty plane, even padded to a non-empty one: only the batch and channels may be 0.
  check_throws_with([&] { conv2d(ones({1, 1, 0, 3}), ones({2, 1, 1, 1}), {}, {.padding = 1}); },
                    "[conv2d] input (1, 1, 0, 3) has an empty plane: only the batch and channel "
                    "dims may be 0");
  check_throws_with([&] { conv2d(ones({1, 1, 3, 0}), ones({2, 1, 1, 1})); },
                    "[conv2d] input (1, 1, 3, 0) has an empty plane");
  // Padding 1 around an empty plane made one window of padding alone, with no argmax to scatter to.
  check_throws_with([&] { max_pool2d(ones({1, 1, 0, 4}), {.kernel_size = 2, .padding = 1}); },
                    "[max_pool2d] input (1, 1, 0, 4) has an empty plane");
  check_throws_with([&] { max_pool2d(ones({1, 1, 4, 0})); },
                    "[max_pool2d] input (1, 1, 4, 0) has an empty plane");
}

TEST_CASE("conv2d and max_pool2d with an empty batch or channels") {
  // As torch: an empty batch gives an empty output, zero weight and bias gradients.
  Tensor x = ones({0, 1, 3, 3}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor w = ones({2, 1, 2, 2}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor b = ones({2}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor y = conv2d(x, w, b);
  CHECK(y.shape() == Shape{0, 2, 2, 2});
  sum(y).backward();
  CHECK(x.grad().shape() == Shape{0, 1, 3, 3});
  check_close(w.grad(), zeros({2, 1, 2, 2}, {.dtype = DType::f64}), 0, 0, "dweight, empty batch");
  check_close(b.grad(), zeros({2}, {.dtype = DType::f64}), 0, 0, "dbias, empty batch");
  // No input channels: every output is its bias (a sum over no taps), and dbias counts them.
  // (torch 1.13 returns a (1, 0, 2, 2) tensor here, whatever the weight's O.)
  Tensor xc = ones({1, 0, 3, 3}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor wc = ones({2, 0, 2, 2}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor bc = from_vector({1, 2}, {2}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor yc = conv2d(xc, wc, bc);
  check_close(yc, {1, 1, 1, 1, 2, 2, 2, 2}, 0, 0, "bias only");
  sum(yc).backward();
  CHECK(xc.grad().shape() == Shape{1, 0, 3, 3});
  CHECK(wc.grad().shape() == Shape{2, 0, 2, 2});
  check_close(bc.grad(), {4, 4}, 0, 0, "dbias, no channels");
  // No output channels: an empty output and a zero input gradient.
  Tensor xo = ones({1, 1, 3, 3}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor yo = conv2d(xo, ones({0, 1, 2, 2}, {.dtype = DType::f64}));
  CHECK(yo.shape() == Shape{1, 0, 2, 2});
  sum(yo).backward();
  check_close(xo.grad(), zeros({1, 1, 3, 3}, {.dtype = DType::f64}), 0, 0,
              "dx, no output channels");
  // max_pool2d: an empty batch or channels pool to nothing, and back.
  for (const Shape& s : {Shape{0, 1, 4, 4}, Shape{1, 0, 4, 4}}) {
    CAPTURE(shape_str(s));
    Tensor xp = ones(s).requires_grad_(true);
    Tensor yp = max_pool2d(xp, {.kernel_size = 2, .padding = 1});
    CHECK(yp.shape() == Shape{s[0], s[1], 3, 3});
    sum(yp).backward();
    CHECK(xp.grad().shape() == s);
  }
}

#if defined(_OPENMP)
namespace {

// Sets the OpenMP team's size for its lifetime (Note [Convolutions over images in parallel]).
class Threads {
 public:
  explicit Threads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(saved_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int saved_;
};

struct ConvPoolStep {
  Tensor y, dx, dw, db;
  std::int64_t peak_allocated = 0, peak_reserved = 0;
};

// pool(conv(x, w, b)) with a 2 x 2 and a 3 x 3 / stride 2 / padding 1 pooling, then backward of a
// weighted sum; on meta only the memory figures mean anything.
ConvPoolStep conv_pool_step(Device device, const Tensor& x0, const Tensor& w0, const Tensor& b0,
                            const Tensor& r0) {
  empty_cache(device);
  reset_peak_memory_stats(device);
  const MemoryStats start = memory_stats(device);
  Tensor x = x0.to(device).detach().requires_grad_(true);
  Tensor w = w0.to(device).detach().requires_grad_(true);
  Tensor b = b0.to(device).detach().requires_grad_(true);
  Tensor c = conv2d(x, w, b, {.padding = 1});
  Tensor y = add(max_pool2d(c, {.kernel_size = 2}),
                 max_pool2d(c, {.kernel_size = 3, .stride = 2, .padding = 1}));
  sum(mul(y, r0.to(device))).backward();
  const MemoryStats end = memory_stats(device);
  return {y.detach(),
          x.grad(),
          w.grad(),
          b.grad(),
          end.allocated.peak - start.allocated.current,
          end.reserved.peak - start.reserved.current};
}

}  // namespace

TEST_CASE("conv2d and max_pool2d on several threads: one thread's results, and meta's peaks") {
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    manual_seed(7);
    const Tensor x = randn({7, 3, 10, 10}).to(dt), w = randn({5, 3, 3, 3}).to(dt);
    const Tensor b = randn({5}).to(dt), r = randn({7, 5, 5, 5}).to(dt);
    ConvPoolStep one;
    {
      Threads threads(1);
      one = conv_pool_step(kCPU, x, w, b, r);
    }
    for (int n : {2, 3}) {
      CAPTURE(n);
      Threads threads(n);
      const ConvPoolStep many = conv_pool_step(kCPU, x, w, b, r);
      // Each image is computed alone, by the same operations, whichever thread takes it.
      CHECK(many.y.to_vector() == one.y.to_vector());
      CHECK(many.dx.to_vector() == one.dx.to_vector());
      CHECK(many.db.to_vector() == one.db.to_vector());
      // The weight's gradient adds the threads' sums: the same sum in another order.
      check_close(many.dw, one.dw.to_vector(), dt == DType::f32 ? 1e-5 : 1e-2,
                  dt == DType::f32 ? 1e-5 : 1e-2, "dweight, summed per thread");
      // A column buffer (and a partial weight gradient) per thread: meta allocates them alike.
      const ConvPoolStep meta =
          conv_pool_step(kMeta, x.to(kMeta), w.to(kMeta), b.to(kMeta), r.to(kMeta));
      CHECK(many.peak_allocated > one.peak_allocated);
      CHECK(meta.peak_allocated == many.peak_allocated);
      CHECK(meta.peak_reserved == many.peak_reserved);
    }
  }
}

TEST_CASE("max_pool2d's plane loop scans as the element function does: values, ties, NaN") {
  // The CPU kernel's plane loop on contiguous rows; max_pool2d_element is the CUDA kernel's scan.
  Tensor x = from_vector({1,
                          1,
                          0,
                          5,
                          2,
                          2,
                          2,
                          2,
                          3,
                          1,
                          1,
                          3,
                          4,
                          4,
                          4,
                          4,  // ties
                          std::nan(""),
                          1,
                          9,
                          std::nan(""),
                          -1,
                          -2,
                          -3,
                          -4},
                         {1, 1, 6, 4});
  kernels::Window2d w{.channels = 1,
                      .height = 6,
                      .width = 4,
                      .kernel_h = 2,
                      .kernel_w = 2,
                      .stride = 2,
                      .padding = 0,
                      .out_h = 3,
                      .out_w = 2};
  Tensor out = empty({1, 1, 3, 2}), indices = empty({1, 1, 3, 2}, {.dtype = DType::i64});
  kernels::cpu::max_pool2d(x.kview(), out.kview(), indices.kview(), w);
  for (std::int64_t e = 0; e < 6; ++e) {
    CAPTURE(e);
    std::int64_t at = -2;
    const float want = kernels::max_pool2d_element<float>(x.kview(), w, e, &at);
    const float got = static_cast<float>(out.to_vector()[static_cast<std::size_t>(e)]);
    CHECK((got == want || (std::isnan(got) && std::isnan(want))));
    CHECK(indices.to_vector()[static_cast<std::size_t>(e)] == static_cast<double>(at));
  }
  // The first of equal maxima wins; a NaN wins and stays.
  CHECK(indices.to_vector() == std::vector<double>{4, 3, 12, 14, 16, 19});
}
#endif
