#include <cmath>
#include <limits>

#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

struct UnaryCase {
  const char* name;
  Tensor (*fn)(const Tensor&);
  double lo, hi;  // input range (kept away from kinks and poles)
};

Tensor gelu_exact(const Tensor& x) { return gelu(x); }
Tensor gelu_tanh(const Tensor& x) { return gelu(x, GeluApproximate::Tanh); }
Tensor pow_scalar(const Tensor& x) { return pow(x, 2.5); }

const UnaryCase kUnary[] = {
    {"neg", [](const Tensor& x) { return neg(x); }, -1, 1},
    {"exp", [](const Tensor& x) { return exp(x); }, -1, 1},
    {"log", [](const Tensor& x) { return log(x); }, 0.5, 2},
    {"sqrt", [](const Tensor& x) { return sqrt(x); }, 0.5, 2},
    {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, 0.5, 2},
    {"abs", [](const Tensor& x) { return abs(x); }, 0.1, 1},
    {"tanh", [](const Tensor& x) { return tanh(x); }, -2, 2},
    {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, -3, 3},
    {"relu", [](const Tensor& x) { return relu(x); }, 0.1, 1},
    {"gelu", gelu_exact, -3, 3},
    {"gelu_tanh", gelu_tanh, -3, 3},
    {"silu", [](const Tensor& x) { return silu(x); }, -3, 3},
    {"pow_scalar", pow_scalar, 0.5, 2},
};

}  // namespace

TEST_CASE("unary ops: gradcheck on contiguous and non-contiguous inputs") {
  for (const auto& c : kUnary) {
    Tensor x = input({3, 4}, c.lo, c.hi, 7);
    gradcheck(c.name, [&](const std::vector<Tensor>& in) { return c.fn(in[0]); }, {x});
    gradcheck(std::string(c.name) + " (non-contiguous)",
              [&](const std::vector<Tensor>& in) { return c.fn(in[0]); }, {non_contiguous(x)});
  }
}

TEST_CASE("gelu (tanh) on contiguous views, vectorized, agrees with the scalar loop of strided ones") {
  // Note [Vectorized GELU] (kernels/cpu/elementwise.cpp): the same formulas with a vectorized exp,
  // so the two paths may differ only through exp: a few units in f32's last place (one in a 16-bit
  // result), and sigmoids below f32's smallest normal flushed to zero. The backward's sum has a zero
  // near x = -0.75, so its tolerance is absolute there. Values from -60 to 60 (both sigmoid
  // branches, their saturation), zeros, infinities and NaN; forward and backward. f64 runs the
  // scalar loop on both layouts: the same bits.
  std::vector<double> v;
  for (int i = -3000; i <= 3000; ++i) v.push_back(i * 0.02 + 0.0013);
  for (double x : {0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 5e4, -5e4}) v.push_back(x);
  v.push_back(std::numeric_limits<double>::infinity());
  v.push_back(-std::numeric_limits<double>::infinity());
  v.push_back(std::numeric_limits<double>::quiet_NaN());
  const std::int64_t n = static_cast<std::int64_t>(v.size());
  struct Case {
    DType dtype;
    double rtol, atol;
  };
  // A sigmoid below f32's smallest normal, flushed, times |x| <= 64.
  const double tiny = std::ldexp(1.0, -120);
  for (Case c : {Case{DType::f32, 8 * std::ldexp(1.0, -24), tiny}, Case{DType::f64, 0, 0},
                 Case{DType::bf16, std::ldexp(1.0, -7), tiny}, Case{DType::f16, std::ldexp(1.0, -10), tiny}}) {
    CAPTURE(std::string(dtype_name(c.dtype)));
    const Tensor x = from_vector(v, {n}, {.dtype = DType::f64}).to(c.dtype);
    const Tensor dy = input({n}, -2, 2, 3).detach().to(c.dtype);
    const Tensor xs = non_contiguous(x), dys = non_contiguous(dy);  // strided: the scalar loop
    REQUIRE_FALSE(xs.is_contiguous());
    auto forward = [](const Tensor& t) { return gelu(t.detach(), GeluApproximate::Tanh); };
    auto backward = [](const Tensor& t, const Tensor& g) {
      Tensor leaf = t.detach().requires_grad_(true);
      gelu(leaf, GeluApproximate::Tanh).backward(g);
      return leaf.grad();
    };
    check_close(forward(x).to(DType::f64), forward(xs).contiguous().to(DType::f64), c.rtol, c.atol,
                "forward");
    // The backward's inputs are x and dy as they lie: contiguous for the vectorized loop.
    check_close(backward(x, dy).to(DType::f64), backward(xs, dys).contiguous().to(DType::f64),
                c.rtol, c.dtype == DType::f64 ? 0 : 1e-6, "backward");
  }
}

