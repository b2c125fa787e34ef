// The CUDA column sums (Note [Column sums]) and sorted scatter_add (Note [Sorted scatter_add])
// against the CPU: the MB_CUDA_TEST_CASEs run on a GPU and are skipped elsewhere; the host-side
// splits, the workspace sizes and what meta allocates for them are checked on every machine.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/ops/dispatch.h"
#include "kernels/index.h"
#include "kernels/reduce.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// input() in `dtype`, a leaf requiring grad when floating.
Tensor input_as(const Shape& shape, DType dtype, std::uint64_t seed) {
  Tensor t = input(shape, -1, 1, seed).detach().to(dtype);
  if (is_floating(dtype)) t.requires_grad_(true);
  return t;
}

// Exact equality of two tensors' values (NaN equal to NaN), naming the first difference.
void check_equal(const Tensor& actual, const Tensor& expected, const std::string& what) {
  REQUIRE_MESSAGE(actual.shape() == expected.shape(), what << ": shapes differ");
  const std::vector<double> a = actual.to_vector(), e = expected.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool same = a[i] == e[i] || (std::isnan(a[i]) && std::isnan(e[i]));
    CHECK_MESSAGE(same, what << ": element " << i << " is " << a[i] << ", expected " << e[i]);
    if (!same) return;
  }
}

// n token ids below `vocab` with long runs of one id: every third position is token 7, token 11
// appears 16 times and token 12 17 times (a run of exactly one load chunk and one past it), the
// rest are spread by a multiplicative hash over [100, vocab).
std::vector<double> skewed_tokens(std::int64_t n, std::int64_t vocab) {
  REQUIRE_MESSAGE(vocab > 100, "skewed_tokens spreads ids over [100, vocab), vocab " << vocab);
  REQUIRE_MESSAGE(n > 50, "skewed_tokens places runs up to position 50, n " << n);
  std::vector<double> ids(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t h = static_cast<std::uint64_t>(i) * 2654435761u;
    ids[static_cast<std::size_t>(i)] = static_cast<double>(100 + h % (vocab - 100));
    if (i % 3 == 0) ids[static_cast<std::size_t>(i)] = 7;
  }
  for (std::int64_t k = 0; k < 16; ++k) ids[static_cast<std::size_t>(3 * k + 1)] = 11;
  for (std::int64_t k = 0; k < 17; ++k) ids[static_cast<std::size_t>(3 * k + 2)] = 12;
  return ids;
}

// The gradient of embedding(weight, indices) for the incoming gradient g (N, C), weight of
// (vocab, C) in g's dtype on `device`, brought back to the CPU.
Tensor embedding_grad(const Tensor& g, const Tensor& indices, std::int64_t vocab, Device device) {
  Tensor w = zeros({vocab, g.shape()[1]}, {.dtype = g.dtype(), .device = device});
  w.requires_grad_(true);
  embedding(w, indices.to(device)).backward(g.to(device));
  return w.grad().to(kCPU);
}

}  // namespace

// ---- host-side splits and workspaces -----------------------------------------------------------

TEST_CASE("column sums split rows into at most 256 non-empty chunks of at least 64 rows") {
  for (std::int64_t rows : {1, 2, 63, 64, 65, 1000, 8192, 100003, 1000003}) {
    for (std::int64_t cols : {2, 7, 31, 33, 768, 2304, 3072, 100000}) {
      const kernels::ColumnSplit s = kernels::column_split(rows, cols);
      INFO("rows " << rows << ", cols " << cols);
      CHECK(s.chunks >= 1);
      CHECK(s.chunks <= 256);
      CHECK(s.chunks * s.rows_per_chunk >= rows);
      CHECK((s.chunks - 1) * s.rows_per_chunk < rows);  // the last chunk is not empty
      CHECK((s.chunks == 1 || s.rows_per_chunk >= 64));
    }
  }
  // GPT-2's bias gradients: about 1024 blocks of 32 columns.
  CHECK(kernels::column_split(8192, 768).chunks == 43);
  CHECK(kernels::column_split(8192, 3072).chunks == 11);
  CHECK(kernels::column_split(0, 5).chunks == 1);
}

