// Shape ops: cat, stack, split and chunk, and the views that are Tensor methods (view, reshape, transpose,
// permute, slice, select, expand, squeeze, unsqueeze, flatten) plus contiguous and clone.
// Forward values come from index arithmetic on arange inputs; gradients from gradcheck on
// contiguous and non-contiguous inputs; errors must name the op.
#include <limits>
#include <string>

#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// 0, 1, ..., n-1 in `shape` (f64), so an element's value is its row-major position.
Tensor iota(const Shape& shape) {
  const auto n = static_cast<double>(shape_numel(shape));
  return arange(0, n, 1, {.dtype = DType::f64}).reshape(shape);
}

}  // namespace

// ---- cat and stack -----------------------------------------------------------------------------

TEST_CASE("cat: forward values along each dim, with negative dims and strided inputs") {
  Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector({7, 8}, {2, 1});
  Tensor c = from_vector({9, 10, 11, 12}, {2, 2});
  Tensor r = cat({a, b, c}, 1);
  CHECK(r.shape() == Shape{2, 6});
  check_close(r, {1, 2, 3, 7, 9, 10, 4, 5, 6, 8, 11, 12}, 0, 0, "cat dim 1");
  check_close(cat({a, b, c}, -1), r, 0, 0, "cat dim -1");

  Tensor d = from_vector({13, 14, 15}, {1, 3});
  Tensor r0 = cat({a, d}, 0);
  CHECK(r0.shape() == Shape{3, 3});
  check_close(r0, {1, 2, 3, 4, 5, 6, 13, 14, 15}, 0, 0, "cat dim 0");

  // a.t() is (3, 2) with strides (1, 3); b.t() is (1, 2).
  Tensor rt = cat({a.t(), b.t()}, 0);
  check_close(rt, {1, 4, 2, 5, 3, 6, 7, 8}, 0, 0, "cat of transposed views");

  // An input with zero extent along the cat dim contributes nothing.
  Tensor none = empty({2, 0});
  check_close(cat({a, none, b}, 1), {1, 2, 3, 7, 4, 5, 6, 8}, 0, 0, "cat with an empty input");

  Tensor ints = cat({from_vector({1, 2}, {2}, {.dtype = DType::i64}),
                     from_vector({3}, {1}, {.dtype = DType::i64})});
  CHECK(ints.dtype() == DType::i64);
  check_close(ints, {1, 2, 3}, 0, 0, "cat of i64");
}

TEST_CASE("cat: the output is fresh memory, and a one-tensor cat is a copy") {
  Tensor a = from_vector({1, 2}, {2});
  Tensor r = cat({a});
  CHECK_FALSE(r.same_storage(a));
  r.fill_(0);
  check_close(a, {1, 2}, 0, 0, "input unchanged");
}

TEST_CASE("cat: gradcheck along each dim, on contiguous and non-contiguous inputs") {
  for (std::int64_t dim : {0, 1, 2, -1}) {
    Shape sa{2, 3, 4}, sb{2, 3, 4};
    sb[dim < 0 ? dim + 3 : dim] = 1;
    Tensor a = input(sa, -1, 1, 1), b = input(sb, -1, 1, 2), c = input({2, 3, 4}, -1, 1, 3);
    auto f = [dim](const std::vector<Tensor>& in) { return cat(in, dim); };
    gradcheck("cat dim " + std::to_string(dim), f, {a, b, c});
    gradcheck("cat dim " + std::to_string(dim) + " (non-contiguous)", f,
              {non_contiguous(a), b, non_contiguous(c)});
  }
  // Only some inputs require grad; the repeated input gets both slices.
  Tensor x = input({2, 2}, -1, 1, 4);
  Tensor frozen = from_vector({1, 2, 3, 4}, {2, 2}, {.dtype = DType::f64});
  gradcheck("cat with a frozen and a repeated input",
            [&](const std::vector<Tensor>& in) { return cat({in[0], frozen, in[0]}, 1); }, {x});
}