TEST_CASE("relu and abs on both sides of zero") {
  Tensor x = input({10}, -1, 1, 3);
  gradcheck("relu", [](const std::vector<Tensor>& in) { return relu(in[0]); }, {x});
  gradcheck("abs", [](const std::vector<Tensor>& in) { return abs(in[0]); }, {x});
  // abs(-0) is +0, as torch: 1 / abs(-0) is +inf.
  for (DType dt : kFloatDTypes) {
    CAPTURE(dtype_name(dt));
    const std::vector<double> r = (1.0 / abs(full({2}, -0.0, {.dtype = dt}))).to_vector();
    CHECK(r == std::vector<double>(2, std::numeric_limits<double>::infinity()));
  }
}

TEST_CASE("accumulate_ reads a source that partly overlaps its destination in full first") {
  // dst = a[1:], src = a[:5]: read first, a[1:] += a[:5] gives [0, 1, 3, 5, 7, 9], not a running
  // sum. The same view as source reads each element before writing it.
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    Tensor a = arange(0, 6, 1, {.dtype = dt});
    Tensor d = a.slice(0, 1, 6);
    accumulate_(d, a.slice(0, 0, 5), 1.0);
    CHECK(a.to_vector() == std::vector<double>{0, 1, 3, 5, 7, 9});
    Tensor b = arange(0, 4, 1, {.dtype = dt});
    accumulate_(b, b, 1.0);
    CHECK(b.to_vector() == std::vector<double>{0, 2, 4, 6});
  }
}

TEST_CASE("binary ops: gradcheck with broadcasting") {
  struct Case {
    const char* name;
    Tensor (*fn)(const Tensor&, const Tensor&);
  };
  const Case cases[] = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
  };
  for (const auto& c : cases) {
    auto f = [&](const std::vector<Tensor>& in) { return c.fn(in[0], in[1]); };
    gradcheck(c.name, f, {input({2, 3}, 0.5, 2, 1), input({2, 3}, 0.5, 2, 2)});
    gradcheck(std::string(c.name) + " (broadcast)", f, {input({2, 1, 3}, 0.5, 2, 3), input({4, 1}, 0.5, 2, 4)});
    gradcheck(std::string(c.name) + " (non-contiguous)", f,
              {non_contiguous(input({2, 3}, 0.5, 2, 5)), input({3}, 0.5, 2, 6)});
  }
}

TEST_CASE("where and masked_fill") {
  Tensor cond = from_vector({1, 0, 1, 0, 0, 1}, {2, 3}, {.dtype = DType::boolean});
  gradcheck("where", [&](const std::vector<Tensor>& in) { return where(cond, in[0], in[1]); },
            {input({2, 3}), input({3})});
  gradcheck("masked_fill", [&](const std::vector<Tensor>& in) { return masked_fill(in[0], cond, -5.0); },
            {input({2, 3})});
  Tensor y = masked_fill(from_vector({1, 2, 3, 4, 5, 6}, {2, 3}), cond, -5.0);
  check_close(y, {-5, 2, -5, 4, 5, -5}, 0, 0, "masked_fill");
}

