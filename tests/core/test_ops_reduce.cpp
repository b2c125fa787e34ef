// Reductions: sum, mean, max, argmax, var and sum_to. Forward values come from hand-worked cases
// and from a plain-loop reference in this file (grouping elements by their kept coordinates), over
// one, several and all dims, with and without keepdim, on contiguous, strided and permuted
// inputs. Gradients from gradcheck (max on inputs without ties); NaN follows torch (a NaN wins);
// errors must name the op.
#include <algorithm>
#include <cmath>
#include <limits>

#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

enum class Kind { Sum, Mean, Max, ArgMax, Var0, Var1 };

// The reference: every element of `t` goes to the group of its coordinates outside `dims`
// (all dims when empty); each group is then reduced by `kind`. Groups come out in row-major
// order of the kept coordinates, which is the layout of the reduced tensor.
std::vector<double> reference(const Tensor& t, std::vector<std::int64_t> dims, Kind kind) {
  const Shape& shape = t.shape();
  const int nd = t.dim();
  std::vector<bool> reduced(nd, dims.empty());
  for (auto d : dims) reduced[d < 0 ? d + nd : d] = true;
  std::int64_t groups = 1;
  for (int i = 0; i < nd; ++i) if (!reduced[i]) groups *= shape[i];
  std::vector<std::vector<double>> members(groups);
  const std::vector<double> values = t.to_vector();
  for (std::int64_t flat = 0; flat < static_cast<std::int64_t>(values.size()); ++flat) {
    std::int64_t rest = flat, group = 0, scale = 1;
    for (int i = nd - 1; i >= 0; --i) {
      const std::int64_t c = rest % shape[i];
      rest /= shape[i];
      if (!reduced[i]) {
        group += c * scale;
        scale *= shape[i];
      }
    }
    members[group].push_back(values[flat]);
  }
  std::vector<double> out;
  for (const auto& m : members) {
    const double n = static_cast<double>(m.size());
    double total = 0;
    for (double v : m) total += v;
    switch (kind) {
      case Kind::Sum: out.push_back(total); break;
      case Kind::Mean: out.push_back(total / n); break;
      case Kind::Max: out.push_back(*std::max_element(m.begin(), m.end())); break;
      case Kind::ArgMax:
        out.push_back(static_cast<double>(std::max_element(m.begin(), m.end()) - m.begin()));
        break;
      case Kind::Var0:
      case Kind::Var1: {
        double sq = 0;
        for (double v : m) sq += (v - total / n) * (v - total / n);
        out.push_back(sq / (n - (kind == Kind::Var1 ? 1 : 0)));
        break;
      }
    }
  }
  return out;
}