TEST_CASE("cat: backward hands each input its slice of the gradient") {
  Tensor a = input({2, 2}), b = input({2, 1}, -1, 1, 2);
  Tensor g = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::f64});
  cat({a, b}, 1).backward(g);
  check_close(a.grad(), {1, 2, 4, 5}, 0, 0, "da");
  check_close(b.grad(), {3, 6}, 0, 0, "db");
}

TEST_CASE("stack: forward values at each position") {
  Tensor a = from_vector({1, 2, 3}, {3}), b = from_vector({4, 5, 6}, {3});
  Tensor s0 = stack({a, b});
  CHECK(s0.shape() == Shape{2, 3});
  check_close(s0, {1, 2, 3, 4, 5, 6}, 0, 0, "stack dim 0");
  Tensor s1 = stack({a, b}, 1);
  CHECK(s1.shape() == Shape{3, 2});
  check_close(s1, {1, 4, 2, 5, 3, 6}, 0, 0, "stack dim 1");
  check_close(stack({a, b}, -1), s1, 0, 0, "stack dim -1");

  Tensor m = iota({2, 2});
  Tensor s = stack({m, m.t()}, 1);  // (2, 2, 2): s[i][k][j] = k == 0 ? m[i][j] : m[j][i]
  CHECK(s.shape() == Shape{2, 2, 2});
  check_close(s, {0, 1, 0, 2, 2, 3, 1, 3}, 0, 0, "stack of a matrix and its transpose");

  Tensor scalars = stack({scalar_tensor(7), scalar_tensor(8)});
  CHECK(scalars.shape() == Shape{2});
  check_close(scalars, {7, 8}, 0, 0, "stack of 0-d tensors");
}

TEST_CASE("stack: gradcheck at each position, on contiguous and non-contiguous inputs") {
  for (std::int64_t dim : {0, 1, 2, -1}) {
    Tensor a = input({3, 2}, -1, 1, 5), b = input({3, 2}, -1, 1, 6);
    auto f = [dim](const std::vector<Tensor>& in) { return stack(in, dim); };
    gradcheck("stack dim " + std::to_string(dim), f, {a, b});
    gradcheck("stack dim " + std::to_string(dim) + " (non-contiguous)", f,
              {non_contiguous(a), non_contiguous(b)});
  }
}

TEST_CASE("cat and stack on meta give the shape without data") {
  Tensor a = empty({2, 3}, {.device = kMeta}), b = empty({2, 5}, {.device = kMeta});
  Tensor r = cat({a, b}, 1);
  CHECK(r.device().is_meta());
  CHECK(r.shape() == Shape{2, 8});
  CHECK(stack({a, a}, 2).shape() == Shape{2, 3, 2});
}

TEST_CASE("cat and stack errors name the op, the tensor and both shapes") {
  Tensor a = zeros({2, 3}), b = zeros({2, 1});
  check_throws_with([] { cat({}); }, "[cat] expected a non-empty list");
  check_throws_with([] { stack({}); }, "[stack] expected a non-empty list");
  check_throws_with([&] { cat({a, b, zeros({3, 2})}, 1); },
                    "[cat] tensor 2 has shape (3, 2) but tensor 0 has shape (2, 3)");
  check_throws_with([&] { cat({a, b}, 0); },
                    "[cat] tensor 1 has shape (2, 1) but tensor 0 has shape (2, 3)");
  check_throws_with([&] { cat({a, zeros({2, 3, 1})}, 0); }, "[cat] tensor 1 has shape (2, 3, 1)");
  check_throws_with([&] { cat({a, zeros({2, 3}, {.dtype = DType::f64})}); },
                    "[cat] tensor 1 has dtype f64 but tensor 0 has f32");
  check_throws_with([&] { cat({a, empty({2, 3}, {.device = kMeta})}); },
                    "[cat] tensor 1 is on meta");
  check_throws_with([&] { cat({a, a}, 2); }, "[cat] dim 2 out of range");
  check_throws_with([] { cat({scalar_tensor(1), scalar_tensor(2)}); },
                    "[cat] tensor 0 is zero-dimensional");
  check_throws_with([&] { stack({a, a.t()}); },
                    "[stack] tensor 1 has shape (3, 2) but tensor 0 has shape (2, 3)");
  check_throws_with([&] { stack({a, zeros({2, 3}, {.dtype = DType::i64})}); },
                    "[stack] tensor 1 has dtype i64");
  check_throws_with([&] { stack({a, a}, 3); }, "[stack] dim 3 out of range");
}