TEST_CASE("the sorted scatter applies to embedding-like views only and sizes its workspace") {
  const std::int64_t n = 8192, c = 768, vocab = 50257;
  const kernels::StridedView dst = view_of({vocab, c}, {c, 1}), src = view_of({n, c}, {c, 1});
  const kernels::StridedView rows = view_of({n, c}, {1, 0});  // one index per row
  const std::int64_t bytes = kernels::sorted_scatter_workspace_bytes(dst, src, rows, 0);
  const kernels::SortedScatterLayout l = kernels::sorted_scatter_layout(n);
  CHECK(bytes == l.total);
  CHECK(l.keys[1] >= l.keys[0] + 4 * n);
  CHECK(l.positions[0] >= l.keys[1] + 4 * n);
  CHECK(l.positions[1] >= l.positions[0] + 4 * n);
  CHECK(l.sort >= l.positions[1] + 4 * n);
  for (std::int64_t at : {l.keys[1], l.positions[0], l.positions[1], l.sort}) CHECK(at % 256 == 0);
  CHECK(l.total == l.sort + l.sort_bytes);
  // Another dim, an index per element, too few positions, or a 3-D view: the unsorted kernel.
  CHECK(kernels::sorted_scatter_workspace_bytes(dst, src, rows, 1) == 0);
  CHECK(kernels::sorted_scatter_workspace_bytes(dst, src, view_of({n, c}, {c, 1}), 0) == 0);
  const kernels::StridedView few = view_of({255, c}, {c, 1});
  CHECK(kernels::sorted_scatter_workspace_bytes(dst, few, view_of({255, c}, {1, 0}), 0) == 0);
  const kernels::StridedView dst3 = view_of({vocab, 2, c}, {2 * c, c, 1});
  const kernels::StridedView src3 = view_of({n, 2, c}, {2 * c, c, 1});
  CHECK(kernels::sorted_scatter_workspace_bytes(dst3, src3, view_of({n, 2, c}, {1, 0, 0}), 0) == 0);
  // One column: an index per element is an index per row.
  const kernels::StridedView one = view_of({n, 1}, {1, 1});
  CHECK(kernels::sorted_scatter_workspace_bytes(view_of({vocab, 4}, {4, 1}), one, one, 0) > 0);
}

TEST_CASE(
    "meta mirroring CUDA: a sum over leading dims allocates partials, not a transposed copy") {
  const std::int64_t rows = 8192, cols = 768;
  auto peak = [&](Backend backend) {
    MetaBackendGuard guard(backend);
    const Tensor x = empty({rows, cols}, {.device = kMeta});
    reset_peak_memory_stats(kMeta);
    const std::int64_t before = memory_stats(kMeta).allocated.current;
    {
      const Tensor s = sum(x, {0});
      CHECK(s.shape() == Shape{cols});
    }
    return memory_stats(kMeta).allocated.peak - before;
  };
  const std::int64_t cuda = peak(Backend::cuda), cpu = peak(Backend::cpu);
  INFO("peak allocated: cuda " << cuda << ", cpu " << cpu);
  CHECK(cpu >= rows * cols * 4);  // the transposed copy
  const std::int64_t partials = kernels::column_split(rows, cols).chunks * cols * 8;
  CHECK(cuda >= partials + cols * 4);
  CHECK(cuda < partials + cols * 4 + 4096);  // allocator rounding only
}

