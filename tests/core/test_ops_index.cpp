// Indexing ops: embedding, gather, index_select. Forward values from index arithmetic (torch's
// documented examples where they exist); gradients from gradcheck with repeated indices on
// contiguous and non-contiguous inputs and indices, and from counting how often each row is picked;
// out-of-range indices and malformed arguments must throw naming the op.
#include "core/rng.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

Tensor i64(const std::vector<double>& values, const Shape& shape) {
  return from_vector(values, shape, {.dtype = DType::i64});
}
Tensor i32(const std::vector<double>& values, const Shape& shape) {
  return from_vector(values, shape, {.dtype = DType::i32});
}
// An index tensor holding `values` (row-major) in a non-contiguous layout.
Tensor strided_index(const std::vector<double>& values, const Shape& shape) {
  return non_contiguous(i64(values, shape));
}

}  // namespace

// ---- embedding ---------------------------------------------------------------------------------

TEST_CASE("embedding: rows picked by i64 and i32 indices of any shape") {
  // w[v][c] = 10 v + c
  Tensor w = from_vector({0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32}, {4, 3});
  const std::vector<double> idx{3, 0, 3, 1, 2, 3};
  std::vector<double> expected;
  for (double v : idx)
    for (int c = 0; c < 3; ++c) expected.push_back(10 * v + c);
  for (Tensor indices : {i64(idx, {2, 3}), i32(idx, {2, 3}), strided_index(idx, {2, 3})}) {
    Tensor out = embedding(w, indices);
    CHECK(out.shape() == Shape{2, 3, 3});
    CHECK(out.dtype() == DType::f32);
    check_close(out, expected, 0, 0,
                std::string("embedding, index ") + dtype_name(indices.dtype()));
  }
  check_close(embedding(w.t().contiguous().t(), i64(idx, {6})), expected, 0, 0,
              "embedding of a column-major weight");
  Tensor one = embedding(w, scalar_tensor(2, {.dtype = DType::i64}));
  CHECK(one.shape() == Shape{3});
  check_close(one, {20, 21, 22}, 0, 0, "embedding of a 0-d index");
  CHECK(embedding(w, i64({}, {0, 5})).shape() == Shape{0, 5, 3});
}

TEST_CASE("embedding: backward adds one gradient row per use of a row") {
  Tensor w = input({5, 2});
  // Row 3 is used three times, rows 0 and 1 once, rows 2 and 4 never.
  Tensor indices = i64({3, 0, 3, 1, 3}, {5});
  embedding(w, indices).backward(ones({5, 2}, {.dtype = DType::f64}));
  check_close(w.grad(), {1, 1, 1, 1, 0, 0, 3, 3, 0, 0}, 0, 0, "counts per row");

  // Distinct gradient rows: dw[v] = sum of g[i] over positions i with index v.
  Tensor w2 = input({4, 3});
  Tensor g = from_vector({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 2, 3}, {.dtype = DType::f64});
  embedding(w2, i32({2, 0, 2, 2}, {2, 2})).backward(g);
  check_close(w2.grad(), {4, 5, 6, 0, 0, 0, 1 + 7 + 10, 2 + 8 + 11, 3 + 9 + 12, 0, 0, 0}, 0, 0,
              "gradient rows summed per index");
}

TEST_CASE("embedding: backward needs no weight values, so parameters may change in place first") {
  // Parameters are views of one arena, and versions count per storage: a change to a neighbour
  // between forward and backward must not fail the embedding's backward (it saves only indices).
  Tensor arena = input({5 * 2 + 3});
  Tensor w, other;
  {
    NoGradGuard no_grad;
    w = arena.detach().slice(0, 0, 10).view({5, 2});
    other = arena.detach().slice(0, 10, 13);
  }
  w.requires_grad_(true);
  w.set_grad(zeros({5, 2}, {.dtype = DType::f64}));  // the in-place path
  Tensor out = embedding(w, i64({4, 4, 1}, {3}));
  {
    NoGradGuard no_grad;
    other.fill_(2.0);  // an optimizer step on another parameter, say
  }
  out.backward(ones({3, 2}, {.dtype = DType::f64}));
  check_close(w.grad(), {0, 0, 1, 1, 0, 0, 0, 0, 2, 2}, 0, 0, "rows 1 and 4");
}