TEST_CASE("masked_fill refuses a value the integer dtype cannot hold, as torch") {
  // torch: "value cannot be converted to type uint8_t without overflow" (and int64_t for NaN);
  // these stored 44 (300 mod 256) and INT64_MIN.
  const Tensor mask = from_vector({1, 0, 1}, {3}, {.dtype = DType::boolean});
  check_throws_with([&] { masked_fill(zeros({3}, {.dtype = DType::u8}), mask, 300); },
                    "[masked_fill] value 300 does not fit dtype u8");
  check_throws_with([&] { masked_fill(zeros({3}, {.dtype = DType::i64}), mask, NAN); },
                    "[masked_fill] value nan does not fit dtype i64");
  check_throws_with([&] { masked_fill(zeros({3}, {.dtype = DType::i32}), mask, 2.5); },
                    "[masked_fill] value 2.5 does not fit dtype i32");
  check_close(masked_fill(zeros({3}, {.dtype = DType::u8}), mask, 255), {255, 0, 255}, 0, 0,
              "u8 255");
  check_close(masked_fill(zeros({3}, {.dtype = DType::i64}), mask, -100), {-100, 0, -100}, 0, 0,
              "i64 -100");
  // Bool takes any value, nonzero as true, as torch.
  check_close(masked_fill(zeros({3}, {.dtype = DType::boolean}), mask, 5), {1, 0, 1}, 0, 0, "bool");
}

TEST_CASE("comparisons give bool and broadcast") {
  Tensor a = from_vector({1, 2, 3}, {3});
  Tensor b = from_vector({2}, {1});
  CHECK(lt(a, b).dtype() == DType::boolean);
  check_close(lt(a, b), {1, 0, 0}, 0, 0, "lt");
  check_close(le(a, b), {1, 1, 0}, 0, 0, "le");
  check_close(gt(a, b), {0, 0, 1}, 0, 0, "gt");
  check_close(ge(a, b), {0, 1, 1}, 0, 0, "ge");
  check_close(eq(a, b), {0, 1, 0}, 0, 0, "eq");
  check_close(ne(a, b), {1, 0, 1}, 0, 0, "ne");
}

TEST_CASE("16-bit storage computes in f32 and rounds once") {
  Tensor a = from_vector({1.0, 2.0, 65504.0}, {3}, {.dtype = DType::f16});
  Tensor b = from_vector({1.0 / 3.0, 0.5, 65504.0}, {3}, {.dtype = DType::f16});
  Tensor c = add(a, b);
  CHECK(c.dtype() == DType::f16);
  std::vector<double> v = c.to_vector();
  CHECK(v[0] == doctest::Approx(1.3330078125));  // 1 + f16(1/3), rounded to f16
  CHECK(v[1] == 2.5);
  CHECK(std::isinf(v[2]));  // 65504 + 65504 overflows f16
  Tensor d = from_vector({1.0, 3.0}, {2}, {.dtype = DType::bf16});
  CHECK(exp(d).to_vector()[0] == doctest::Approx(2.71875));  // e rounded to bf16
}

TEST_CASE("casts between dtypes and their gradient") {
  Tensor x = from_vector({1.7, -2.2, 0.0}, {3});
  check_close(x.to(DType::i32), {1, -2, 0}, 0, 0, "f32->i32");
  check_close(x.to(DType::boolean), {1, 1, 0}, 0, 0, "f32->bool");
  gradcheck("cast", [](const std::vector<Tensor>& in) { return in[0].to(DType::f32).to(DType::f64); },
            {input({4})}, {.eps = 1e-3, .atol = 1e-3, .rtol = 1e-3});
}

TEST_CASE("element-wise errors name the op and both shapes") {
  check_throws_with([] { add(zeros({2, 3}), zeros({4})); }, "[add] shapes (2, 3) and (4,) cannot be broadcast");
  check_throws_with([] { exp(zeros({2}, {.dtype = DType::i64})); }, "[exp] expected a floating-point tensor");
  check_throws_with([] { where(zeros({2}), zeros({2}), zeros({2})); }, "[where] condition must be bool");
  check_throws_with([] { masked_fill(zeros({2}), zeros({3}, {.dtype = DType::boolean}), 1.0); }, "[masked_fill]");
}