TEST_CASE("meta mirroring CUDA: an embedding with a gradient buffer allocates only the workspace") {
  // Note [Embedding gradients in place]: no dense (vocab, C) gradient is made.
  const std::int64_t n = 4096, c = 64, vocab = 1000;
  MetaBackendGuard guard(Backend::cuda);
  Tensor w = empty({vocab, c}, {.dtype = DType::bf16, .device = kMeta}).requires_grad_(true);
  w.set_grad(empty({vocab, c}, {.device = kMeta}));
  const Tensor idx = empty({n}, {.dtype = DType::i64, .device = kMeta});
  Tensor out = embedding(w, idx);
  Tensor g = empty({n, c}, {.dtype = DType::bf16, .device = kMeta});
  reset_peak_memory_stats(kMeta);
  const std::int64_t before = memory_stats(kMeta).allocated.current;
  out.backward(g);
  const std::int64_t extra = memory_stats(kMeta).allocated.peak - before;
  INFO("peak above the start of the backward: " << extra);
  CHECK(extra >= kernels::sorted_scatter_layout(n).total);
  CHECK(extra < kernels::sorted_scatter_layout(n).total + vocab * c * 2);  // no dense gradient
}

TEST_CASE("meta mirroring CUDA: the embedding backward allocates the sort's workspace") {
  const std::int64_t n = 4096, c = 64, vocab = 1000;
  MetaBackendGuard guard(Backend::cuda);
  Tensor w = empty({vocab, c}, {.device = kMeta}).requires_grad_(true);
  const Tensor idx = empty({n}, {.dtype = DType::i64, .device = kMeta});
  reset_peak_memory_stats(kMeta);
  const std::int64_t before = memory_stats(kMeta).allocated.current;
  sum(embedding(w, idx)).backward();
  CHECK(w.grad().shape() == Shape{vocab, c});
  CHECK(memory_stats(kMeta).allocated.peak - before >=
        kernels::sorted_scatter_layout(n).total + vocab * c * 4);
}

// ---- column sums -------------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda sums over leading dims match the CPU in every floating dtype") {
  struct Case {
    Shape shape;
    std::vector<std::int64_t> dims;
  };
  const std::vector<Case> cases = {
      {{8192, 768}, {0}},  {{2, 1024, 2304}, {0, 1}}, {{3, 5, 7}, {0, 1}}, {{3, 5, 7}, {0}},
      {{1, 1}, {0}},       {{4, 1, 6}, {0}},          {{4, 1, 6}, {0, 1}}, {{1, 9, 1, 5}, {0, 1}},
      {{33, 31}, {0}},     {{31, 33}, {0}},           {{2, 100003}, {0}},  {{100003, 3}, {0}},
      {{1000003, 2}, {0}},
  };
  for (DType dt : kFloatDTypes) {
    for (const Case& c : cases) {
      const Tensor x = input_as(c.shape, dt, 21);
      const std::string name = std::string(dtype_name(dt)) + " " + shape_str(c.shape);
      ParityOptions tol = parity_tolerance(dt);
      tol.atol *= 4;  // sums of up to 10^6 values
      check_cuda_parity(
          "sum " + name, [&](const std::vector<Tensor>& in) { return sum(in[0], c.dims); }, {x},
          tol);
      check_cuda_parity(
          "mean keepdim " + name,
          [&](const std::vector<Tensor>& in) { return mean(in[0], c.dims, {.keepdim = true}); },
          {x}, tol);
    }
  }
  // Integer and bool sums are exact i64.
  std::vector<double> big(300 * 5);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = 1e12 + static_cast<double>(i);
  const Tensor ints = from_vector(big, {300, 5}, {.dtype = DType::i64});
  check_cuda_parity("sum i64", [](const std::vector<Tensor>& in) { return sum(in[0], {0}); },
                    {ints}, {.rtol = 0, .atol = 0});
  const Tensor i32 =
      from_vector(std::vector<double>(1000 * 33, -3.0), {1000, 33}, {.dtype = DType::i32});
  check_cuda_parity("sum i32", [](const std::vector<Tensor>& in) { return sum(in[0], {0}); }, {i32},
                    {.rtol = 0, .atol = 0});
  const Tensor flags = gt(input({4000, 33}, -1, 1, 22).detach(), zeros({}, {.dtype = DType::f64}));
  check_cuda_parity("sum bool", [](const std::vector<Tensor>& in) { return sum(in[0], {0}); },
                    {flags}, {.rtol = 0, .atol = 0});
  // A bias gradient through linear: sum of (B*T, C) over its rows.
  check_cuda_parity(
      "linear bias", [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); },
      {input_as({2, 300, 40}, DType::f32, 23), input_as({33, 40}, DType::f32, 24),
       input_as({33}, DType::f32, 25)},
      parity_tolerance(DType::f32));
  // Rows of a wider matrix (Note [Padded rows]): summed in place, and so are a 16-bit linear's
  // padded rows when its bias gradient is taken.
  for (DType dt : {DType::f32, DType::bf16}) {
    check_cuda_parity(
        std::string("sum of padded rows ") + dtype_name(dt),
        [](const std::vector<Tensor>& in) { return sum(in[0].slice(1, 0, 33), {0}); },
        {input_as({600, 40}, dt, 26)}, parity_tolerance(dt));
    check_cuda_parity(
        std::string("linear bias, padded rows ") + dtype_name(dt),
        [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); },
        {input_as({2, 300, 40}, dt, 23), input_as({33, 40}, dt, 24), input_as({33}, dt, 25)},
        parity_tolerance(dt));
  }
}