Shape reduced_shape(const Shape& shape, std::vector<std::int64_t> dims, bool keepdim) {
  const int nd = static_cast<int>(shape.size());
  Shape out;
  for (int i = 0; i < nd; ++i) {
    const bool r = dims.empty() || std::find_if(dims.begin(), dims.end(), [&](std::int64_t d) {
                                     return (d < 0 ? d + nd : d) == i;
                                   }) != dims.end();
    if (!r) out.push_back(shape[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

// Three layouts of the same kind of data: contiguous, strided (non_contiguous) and permuted.
std::vector<std::pair<std::string, Tensor>> layouts() {
  Tensor a = input({3, 4, 5}, -2, 2, 21).detach();
  return {{"contiguous", a}, {"strided", non_contiguous(a)}, {"permuted", a.permute({2, 0, 1})}};
}

std::string label(const std::string& op, const std::string& layout,
                  const std::vector<std::int64_t>& dims, bool keepdim) {
  std::string s = op + " " + layout + " dims {";
  for (auto d : dims) s += std::to_string(d) + ",";
  return s + "} keepdim " + (keepdim ? "true" : "false");
}

const std::vector<std::vector<std::int64_t>> kDimSets = {{0}, {1}, {-1}, {0, 2}, {2, 0}, {1, 2},
                                                         {-3, -2}, {0, 1, 2}, {}};

}  // namespace

// ---- forward values ----------------------------------------------------------------------------

TEST_CASE("sum, mean and var by hand") {
  Tensor m = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::f64});
  check_close(sum(m, {0}), {5, 7, 9}, 0, 0, "sum dim 0");
  check_close(sum(m, {1}), {6, 15}, 0, 0, "sum dim 1");
  check_close(sum(m), {21}, 0, 0, "sum all");
  CHECK(sum(m).dim() == 0);
  CHECK(sum(m, {1}, {.keepdim = true}).shape() == Shape{2, 1});
  CHECK(sum(m, {}, {.keepdim = true}).shape() == Shape{1, 1});
  check_close(mean(m, {1}), {2, 5}, 0, 1e-15, "mean dim 1");
  check_close(mean(m), {3.5}, 0, 1e-15, "mean all");
  Tensor v = from_vector({1, 2, 3, 4}, {4}, {.dtype = DType::f64});
  check_close(var(v), {5.0 / 3.0}, 1e-15, 0, "var, correction 1");
  check_close(var(v, {}, {.correction = 0}), {1.25}, 1e-15, 0, "var, correction 0");
  check_close(var(m, {1}), {1, 1}, 1e-15, 0, "var of each row");
  check_close(var(m, {0}, {.correction = 0, .keepdim = true}), {2.25, 2.25, 2.25}, 1e-15, 0,
              "var of each column, biased");
  CHECK(var(m, {0}, {.keepdim = true}).shape() == Shape{1, 3});
}

TEST_CASE("max and argmax by hand: the first maximal element wins ties") {
  Tensor m = from_vector({1, 5, 2, 7, 0, 7}, {2, 3});
  check_close(max(m, 1), {5, 7}, 0, 0, "max dim 1");
  check_close(argmax(m, 1), {1, 0}, 0, 0, "argmax dim 1 (first of the tied 7s)");
  check_close(max(m, 0), {7, 5, 7}, 0, 0, "max dim 0");
  check_close(argmax(m, -2), {1, 0, 1}, 0, 0, "argmax dim -2");
  CHECK(argmax(m, 0).dtype() == DType::i64);
  CHECK(max(m, 1, {.keepdim = true}).shape() == Shape{2, 1});
  CHECK(argmax(m, 1, {.keepdim = true}).shape() == Shape{2, 1});
  check_close(max(m), {7}, 0, 0, "max of all");
  CHECK(max(m).dim() == 0);
  check_close(max(from_vector({-3, -1, -2}, {3})), {-1}, 0, 0, "max of negatives");
  check_close(argmax(from_vector({-5, 4, 9, 9}, {4}, {.dtype = DType::i32}), 0), {2}, 0, 0,
              "argmax of i32");
}

TEST_CASE("reductions against a loop reference: dims, keepdim, layouts") {
  for (const auto& [name, a] : layouts()) {
    for (const auto& dims : kDimSets) {
      for (bool keepdim : {false, true}) {
        const Shape shape = reduced_shape(a.shape(), dims, keepdim);
        Tensor s = sum(a, dims, {.keepdim = keepdim});
        CHECK(s.shape() == shape);
        check_close(s, reference(a, dims, Kind::Sum), 1e-12, 1e-12,
                    label("sum", name, dims, keepdim));
        Tensor mu = mean(a, dims, {.keepdim = keepdim});
        CHECK(mu.shape() == shape);
        check_close(mu, reference(a, dims, Kind::Mean), 1e-12, 1e-12,
                    label("mean", name, dims, keepdim));
        Tensor v1 = var(a, dims, {.keepdim = keepdim});
        CHECK(v1.shape() == shape);
        check_close(v1, reference(a, dims, Kind::Var1), 1e-12, 1e-12,
                    label("var", name, dims, keepdim));
        check_close(var(a, dims, {.correction = 0, .keepdim = keepdim}),
                    reference(a, dims, Kind::Var0),
                    1e-12, 1e-12, label("var correction 0", name, dims, keepdim));
      }
    }
    for (std::int64_t d : {0, 1, 2, -1}) {
      for (bool keepdim : {false, true}) {
        const Shape shape = reduced_shape(a.shape(), {d}, keepdim);
        Tensor mx = max(a, d, {.keepdim = keepdim});
        CHECK(mx.shape() == shape);
        check_close(mx, reference(a, {d}, Kind::Max), 0, 0, label("max", name, {d}, keepdim));
        Tensor am = argmax(a, d, {.keepdim = keepdim});
        CHECK(am.shape() == shape);
        check_close(am, reference(a, {d}, Kind::ArgMax), 0, 0, label("argmax", name, {d}, keepdim));
      }
    }
    check_close(max(a), reference(a, {}, Kind::Max), 0, 0, "max of all, " + name);
  }
}

TEST_CASE("reductions of 0-d, empty and integer tensors") {
  Tensor s = scalar_tensor(4, {.dtype = DType::f64});
  check_close(sum(s), {4}, 0, 0, "sum of a 0-d tensor");
  check_close(sum(s, {0}), {4}, 0, 0, "sum of a 0-d tensor over dim 0");
  check_close(mean(s, {-1}), {4}, 0, 0, "mean of a 0-d tensor over dim -1");
  check_close(max(s, 0), {4}, 0, 0, "max of a 0-d tensor");
  check_close(argmax(s, 0), {0.0}, 0, 0, "argmax of a 0-d tensor");
  check_close(max(s), {4}, 0, 0, "max() of a 0-d tensor");
  CHECK(sum(s, {0}).dim() == 0);

  Tensor e = zeros({2, 0});
  CHECK(sum(e, {1}).shape() == Shape{2});
  check_close(sum(e, {1}), {0, 0}, 0, 0, "sum over an empty dim is 0");
  CHECK(sum(e, {0}).shape() == Shape{0});
  check_close(sum(e), {0.0}, 0, 0, "sum of an empty tensor");

  Tensor i = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::i64});
  Tensor si = sum(i, {1});
  CHECK(si.dtype() == DType::i64);
  check_close(si, {6, 15}, 0, 0, "sum of i64");
  check_close(max(i, 0), {4, 5, 6}, 0, 0, "max of i64");
  // Bool and i32 sums are exact and i64, as torch.sum: a count of true values, and a total past
  // 2^53 that a double accumulator would round.
  Tensor b = from_vector({1, 0, 1, 1}, {4}, {.dtype = DType::boolean});
  CHECK(sum(b).dtype() == DType::i64);
  CHECK(sum(b).item() == 3);
  Tensor big = full({3}, static_cast<double>(1LL << 53), {.dtype = DType::i64});
  Tensor one = from_vector({1}, {1}, {.dtype = DType::i64});
  CHECK(sum(cat({big, one})).data<std::int64_t>()[0] == 3 * (1LL << 53) + 1);
  CHECK(sum(from_vector({7, -2}, {2}, {.dtype = DType::i32})).dtype() == DType::i64);
}

