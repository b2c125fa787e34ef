// CUDA element-wise, reduction, indexing and copy kernels against the CPU: the MB_CUDA_TEST_CASEs
// run on a GPU and are skipped elsewhere; the host-side index math and the portable normal draw
// are checked here on every machine.
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/rng.h"
#include "kernels/elementwise.h"
#include "kernels/indexer.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// input() in `dtype`, a leaf requiring grad when floating.
Tensor input_as(const Shape& shape, DType dtype, double lo = -1.0, double hi = 1.0,
                std::uint64_t seed = 1) {
  Tensor t = input(shape, lo, hi, seed).detach().to(dtype);
  if (is_floating(dtype)) t.requires_grad_(true);
  return t;
}

Tensor index_tensor(const std::vector<double>& values, const Shape& shape,
                    DType dtype = DType::i64) {
  return from_vector(values, shape, {.dtype = dtype});
}

// Exact equality of two tensors' values (NaN equal to NaN), naming the first difference.
void check_equal(const Tensor& actual, const Tensor& expected, const std::string& what) {
  REQUIRE_MESSAGE(actual.shape() == expected.shape(), what << ": shapes differ");
  const std::vector<double> a = actual.to_vector(), e = expected.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool same = a[i] == e[i] || (std::isnan(a[i]) && std::isnan(e[i]));
    CHECK_MESSAGE(
        same, what << ": element " << i << " is " << a[i] << " on CUDA, " << e[i] << " on the CPU");
    if (!same) return;
  }
}

const std::vector<Shape> kOddShapes = {{1}, {31}, {33}, {3, 33}, {1000003}};

}  // namespace

// ---- host-side index math ----------------------------------------------------------------------

TEST_CASE("indexer: merged dims give the offsets of a row-major walk") {
  // A (2, 3, 4) contiguous tensor, its transpose (4, 3, 2) view, a broadcast (3, 1) -> (2, 3, 4)
  // operand and a size-1 dim, against offsets computed dim by dim.
  auto brute = [](const kernels::StridedView& v, std::int64_t linear) {
    std::int64_t off = 0;
    for (int d = v.ndim - 1; d >= 0; --d) {
      off += (linear % v.shape[d]) * v.strides[d];
      linear /= v.shape[d];
    }
    return off;
  };
  const kernels::StridedView out = view_of({2, 1, 3, 4}, {12, 12, 4, 1});
  const kernels::StridedView transposed = view_of({2, 1, 3, 4}, {1, 1, 2, 6});
  const kernels::StridedView bias = view_of({2, 1, 3, 4}, {0, 0, 1, 0});
  const kernels::StridedView scalar = view_of({2, 1, 3, 4}, {0, 0, 0, 0});
  const kernels::StridedView* const views[4] = {&out, &transposed, &bias, &scalar};
  for (bool small : {true, false}) {
    kernels::Indexer<4> ix = kernels::make_indexer(views);
    ix.small = small;
    CHECK_FALSE(ix.is_contiguous());
    for (std::int64_t i = 0; i < out.numel(); ++i) {
      std::int64_t off[4];
      ix.offsets(i, off);
      for (int k = 0; k < 4; ++k) CHECK(off[k] == brute(*views[k], i));
    }
  }
  // Contiguous operands merge into one dim of stride 1; a size-1 dim in between does not matter.
  const kernels::StridedView* const same[2] = {&out, &out};
  const kernels::Indexer<2> flat = kernels::make_indexer(same);
  CHECK(flat.ndim == 1);
  CHECK(flat.shape[0] == 24);
  CHECK(flat.is_contiguous());
  // A 0-d view: no dims, offset 0.
  const kernels::StridedView scalar0 = view_of({}, {});
  const kernels::StridedView* const none[1] = {&scalar0};
  const kernels::Indexer<1> zero = kernels::make_indexer(none);
  std::int64_t off[1] = {7};
  zero.offsets(0, off);
  CHECK(zero.ndim == 0);
  CHECK(off[0] == 0);
  CHECK(zero.is_contiguous());
}

