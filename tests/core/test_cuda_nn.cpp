// The CUDA row kernels (softmax, log_softmax, cross_entropy, layer_norm) and the fused attention
// kernel against the CPU: values and gradients in f32, f16 and bf16, odd widths, ignored and
// out-of-range targets, and reruns that must give the same bits. The CPU cases check the head
// layout arithmetic the attention kernel shares with the host, and that the meta device predicts
// the fused kernel's smaller footprint.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/ops/dispatch.h"
#include "kernels/attention.h"
#include "kernels/nn.h"
#include "kernels/online_softmax.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

using V = std::vector<Tensor>;

// A leaf requiring grad: deterministic values in [lo, hi), rounded once to dt.
Tensor leaf(const Shape& shape, DType dt, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Tensor t = input(shape, lo, hi, seed).detach().to(dt);
  t.requires_grad_(true);
  return t;
}

std::string label(const std::string& what, DType dt, std::int64_t n) {
  return what + " " + dtype_name(dt) + " " + std::to_string(n);
}

// Row i's target is (7 i + 3) mod C, except the rows listed, which get ignore_index.
Tensor class_targets(std::int64_t n, std::int64_t c, const std::vector<std::int64_t>& ignored,
                     DType dt = DType::i64) {
  std::vector<double> values(n);
  for (std::int64_t i = 0; i < n; ++i) values[i] = static_cast<double>((7 * i + 3) % c);
  for (std::int64_t i : ignored) values[i] = -100;
  return from_vector(values, {n}, {.dtype = dt});
}

// Attention computed on the CPU in f32 whatever the dtype (the reference for the fused CUDA
// kernel, which does its math in f32), on CUDA in the inputs' dtype.
OpFn attention_fn(bool causal, bool heads_transposed = false) {
  return [causal, heads_transposed](const V& in) {
    V x = in;
    if (heads_transposed) {  // (B, T, H, D) leaves viewed as (B, H, T, D), as in a transformer
      for (Tensor& t : x) t = t.transpose(1, 2);
    }
    AttentionOptions options;
    options.causal = causal;
    if (!in[0].device().is_cpu()) return scaled_dot_product_attention(x[0], x[1], x[2], options);
    const DType dt = in[0].dtype();
    return scaled_dot_product_attention(x[0].to(DType::f32), x[1].to(DType::f32),
                                        x[2].to(DType::f32), options)
        .to(dt);
  };
}

// Copies of `inputs` on cuda:0, leaves that require grad where their sources do.
V cuda_leaves(const V& inputs) {
  V on_gpu;
  for (const Tensor& t : inputs) {
    Tensor g = t.detach().to(test_gpu());
    g.requires_grad_(t.requires_grad());
    on_gpu.push_back(g);
  }
  return on_gpu;
}

// The gradients of sum(f(inputs) * r) on cuda:0, copied to the CPU.
V cuda_grads(const OpFn& f, const V& inputs) {
  V on_gpu = cuda_leaves(inputs);
  Tensor out = f(on_gpu);
  Tensor r = input(out.shape(), -1, 1, 99).detach().to(out.dtype()).to(test_gpu());
  sum(out * r).backward();
  V grads;
  for (const Tensor& t : on_gpu)
    if (t.requires_grad()) grads.push_back(t.grad().to(kCPU));
  return grads;
}

void check_same_bits(const V& a, const V& b, const std::string& what) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    CHECK_MESSAGE(a[i].to_vector() == b[i].to_vector(), what << ": gradient " << i << " differs");
}

constexpr float kInf = std::numeric_limits<float>::infinity();