TEST_CASE("embedding: gradcheck with repeated indices, contiguous and not") {
  Tensor w = input({6, 4}, -1, 1, 3);
  const std::vector<double> idx{5, 1, 5, 0, 1, 5};
  auto f_for = [](Tensor indices) {
    return [indices](const std::vector<Tensor>& in) { return embedding(in[0], indices); };
  };
  gradcheck("embedding", f_for(i64(idx, {2, 3})), {w});
  gradcheck("embedding (non-contiguous weight)", f_for(i64(idx, {2, 3})), {non_contiguous(w)});
  gradcheck("embedding (non-contiguous i32 index)", f_for(non_contiguous(i32(idx, {3, 2}))), {w});
}

TEST_CASE("embedding: f32 gradients of a repeated row are the same on every run") {
  manual_seed(5);
  Tensor g = randn({64, 8});
  std::vector<double> idx(64);
  for (int i = 0; i < 64; ++i) idx[i] = i % 3;
  Tensor indices = i64(idx, {64});
  std::vector<double> first;
  for (int run = 0; run < 3; ++run) {
    Tensor w = zeros({3, 8});
    w.requires_grad_(true);
    embedding(w, indices).backward(g);
    const std::vector<double> dw = w.grad().to_vector();
    if (run == 0) first = dw;
    else CHECK(dw == first);
  }
  // And they equal the per-row sums (to f32 rounding).
  const std::vector<double> gv = g.to_vector();
  std::vector<double> expected(24, 0.0);
  for (int i = 0; i < 64; ++i)
    for (int c = 0; c < 8; ++c) expected[(i % 3) * 8 + c] += gv[i * 8 + c];
  check_close(from_vector(first, {3, 8}, {.dtype = DType::f64}), expected, 1e-5, 1e-5, "row sums");
}

TEST_CASE("embedding: with a gradient buffer, backward adds w * g rows straight into it") {
  // Note [Embedding gradients in place]: grad[index[i]] += w * g[i] in position order, the product
  // rounded to the buffer's compute type, then the sum, and no dense gradient returned. The
  // expected buffer is that loop, written out here in the buffer's arithmetic, to the bit.
  struct Case {
    DType weight, buffer;
  };
  manual_seed(9);
  const std::int64_t vocab = 7, c = 5, n = 40;
  std::vector<double> ids(n);
  for (std::int64_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = static_cast<double>((i * i + 3) % vocab);
  const Tensor indices = i64(ids, {4, n / 4});
  const Tensor g1 = randn({4, n / 4, c}), g2 = randn({4, n / 4, c});
  for (Case k : {Case{DType::f32, DType::f32}, Case{DType::bf16, DType::f32}, Case{DType::f16, DType::f32},
                 Case{DType::f64, DType::f64}, Case{DType::bf16, DType::bf16}}) {
    CAPTURE(std::string(dtype_name(k.weight)));
    CAPTURE(std::string(dtype_name(k.buffer)));
    Tensor w = zeros({vocab, c}, {.dtype = k.weight}).requires_grad_(true);
    Tensor buffer = full({vocab, c}, 0.5, {.dtype = k.buffer});
    w.set_grad(buffer);
    {
      GradWeightGuard weight(0.3);  // w * g is rounded: the product's rounding is checked too
      for (const Tensor& g : {g1, g2}) embedding(w, indices).backward(g.to(k.weight));
    }
    CHECK(w.grad().same_storage(buffer));  // written in place
    // The loop, in f32 for f32 and 16-bit buffers (16-bit ones rounded after each addition), in
    // f64 for f64.
    std::vector<double> want(static_cast<std::size_t>(vocab * c), 0.5);
    for (const Tensor& g : {g1, g2}) {
      const std::vector<double> gv = g.to(k.weight).to_vector();  // the values the op saw
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < c; ++j) {
          double& t = want[static_cast<std::size_t>(static_cast<std::int64_t>(ids[static_cast<std::size_t>(i)]) * c + j)];
          t = weighted_add_reference(t, gv[static_cast<std::size_t>(i * c + j)], 0.3, k.buffer);
        }
      }
    }
    check_close(buffer.to(DType::f64), from_vector(want, {vocab, c}, {.dtype = DType::f64}), 0.0, 0.0,
                "the buffer after two weighted backward passes (to the bit)");
  }
  // grad() capturing the weight still gets the dense gradient, and the buffer is left alone.
  Tensor w = zeros({vocab, c}).requires_grad_(true);
  Tensor buffer = zeros({vocab, c});
  w.set_grad(buffer);
  const Tensor dense = grad({sum(embedding(w, indices))}, {Tensor()}, {w})[0];
  CHECK_FALSE(dense.same_storage(buffer));
  CHECK(sum(dense).item() == static_cast<double>(n * c));
  CHECK(sum(buffer).item() == 0.0);
}