TEST_CASE("portable normals agree with libm's Box-Muller to a few ulp") {
  double worst = 0.0;
  for (std::uint64_t c = 0; c < 200000; ++c) {
    const PhiloxBlock b = philox4x32(c, 77);
    const float z = normal_from_bits(b.v[0], b.v[1]);
    const double u1 = uniform_open0_from_bits(b.v[0]), u2 = uniform_from_bits(b.v[1]);
    const double reference = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    worst = std::max(worst, std::abs(z - reference) / std::max(1.0, std::abs(reference)));
  }
  CHECK(worst < 1e-6);
  CHECK(portable_log(1.0f) == 0.0f);
  CHECK(portable_cos_2pi(0.0f) == 1.0f);
  CHECK(portable_cos_2pi(0.5f) == -1.0f);
}

// ---- element-wise ------------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda unary ops match the CPU in every floating dtype, any layout and size") {
  struct Case {
    const char* name;
    Tensor (*fn)(const Tensor&);
    double lo, hi;
  };
  const Case cases[] = {
      {"neg", [](const Tensor& x) { return neg(x); }, -2, 2},
      {"exp", [](const Tensor& x) { return exp(x); }, -2, 2},
      {"log", [](const Tensor& x) { return log(x); }, 0.5, 2},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, 0.5, 2},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, 0.5, 2},
      {"abs", [](const Tensor& x) { return abs(x); }, -2, 2},
      {"tanh", [](const Tensor& x) { return tanh(x); }, -2, 2},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, -4, 4},
      {"relu", [](const Tensor& x) { return relu(x); }, -2, 2},
      {"gelu", [](const Tensor& x) { return gelu(x); }, -3, 3},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, GeluApproximate::Tanh); }, -3, 3},
      {"silu", [](const Tensor& x) { return silu(x); }, -3, 3},
      {"pow", [](const Tensor& x) { return pow(x, 2.5); }, 0.5, 2},
  };
  for (DType dt : kFloatDTypes) {
    for (const Case& c : cases) {
      for (const Shape& shape : kOddShapes) {
        const std::string name =
            std::string(c.name) + " " + dtype_name(dt) + " " + shape_str(shape);
        const Tensor x = input_as(shape, dt, c.lo, c.hi, 3);
        auto f = [&](const std::vector<Tensor>& in) { return c.fn(in[0]); };
        check_cuda_parity(name, f, {x}, parity_tolerance(dt));
        if (shape.size() > 1)
          check_cuda_parity(name + " non-contiguous", f, {non_contiguous(x)}, parity_tolerance(dt));
      }
    }
  }
}

MB_CUDA_TEST_CASE("cuda unary ops on integers: neg and abs") {
  for (DType dt : {DType::i32, DType::i64}) {
    Tensor x = from_vector({-3, 0, 5, -7, 9}, {5}, {.dtype = dt});
    check_cuda_parity("neg", [](const std::vector<Tensor>& in) { return neg(in[0]); }, {x});
    check_cuda_parity("abs", [](const std::vector<Tensor>& in) { return abs(in[0]); }, {x});
  }
}

MB_CUDA_TEST_CASE("cuda binary ops match the CPU with broadcasting, scalars and strided inputs") {
  struct Case {
    const char* name;
    Tensor (*fn)(const Tensor&, const Tensor&);
  };
  const Case cases[] = {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
  };
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{33}, {33}}, {{1000003}, {1000003}}, {{4, 1, 33}, {5, 1}}, {{31, 7}, {}}, {{1}, {3, 1}}};
  for (DType dt : kFloatDTypes) {
    for (const Case& c : cases) {
      for (const auto& [sa, sb] : shapes) {
        const std::string name =
            std::string(c.name) + " " + dtype_name(dt) + " " + shape_str(sa) + " " + shape_str(sb);
        const Tensor a = input_as(sa, dt, 0.5, 2, 5), b = input_as(sb, dt, 0.5, 2, 6);
        auto f = [&](const std::vector<Tensor>& in) { return c.fn(in[0], in[1]); };
        check_cuda_parity(name, f, {a, b}, parity_tolerance(dt));
        if (sa.size() > 1)
          check_cuda_parity(name + " non-contiguous", f, {non_contiguous(a), b},
                            parity_tolerance(dt));
      }
    }
  }
  // Integer arithmetic is exact.
  const Tensor ia = from_vector({1, -2, 3, 40, 5, 6}, {2, 3}, {.dtype = DType::i64});
  const Tensor ib = from_vector({7, 8, -9}, {3}, {.dtype = DType::i64});
  for (const Case& c : {cases[0], cases[1], cases[2], cases[5], cases[6]}) {
    check_cuda_parity(std::string(c.name) + " i64",
                      [&](const std::vector<Tensor>& in) { return c.fn(in[0], in[1]); }, {ia, ib},
                      {.rtol = 0, .atol = 0});
  }
}