// ---- split and chunk ---------------------------------------------------------------------------

TEST_CASE("split and chunk: the pieces torch gives, as views of the input") {
  Tensor a = iota({2, 7});
  std::vector<Tensor> p = split(a, 3, 1);  // sizes 3, 3, 1
  REQUIRE(p.size() == 3);
  check_close(p[0], {0, 1, 2, 7, 8, 9}, 0, 0, "piece 0");
  check_close(p[1], {3, 4, 5, 10, 11, 12}, 0, 0, "piece 1");
  check_close(p[2], {6, 13}, 0, 0, "piece 2");
  CHECK(p[2].shape() == Shape{2, 1});
  CHECK(p[1].storage() == a.storage());  // a view, no copy
  std::vector<Tensor> q = split(a, std::vector<std::int64_t>{1, 0, 6}, -1);
  REQUIRE(q.size() == 3);
  CHECK(q[1].shape() == Shape{2, 0});
  check_close(q[2], {1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13}, 0, 0, "sizes 1, 0, 6");
  CHECK(split(a, 2, 0).size() == 1);  // one piece of the whole dim
  // A braced list is sizes, even of one element: {7} is the whole dim, not pieces of 7.
  CHECK(split(a, {7}, 1).size() == 1);
  CHECK(split(a, {2, 5}, 1)[1].shape() == Shape{2, 5});
  // chunk: pieces of ceil(n / chunks), fewer when they run out (6 over 4 chunks gives 3 of 2).
  CHECK(chunk(iota({6}), 4).size() == 3);
  std::vector<Tensor> c = chunk(iota({5}), 3);
  REQUIRE(c.size() == 3);
  check_close(c[2], {4}, 0, 0, "last chunk");
  CHECK(split(empty({0, 3}), 2, 0).size() == 1);
}

TEST_CASE("split: one backward node; gradcheck with every piece used and with pieces unused") {
  Tensor a = input({3, 8}, -1, 1, 5);
  std::vector<Tensor> p = split(a, 3, 1);
  CHECK(p[0].grad_fn() != nullptr);
  CHECK(p[0].grad_fn() == p[2].grad_fn());
  gradcheck(
      "split, every piece", [](const std::vector<Tensor>& in) {
        std::vector<Tensor> x = split(in[0], 3, 1);
        return cat({x[2] * 2.0, x[0], x[1] * x[1]}, 1);
      },
      {a});
  gradcheck(
      "split, piece 1 unused (its gradient is zero)", [](const std::vector<Tensor>& in) {
        std::vector<Tensor> x = split(in[0], 3, 1);
        return cat({x[0], x[2]}, 1);
      },
      {non_contiguous(a)});
  gradcheck(
      "chunk along dim 0", [](const std::vector<Tensor>& in) { return chunk(in[0], 2, 0)[1] * 3.0; },
      {a});
}