TEST_CASE("div is true division: integer and bool operands give f32") {
  // As torch.div: 1 / 0 = inf and 0 / 0 = NaN rather than a trap, 5 / 2 = 2.5 rather than 2.
  const Tensor i = arange(0, 4, 1, {.dtype = DType::i64});
  const Tensor q = div(i, zeros({4}, {.dtype = DType::i64}));
  CHECK(q.dtype() == DType::f32);
  check_close(q, {NAN, INFINITY, INFINITY, INFINITY}, 0, 0, "i64 / 0");
  const Tensor half = arange(0, 5, 1, {.dtype = DType::i64}) / 2.0;
  CHECK(half.dtype() == DType::f32);
  check_close(half, {0, 0.5, 1, 1.5, 2}, 0, 0, "i64 / 2.0");
  const Tensor i32 = from_vector({5, -7}, {2}, {.dtype = DType::i32});
  check_close(i32 / from_vector({2, 2}, {2}, {.dtype = DType::i32}), {2.5, -3.5}, 0, 0,
              "i32 / i32");
  check_close(2.0 / i, {INFINITY, 2, 1, 2.0 / 3.0}, 1e-7, 0, "2.0 / i64");
  const Tensor mask = from_vector({1, 0}, {2}, {.dtype = DType::boolean});
  CHECK((mask / mask).dtype() == DType::f32);
  check_close(mask / mask, {1, NAN}, 0, 0, "bool / bool");
  // A floating operand keeps its dtype, as torch (f16 / i64 is f16).
  const Tensor h =
      from_vector({3}, {1}, {.dtype = DType::f16}) / from_vector({2}, {1}, {.dtype = DType::i64});
  CHECK(h.dtype() == DType::f16);
  check_close(h, {1.5}, 0, 0, "f16 / i64");
}

TEST_CASE("scalar operands with integer tensors: integral values keep the dtype, others give f32") {
  // Note [Scalar operands]: a double cannot tell 2 from 2.0, so integral values act as Python ints.
  const Tensor i = arange(0, 3, 1, {.dtype = DType::i64});
  CHECK((i + 1.0).dtype() == DType::i64);
  CHECK((i * 2.5).dtype() == DType::f32);
  check_close(i * 2.5, {0, 2.5, 5}, 0, 0, "i64 * 2.5");
  check_close(1.5 - i, {1.5, 0.5, -0.5}, 0, 0, "1.5 - i64");
  const Tensor i32 = arange(0, 3, 1, {.dtype = DType::i32});
  const Tensor inf = i32 + INFINITY;  // a Python float: f32, not an integer that cannot hold it
  CHECK(inf.dtype() == DType::f32);
  check_close(inf, {INFINITY, INFINITY, INFINITY}, 0, 0, "i32 + inf");
  // An integral value the dtype cannot hold is refused, not wrapped.
  check_throws_with([&] { (void)(i32 + 3e9); },
                    "[add] the scalar 3000000000 does not fit in the tensor's dtype i32");
  check_throws_with([&] { (void)(i * 1e19); }, "[mul] the scalar");
  check_throws_with([] { (void)(from_vector({1}, {1}, {.dtype = DType::u8}) + -1.0); }, "dtype u8");
}