MB_CUDA_TEST_CASE("cuda comparisons and where match the CPU") {
  const Tensor a = from_vector({1, 2, 3, NAN, 5, 6}, {2, 3});
  const Tensor b = from_vector({3, 2, 1}, {3});
  using Cmp = Tensor (*)(const Tensor&, const Tensor&);
  const std::pair<const char*, Cmp> cases[] = {
      {"eq", [](const Tensor& x, const Tensor& y) { return eq(x, y); }},
      {"ne", [](const Tensor& x, const Tensor& y) { return ne(x, y); }},
      {"lt", [](const Tensor& x, const Tensor& y) { return lt(x, y); }},
      {"le", [](const Tensor& x, const Tensor& y) { return le(x, y); }},
      {"gt", [](const Tensor& x, const Tensor& y) { return gt(x, y); }},
      {"ge", [](const Tensor& x, const Tensor& y) { return ge(x, y); }},
  };
  const Tensor ints = from_vector({1, 2, 3, -4, 5, 6}, {2, 3}, {.dtype = DType::i32});
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::i32}) {
    const Tensor x = dt == DType::i32 ? ints : a.to(dt);  // NaN has no integer value
    for (const auto& [name, fn] : cases) {
      check_cuda_parity(std::string(name) + " " + dtype_name(dt),
                        [fn = fn](const std::vector<Tensor>& in) { return fn(in[0], in[1]); },
                        {x, b.to(dt)}, {.rtol = 0, .atol = 0});
    }
  }
  for (DType dt : kFloatDTypes) {
    const Tensor x = input_as({4, 33}, dt, -1, 1, 8), y = input_as({33}, dt, -1, 1, 9);
    const Tensor cond = gt(input({4, 1}, -1, 1, 10).detach(), zeros({}, {.dtype = DType::f64}));
    check_cuda_parity(
        std::string("where ") + dtype_name(dt),
        [](const std::vector<Tensor>& in) { return where(in[0], in[1], in[2]); }, {cond, x, y},
        parity_tolerance(dt));
    check_cuda_parity(
        std::string("masked_fill ") + dtype_name(dt),
        [](const std::vector<Tensor>& in) { return masked_fill(in[1], in[0], -2.5); }, {cond, x},
        parity_tolerance(dt));
  }
}

MB_CUDA_TEST_CASE("cuda casts between all dtypes match the CPU exactly") {
  // Non-negative values with halves and zeros: every conversion is defined and exact on both sides.
  std::vector<double> values;
  for (int i = 0; i < 67; ++i) values.push_back(i % 5 == 0 ? 0.0 : i * 0.5);
  const Tensor base = from_vector(values, {67}, {.dtype = DType::f64});
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      const Tensor x = base.to(from);
      const std::string name = std::string("cast ") + dtype_name(from) + " to " + dtype_name(to);
      check_cuda_parity(name, [to](const std::vector<Tensor>& in) { return in[0].to(to); }, {x},
                        {.rtol = 0, .atol = 0, .check_grads = false});
      check_cuda_parity(
          name + " strided",
          [to](const std::vector<Tensor>& in) { return in[0].slice(0, 1, 67, 3).to(to); }, {x},
          {.rtol = 0, .atol = 0, .check_grads = false});
    }
  }
}

MB_CUDA_TEST_CASE("cuda fill writes any value into any layout") {
  const Device gpu = test_gpu();
  for (DType dt : kAllDTypes) {
    for (double v : {0.0, 1.0, 3.25, -2.0}) {
      // An integer dtype refuses a value it cannot hold, on every device (the CPU's tests check
      // it); bool takes any value as its truth.
      if (dt != DType::boolean && !holds_value(dt, v)) continue;
      check_equal(full({33, 65}, v, {.dtype = dt, .device = gpu}), full({33, 65}, v, {.dtype = dt}),
                  std::string("full ") + dtype_name(dt));
    }
  }
  Tensor t = zeros({6, 5}, {.device = gpu});
  t.t().slice(0, 1, 5, 2).fill_(7.0);  // a strided view
  Tensor expected = zeros({6, 5});
  expected.t().slice(0, 1, 5, 2).fill_(7.0);
  check_equal(t, expected, "strided fill_");
  Tensor negative_zero = full({3}, -0.0, {.device = gpu});
  for (double v : negative_zero.to_vector()) CHECK(std::signbit(v));
}