// A row's (max, sum of exp(x - max)) formed as a CUDA row pass forms it: `lanes` threads take the
// first `head` columns one each, then packs of 8 in turn, then the tail columns one each; their
// pairs meet in a butterfly, which must leave every lane with the same pair.
kernels::MaxSum<float> online_max_sum(const std::vector<float>& x, std::int64_t head, int lanes) {
  const auto n = static_cast<std::int64_t>(x.size());
  head = std::min(head, n);
  std::vector<kernels::MaxSum<float>> acc(lanes);
  auto add_one = [&](std::int64_t j, int lane) {
    const float one[1] = {x[j]};
    acc[lane].add(one);
  };
  for (std::int64_t j = 0; j < head; ++j) add_one(j, static_cast<int>(j % lanes));
  const std::int64_t packs = (n - head) / 8, tail = head + packs * 8;
  for (std::int64_t p = 0; p < packs; ++p) {
    float v[8];
    for (int k = 0; k < 8; ++k) v[k] = x[head + p * 8 + k];
    acc[p % lanes].add(v);
  }
  for (std::int64_t j = tail; j < n; ++j) add_one(j, static_cast<int>((j - tail) % lanes));
  for (int o = lanes / 2; o > 0; o /= 2) {
    std::vector<kernels::MaxSum<float>> next(lanes);
    for (int l = 0; l < lanes; ++l) next[l] = kernels::merge(acc[l], acc[l ^ o]);
    acc = next;
  }
  for (int l = 1; l < lanes; ++l) {
    CHECK((acc[l].max == acc[0].max || (std::isnan(acc[l].max) && std::isnan(acc[0].max))));
    CHECK((acc[l].sum == acc[0].sum || (std::isnan(acc[l].sum) && std::isnan(acc[0].sum))));
  }
  return acc[0];
}

// The CPU's two passes in f64: the max, then the sum of exp(x - max).
std::pair<double, double> two_pass_max_sum(const std::vector<float>& x) {
  double m = -INFINITY;
  for (float v : x) m = std::isnan(v) ? NAN : (v > m ? v : m);  // a NaN stays: NaN > v fails
  double s = 0.0;
  for (float v : x) s += std::exp(static_cast<double>(v) - m);
  return {m, s};
}

std::vector<float> uniform_row(std::int64_t n, double lo, double hi, std::uint64_t seed) {
  std::vector<float> row;
  for (double v : input({n}, lo, hi, seed).to_vector()) row.push_back(static_cast<float>(v));
  return row;
}

}  // namespace

// ---- host-side arithmetic ----------------------------------------------------------------------

TEST_CASE("attention head strides: 4-d views with transposed heads, and 3-d views") {
  // (B, T, H, D) = (2, 5, 3, 4) holding its own row-major index, viewed as (B, H, T, D).
  Tensor x = arange(0, 120, 1, {.dtype = DType::f32}).reshape({2, 5, 3, 4});
  const kernels::StridedView v = x.transpose(1, 2).kview();
  const kernels::HeadStrides s = kernels::head_strides(v);
  CHECK(s.heads == 3);
  const float* base = v.ptr<float>();
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 3; ++h)
      for (std::int64_t t = 0; t < 5; ++t)
        for (std::int64_t c = 0; c < 4; ++c)
          CHECK(base[kernels::head_offset(s, b * 3 + h) + t * s.row + c] ==
                static_cast<float>(((b * 5 + t) * 3 + h) * 4 + c));

  Tensor y = arange(0, 24, 1, {.dtype = DType::f32}).reshape({2, 3, 4});  // (B, T, D)
  const kernels::HeadStrides s3 = kernels::head_strides(y.kview());
  CHECK(s3.heads == 1);
  CHECK(kernels::head_offset(s3, 1) + 2 * s3.row + 3 == 23);
}

TEST_CASE("layer norm backward chunks: at least 32 rows each, at most 128") {
  CHECK(kernels::layer_norm_chunks(0) == 0);
  CHECK(kernels::layer_norm_chunks(1) == 1);
  CHECK(kernels::layer_norm_chunks(32) == 1);
  CHECK(kernels::layer_norm_chunks(33) == 2);
  CHECK(kernels::layer_norm_chunks(4096) == 128);
  CHECK(kernels::layer_norm_chunks(1000003) == 128);
}