TEST_CASE("a 0-d operand decides the dtype only from a higher category, as torch") {
  // Note [0-d operands in promotion]; each expected dtype is torch 1.13's.
  const Tensor h = from_vector({1, 2}, {2}, {.dtype = DType::f16});
  const Tensor f = from_vector({1, 2}, {2});
  const Tensor i32 = from_vector({1, 2}, {2}, {.dtype = DType::i32});
  const Tensor u8 = from_vector({1, 2}, {2}, {.dtype = DType::u8});
  const Tensor b = from_vector({1, 0}, {2}, {.dtype = DType::boolean});
  const Tensor f32_0d = scalar_tensor(1.0);
  const Tensor f64_0d = scalar_tensor(1.5, {.dtype = DType::f64});
  const Tensor i64_0d = scalar_tensor(1, {.dtype = DType::i64});
  CHECK((h + f32_0d).dtype() == DType::f16);  // floating beside floating: the tensor's
  CHECK((f32_0d * h).dtype() == DType::f16);
  CHECK((f - f64_0d).dtype() == DType::f32);
  CHECK((i32 + i64_0d).dtype() == DType::i32);  // integer beside integer: the tensor's
  CHECK((u8 + i64_0d).dtype() == DType::u8);
  CHECK((i32 + f64_0d).dtype() == DType::f64);  // a higher category promotes
  CHECK((b + i64_0d).dtype() == DType::i64);
  CHECK((scalar_tensor(1, {.dtype = DType::f16}) + f32_0d).dtype() == DType::f32);  // both 0-d
  CHECK((h + from_vector({1}, {1})).dtype() == DType::f32);  // both dimensioned
  CHECK(maximum(h, f32_0d).dtype() == DType::f16);
  CHECK(div(i32, i64_0d).dtype() == DType::f32);  // two integers: true division in f32
  // Computed in the result dtype: 0.1 rounds to f16 (0.0999755859375) before the product.
  check_close(h * scalar_tensor(0.1), {0.0999755859375, 0.199951171875}, 0, 0, "f16 * 0-d f32");
  check_close(gt(i32, f64_0d), {0, 1}, 0, 0, "i32 > 0-d 1.5, compared in f64");
  const Tensor cond = from_vector({1, 0}, {2}, {.dtype = DType::boolean});
  CHECK(where(cond, h, f32_0d).dtype() == DType::f16);
  CHECK(where(cond, i32, f64_0d).dtype() == DType::f64);
  check_close(where(cond, i32, f64_0d), {1, 1.5}, 0, 0, "where(i32, 0-d f64)");
}

TEST_CASE("maximum and minimum gradients at NaN and at ties, as torch 1.13") {
  // torch 1.13, a = [nan, 1, nan, 2, 2], b = [1, nan, nan, 2, 3], backward of ones: maximum gives
  // a.grad [1, 1, 1, .5, 0], b.grad [1, 1, 1, .5, 1]; minimum gives [1, 1, 1, .5, 1] and
  // [1, 1, 1, .5, 0]. A NaN loses no comparison, so both sides of a NaN pair get the gradient.
  for (bool is_max : {true, false}) {
    CAPTURE(is_max);
    Tensor a = from_vector({NAN, 1, NAN, 2, 2}, {5}, {.dtype = DType::f64, .requires_grad = true});
    Tensor b = from_vector({1, NAN, NAN, 2, 3}, {5}, {.dtype = DType::f64, .requires_grad = true});
    sum(is_max ? maximum(a, b) : minimum(a, b)).backward();
    check_close(a.grad(), {1, 1, 1, 0.5, is_max ? 0.0 : 1.0}, 0, 0, "a's gradient");
    check_close(b.grad(), {1, 1, 1, 0.5, is_max ? 1.0 : 0.0}, 0, 0, "b's gradient");
  }
}

TEST_CASE("bool subtraction is refused, as torch") {
  const Tensor m = from_vector({1, 0}, {2}, {.dtype = DType::boolean});
  check_throws_with([&] { (void)(m - m); },
                    "[sub] subtraction with a bool tensor is not supported (got bool - bool)");
  check_throws_with([&] { (void)(m - 1.0); }, "[sub] subtraction with a bool tensor");
  check_throws_with([&] { (void)(1.0 - m); }, "[sub] subtraction with a bool tensor");
  check_throws_with([&] { (void)sub(ones({2}), m); }, "(got f32 - bool)");
  check_close(m + 1.0, {2, 1}, 0, 0, "bool + 1");  // addition stays allowed, as torch
}