// ---- reductions --------------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda sum, max and argmax match the CPU over any dims and row lengths") {
  // Row lengths on both sides of each kernel's thresholds (1, 16, 1024, 65536 elements).
  const std::vector<Shape> shapes = {{1},       {16},       {17},    {3, 1024},
                                     {2, 1025}, {2, 65536}, {70000}, {5, 7, 9}};
  for (DType dt : kFloatDTypes) {
    for (const Shape& shape : shapes) {
      const Tensor x = input_as(shape, dt, -1, 1, 11);
      for (int d = -1; d < static_cast<int>(shape.size()); ++d) {
        const std::string name =
            std::string(dtype_name(dt)) + " " + shape_str(shape) + " dim " + std::to_string(d);
        std::vector<std::int64_t> dims;
        if (d >= 0) dims.push_back(d);  // -1: all dims
        ParityOptions tol = parity_tolerance(dt);
        tol.atol *= 4;  // sums of up to 70000 values
        check_cuda_parity(
            "sum " + name, [&](const std::vector<Tensor>& in) { return sum(in[0], dims); }, {x},
            tol);
        check_cuda_parity(
            "mean " + name,
            [&](const std::vector<Tensor>& in) { return mean(in[0], dims, {.keepdim = true}); },
            {x}, tol);
        if (d < 0) continue;
        check_cuda_parity("max " + name,
                          [&](const std::vector<Tensor>& in) { return max(in[0], d); }, {x},
                          {.rtol = 0, .atol = 0});
        check_cuda_parity("argmax " + name,
                          [&](const std::vector<Tensor>& in) { return argmax(in[0], d); }, {x},
                          {.rtol = 0, .atol = 0});
      }
    }
  }
  // Integer and bool sums are exact i64.
  const Tensor ints = from_vector(std::vector<double>(3000, 7.0), {3, 1000}, {.dtype = DType::i32});
  check_cuda_parity("sum i32", [](const std::vector<Tensor>& in) { return sum(in[0], {1}); },
                    {ints}, {.rtol = 0, .atol = 0});
  const Tensor flags = gt(input({40, 33}, -1, 1, 12).detach(), zeros({}, {.dtype = DType::f64}));
  check_cuda_parity("sum bool", [](const std::vector<Tensor>& in) { return sum(in[0], {0}); },
                    {flags}, {.rtol = 0, .atol = 0});
}

MB_CUDA_TEST_CASE("cuda argmax takes the first maximum and NaN wins, in every row length") {
  for (std::int64_t n : {5, 40, 3000}) {
    std::vector<double> ties(static_cast<std::size_t>(n), 1.0);
    ties[static_cast<std::size_t>(n / 2)] = 3.0;
    ties[static_cast<std::size_t>(n - 1)] = 3.0;
    std::vector<double> nans = ties;
    nans[static_cast<std::size_t>(n / 3)] = NAN;
    nans[static_cast<std::size_t>(n - 2)] = NAN;
    for (const auto& values : {ties, nans}) {
      const Tensor x = from_vector(values, {1, n});
      check_cuda_parity("argmax " + std::to_string(n),
                        [](const std::vector<Tensor>& in) { return argmax(in[0], 1); }, {x},
                        {.rtol = 0, .atol = 0});
      check_cuda_parity("max " + std::to_string(n),
                        [](const std::vector<Tensor>& in) { return max(in[0], 1); }, {x},
                        {.rtol = 0, .atol = 0});
    }
  }
}