TEST_CASE("split and chunk errors name the op and the sizes") {
  Tensor a = zeros({2, 7});
  check_throws_with([&] { split(a, std::vector<std::int64_t>{3, 3}, 1); },
                    "[split] split sizes add up to 6 but dim 1 of (2, 7) has size 7");
  check_throws_with([&] { split(a, std::vector<std::int64_t>{8, -1}, 1); },
                    "[split] split sizes must be non-negative, got -1");
  check_throws_with([&] { split(a, {3}, 1); },
                    "[split] split sizes add up to 3 but dim 1 of (2, 7) has size 7");
  check_throws_with([&] { split(a, 0, 1); }, "[split] split_size must be positive, got 0");
  check_throws_with([&] { split(a, 2, 2); }, "[split] dim 2 out of range");
  check_throws_with([&] { chunk(a, 0, 1); }, "[chunk] chunks must be positive, got 0");
  check_throws_with([] { split(scalar_tensor(1), 1); }, "[split] a zero-dimensional tensor");
}

// ---- views -------------------------------------------------------------------------------------

TEST_CASE("view and reshape: shapes with -1, shared storage, and copies only when needed") {
  Tensor a = iota({2, 3, 4});
  Tensor v = a.view({4, -1});
  CHECK(v.shape() == Shape{4, 6});
  CHECK(v.same_storage(a));
  check_close(v.reshape({-1}), iota({24}).reshape({-1}), 0, 0, "view keeps row-major order");
  CHECK(a.view({-1}).shape() == Shape{24});
  CHECK(a.reshape({2, -1, 2}).shape() == Shape{2, 6, 2});

  // The transpose of (2, 3) is [[0, 3], [1, 4], [2, 5]]; reshape copies it in that order.
  Tensor m = iota({2, 3});
  Tensor r = m.t().reshape({-1});
  CHECK_FALSE(r.same_storage(m));
  check_close(r, {0, 3, 1, 4, 2, 5}, 0, 0, "reshape of a transpose");
  CHECK(m.reshape({3, 2}).same_storage(m));
}

TEST_CASE("transpose and permute move elements to the permuted positions") {
  Tensor a = iota({2, 3, 4});  // a[i][j][k] = 12 i + 4 j + k
  Tensor p = a.permute({2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  std::vector<double> expected;
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) expected.push_back(12 * i + 4 * j + k);
  check_close(p, expected, 0, 0, "permute (2, 0, 1)");
  check_close(a.permute({-1, 0, 1}), expected, 0, 0, "permute with a negative dim");

  Tensor t = a.transpose(0, -1);  // t[k][j][i] = a[i][j][k]
  CHECK(t.shape() == Shape{4, 3, 2});
  expected.clear();
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 2; ++i) expected.push_back(12 * i + 4 * j + k);
  check_close(t, expected, 0, 0, "transpose (0, -1)");
  CHECK_FALSE(t.is_contiguous());
  check_close(iota({2, 3}).t(), {0, 3, 1, 4, 2, 5}, 0, 0, "t()");
}

TEST_CASE("slice with steps and negative bounds, and select") {
  Tensor a = iota({10});
  check_close(a.slice(0, -8, -1, 3), {2, 5, 8}, 0, 0, "slice [-8:-1:3]");
  check_close(a.slice(0, 1, 100, 4), {1, 5, 9}, 0, 0, "slice [1:100:4] clamps the end");
  check_close(a.slice(0, -100, 2), {0, 1}, 0, 0, "slice [-100:2] clamps the start");
  CHECK(a.slice(0, 7, 3).numel() == 0);

  Tensor m = iota({3, 4});  // m[i][j] = 4 i + j
  Tensor s = m.slice(1, 1, 4, 2);
  CHECK(s.shape() == Shape{3, 2});
  check_close(s, {1, 3, 5, 7, 9, 11}, 0, 0, "slice along dim 1");
  check_close(m.slice(-2, -1, 3), {8, 9, 10, 11}, 0, 0, "slice [-1:] of dim -2");

  check_close(m.select(1, -1), {3, 7, 11}, 0, 0, "select last column");
  check_close(m.select(0, 1), {4, 5, 6, 7}, 0, 0, "select row 1");
  CHECK(m.select(0, 1).shape() == Shape{4});
  CHECK(m.select(0, 1).same_storage(m));
}