TEST_CASE("pow gradients at a zero base are 0 where torch masks them") {
  // torch: d/da = 0 where b == 0; d/db = 0 where a == 0 and b >= 0 (else 0 * inf = NaN). Values
  // from torch.pow in f64.
  struct Case {
    double a, b, da, db;
  };
  const double inf = std::numeric_limits<double>::infinity();
  for (Case c :
       {Case{0, 2, 0, 0}, Case{0, 0, 0, 0}, Case{0, -0.0, 0, 0}, Case{0, 0.5, inf, 0},
        Case{0, -1, -inf, -inf}, Case{2, 3, 12, 5.545177444479562}, Case{-2, 2, -4, NAN}}) {
    CAPTURE(c.a);
    CAPTURE(c.b);
    Tensor a = from_vector({c.a}, {1}, {.dtype = DType::f64, .requires_grad = true});
    Tensor b = from_vector({c.b}, {1}, {.dtype = DType::f64, .requires_grad = true});
    sum(pow(a, b)).backward();
    check_close(a.grad(), {c.da}, 1e-12, 0, "d/da");
    check_close(b.grad(), {c.db}, 1e-12, 0, "d/db");
  }
  // Finite differences agree where pow is smooth in both: zero bases with integer exponents, and
  // zero exponents with positive bases; broadcast too, so the masked terms are summed back.
  auto f = [](const std::vector<Tensor>& in) { return pow(in[0], in[1]); };
  auto f64 = [](std::vector<double> v, Shape shape) {
    return from_vector(v, shape, {.dtype = DType::f64, .requires_grad = true});
  };
  gradcheck("pow at a = 0", f, {f64({0, 0, 1.5, 0.7}, {4}), f64({2, 3, 1.2, 0}, {4})});
  gradcheck("pow at a = 0 (broadcast)", f, {f64({0, 0.5}, {2, 1}), f64({2, 3, 1}, {3})});
  gradcheck("pow at b = 0 (broadcast)", f, {f64({0.5, 2, 1.5}, {3}), f64({0, 1}, {2, 1})});
}

TEST_CASE("relu propagates NaN; its gradient passes there, as torch's threshold_backward") {
  for (DType dt : kFloatDTypes) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor x = from_vector({NAN, -1, 2, 0}, {4}, {.dtype = dt, .requires_grad = true});
    Tensor y = relu(x);
    check_close(y, {NAN, 0, 2, 0}, 0, 0, "relu");
    sum(y).backward();
    check_close(x.grad(), {1, 0, 1, 0}, 0, 0, "relu backward");  // torch 1.13 gives 1 at NaN
  }
}

TEST_CASE("where and masked_fill refuse a condition modified in place since") {
  // The condition routes the gradient, so it is saved like any input (a plain handle gave 0 here).
  Tensor a = ones({3}, {.requires_grad = true});
  Tensor cond = from_vector({1, 0, 1}, {3}, {.dtype = DType::boolean});
  Tensor y = where(cond, a, zeros({3}));
  cond.fill_(0);
  check_throws_with([&] { sum(y).backward(); },
                    "a tensor that where saved for backward was modified");
  Tensor mask = from_vector({1, 0, 1}, {3}, {.dtype = DType::boolean});
  Tensor z = masked_fill(a, mask, 5.0);
  mask.fill_(0);
  check_throws_with([&] { sum(z).backward(); }, "a tensor that masked_fill saved for backward");
}

MB_CUDA_TEST_CASE("cuda: true integer division, relu at NaN and pow at a zero base match the CPU") {
  const Tensor i = from_vector({0, 1, -5, 7}, {4}, {.dtype = DType::i64});
  const Tensor j = from_vector({0, 0, 2, -2}, {4}, {.dtype = DType::i64});
  check_cuda_parity("i64 / i64", [](const std::vector<Tensor>& in) { return in[0] / in[1]; },
                    {i, j}, {.rtol = 0, .atol = 0, .check_grads = false});
  check_cuda_parity(
      "relu", [](const std::vector<Tensor>& in) { return relu(in[0]); },
      {from_vector({NAN, -1, 2, 0}, {4}, {.dtype = DType::f64, .requires_grad = true})},
      {.rtol = 0, .atol = 0});
  check_cuda_parity(
      "pow", [](const std::vector<Tensor>& in) { return pow(in[0], in[1]); },
      {from_vector({0, 0, 0, 2}, {4}, {.dtype = DType::f64, .requires_grad = true}),
       from_vector({2, 0, 0.5, 3}, {4}, {.dtype = DType::f64, .requires_grad = true})},
      {.rtol = 1e-12, .atol = 0});
}