// ---- indexing ----------------------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda gather, index_select and embedding match the CPU, backward included") {
  const std::vector<double> rows{5, 1, 5, 0, 1, 5, 2};  // repeated indices
  for (DType dt : kFloatDTypes) {
    for (DType it : {DType::i64, DType::i32}) {
      const Tensor w = input_as({6, 33}, dt, -1, 1, 13);
      const Tensor idx = index_tensor(rows, {7}, it);
      const ParityOptions tol = parity_tolerance(dt);
      check_cuda_parity(
          "embedding", [](const std::vector<Tensor>& in) { return embedding(in[0], in[1]); },
          {w, idx.reshape({7, 1})}, tol);
      check_cuda_parity(
          "embedding (non-contiguous)",
          [](const std::vector<Tensor>& in) { return embedding(in[0], in[1]); },
          {non_contiguous(w), idx}, tol);
      check_cuda_parity(
          "index_select dim 0",
          [](const std::vector<Tensor>& in) { return index_select(in[0], 0, in[1]); }, {w, idx},
          tol);
      const Tensor cols = index_tensor({32, 0, 7, 7, 31}, {5}, it);
      check_cuda_parity(
          "index_select dim 1",
          [](const std::vector<Tensor>& in) { return index_select(in[0], 1, in[1]); }, {w, cols},
          tol);
      const Tensor gidx = index_tensor({0, 5, 5, 1, 2, 2, 3, 3, 0, 4, 4, 4}, {4, 3}, it);
      check_cuda_parity(
          "gather dim 0", [](const std::vector<Tensor>& in) { return gather(in[0], 0, in[1]); },
          {w, gidx}, tol);
      check_cuda_parity(
          "gather dim 1", [](const std::vector<Tensor>& in) { return gather(in[0], 1, in[1]); },
          {w, gidx}, tol);
    }
  }
}

MB_CUDA_TEST_CASE("cuda embedding gradients of repeated rows equal the CPU's bit for bit") {
  GeneratorStateGuard restore;
  manual_seed(6);
  const Tensor g = randn({4096, 64});
  std::vector<double> idx(4096);
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<double>((i * 7) % 5);
  const Tensor indices = index_tensor(idx, {4096});
  Tensor w_cpu = zeros({5, 64}).requires_grad_(true);
  embedding(w_cpu, indices).backward(g);
  Tensor w_gpu = zeros({5, 64}, {.device = test_gpu()}).requires_grad_(true);
  embedding(w_gpu, indices.to(test_gpu())).backward(g.to(test_gpu()));
  check_equal(w_gpu.grad(), w_cpu.grad(), "embedding gradient");
}

MB_CUDA_ONLY_TEST_CASE(
    "cuda index errors are raised at the next copy to the host, naming op and value") {
  const Device gpu = cuda_device(0);
  const Tensor w = ones({5, 3}, {.device = gpu});
  const Tensor bad = index_tensor({1, 7, 2, 9}, {4}).to(gpu);
  Tensor out = embedding(w, bad);  // no host synchronisation here
  check_throws_with([&] { (void)out.to(kCPU); },
                    "[embedding] index 7 is out of range for size 5 (at position 1)");
  CHECK(out.to(kCPU).shape() == Shape{4, 3});  // raised once, then cleared
  check_throws_with([&] { (void)sum(index_select(w, 1, index_tensor({-1}, {1}).to(gpu))).item(); },
                    "[index_select] index -1 is out of range for size 3");
  const Tensor good = index_tensor({4, 0}, {2}).to(gpu);
  CHECK(sum(embedding(w, good)).item() == 6.0);
}

// ---- copies, joins, views ----------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda copies between devices convert dtypes and handle any strides") {
  const Device gpu = test_gpu();
  const Tensor x = input({7, 9}, -3, 3, 14).detach();
  for (DType to : kFloatDTypes) {
    // CPU -> CUDA with conversion, strided source and strided destination.
    Tensor dst = zeros({9, 7}, {.dtype = to, .device = gpu});
    dst.t().copy_(x);
    check_equal(dst.to(kCPU), x.to(to).t().contiguous(),
                std::string("to cuda, strided dst ") + dtype_name(to));
    check_equal(x.t().to(gpu, to), x.t().to(to),
                std::string("to cuda, strided src ") + dtype_name(to));
    // CUDA -> CPU with conversion from a strided source, into a strided destination.
    const Tensor on_gpu = x.to(gpu);
    check_equal(on_gpu.t().to(kCPU, to), x.t().to(to), std::string("to cpu ") + dtype_name(to));
    Tensor host = zeros({9, 7}, {.dtype = to});
    host.t().copy_(on_gpu);
    check_equal(host, x.to(to).t().contiguous(),
                std::string("to cpu, strided dst ") + dtype_name(to));
    // CUDA -> CUDA, converting and broadcasting.
    Tensor wide = zeros({3, 7, 9}, {.dtype = to, .device = gpu});
    wide.copy_(on_gpu);
    check_equal(wide, x.to(to).expand({3, 7, 9}).contiguous(),
                std::string("broadcast on cuda ") + dtype_name(to));
  }
  // A copy within one storage is staged, so overlapping ranges read the old values.
  Tensor line = from_vector({0, 1, 2, 3, 4, 5}, {6}).to(gpu);
  line.slice(0, 1, 6).copy_(line.slice(0, 0, 5));
  check_equal(line, from_vector({0, 0, 1, 2, 3, 4}, {6}), "overlapping copy");
}