// ---- gather ------------------------------------------------------------------------------------

TEST_CASE("gather: torch.gather's examples and a smaller index") {
  Tensor t = from_vector({1, 2, 3, 4}, {2, 2});
  check_close(gather(t, 1, i64({0, 0, 1, 0}, {2, 2})), {1, 1, 4, 3}, 0, 0, "gather dim 1");
  check_close(gather(t, 0, i64({1, 0, 0, 0}, {2, 2})), {3, 2, 1, 2}, 0, 0, "gather dim 0");
  check_close(gather(t, -1, i32({1, 1, 0, 1}, {2, 2})), {2, 2, 3, 4}, 0, 0, "gather dim -1, i32");

  // a[i][j] = 10 i + j, (3, 4); an index (2, 2) smaller than a in dim 0.
  Tensor a = from_vector({0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}, {3, 4});
  Tensor out = gather(a, 1, i64({3, 0, 2, 2}, {2, 2}));
  CHECK(out.shape() == Shape{2, 2});
  check_close(out, {3, 0, 12, 12}, 0, 0, "gather with an index smaller than the input");
  // Along dim 0 the index may be longer than the input.
  check_close(gather(a, 0, i64({2, 0, 1, 1, 0, 2}, {3, 2})), {20, 1, 10, 11, 0, 21}, 0, 0,
              "gather dim 0 with a longer index");
  check_close(gather(a.t(), 1, strided_index({2, 0, 1, 1}, {2, 2})), {20, 0, 11, 11}, 0, 0,
              "gather from a transpose with a strided index");
}

TEST_CASE("gather: backward scatter-adds, so repeated indices accumulate") {
  Tensor a = input({2, 3});
  gather(a, 1, i64({0, 0, 2, 1, 1, 1}, {2, 3})).backward(ones({2, 3}, {.dtype = DType::f64}));
  check_close(a.grad(), {2, 0, 1, 0, 3, 0}, 0, 0, "counts per element");
}

TEST_CASE("gather: gradcheck on contiguous and non-contiguous inputs and indices") {
  Tensor a = input({3, 4, 2}, -1, 1, 7);
  Tensor idx1 = i64({3, 0, 0, 1, 3, 3, 2, 2, 1, 0, 0, 0}, {3, 2, 2});  // dim 1, smaller in dim 1
  Tensor idx0 = i64({2, 2, 0, 1, 1, 1, 0, 2}, {2, 2, 2});              // dim 0, smaller in dim 1
  auto f_for = [](std::int64_t dim, Tensor index) {
    return [dim, index](const std::vector<Tensor>& in) { return gather(in[0], dim, index); };
  };
  gradcheck("gather dim 1", f_for(1, idx1), {a});
  gradcheck("gather dim 1 (non-contiguous input)", f_for(1, idx1), {non_contiguous(a)});
  gradcheck("gather dim 0 (non-contiguous index)", f_for(0, non_contiguous(idx0)), {a});
  gradcheck("gather dim -1", f_for(-1, i64({1, 1, 0, 1, 0, 0}, {3, 1, 2})), {non_contiguous(a)});
}

// ---- index_select ------------------------------------------------------------------------------

TEST_CASE("index_select: entries along each dim, repeated and reordered") {
  // a[i][j] = 10 i + j, (3, 4)
  Tensor a = from_vector({0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}, {3, 4});
  Tensor rows = index_select(a, 0, i64({2, 0, 2}, {3}));
  CHECK(rows.shape() == Shape{3, 4});
  check_close(rows, {20, 21, 22, 23, 0, 1, 2, 3, 20, 21, 22, 23}, 0, 0, "rows");
  Tensor cols = index_select(a, -1, i32({3, 1}, {2}));
  CHECK(cols.shape() == Shape{3, 2});
  check_close(cols, {3, 1, 13, 11, 23, 21}, 0, 0, "columns");
  check_close(index_select(a.t(), 0, strided_index({1, 1}, {2})), {1, 11, 21, 1, 11, 21}, 0, 0,
              "rows of a transpose, strided index");
  CHECK(index_select(a, 1, i64({}, {0})).shape() == Shape{3, 0});
}

TEST_CASE("index_select: backward accumulates repeated indices") {
  Tensor a = input({3, 2});
  Tensor g = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}, {.dtype = DType::f64});
  index_select(a, 0, i64({1, 1, 0, 1}, {4})).backward(g);
  check_close(a.grad(), {5, 6, 1 + 3 + 7, 2 + 4 + 8, 0, 0}, 0, 0, "rows summed per index");
}