TEST_CASE("expand, squeeze, unsqueeze, flatten") {
  Tensor col = from_vector({1, 2, 3}, {3, 1});
  Tensor e = col.expand({2, 3, 4});
  CHECK(e.shape() == Shape{2, 3, 4});
  CHECK(e.same_storage(col));
  std::vector<double> expected;
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) expected.push_back(i + 1);
  check_close(e, expected, 0, 0, "expand (3, 1) to (2, 3, 4)");
  CHECK(col.expand({-1, 2}).shape() == Shape{3, 2});

  Tensor a = iota({2, 1, 3});
  CHECK(a.squeeze(1).shape() == Shape{2, 3});
  CHECK(a.squeeze(-2).shape() == Shape{2, 3});
  CHECK(a.squeeze(0).shape() == Shape{2, 1, 3});  // a dim that is not 1 stays
  CHECK(a.unsqueeze(0).shape() == Shape{1, 2, 1, 3});
  CHECK(a.unsqueeze(3).shape() == Shape{2, 1, 3, 1});
  CHECK(a.unsqueeze(-1).shape() == Shape{2, 1, 3, 1});
  check_close(a.squeeze(1).unsqueeze(-1), iota({6}).reshape({2, 3, 1}), 0, 0,
              "squeeze/unsqueeze values");

  Tensor b = iota({2, 3, 4, 5});
  CHECK(b.flatten().shape() == Shape{120});
  CHECK(b.flatten(1).shape() == Shape{2, 60});
  CHECK(b.flatten(1, 2).shape() == Shape{2, 12, 5});
  CHECK(b.flatten(-2, -1).shape() == Shape{2, 3, 20});
  check_close(b.flatten(1, 2), iota({120}).reshape({2, 12, 5}), 0, 0,
              "flatten keeps row-major order");
  // flatten of a non-contiguous tensor copies in logical order.
  check_close(iota({2, 3}).t().flatten(), {0, 3, 1, 4, 2, 5}, 0, 0, "flatten of a transpose");
  CHECK(scalar_tensor(5).flatten().shape() == Shape{1});
}

TEST_CASE("contiguous and clone") {
  Tensor m = iota({2, 3});
  Tensor t = m.t();
  Tensor c = t.contiguous();
  CHECK(c.is_contiguous());
  CHECK_FALSE(c.same_storage(m));
  check_close(c, {0, 3, 1, 4, 2, 5}, 0, 0, "contiguous of a transpose");
  CHECK(m.contiguous().same_storage(m));

  Tensor k = t.clone();
  CHECK_FALSE(k.same_storage(m));
  check_close(k, {0, 3, 1, 4, 2, 5}, 0, 0, "clone of a transpose");
  k.fill_(-1);
  check_close(m, {0, 1, 2, 3, 4, 5}, 0, 0, "the original is untouched by writes to the clone");
}