MB_CUDA_TEST_CASE("cuda cat, stack, transpose and contiguous match the CPU") {
  for (DType dt : kFloatDTypes) {
    const Tensor a = input_as({3, 33}, dt, -1, 1, 15), b = input_as({2, 33}, dt, -1, 1, 16);
    const Tensor c = input_as({3, 33}, dt, -1, 1, 17);
    const ParityOptions tol = parity_tolerance(dt);
    check_cuda_parity(
        "cat dim 0",
        [](const std::vector<Tensor>& in) {
          return cat({in[0], in[1]}, 0);
        },
        {a, b}, tol);
    check_cuda_parity(
        "cat dim 1",
        [](const std::vector<Tensor>& in) {
          return cat({in[0], in[1].t()}, 1);
        },
        {a, input_as({3, 3}, dt, -1, 1, 18)}, tol);
    check_cuda_parity(
        "stack",
        [](const std::vector<Tensor>& in) {
          return stack({in[0], in[1]}, 1);
        },
        {a, c}, tol);
    check_cuda_parity(
        "transpose contiguous",
        [](const std::vector<Tensor>& in) { return in[0].t().contiguous(); }, {a}, tol);
    check_cuda_parity(
        "permute reshape",
        [](const std::vector<Tensor>& in) {
          return in[0].reshape({3, 3, 11}).permute({2, 0, 1}).reshape({-1});
        },
        {a}, tol);
    check_cuda_parity(
        "slice backward",
        [](const std::vector<Tensor>& in) { return in[0].slice(1, 2, 30, 3) * 2.0; }, {a}, tol);
  }
}

// ---- random ------------------------------------------------------------------------------------

MB_CUDA_ONLY_TEST_CASE("cuda rand, randn and dropout draw the CPU's bits") {
  GeneratorStateGuard restore;
  const Device gpu = cuda_device(0);
  for (DType dt : kFloatDTypes) {
    for (std::int64_t n : {1, 3, 31, 33, 1000003}) {
      const std::string name = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
      manual_seed(99);
      const Tensor u_cpu = rand({n}, {.dtype = dt}), z_cpu = randn({n}, {.dtype = dt});
      manual_seed(99);
      const Tensor u_gpu = rand({n}, {.dtype = dt, .device = gpu}),
                   z_gpu = randn({n}, {.dtype = dt, .device = gpu});
      check_equal(u_gpu, u_cpu, "rand " + name);
      check_equal(z_gpu, z_cpu, "randn " + name);
      manual_seed(7);
      const Tensor d_cpu = dropout(ones({n}, {.dtype = dt}), 0.3);
      manual_seed(7);
      const Tensor d_gpu = dropout(ones({n}, {.dtype = dt, .device = gpu}), 0.3);
      check_equal(d_gpu, d_cpu, "dropout " + name);
    }
  }
  // The strided kernels number elements in row-major order of the view, as the CPU loops do.
  const kernels::PhiloxArgs args{.seed = 3, .offset = 11};
  Tensor host = zeros({9, 7});
  Tensor dev = zeros({9, 7}, {.device = gpu});
  kernels::cpu::rand_normal(host.t().kview(), args);
  kernels::cuda::rand_normal(dev.t().kview(), args);
  check_equal(dev, host, "strided randn");
  kernels::cpu::dropout_mask(host.t().kview(), args, 0.5);
  kernels::cuda::dropout_mask(dev.t().kview(), args, 0.5);
  check_equal(dev, host, "strided dropout mask");
}