TEST_CASE("16-bit sums accumulate in wider precision") {
  // 300 ones: a bf16 accumulator would stall at 256 (257 is not representable).
  check_close(sum(ones({300}, {.dtype = DType::bf16})), {300}, 0, 0, "bf16 sum");
  check_close(sum(ones({3000}, {.dtype = DType::f16})), {3000}, 0, 0, "f16 sum");
}

TEST_CASE("16-bit mean and var are taken in f32 and rounded once") {
  // 1000 values of 100 sum to 1e5, past f16's 65504; 70000 is inf as an f16 count; the squares of
  // sin(0.37 i) * 100 sum past 65504. Values from torch 1.13 (var) or exact (mean).
  check_close(mean(full({1000}, 100.0, {.dtype = DType::f16})), {100}, 0, 0, "f16 mean");
  check_close(mean(ones({70000}, {.dtype = DType::f16})), {1}, 0, 0, "f16 mean of 70000");
  std::vector<double> v;
  for (int i = 0; i < 40; ++i) v.push_back(std::sin(i * 0.37) * 100);
  const Tensor x = from_vector(v, {2, 20}, {.dtype = DType::f16});
  const Tensor got = var(x, {1});
  CHECK(got.dtype() == DType::f16);
  check_close(got, {4752, 5692}, 0, 0, "f16 var");
  check_close(var(x.to(DType::bf16), {1}), {4736, 5696}, 0, 0, "bf16 var");
}

TEST_CASE("max and argmax: a NaN wins, and the first NaN is the argmax") {
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor a = from_vector({1, kNaN, 3}, {3}, {.dtype = dt});
    CHECK(std::isnan(max(a, 0).item()));
    CHECK(std::isnan(max(a).item()));
    check_close(argmax(a, 0), {1}, 0, 0, "argmax with a NaN in the middle");
    Tensor b = from_vector({kNaN, 5, kNaN}, {3}, {.dtype = dt});
    check_close(argmax(b, 0), {0.0}, 0, 0, "argmax with a leading NaN");
    Tensor c = from_vector({2, 9, kNaN, kNaN, 1, 0}, {3, 2}, {.dtype = dt});
    check_close(max(c, 1), {9, kNaN, 1}, 0, 0, "max per row");
    check_close(argmax(c, 1), {1, 0, 0}, 0, 0, "argmax per row");
    check_close(max(c, 0), {kNaN, kNaN}, 0, 0, "max per column");
    check_close(argmax(c, 0), {1, 1}, 0, 0, "argmax per column");
  }
}

// ---- gradients ---------------------------------------------------------------------------------