TEST_CASE("view ops: gradcheck on contiguous and non-contiguous inputs") {
  struct Case {
    const char* name;
    Shape shape;
    Tensor (*fn)(const Tensor&);
  };
  const Case cases[] = {
      {"reshape (-1)", {2, 3, 4}, [](const Tensor& x) { return x.reshape({4, -1}); }},
      {"transpose", {2, 3, 4}, [](const Tensor& x) { return x.transpose(0, 2); }},
      {"permute", {2, 3, 4}, [](const Tensor& x) { return x.permute({1, 2, 0}); }},
      {"slice step 2, negative bounds", {5, 6},
       [](const Tensor& x) { return x.slice(1, -5, -1, 2); }},
      {"slice of a slice", {5, 6},
       [](const Tensor& x) { return x.slice(0, 1, 5, 3).slice(1, 4, 6); }},
      {"select", {3, 4}, [](const Tensor& x) { return x.select(1, -2); }},
      {"expand", {3, 1}, [](const Tensor& x) { return x.expand({2, 3, 4}); }},
      {"squeeze", {3, 1, 2}, [](const Tensor& x) { return x.squeeze(1); }},
      {"unsqueeze", {3, 2}, [](const Tensor& x) { return x.unsqueeze(1); }},
      {"flatten", {2, 3, 2}, [](const Tensor& x) { return x.flatten(1); }},
      {"contiguous", {3, 4}, [](const Tensor& x) { return x.t().contiguous(); }},
      {"clone", {3, 4}, [](const Tensor& x) { return x.clone(); }},
  };
  for (const auto& c : cases) {
    Tensor x = input(c.shape, -1, 1, 11);
    auto f = [&c](const std::vector<Tensor>& in) { return c.fn(in[0]); };
    gradcheck(c.name, f, {x});
    gradcheck(std::string(c.name) + " (non-contiguous)", f, {non_contiguous(x)});
  }
  Tensor x = input({3, 4}, -1, 1, 12);
  gradcheck("view", [](const std::vector<Tensor>& in) { return in[0].view({2, -1, 3}); }, {x});
}

TEST_CASE("size, slice and select refuse a 0-d tensor, whose dim 0 other ops accept") {
  Tensor s = scalar_tensor(3);
  check_throws_with([&] { s.size(0); },
                    "[size] dimension specified as 0 but the tensor has no dimensions");
  check_throws_with([&] { s.size(-1); }, "[size] dimension specified as -1");
  check_throws_with([&] { s.slice(0, 0, 1); }, "[slice] cannot be applied to a 0-d tensor");
  check_throws_with([&] { s.select(0, 0); }, "[select] cannot be applied to a 0-d tensor");
  check_throws_with([&] { s.select(-1, 0); }, "[select] cannot be applied to a 0-d tensor");
  // The ops for which PyTorch takes dim 0 of a 0-d tensor still do.
  CHECK(sum(s, {0}).item() == 3);
  CHECK(s.squeeze(0).dim() == 0);
  CHECK(s.transpose(0, -1).dim() == 0);
  CHECK(s.unsqueeze(0).size(0) == 1);
}

TEST_CASE("expand refuses sizes below -1, and -1 in a new leading dim") {
  Tensor one = ones({1});
  check_throws_with([&] { one.expand({-2}); },
                    "[expand] invalid size -2 in (-2,): sizes are >= 0, or -1 to keep a dim");
  check_throws_with([&] { one.expand({2, -3}); }, "[expand] invalid size -3 in (2, -3)");
  check_throws_with(
      [&] { one.expand({-1, 2}); },
      "[expand] the expanded size -1 is not allowed in the leading, new dim 0 of (-1, 2)");
  check_throws_with([&] { one.expand({-2, 1}); }, "[expand] invalid size -2");
  CHECK(one.expand({3, -1}).shape() == Shape{3, 1});
  CHECK(one.expand({-1}).shape() == Shape{1});
}