MB_CUDA_TEST_CASE("cuda sums over leading dims give the same bits on every run") {
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = input_as({8192, 768}, dt, 26).detach().to(test_gpu());
    const Tensor first = sum(x, {0}).to(kCPU);
    for (int run = 0; run < 3; ++run) {
      check_equal(sum(x, {0}).to(kCPU), first, std::string("rerun ") + dtype_name(dt));
    }
  }
}

// ---- sorted scatter_add ------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda embedding gradients equal the CPU's bits with long runs of one token") {
  GeneratorStateGuard restore;
  manual_seed(31);
  struct Case {
    std::int64_t n, c, vocab;
    DType index_dtype;
  };
  const std::vector<Case> cases = {{8192, 768, 50257, DType::i64},
                                   {4096, 33, 1000, DType::i32},
                                   {256, 1, 300, DType::i64},
                                   {100003, 3, 5000, DType::i32},
                                   {257, 20000, 400, DType::i64}};
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (const Case& k : cases) {
      const std::string name =
          std::string(dtype_name(dt)) + " n " + std::to_string(k.n) + " c " + std::to_string(k.c);
      const Tensor g = randn({k.n, k.c}).to(dt);
      const Tensor idx = from_vector(skewed_tokens(k.n, k.vocab), {k.n}, {.dtype = k.index_dtype});
      const Tensor expected = embedding_grad(g, idx, k.vocab, kCPU);
      const Tensor got = embedding_grad(g, idx, k.vocab, test_gpu());
      check_equal(got, expected, "embedding gradient " + name);
      check_equal(embedding_grad(g, idx, k.vocab, test_gpu()), got, "rerun " + name);
    }
  }
}

MB_CUDA_TEST_CASE("cuda embedding gradients added in place into an f32 buffer equal the CPU's bits") {
  // Note [Embedding gradients in place]: two micro-batches of weight 0.3 (a product that rounds)
  // into a preset buffer, through the sorted kernel (n >= 256) and the line kernel (n < 256).
  GeneratorStateGuard restore;
  manual_seed(33);
  struct Case {
    std::int64_t n, c, vocab;
    DType weight, buffer;
  };
  for (const Case& k : {Case{8192, 768, 50257, DType::bf16, DType::f32},
                        Case{4096, 33, 1000, DType::f16, DType::f32},
                        Case{100, 64, 130, DType::bf16, DType::f32},
                        Case{3000, 17, 200, DType::f32, DType::f32},
                        Case{3000, 17, 200, DType::bf16, DType::bf16}}) {
    const std::string name = std::string(dtype_name(k.weight)) + " into " + dtype_name(k.buffer) +
                             ", n " + std::to_string(k.n);
    const Tensor idx = from_vector(skewed_tokens(k.n, k.vocab), {k.n}, {.dtype = DType::i64});
    const Tensor g1 = randn({k.n, k.c}).to(k.weight), g2 = randn({k.n, k.c}).to(k.weight);
    auto run = [&](Device device) {
      Tensor w = zeros({k.vocab, k.c}, {.dtype = k.weight, .device = device}).requires_grad_(true);
      Tensor buffer = full({k.vocab, k.c}, 0.5, {.dtype = k.buffer, .device = device});
      w.set_grad(buffer);
      GradWeightGuard weight(0.3);
      for (const Tensor& g : {g1, g2}) embedding(w, idx.to(device)).backward(g.to(device));
      CHECK(w.grad().same_storage(buffer));
      return buffer.to(kCPU);
    };
    check_equal(run(test_gpu()), run(kCPU), "embedding gradient in place, " + name);
  }
}