TEST_CASE("sum, mean and var: gradcheck over dims and keepdim, contiguous and not") {
  Tensor x = input({3, 4, 2}, -1, 1, 17);
  for (const auto& dims : kDimSets) {
    for (bool keepdim : {false, true}) {
      for (Tensor in : {x, non_contiguous(x)}) {
        const std::string layout = in.is_contiguous() ? "contiguous" : "strided";
        const std::string tag = label("", layout, dims, keepdim);
        gradcheck("sum" + tag, [&](const std::vector<Tensor>& v) {
          return sum(v[0], dims, {.keepdim = keepdim});
        }, {in});
        gradcheck("mean" + tag, [&](const std::vector<Tensor>& v) {
          return mean(v[0], dims, {.keepdim = keepdim});
        }, {in});
        gradcheck("var" + tag, [&](const std::vector<Tensor>& v) {
          return var(v[0], dims, {.keepdim = keepdim});
        }, {in});
        gradcheck("var correction 0" + tag, [&](const std::vector<Tensor>& v) {
          return var(v[0], dims, {.correction = 0, .keepdim = keepdim});
        }, {in});
      }
    }
  }
}

TEST_CASE("max: gradcheck without ties, and the gradient of a tie goes to the first maximum") {
  Tensor x = input({3, 4, 2}, -1, 1, 19);  // distinct values
  for (std::int64_t d : {0, 1, 2, -1}) {
    for (bool keepdim : {false, true}) {
      for (Tensor in : {x, non_contiguous(x)}) {
        gradcheck(label("max", in.is_contiguous() ? "contiguous" : "strided", {d}, keepdim),
                  [&](const std::vector<Tensor>& v) { return max(v[0], d, {.keepdim = keepdim}); },
                  {in});
      }
    }
  }
  gradcheck("max of all", [](const std::vector<Tensor>& v) { return max(v[0]); }, {x});

  Tensor t = from_vector({1, 3, 3, 2, 0, 2}, {2, 3}, {.dtype = DType::f64, .requires_grad = true});
  max(t, 1).backward(from_vector({10, 20}, {2}, {.dtype = DType::f64}));
  check_close(t.grad(), {0, 10, 0, 20, 0, 0}, 0, 0, "gradient of tied maxima");
}

TEST_CASE("max of all elements shares the gradient evenly among tied maxima, as torch") {
  // torch 1.13: x.max().backward() gives [0, 0.5, 0.5] for [1, 3, 3], and [0, 0.5, 0, 0.5] for
  // [1, NaN, 3, NaN] (the NaNs are the maxima).
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor x = from_vector({1, 3, 3}, {3}, {.dtype = dt, .requires_grad = true});
    max(x).backward();
    check_close(x.grad(), {0, 0.5, 0.5}, 0, 0, "two tied maxima");
    Tensor m = from_vector({1, 3, 3, 2, 3, 0}, {2, 3}, {.dtype = dt, .requires_grad = true});
    (max(m) * 6.0).backward();
    check_close(m.grad(), {0, 2, 2, 0, 2, 0}, 0, 0, "three tied maxima of a matrix");
    Tensor n = from_vector({1, kNaN, 3, kNaN}, {4}, {.dtype = dt, .requires_grad = true});
    max(n).backward();
    check_close(n.grad(), {0, 0.5, 0, 0.5}, 0, 0, "the NaNs share it");
  }
  Tensor t = from_vector({1, 3, 3}, {3}, {.dtype = DType::f64, .requires_grad = true});
  max(t, 0).backward();
  check_close(t.grad(), {0, 1, 0}, 0, 0, "along a dim, one index takes it all (torch too)");
}

TEST_CASE("mean and sum gradients by hand") {
  Tensor t = input({2, 4});
  mean(t, {1}).backward(from_vector({1, 2}, {2}, {.dtype = DType::f64}));
  check_close(t.grad(), {0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 0.5, 0.5}, 0, 1e-15, "mean");
  Tensor u = input({2, 2});
  sum(u).backward();
  check_close(u.grad(), {1, 1, 1, 1}, 0, 0, "sum");
}

// ---- sum_to ------------------------------------------------------------------------------------