TEST_CASE("view errors name the op and the shapes") {
  Tensor m = iota({2, 3});
  check_throws_with([&] { m.t().view({6}); }, "[view] input of shape (3, 2) is not contiguous in the dims that (6,) merges");
  // Splitting or merging only dims that lie one after the other in memory is a view, as in PyTorch.
  Tensor w = zeros({2, 3, 4}).transpose(0, 1);  // (3, 2, 4), strides (4, 12, 1)
  Tensor split = w.view({3, 2, 2, 2});
  CHECK(split.same_storage(w));
  CHECK(split.strides() == Shape{4, 12, 2, 1});
  CHECK(w.reshape({3, 8}).same_storage(w) == false);  // merging dims 1 and 2 needs a copy
  Tensor batched = zeros({2, 3, 5, 4}).transpose(-2, -1);  // a batch of transposed matrices
  CHECK(batched.reshape({6, 4, 5}).same_storage(batched));
  check_throws_with([&] { m.view({-1, -1}); }, "[view] only one dimension can be -1");
  check_throws_with([&] { m.view({4, -1}); }, "[view] cannot view (2, 3) as (4, -1)");
  check_throws_with([&] { m.view({5}); }, "[view] shape (5,) is invalid for input of shape (2, 3)");
  check_throws_with([&] { m.reshape({-1, 4}); }, "cannot view (2, 3) as (-1, 4)");
  check_throws_with([&] { m.transpose(0, 2); }, "[transpose] dim 2 out of range");
  check_throws_with([&] { m.permute({0, 0}); }, "[permute] dim 0 repeated");
  check_throws_with([&] { m.permute({0}); }, "[permute] 1 dims given for a 2-d tensor");
  check_throws_with([&] { m.slice(2, 0, 1); }, "[slice] dim 2 out of range");
  check_throws_with([&] { m.slice(0, 0, 1, 0); }, "[slice] step must be positive");
  check_throws_with([&] { m.select(1, 3); }, "[select] index 3 out of range for dim 1 of size 3");
  check_throws_with([&] { m.select(-3, 0); }, "[select] dim -3 out of range");
  check_throws_with([&] { m.expand({2, 4}); }, "[expand] cannot expand shape (2, 3) to (2, 4)");
  check_throws_with([&] { m.expand({3}); }, "[expand] cannot expand shape (2, 3) to (3,)");
  check_throws_with([&] { m.squeeze(2); }, "[squeeze] dim 2 out of range");
  check_throws_with([&] { m.unsqueeze(3); }, "[unsqueeze] dim 3 out of range");
  check_throws_with([&] { m.flatten(1, 0); }, "[flatten] start_dim 1 is after end_dim 0");
}

TEST_CASE("view, reshape, expand, cat and flatten refuse element counts past int64") {
  // 5 * 0x6666666666666667 wraps to 3 mod 2^64: accepted, the view reached far past its storage.
  const std::int64_t wraps_to_3 = 0x6666666666666667LL;
  const std::string too_many = "shape (5, 7378697629483820647) has more elements than int64";
  Tensor x = iota({3});
  check_throws_with([&] { x.view({5, wraps_to_3}); }, "[view] " + too_many + " can count");
  Tensor strided = iota({2, 3}).t();  // not contiguous: reshape resolves the shape itself
  check_throws_with([&] { strided.reshape({5, wraps_to_3}); }, "[reshape] " + too_many);
  // The known sizes' product wrapped to 3 too, so -1 inferred 1 (and only the strides' check
  // refused the shape).
  check_throws_with([&] { x.view({-1, 5, wraps_to_3}); },
                    "[view] shape (-1, 5, 7378697629483820647) has more elements than int64");
  // 2^32 * 2^32 wraps to 0, the count of an empty tensor; torch: "numel: integer multiplication
  // overflow". A real 0 among the sizes holds nothing, however large the others.
  const std::int64_t two32 = std::int64_t{1} << 32;
  check_throws_with([&] { empty({0}).view({two32, two32}); },
                    "[view] shape (4294967296, 4294967296) has more elements");
  // (2^62, 4, 3) has 3 * 2^64 elements, which wrapped to 0: its sum was silently 0.
  const std::int64_t two62 = std::int64_t{1} << 62;
  check_throws_with([&] { ones({1, 3}).expand({two62, 4, 3}); },
                    "[expand] shape (4611686018427387904, 4, 3) has more elements");
  CHECK(ones({1, 3}).expand({two62, 0, 3}).numel() == 0);  // as torch
  // Two dims of 2^62 + 1 elements add up to 2^63 + 2, past int64.
  Tensor half = ones({1}).expand({two62 + 1});
  check_throws_with([&] { cat({half, half}); },
                    "[cat] the sizes along dim 0 add up to more than int64 holds");
  Tensor hollow = ones({1, 1, 1}).expand({0, two32, two32});  // no elements, but 2^64 per row
  check_throws_with([&] { hollow.flatten(1); },
                    "[flatten] shape (4294967296, 4294967296) has more elements");
}