TEST_CASE("index_select: gradcheck on contiguous and non-contiguous inputs and indices") {
  Tensor a = input({3, 4, 2}, -1, 1, 9);
  auto f_for = [](std::int64_t dim, Tensor index) {
    return [dim, index](const std::vector<Tensor>& in) { return index_select(in[0], dim, index); };
  };
  for (std::int64_t dim : {0, 1, 2}) {
    Tensor idx = i64({1, 0, 1, 1}, {4});
    gradcheck("index_select dim " + std::to_string(dim), f_for(dim, idx), {a});
    gradcheck("index_select dim " + std::to_string(dim) + " (non-contiguous)",
              f_for(dim, strided_index({1, 0, 1, 1}, {4})), {non_contiguous(a)});
  }
}

TEST_CASE("indexing ops on meta give shapes without reading indices") {
  Tensor w = empty({10, 4}, {.device = kMeta});
  Tensor idx = empty({2, 3}, {.dtype = DType::i64, .device = kMeta});
  CHECK(embedding(w, idx).shape() == Shape{2, 3, 4});
  Tensor idx5 = empty({5}, {.dtype = DType::i64, .device = kMeta});
  CHECK(index_select(w, 1, idx5).shape() == Shape{10, 5});
  CHECK(gather(w, 0, empty({3, 4}, {.dtype = DType::i32, .device = kMeta})).shape() == Shape{3, 4});
}

// ---- errors ------------------------------------------------------------------------------------

TEST_CASE("out-of-range indices throw, naming the op, the value and the valid range") {
  Tensor w = zeros({4, 3});
  check_throws_with([&] { embedding(w, i64({0, 1, 4}, {3})); },
                    "[embedding] index 4 is out of range for dim 0 of size 4 (valid range [0, 4)), "
                    "at position 2");
  check_throws_with([&] { embedding(w, i32({-1, 1}, {2})); },
                    "[embedding] index -1 is out of range");
  check_throws_with([&] { embedding(w, strided_index({0, 1, 2, 7}, {2, 2})); },
                    "[embedding] index 7");
  check_throws_with([&] { gather(w, 1, i64({0, 3}, {1, 2})); },
                    "[gather] index 3 is out of range for dim 1 of size 3 (valid range [0, 3))");
  check_throws_with([&] { gather(w, 0, i64({0, -2}, {1, 2})); },
                    "[gather] index -2 is out of range");
  check_throws_with([&] { index_select(w, 0, i64({1, 9}, {2})); },
                    "[index_select] index 9 is out of range for dim 0 of size 4 "
                    "(valid range [0, 4))");
  check_throws_with([&] { index_select(w, -1, i32({3}, {1})); },
                    "[index_select] index 3 is out of range for dim 1 of size 3");
}

TEST_CASE("indexing errors name the op and what was given") {
  Tensor w = zeros({4, 3});
  check_throws_with([&] { embedding(w, from_vector({0, 1}, {2})); },
                    "[embedding] index must be i32 or i64, got f32");
  check_throws_with([&] { embedding(zeros({4}), i64({0}, {1})); },
                    "[embedding] weight must be (V, C), got shape (4,)");
  check_throws_with([&] { embedding(w, empty({1}, {.dtype = DType::i64, .device = kMeta})); },
                    "[embedding] tensors on different devices: cpu and meta");
  check_throws_with([&] { gather(w, 0, i64({0, 0}, {2})); },
                    "[gather] index has 1 dims but the input has 2 (shapes (2,) and (4, 3))");
  check_throws_with([&] { gather(w, 0, i64({0, 0, 0, 0, 0, 0, 0, 0}, {2, 4})); },
                    "[gather] index shape (2, 4) exceeds input shape (4, 3) in dim 1");
  check_throws_with([&] { gather(w, 2, i64({0}, {1, 1})); }, "[gather] dim 2 out of range");
  check_throws_with([&] { gather(w, 0, from_vector({0}, {1, 1}, {.dtype = DType::u8})); },
                    "[gather] index must be i32 or i64, got u8");
  check_throws_with([&] { index_select(w, 0, i64({0, 1}, {1, 2})); },
                    "[index_select] index must be 1-D, got shape (1, 2)");
  check_throws_with([&] { index_select(w, 2, i64({0}, {1})); },
                    "[index_select] dim 2 out of range");
  check_throws_with([&] { index_select(scalar_tensor(1), 0, i64({0}, {1})); },
                    "[index_select] the input must have at least one dim");
}