TEST_CASE("sum_to: sums leading and size-1 dims back down") {
  Tensor a = from_vector({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 2, 3}, {.dtype = DType::f64});
  Tensor r = sum_to(a, {3});
  CHECK(r.shape() == Shape{3});
  check_close(r, {1 + 4 + 7 + 10, 2 + 5 + 8 + 11, 3 + 6 + 9 + 12}, 0, 0, "to (3)");
  Tensor c = sum_to(a, {2, 1});
  CHECK(c.shape() == Shape{2, 1});
  check_close(c, {1 + 2 + 3 + 7 + 8 + 9, 4 + 5 + 6 + 10 + 11 + 12}, 0, 0, "to (2, 1)");
  check_close(sum_to(a, {1, 2, 1}), {1 + 2 + 3 + 7 + 8 + 9, 4 + 5 + 6 + 10 + 11 + 12}, 0, 0,
              "to (1, 2, 1)");
  check_close(sum_to(a, {}), {78}, 0, 0, "to ()");
  CHECK(sum_to(a, {}).dim() == 0);
  CHECK(sum_to(a, {2, 2, 3}).same_storage(a));  // same shape: no work
  check_close(sum_to(a.transpose(0, 2), {3, 1, 1}),
              {1 + 4 + 7 + 10, 2 + 5 + 8 + 11, 3 + 6 + 9 + 12}, 0, 0, "from a transposed input");
  // sum_to undoes expand's broadcast: expanding then summing back multiplies by the copies.
  Tensor b = from_vector({1, 2}, {2, 1}, {.dtype = DType::f64});
  check_close(sum_to(b.expand({3, 2, 4}), {2, 1}), {12, 24}, 0, 0, "sum_to of an expand");

  Tensor x = input({2, 3, 4}, -1, 1, 23);
  gradcheck("sum_to (3, 1)", [](const std::vector<Tensor>& v) { return sum_to(v[0], {3, 1}); },
            {x});
  gradcheck("sum_to (2, 1, 4) strided",
            [](const std::vector<Tensor>& v) { return sum_to(v[0], {2, 1, 4}); },
            {non_contiguous(x)});
}

// ---- errors ------------------------------------------------------------------------------------

TEST_CASE("reduction errors name the op") {
  Tensor a = zeros({2, 3, 4});
  check_throws_with([&] { sum(a, {3}); }, "[sum] dim 3 out of range for a 3-d tensor");
  check_throws_with([&] { mean(a, {-4}); }, "[mean] dim -4 out of range");
  check_throws_with([&] { var(a, {0, 7}); }, "[var] dim 7 out of range");
  check_throws_with([&] { max(a, 3); }, "[max] dim 3 out of range");
  check_throws_with([&] { argmax(a, -4); }, "[argmax] dim -4 out of range");
  check_throws_with([&] { sum(a, {1, -2}); }, "[sum] dim 1 repeated");
  check_throws_with([&] { mean(a, {0, 0}); }, "[mean] dim 0 repeated");
  check_throws_with([&] { var(a, {2, -1}); }, "[var] dim 2 repeated");
  check_throws_with([] { var(zeros({1, 3}), {0}); },
                    "[var] 1 elements with correction 1 leave no degrees of freedom");
  check_throws_with([] { var(zeros({0}), {}, {.correction = 0}); },
                    "[var] 0 elements with correction 0 leave no degrees of freedom");
  check_throws_with([] { max(zeros({2, 0}), 1); }, "[max] of an empty dim 1 (shape (2, 0))");
  check_throws_with([] { argmax(zeros({0, 2}), 0); }, "[argmax] of an empty dim 0 (shape (0, 2))");
  check_throws_with([] { max(zeros({0, 3})); }, "[max] of an empty tensor");
  check_throws_with([] { mean(zeros({2, 0}), {1}); }, "[mean] of an empty selection");
  check_throws_with([] { mean(zeros({2}, {.dtype = DType::i64})); },
                    "[mean] expected a floating-point tensor, got i64");
  check_throws_with([] { var(zeros({2}, {.dtype = DType::i32})); },
                    "[var] expected a floating-point");
  check_throws_with([&] { sum_to(a, {3, 4, 4}); },
                    "[sum_to] cannot sum shape (2, 3, 4) to (3, 4, 4)");
  check_throws_with([&] { sum_to(a, {1, 2, 3, 4}); },
                    "[sum_to] cannot sum shape (2, 3, 4) to (1, 2, 3, 4)");
  check_throws_with([&] { sum_to(a, {2, 4}); }, "[sum_to] cannot sum shape (2, 3, 4) to (2, 4)");
}

TEST_CASE("a 0-d tensor's dims 0 and -1 are one dim, which a reduction may not name twice") {
  // torch.tensor(3.).sum((0, 0)) and .sum((0, -1)): "dim 0 appears multiple times".
  check_throws_with([] { sum(scalar_tensor(3), {0, 0}); }, "[sum] dim 0 repeated");
  check_throws_with([] { mean(scalar_tensor(3), {0, -1}); }, "[mean] dim 0 repeated");
  check_close(sum(scalar_tensor(3), {-1}), {3}, 0, 0, "one dim is fine");
}