TEST_CASE("slice with a step near int64's maximum keeps one element") {
  // The size was (end - start + step - 1) / step, whose numerator overflowed: shape (-1,).
  Tensor a = iota({3});
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  Tensor s = a.slice(0, 0, 3, big);
  CHECK(s.shape() == Shape{1});
  check_close(s, {0.0}, 0, 0, "[0:3:INT64_MAX]");
  check_close(a.slice(0, 1, 3, big), {1}, 0, 0, "[1:3:INT64_MAX]");
  check_close(a.slice(0, 2, 3, big / 2), {2}, 0, 0, "[2:3:INT64_MAX / 2]");
  CHECK(a.slice(0, 3, 3, big).numel() == 0);
  Tensor m = iota({3, 4});  // m[i][j] = 4 i + j
  check_close(m.slice(1, 1, 4, big), {1, 5, 9}, 0, 0, "a column by a huge step");
  CHECK(m.slice(1, 1, 4, big).shape() == Shape{3, 1});
  gradcheck("slice with a huge step",
            [&](const std::vector<Tensor>& in) { return in[0].slice(1, 1, 4, big); },
            {input({3, 4})});
}

TEST_CASE("unsqueeze and stack name the input's ndim and the range of a new dim") {
  Tensor v = iota({2});
  check_throws_with([&] { v.unsqueeze(2); },
                    "[unsqueeze] dim 2 out of range for a 1-d tensor: a new dim goes at -2 to 1");
  check_throws_with([&] { v.unsqueeze(-3); }, "[unsqueeze] dim -3 out of range for a 1-d tensor");
  check_throws_with([&] { stack({v, v}, 3); },
                    "[stack] dim 3 out of range for a 1-d tensor: a new dim goes at -2 to 1");
  CHECK(v.unsqueeze(1).shape() == Shape{2, 1});
  CHECK(v.unsqueeze(-2).shape() == Shape{1, 2});
  CHECK(stack({v, v}, -1).shape() == Shape{2, 2});
}

TEST_CASE("views with more dims than the kernels take are refused where they are made") {
  Tensor one = ones({1});
  check_throws_with([&] { one.view(Shape(9, 1)); }, "[view] at most 8 dims are supported, got 9");
  check_throws_with([&] { iota({2, 2}).t().reshape(Shape(9, 1)); },
                    "[reshape] at most 8 dims are supported");
  Tensor eight = one.view(Shape(8, 1));
  check_throws_with([&] { eight.unsqueeze(0); }, "[unsqueeze] at most 8 dims are supported, got 9");
  check_throws_with([&] { one.expand(Shape(9, 2)); },
                    "[expand] at most 8 dims are supported, got 9");
  check_throws_with([&] { stack({eight, eight}); }, "[stack] at most 8 dims are supported, got 9");
  CHECK((eight * 2.0).dim() == 8);
}

TEST_CASE("split sizes that add up past int64 are refused; chunk of a huge count") {
  // INT64_MAX + INT64_MAX + 7 wraps to 5, the size of the dim.
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const Tensor five = iota({5});
  check_throws_with([&] { split(five, {big, big, 7}); },
                    "[split] split sizes (9223372036854775807, 9223372036854775807, 7) add up to "
                    "more than int64 holds, but dim 0 of (5,) has size 5");
  // ceil(5 / INT64_MAX) = 1: five pieces of one (n + chunks - 1 overflowed).
  std::vector<Tensor> pieces = chunk(iota({5}), big);
  CHECK(pieces.size() == 5);
  check_close(pieces[4], {4}, 0, 0, "last chunk");
}