MB_CUDA_TEST_CASE("cuda index_select along dim 0 with many positions matches the CPU") {
  const std::vector<double> ids = skewed_tokens(600, 150);
  for (DType dt : kFloatDTypes) {
    const Tensor x = input_as({150, 70}, dt, 32);
    const Tensor idx = from_vector(ids, {600}, {.dtype = DType::i64});
    const ParityOptions tol = parity_tolerance(dt);
    check_cuda_parity(
        "index_select dim 0",
        [](const std::vector<Tensor>& in) { return index_select(in[0], 0, in[1]); }, {x, idx}, tol);
    // A transposed incoming gradient: the scatter reads its source with strides (1, 600).
    check_cuda_parity(
        "index_select dim 0, transposed",
        [](const std::vector<Tensor>& in) { return index_select(in[0], 0, in[1]).t(); }, {x, idx},
        tol);
    // One column, an index per element: gather's backward takes the sorted path too.
    const Tensor column = from_vector(ids, {600, 1}, {.dtype = DType::i32});
    check_cuda_parity(
        "gather dim 0, one column",
        [](const std::vector<Tensor>& in) { return gather(in[0], 0, in[1]); }, {x, column}, tol);
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda embedding gradients skip out-of-range indices and report the first") {
  const Device gpu = cuda_device(0);
  const std::int64_t n = 600, c = 40, vocab = 50;
  std::vector<double> ids = skewed_tokens(n, 1000);
  std::vector<double> valid_ids, valid_positions;
  for (std::int64_t i = 0; i < n; ++i) {
    double& v = ids[static_cast<std::size_t>(i)];
    v = std::fmod(v, vocab);
    if (i == 10) v = vocab;
    if (i == 300) v = -3;
    if (i == 599) v = 1000000;
    if (v >= 0 && v < vocab) {
      valid_ids.push_back(v);
      valid_positions.push_back(static_cast<double>(i));
    }
  }
  const auto valid_n = static_cast<std::int64_t>(valid_ids.size());
  const Tensor g = input({n, c}, -1, 1, 33).detach().to(DType::f32);
  // The CPU's gradient of the valid positions alone, added in the same order.
  const Tensor valid_g =
      index_select(g, 0, from_vector(valid_positions, {valid_n}, {.dtype = DType::i64}));
  const Tensor expected = embedding_grad(
      valid_g, from_vector(valid_ids, {valid_n}, {.dtype = DType::i64}), vocab, kCPU);

  Tensor w = zeros({vocab, c}, {.device = gpu}).requires_grad_(true);
  const Tensor idx = from_vector(ids, {n}, {.dtype = DType::i64}).to(gpu);
  check_throws_with(
      [&] {
        embedding(w, idx).backward(g.to(gpu));
        (void)w.grad().to(kCPU);
      },
      "[embedding] index 50 is out of range for size 50 (at position 10)");
  REQUIRE(w.grad().defined());
  check_equal(w.grad().to(kCPU), expected, "gradient without the bad positions");
}