TEST_CASE("online max and sum: packs, lanes and merges give the two passes' max and sum") {
  struct Row {
    std::string what;
    std::vector<float> x;
  };
  std::vector<Row> rows{{"uniform 50257", uniform_row(50257, -5, 5, 1)},
                        {"1e4 + noise", uniform_row(1000, 1e4, 1e4 + 1, 2)},
                        {"one column", {0.25f}},
                        {"fewer columns than lanes", uniform_row(5, -1, 1, 3)},
                        {"all equal", std::vector<float>(1000, 2.5f)},
                        {"all -inf", std::vector<float>(40, -kInf)}};
  std::vector<float> holes = uniform_row(333, -3, 3, 4);
  for (std::size_t j = 0; j < holes.size(); j += 7) holes[j] = -kInf;
  rows.push_back({"every 7th -inf", holes});
  for (const Row& row : rows) {
    const auto [m, s] = two_pass_max_sum(row.x);
    for (std::int64_t head : {0, 3, 7}) {
      for (int lanes : {1, 32, 256}) {
        INFO(row.what << ", head " << head << ", " << lanes << " lanes");
        const kernels::MaxSum<float> got = online_max_sum(row.x, head, lanes);
        CHECK(got.max == m);
        if (m == -INFINITY) {
          CHECK(got.sum == 0.0f);
        } else {
          CHECK(got.sum == doctest::Approx(s).epsilon(1e-4));  // f32 sums of up to 6283 terms
        }
      }
    }
  }
  // All equal: every term is exactly 1, and so is every partial sum.
  CHECK(online_max_sum(std::vector<float>(1000, -7.0f), 5, 32).sum == 1000.0f);
  // A NaN makes the sum NaN, even beside -inf only; so does a +inf (exp(inf - inf)), as on the CPU.
  std::vector<float> nan_row = uniform_row(100, -1, 1, 5);
  nan_row[42] = std::nanf("");
  std::vector<float> nan_beside_inf(50, -kInf);
  nan_beside_inf[9] = std::nanf("");
  std::vector<float> inf_row = uniform_row(100, -1, 1, 6);
  inf_row[17] = kInf;
  for (const std::vector<float>* x : {&nan_row, &nan_beside_inf, &inf_row}) {
    CHECK(std::isnan(online_max_sum(*x, 3, 32).sum));
    CHECK(std::isnan(two_pass_max_sum(*x).second));
  }
}

TEST_CASE("row split: an aligned head, whole packs, a short tail; scalar where rows disagree") {
  const std::uintptr_t base = 0x10000;
  for (std::size_t size : {2, 4, 8}) {
    const auto per_pack = static_cast<std::int64_t>(16 / size);
    for (std::uintptr_t offset = 0; offset < 16; offset += size) {
      for (std::int64_t cols : {0, 1, 7, 8, 9, 33, 1000, 50257}) {
        INFO("element " << size << " bytes, offset " << offset << ", " << cols << " columns");
        const kernels::RowSplit s = kernels::row_split(base + offset, base + offset, cols, size);
        const std::int64_t tail = s.head + s.packs * per_pack;
        CHECK(s.head >= 0);
        CHECK(s.head < per_pack);
        CHECK(tail <= cols);
        CHECK(cols - tail < per_pack);
        if (s.head < cols) CHECK((base + offset + s.head * size) % 16 == 0);
        // A second row at the same offset from a boundary shares the split; one elsewhere does not.
        const kernels::RowSplit same =
            kernels::row_split(base + offset, 3 * base + 32 + offset, cols, size);
        CHECK((same.head == s.head && same.packs == s.packs));
        const kernels::RowSplit apart =
            kernels::row_split(base + offset, base + offset + size, cols, size);
        CHECK((apart.head == cols && apart.packs == 0));
      }
    }
  }
  // Rows of 50257 bf16: row r starts r mod 8 columns past a boundary.
  for (std::uintptr_t r = 0; r < 16; ++r) {
    const std::uintptr_t row = base + 2 * 50257 * r;
    const kernels::RowSplit s = kernels::row_split(row, row, 50257, 2);
    CHECK(s.head == static_cast<std::int64_t>((8 - r % 8) % 8));
    CHECK(s.packs == (50257 - s.head) / 8);
  }
  // Not element-aligned: all scalar.
  const kernels::RowSplit odd = kernels::row_split(base + 1, base + 1, 100, 2);
  CHECK((odd.head == 100 && odd.packs == 0));
}

