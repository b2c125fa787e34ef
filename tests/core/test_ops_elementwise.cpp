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