TEST_CASE("attention on meta: the fused CUDA path's peak is below the composed path's") {
  const std::int64_t b = 2, h = 4, t = 256, d = 64;
  auto peak = [&](Backend backend) {
    MetaBackendGuard guard(backend);
    const TensorOptions meta{.device = kMeta};
    Tensor q = empty({b, h, t, d}, meta), k = empty({b, h, t, d}, meta),
           v = empty({b, h, t, d}, meta);
    for (Tensor* x : {&q, &k, &v}) x->requires_grad_(true);
    reset_peak_memory_stats(kMeta);
    const std::int64_t before = memory_stats(kMeta).allocated.current;
    {
      Tensor out = scaled_dot_product_attention(q, k, v);
      CHECK(out.shape() == Shape{b, h, t, d});
      sum(out).backward();
    }
    return memory_stats(kMeta).allocated.peak - before;
  };
  const std::int64_t fused = peak(Backend::cuda), composed = peak(Backend::cpu);
  const std::int64_t probs = b * h * t * t * 4;  // one (B, H, T, S) f32 tensor
  INFO("peak allocated: fused " << fused << ", composed " << composed);
  CHECK(fused + probs <= composed);
}

// ---- softmax and log_softmax -------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda softmax and log_softmax match the CPU over the last dim") {
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    for (std::int64_t cols : {1, 33, 1000, 1025, 50257}) {
      const std::int64_t rows = cols > 1025 ? 3 : 9;
      Tensor x = leaf({rows, cols}, dt, 1 + cols, -4, 4);
      check_cuda_parity(
          label("softmax", dt, cols), [](const V& in) { return softmax(in[0], -1); }, {x},
          parity_tolerance(dt));
      check_cuda_parity(
          label("log_softmax", dt, cols), [](const V& in) { return log_softmax(in[0], -1); }, {x},
          parity_tolerance(dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda softmax and log_softmax match the CPU over an inner dim") {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t cols : {1, 33, 1000}) {
      Tensor x = leaf({4, cols, 3}, dt, 2 + cols, -4, 4);
      check_cuda_parity(
          label("softmax dim 1", dt, cols), [](const V& in) { return softmax(in[0], 1); }, {x},
          parity_tolerance(dt));
      check_cuda_parity(
          label("log_softmax dim 0", dt, cols), [](const V& in) { return log_softmax(in[0], 0); },
          {x}, parity_tolerance(dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda softmax: large and -inf logits stay finite where the CPU's do") {
  Tensor x = from_vector({1e4, 1e4 - 1, -1e4, 0, -INFINITY, 3, 2, 1}, {2, 4});
  check_cuda_parity("softmax extremes", [](const V& in) { return softmax(in[0], -1); }, {x},
                    {.check_grads = false});
  check_cuda_parity("log_softmax extremes", [](const V& in) { return log_softmax(in[0], -1); }, {x},
                    {.check_grads = false});
}

MB_CUDA_TEST_CASE("cuda softmax and log_softmax: rows off 16-byte boundaries, an offset input") {
  // Rows of 7, 33, 1000 and 50257 columns start at every offset from a boundary (Note [Row packs]).
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t cols : {7, 33, 1000, 50257}) {
      const std::int64_t rows = cols > 1000 ? 9 : 33;
      Tensor x = leaf({rows, cols}, dt, 60 + cols, -6, 6);
      check_cuda_parity(
          label("softmax packs", dt, cols), [](const V& in) { return softmax(in[0], -1); }, {x},
          parity_tolerance(dt));
      check_cuda_parity(
          label("log_softmax packs", dt, cols), [](const V& in) { return log_softmax(in[0], -1); },
          {x}, parity_tolerance(dt));
    }
  }
  // Input rows one element past the output's: the output pass goes scalar.
  constexpr std::int64_t rows = 5, cols = 50257;
  Tensor flat = leaf({rows * cols + 1}, DType::bf16, 70, -6, 6);
  check_cuda_parity(
      "softmax of an offset view",
      [](const V& in) {
        return softmax(in[0].slice(0, 1, rows * cols + 1).reshape({rows, cols}), -1);
      },
      {flat}, parity_tolerance(DType::bf16));
}

// ---- cross-entropy -----------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda cross_entropy matches the CPU: ignored rows, smoothing, 16-bit, 50257") {
  struct Case {
    std::int64_t n, c;
    DType dt;
    double smoothing;
  };
  for (const Case& k : {Case{8, 10, DType::f32, 0.0}, Case{8, 10, DType::f32, 0.1},
                        Case{6, 1000, DType::f16, 0.0}, Case{6, 1000, DType::bf16, 0.2},
                        Case{7, 1025, DType::f32, 0.0}, Case{4, 50257, DType::f32, 0.0},
                        Case{4, 50257, DType::bf16, 0.1}, Case{5, 33, DType::f64, 0.3}}) {
    Tensor logits = leaf({k.n, k.c}, k.dt, 3 + k.c, -5, 5);
    Tensor target = class_targets(k.n, k.c, {1, 3});
    for (Reduction reduction : {Reduction::None, Reduction::Sum, Reduction::Mean}) {
      const CrossEntropyOptions options{.reduction = reduction, .label_smoothing = k.smoothing};
      check_cuda_parity(
          label("cross_entropy s=" + std::to_string(k.smoothing), k.dt, k.c),
          [options](const V& in) { return cross_entropy(in[0], in[1], options); }, {logits, target},
          parity_tolerance(k.dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda cross_entropy: rows off 16-byte boundaries, ignored rows, smoothing") {
  // Row r of C columns starts r * C elements in: odd C puts rows at every offset from a boundary,
  // so heads, packs and tails all vary (Note [Row packs]) and the targets (7 r + 3) mod C fall in
  // each; C = 1000 keeps every row aligned. Rows 1 and 4 are ignored.
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t c : {7, 33, 1000, 50257}) {
      const std::int64_t n = c > 1000 ? 9 : 33;
      Tensor logits = leaf({n, c}, dt, 80 + c, -8, 8);
      Tensor target = class_targets(n, c, {1, 4});
      for (double smoothing : {0.0, 0.1}) {
        const CrossEntropyOptions options{.reduction = Reduction::None,
                                          .label_smoothing = smoothing};
        check_cuda_parity(
            label("cross_entropy packs s=" + std::to_string(smoothing), dt, c),
            [options](const V& in) { return cross_entropy(in[0], in[1], options); },
            {logits, target}, parity_tolerance(dt));
      }
    }
  }
}

MB_CUDA_TEST_CASE("cuda cross_entropy: offset and -inf logits, 1e4 + noise, the same bits twice") {
  // Logits one element past dlogits' alignment: the backward reads and writes scalars.
  constexpr std::int64_t n = 5, c = 50257;
  Tensor flat = leaf({n * c + 1}, DType::bf16, 90, -8, 8);
  Tensor target = class_targets(n, c, {2});
  auto offset_ce = [](const V& in) {
    return cross_entropy(in[0].slice(0, 1, n * c + 1).reshape({n, c}), in[1],
                         {.label_smoothing = 0.1});
  };
  check_cuda_parity("cross_entropy of an offset view", offset_ce, {flat, target},
                    parity_tolerance(DType::bf16));

  // Two -inf logits a row, away from the targets: finite losses, zero gradients there.
  std::vector<double> values = input({6, 37}, -3, 3, 91).to_vector();
  for (std::size_t r = 0; r < 6; ++r) values[r * 37 + 10 + 5 * r] = values[r * 37 + 36] = -INFINITY;
  Tensor masked = from_vector(values, {6, 37});
  masked.requires_grad_(true);
  Tensor masked_target = from_vector({0, 1, 2, 3, 4, 5}, {6}, {.dtype = DType::i64});
  check_cuda_parity("cross_entropy with -inf logits",
                    [](const V& in) { return cross_entropy(in[0], in[1]); },
                    {masked, masked_target});

  // Values far from zero: smoothing's mean(x - max) keeps its precision.
  Tensor far = (leaf({4, 3000}, DType::f32, 92).detach() + 1e4).detach();
  far.requires_grad_(true);
  check_cuda_parity(
      "cross_entropy of 1e4 + noise",
      [](const V& in) { return cross_entropy(in[0], in[1], {.label_smoothing = 0.2}); },
      {far, class_targets(4, 3000, {})});

  // Reruns give the same bits: losses and gradients.
  Tensor logits = leaf({7, c}, DType::bf16, 93, -8, 8);
  Tensor t7 = class_targets(7, c, {3});
  auto ce = [](const V& in) {
    return cross_entropy(in[0], in[1], {.reduction = Reduction::None, .label_smoothing = 0.1});
  };
  const V gpu{logits.detach().to(test_gpu()), t7.to(test_gpu())};
  check_same_bits({ce(gpu).to(kCPU)}, {ce(gpu).to(kCPU)}, "cross_entropy loss rerun");
  check_same_bits(cuda_grads(ce, {logits, t7}), cuda_grads(ce, {logits, t7}),
                  "cross_entropy rerun");
}

// Note [Reusing an input's memory]: the in-place backward (logits only cross_entropy holds) gives
// the bits of the one that allocates (logits the caller keeps), with one logits' worth less memory
// at its peak: over dense rows at every offset from a 16-byte boundary (x * 2), and over a 16-bit
// linear's padded rows (Note [Padded rows], core/ops/linalg.cpp), as GPT-2's head makes them.
MB_CUDA_TEST_CASE("cuda cross_entropy writes its gradient over logits that nothing else holds") {
  struct Run {
    V grads;
    std::int64_t peak = 0;
  };
  using Make = std::function<Tensor(const V&)>;
  auto run = [](const Make& make, const V& leaves, const Tensor& target, bool keep) {
    const V in = cuda_leaves(leaves);  // every one requires grad (leaf())
    Tensor logits = make(in);
    const std::int64_t bytes = logits.storage()->nbytes;
    Tensor loss = cross_entropy(logits, target.to(test_gpu()), {.label_smoothing = 0.1});
    if (!keep) logits = Tensor();
    reset_peak_memory_stats(test_gpu());
    const std::int64_t before = memory_stats(test_gpu()).allocated.current;
    loss.backward();
    Run r{{}, memory_stats(test_gpu()).allocated.peak - before};
    for (const Tensor& t : in) r.grads.push_back(t.grad().to(kCPU));
    return std::pair{r, bytes};
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (std::int64_t c : {37, 50257}) {
      const std::int64_t n = 9;
      Tensor target = class_targets(n, c, {4});
      const Make scaled = [](const V& in) { return in[0] * 2.0; };
      const Make head = [](const V& in) { return linear(in[0], in[1]); };
      const std::vector<std::pair<Make, V>> cases{
          {scaled, {leaf({n, c}, dt, 70 + c, -4, 4)}},
          {head, {leaf({n, 16}, dt, 71 + c), leaf({c, 16}, dt, 72 + c)}}};
      for (std::size_t k = 0; k < cases.size(); ++k) {
        const std::string name = label(k == 0 ? "x * 2" : "linear head", dt, c);
        CAPTURE(name);
        const auto [kept, bytes] = run(cases[k].first, cases[k].second, target, true);
        const Run dropped = run(cases[k].first, cases[k].second, target, false).first;
        check_same_bits(dropped.grads, kept.grads, name + " dlogits over the logits");
        CHECK(kept.peak - dropped.peak ==
              static_cast<std::int64_t>((static_cast<std::size_t>(bytes) + kBlockRound - 1) /
                                        kBlockRound * kBlockRound));
      }
    }
  }
}

MB_CUDA_TEST_CASE("cuda cross_entropy: every row ignored, i32 targets, (N, C, d) logits") {
  Tensor logits = leaf({4, 7}, DType::f32, 5);
  Tensor none = class_targets(4, 7, {0, 1, 2, 3});
  for (Reduction reduction : {Reduction::None, Reduction::Sum, Reduction::Mean}) {
    // Mean gives 0 / 0 = NaN on both devices, and zero gradients.
    check_cuda_parity(
        "cross_entropy all ignored",
        [reduction](const V& in) { return cross_entropy(in[0], in[1], {.reduction = reduction}); },
        {logits, none});
  }
  check_cuda_parity("cross_entropy i32 targets",
                    [](const V& in) { return cross_entropy(in[0], in[1]); },
                    {logits, class_targets(4, 7, {2}, DType::i32)});
  Tensor spatial = leaf({2, 5, 3}, DType::f32, 6);
  Tensor spatial_target = from_vector({0, 4, -100, 2, 1, 3}, {2, 3}, {.dtype = DType::i64});
  check_cuda_parity("cross_entropy (N, C, d)",
                    [](const V& in) { return cross_entropy(in[0], in[1]); },
                    {spatial, spatial_target});
}

MB_CUDA_ONLY_TEST_CASE("cuda cross_entropy: an out-of-range target is reported at the next host copy") {
  const Device gpu = cuda_device(0);
  Tensor logits = zeros({3, 4}).to(gpu);
  Tensor bad = from_vector({0, 7, 1}, {3}, {.dtype = DType::i64}).to(gpu);
  Tensor loss = cross_entropy(logits, bad);  // no error yet: the check does not wait for the GPU
  check_throws_with([&] { loss.to(kCPU); }, "[cross_entropy] index 7 is out of range");
  // Reported once; the device goes on working.
  Tensor good = from_vector({0, 3, 1}, {3}, {.dtype = DType::i64}).to(gpu);
  CHECK(cross_entropy(logits, good).to(kCPU).item() == doctest::Approx(std::log(4.0)));
}

// ---- layer norm --------------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda layer_norm matches the CPU: with and without affine, 16-bit, odd widths") {
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    for (std::int64_t cols : {1, 33, 768, 1500}) {
      Tensor x = leaf({70, cols}, dt, 7 + cols, -3, 3);
      Tensor w = leaf({cols}, dt, 8 + cols, 0.5, 1.5), b = leaf({cols}, dt, 9 + cols);
      check_cuda_parity(
          label("layer_norm affine", dt, cols),
          [cols](const V& in) { return layer_norm(in[0], {cols}, in[1], in[2]); }, {x, w, b},
          parity_tolerance(dt));
      check_cuda_parity(
          label("layer_norm plain", dt, cols),
          [cols](const V& in) { return layer_norm(in[0], {cols}); }, {x}, parity_tolerance(dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda layer_norm: many rows, 3-d input, offset values, weight only") {
  Tensor x = leaf({5000, 64}, DType::f32, 10);  // 128 chunks of 40 rows for dweight
  Tensor w = leaf({64}, DType::f32, 11, 0.5, 1.5), b = leaf({64}, DType::f32, 12);
  auto affine = [](const V& in) { return layer_norm(in[0], {64}, in[1], in[2]); };
  check_cuda_parity("layer_norm 5000 rows", affine, {x, w, b});
  check_same_bits(cuda_grads(affine, {x, w, b}), cuda_grads(affine, {x, w, b}), "layer_norm rerun");
  Tensor x3 = leaf({2, 35, 48}, DType::bf16, 13);
  Tensor w3 = leaf({35, 48}, DType::bf16, 14);
  check_cuda_parity(
      "layer_norm over two dims, weight only",
      [](const V& in) {
        return layer_norm(in[0], {35, 48}, in[1]);
      },
      {x3, w3}, parity_tolerance(DType::bf16));
  Tensor far = (leaf({6, 100}, DType::f32, 15).detach() + 1e4).detach();
  far.requires_grad_(true);
  check_cuda_parity("layer_norm of 1e4 + noise",
                    [](const V& in) { return layer_norm(in[0], {100}); }, {far});
}

// ---- fused attention ---------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda fused attention matches the composed CPU attention, forward and backward") {
  struct Case {
    Shape q, k;  // v has k's shape
  };
  for (const Case& c : {Case{{1, 2, 33, 64}, {1, 2, 33, 64}},    // one partial tile
                        Case{{2, 3, 17, 64}, {2, 3, 45, 64}},    // T < S
                        Case{{1, 2, 50, 32}, {1, 2, 20, 32}},    // T > S
                        Case{{2, 4, 1, 64}, {2, 4, 40, 64}},     // T = 1
                        Case{{2, 1, 70, 128}, {2, 1, 70, 128}},  // D = 128
                        Case{{1, 2, 19, 40}, {1, 2, 23, 40}},    // D padded to 64
                        Case{{3, 37, 8}, {3, 37, 8}},            // 3-d, small D
                        Case{{1, 1, 5, 1}, {1, 1, 5, 1}}}) {     // D = 1
    Tensor q = leaf(c.q, DType::f32, 21, -2, 2), k = leaf(c.k, DType::f32, 22, -2, 2),
           v = leaf(c.k, DType::f32, 23);
    for (bool causal : {false, true}) {
      check_cuda_parity(
          "attention " + shape_str(c.q) + " x " + shape_str(c.k) + (causal ? " causal" : ""),
          attention_fn(causal), {q, k, v});
    }
  }
}

MB_CUDA_TEST_CASE("cuda fused attention in f16 and bf16 against the CPU in f32") {
  for (DType dt : {DType::f16, DType::bf16}) {
    for (std::int64_t d : {64, 128}) {
      Tensor q = leaf({2, 2, 40, d}, dt, 31, -2, 2), k = leaf({2, 2, 40, d}, dt, 32, -2, 2),
             v = leaf({2, 2, 40, d}, dt, 33);
      for (bool causal : {false, true})
        check_cuda_parity(label(causal ? "attention causal" : "attention", dt, d),
                          attention_fn(causal), {q, k, v}, parity_tolerance(dt));
    }
  }
}

MB_CUDA_TEST_CASE("cuda fused attention: transposed heads, long sequences, the same bits twice") {
  // (B, T, H, D) leaves read through strided (B, H, T, D) views, without copies.
  Tensor q = leaf({2, 130, 3, 64}, DType::f32, 41), k = leaf({2, 130, 3, 64}, DType::f32, 42),
         v = leaf({2, 130, 3, 64}, DType::f32, 43);
  check_cuda_parity("attention transposed heads", attention_fn(true, true), {q, k, v});
  check_same_bits(cuda_grads(attention_fn(true, true), {q, k, v}),
                  cuda_grads(attention_fn(true, true), {q, k, v}), "attention rerun");
  Tensor ql = leaf({1, 2, 300, 64}, DType::bf16, 44), kl = leaf({1, 2, 300, 64}, DType::bf16, 45),
         vl = leaf({1, 2, 300, 64}, DType::bf16, 46);
  check_cuda_parity("attention T = 300 bf16", attention_fn(true), {ql, kl, vl},
                    parity_tolerance(DType::bf16));
}

MB_CUDA_TEST_CASE("cuda attention outside the fused kernel's range uses the composed path") {
  // Dropout, f64 and D > 128 run the composition on CUDA too.
  Tensor q = leaf({1, 2, 9, 130}, DType::f32, 51), k = leaf({1, 2, 9, 130}, DType::f32, 52),
         v = leaf({1, 2, 9, 130}, DType::f32, 53);
  check_cuda_parity("attention D = 130", attention_fn(true), {q, k, v});
  Tensor q64 = leaf({1, 2, 9, 16}, DType::f64, 54), k64 = leaf({1, 2, 9, 16}, DType::f64, 55),
         v64 = leaf({1, 2, 9, 16}, DType::f64, 56);
  check_cuda_parity(
      "attention f64",
      [](const V& in) { return scaled_dot_product_attention(in[0], in[1], in[2]); },
      {q64, k64, v64}, parity_tolerance(DType::f64));
}
