// Tensor basics: factories in every dtype, views and their shared version counter, contiguous(),
// dtype conversions (16-bit rounding checked bit for bit), item(), printing, the random factories,
// meta tensors, device and dtype parsing, and CUDA placement.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

#include "core/half.h"
#include "core/rng.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// The stored bits of each element of a 16-bit tensor, after converting f32 `values` to `dtype`.
std::vector<std::uint16_t> bits_after_cast(const std::vector<float>& values, DType dtype) {
  std::vector<double> wide(values.begin(), values.end());  // every f32 is exact in f64
  Tensor src = from_vector(wide, {static_cast<std::int64_t>(values.size())}, {.dtype = DType::f32});
  Tensor h = src.to(dtype);
  REQUIRE(h.dtype() == dtype);
  std::vector<std::uint16_t> out(values.size());
  std::memcpy(out.data(), h.raw_data(), out.size() * sizeof(std::uint16_t));
  return out;
}

float f32_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

// ---- factories ---------------------------------------------------------------------------------

TEST_CASE("empty: shape, strides, dtype, device and bytes in every dtype") {
  for (DType dt : kAllDTypes) {
    CAPTURE(dtype_name(dt));
    Tensor t = empty({2, 3, 4}, {.dtype = dt});
    CHECK(t.shape() == Shape{2, 3, 4});
    CHECK(t.strides() == Shape{12, 4, 1});
    CHECK(t.dim() == 3);
    CHECK(t.numel() == 24);
    CHECK(t.dtype() == dt);
    CHECK(t.device() == kCPU);
    CHECK(t.nbytes() == 24 * dtype_size(dt));
    CHECK(t.is_contiguous());
    CHECK_FALSE(t.requires_grad());
    CHECK(t.is_leaf());
  }
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::i32) == 4);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK(dtype_size(DType::u8) == 1);
  CHECK(dtype_size(DType::boolean) == 1);
  Tensor zero_sized = empty({0, 5});
  CHECK(zero_sized.numel() == 0);
  CHECK(zero_sized.to_vector().empty());
  check_throws_with([] { empty({2, -1}); }, "[empty] negative size");
  check_throws_with([] { empty({1, 1, 1, 1, 1, 1, 1, 1, 1}); }, "[empty] at most 8 dims");
}

TEST_CASE("zeros, ones and full in every dtype") {
  for (DType dt : kAllDTypes) {
    CAPTURE(dtype_name(dt));
    CHECK(zeros({2, 3}, {.dtype = dt}).to_vector() == std::vector<double>(6, 0.0));
    CHECK(ones({3, 2}, {.dtype = dt}).to_vector() == std::vector<double>(6, 1.0));
    // 1 fits every dtype, bool included; 5 every dtype but bool (which stores "nonzero").
    const double v = dt == DType::boolean ? 1.0 : 5.0;
    CHECK(full({4}, v, {.dtype = dt}).to_vector() == std::vector<double>(4, v));
  }
  CHECK(full({2}, -2.5, {.dtype = DType::f16}).to_vector() == std::vector<double>{-2.5, -2.5});
  CHECK(full({2}, 7.0, {.dtype = DType::boolean}).to_vector() == std::vector<double>{1.0, 1.0});
  Tensor s = scalar_tensor(3.25);
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.item() == 3.25);
  Tensor like = zeros_like(full({2, 2}, 9.0, {.dtype = DType::i64}));
  CHECK(like.dtype() == DType::i64);
  CHECK(like.to_vector() == std::vector<double>(4, 0.0));
  CHECK(ones_like(like).to_vector() == std::vector<double>(4, 1.0));
  CHECK(empty_like(like).shape() == Shape{2, 2});
  Tensor g = zeros({3}, {.requires_grad = true});
  CHECK(g.requires_grad());
  CHECK(g.is_leaf());
  check_throws_with([] { zeros({2}, {.dtype = DType::i32, .requires_grad = true}); },
                    "[requires_grad_] only floating-point");
}

TEST_CASE("full, fill_ and scalar_tensor refuse a value an integer dtype cannot hold") {
  // torch.full((2,), 1e10, dtype=torch.int32): "value cannot be converted to type int without
  // overflow"; this stored INT32_MIN. The same rule as the scalar operators (holds_value).
  check_throws_with([] { full({2}, 1e10, {.dtype = DType::i32}); },
                    "[full] value 10000000000 does not fit dtype i32");
  check_throws_with([] { full({2}, -1, {.dtype = DType::u8}); },
                    "[full] value -1 does not fit dtype u8");
  check_throws_with([] { scalar_tensor(NAN, {.dtype = DType::i64}); },
                    "[scalar_tensor] value nan does not fit dtype i64");
  check_throws_with([] { zeros({2}, {.dtype = DType::u8}).fill_(256); },
                    "[fill_] value 256 does not fit dtype u8");
  check_throws_with([] { zeros({2}, {.dtype = DType::i64}).fill_(0x1p63); },
                    "[fill_] value 9.223372036854776e+18 does not fit dtype i64");
  check_throws_with([] { zeros({2}, {.dtype = DType::i32}).fill_(INFINITY); }, "dtype i32");
  CHECK(full({2}, -2147483648.0, {.dtype = DType::i32}).to_vector() ==
        std::vector<double>{-2147483648.0, -2147483648.0});
  CHECK(zeros({1}, {.dtype = DType::u8}).fill_(255).item() == 255);
  CHECK(full({1}, NAN, {.dtype = DType::boolean}).item<bool>());  // nonzero is true, as torch
}

TEST_CASE("arange in every dtype, with fractional and negative steps") {
  for (DType dt : kAllDTypes) {
    CAPTURE(dtype_name(dt));
    Tensor t = arange(0, dt == DType::boolean ? 2 : 5, 1, {.dtype = dt});
    CHECK(t.dtype() == dt);
    if (dt == DType::boolean) {
      CHECK(t.to_vector() == std::vector<double>{0, 1});
    } else {
      CHECK(t.to_vector() == std::vector<double>{0, 1, 2, 3, 4});
    }
  }
  CHECK(arange(1, 2, 0.25).to_vector() == std::vector<double>{1, 1.25, 1.5, 1.75});
  CHECK(arange(5, 0, -2).to_vector() == std::vector<double>{5, 3, 1});
  CHECK(arange(0, 10, 3).to_vector() == std::vector<double>{0, 3, 6, 9});  // end is excluded
  CHECK(arange(3, 3).numel() == 0);
  CHECK(arange(3, 1).numel() == 0);  // wrong direction: empty, as numpy
  check_throws_with([] { arange(0, 1, 0); }, "[arange] step must be nonzero");
  // An integer dtype refuses fractions, where torch truncates them (and counts differently in
  // int64 and in narrower dtypes).
  CHECK(arange(-3, 3, 2, {.dtype = DType::i64}).to_vector() == std::vector<double>{-3, -1, 1});
  check_throws_with([] { arange(0, 5, 1.5, {.dtype = DType::i64}); },
                    "[arange] i64 needs whole start, end and step, got 0 -> 5 in steps of 1.5");
  check_throws_with([] { arange(0.5, 5, 1, {.dtype = DType::i32}); },
                    "[arange] i32 needs whole start, end and step, got 0.5 -> 5 in steps of 1");
  check_throws_with([] { arange(0, 4.5, 1, {.dtype = DType::u8}); },
                    "[arange] u8 needs whole start, end and step, got 0 -> 4.5 in steps of 1");
}

TEST_CASE("arange refuses non-finite bounds and steps, and counts beyond int64, by name") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  check_throws_with([&] { arange(0, inf); }, "[arange] unsupported range: 0 -> inf");
  check_throws_with([&] { arange(-inf, 0); }, "[arange] unsupported range: -inf -> 0");
  check_throws_with([&] { arange(0, nan); }, "[arange] unsupported range: 0 -> nan");
  check_throws_with([&] { arange(nan, 3); }, "[arange] unsupported range: nan -> 3");
  check_throws_with([&] { arange(0, 3, nan); },
                    "[arange] step must be nonzero and finite, got nan");
  check_throws_with([&] { arange(0, 3, inf); },
                    "[arange] step must be nonzero and finite, got inf");
  check_throws_with([] { arange(0, 1e19); }, "more than int64 counts");
  check_throws_with([] { arange(-1e308, 1e308); }, "more than int64 counts");  // the span is inf
  check_throws_with([] { arange(0, 1e300, 1e-300); }, "more than int64 counts");
  // A count that fits int64 but not in memory is the allocator's error, not std::length_error.
  CHECK_THROWS_AS(arange(0, 4e18), Error);
  CHECK(arange(0, 4, 1, {.device = kMeta}).shape() == Shape{4});
}

TEST_CASE("arange of an integer dtype is exact past 2^53") {
  // torch.arange(2**53, 2**53 + 4, dtype=torch.int64) is [2^53, 2^53 + 1, 2^53 + 2, 2^53 + 3];
  // computed in double, 2^53 + 1 rounded to 2^53 and 2^53 + 3 to 2^53 + 4.
  const std::int64_t base = std::int64_t{1} << 53;
  Tensor a = arange(0x1p53, 0x1p53 + 4, 1, {.dtype = DType::i64});
  REQUIRE(a.numel() == 4);
  for (std::int64_t i = 0; i < 4; ++i) CHECK(a.data<std::int64_t>()[i] == base + i);
  // Doubles near 2^60 are 256 apart: 2^60 + 64 has none.
  Tensor b = arange(0x1p60, 0x1p60 + 256, 64, {.dtype = DType::i64});
  REQUIRE(b.numel() == 4);
  for (std::int64_t i = 0; i < 4; ++i) CHECK(b.data<std::int64_t>()[i] == (base << 7) + 64 * i);
  Tensor down = arange(0x1p53 + 4, 0x1p53, -1, {.dtype = DType::i64});
  REQUIRE(down.numel() == 4);
  CHECK(down.data<std::int64_t>()[1] == base + 3);
  // 0, 2^62, 2^63: the last is past int64 (torch: "value cannot be converted to type int64_t").
  check_throws_with([] { arange(0, 1e19, 0x1p62, {.dtype = DType::i64}); },
                    "[arange] 0 -> 1e+19 in steps of 4.611686018427388e+18 passes int64's range");
}

TEST_CASE("empty refuses a shape whose size in bytes overflows, unless it has a 0") {
  check_throws_with([] { empty({std::int64_t{1} << 40, std::int64_t{1} << 40}); },
                    "[empty] shape (1099511627776, 1099511627776) of f32 needs more than 2^63 "
                    "bytes");
  check_throws_with([] { empty({std::int64_t{1} << 61}, {.dtype = DType::f64, .device = kMeta}); },
                    "needs more than 2^63 bytes");
  Tensor none = empty({std::int64_t{1} << 40, 0, std::int64_t{1} << 40});
  CHECK(none.numel() == 0);
  CHECK(none.nbytes() == 0);
  CHECK(none.strides() == Shape{std::int64_t{1} << 40, std::int64_t{1} << 40, 1});
  // Holding nothing, but with strides that int64 cannot hold.
  check_throws_with(
      [] { empty({std::int64_t{1} << 40, std::int64_t{1} << 40, 0, std::int64_t{1} << 40}); },
      "[tensor] shape (1099511627776, 1099511627776, 0, 1099511627776) has strides beyond int64's "
      "range");
}

TEST_CASE("from_vector in every dtype, and its size check") {
  for (DType dt : kAllDTypes) {
    CAPTURE(dtype_name(dt));
    const std::vector<double> values =
        dt == DType::boolean ? std::vector<double>{0, 1, 1, 0} : std::vector<double>{0, 1, 2, 100};
    Tensor t = from_vector(values, {2, 2}, {.dtype = dt});
    CHECK(t.dtype() == dt);
    CHECK(t.shape() == Shape{2, 2});
    CHECK(t.to_vector() == values);
  }
  // Values are converted to the dtype: u8 keeps 255, bool keeps "nonzero".
  CHECK(from_vector({255}, {1}, {.dtype = DType::u8}).to_vector() == std::vector<double>{255});
  CHECK(from_vector({-3, 0, 0.5}, {3}, {.dtype = DType::boolean}).to_vector() ==
        std::vector<double>{1, 0, 1});
  check_throws_with([] { from_vector({1, 2, 3}, {2, 2}); }, "[from_vector] 3 values do not fill");
  Tensor leaf = from_vector({1, 2}, {2}, {.requires_grad = true});
  CHECK(leaf.requires_grad());
  CHECK(leaf.is_leaf());
}

// ---- views -------------------------------------------------------------------------------------

TEST_CASE("views share storage and the version counter") {
  Tensor base = arange(0, 12).view({3, 4});
  const Tensor views[] = {base.t(),
                          base.view({12}),
                          base.slice(1, 1, 3),
                          base.select(0, 2),
                          base.reshape({2, 6}),
                          base.unsqueeze(0),
                          base.permute({1, 0}),
                          base.slice(0, 0, 3, 2),
                          base.flatten()};
  for (const Tensor& v : views) {
    CHECK(v.same_storage(base));
    CHECK(v.version() == base.version());
  }
  CHECK(base.t().shape() == Shape{4, 3});
  CHECK(base.t().strides() == Shape{1, 4});
  CHECK(base.slice(1, 1, 3).offset() == 1);
  CHECK(base.select(0, 2).to_vector() == std::vector<double>{8, 9, 10, 11});
  CHECK(base.slice(0, 0, 3, 2).to_vector() == std::vector<double>{0, 1, 2, 3, 8, 9, 10, 11});
  CHECK(base.t().select(0, 1).to_vector() == std::vector<double>{1, 5, 9});

  // Writing through a view changes the base and bumps the one counter they share.
  const std::int64_t v0 = base.version();
  Tensor column = base.slice(1, 1, 2);
  column.fill_(-1);
  CHECK(base.version() == v0 + 1);
  CHECK(views[0].version() == v0 + 1);
  CHECK(base.to_vector() == std::vector<double>{0, -1, 2, 3, 4, -1, 6, 7, 8, -1, 10, 11});
  base.select(0, 0).copy_(from_vector({7, 7, 7, 7}, {4}));
  CHECK(column.version() == v0 + 2);
  CHECK(base.select(0, 0).to_vector() == std::vector<double>{7, 7, 7, 7});

  // A copy is a new storage with its own counter.
  Tensor copy = base.clone();
  CHECK_FALSE(copy.same_storage(base));
  copy.zero_();
  CHECK(base.version() == v0 + 2);
  CHECK(base.select(0, 1).to_vector() == std::vector<double>{4, -1, 6, 7});

  // detach() shares data but not history.
  Tensor leaf = ones({2}, {.requires_grad = true});
  Tensor d = leaf.detach();
  CHECK(d.same_storage(leaf));
  CHECK_FALSE(d.requires_grad());

  check_throws_with([&] { base.t().view({12}); }, "[view] input of shape (4, 3) is not contiguous");
  check_throws_with([&] { base.view({5, 3}); }, "[view] shape (5, 3) is invalid");
}

TEST_CASE("contiguous copies only when the layout needs it") {
  Tensor a = arange(0, 6).view({2, 3});
  Tensor same = a.contiguous();
  CHECK(same.same_storage(a));

  Tensor t = a.t();
  CHECK_FALSE(t.is_contiguous());
  Tensor c = t.contiguous();
  CHECK(c.is_contiguous());
  CHECK_FALSE(c.same_storage(a));
  CHECK(c.shape() == Shape{3, 2});
  CHECK(c.strides() == Shape{2, 1});
  CHECK(c.to_vector() == std::vector<double>{0, 3, 1, 4, 2, 5});

  Tensor e = from_vector({1, 2}, {2, 1}).expand({2, 3});
  CHECK(e.strides() == Shape{1, 0});
  CHECK_FALSE(e.is_contiguous());
  CHECK(e.contiguous().to_vector() == std::vector<double>{1, 1, 1, 2, 2, 2});

  // Size-1 dims do not break contiguity, whatever their stride.
  Tensor row = a.slice(0, 1, 2);
  CHECK(row.is_contiguous());
  CHECK(row.contiguous().same_storage(a));
}

TEST_CASE("empty tensors are contiguous whatever their strides, so row ops take them") {
  for (const Shape& shape : {Shape{2, 0}, Shape{2, 0, 3}, Shape{0, 3}}) {
    CAPTURE(shape_str(shape));
    CHECK(ones(shape).is_contiguous());
    CHECK(ones(shape).kview().is_contiguous());
  }
  Tensor cut = ones({3, 4}).slice(1, 0, 0);  // (3, 0), strides (4, 1)
  CHECK(cut.is_contiguous());
  CHECK(cut.contiguous().same_storage(cut));

  // The shapes PyTorch gives, and gradients of the input's shape (zeros for the parameters).
  auto check_empty = [](const Tensor& y, const Shape& shape) {
    CHECK(y.shape() == shape);
    CHECK(y.numel() == 0);
  };
  for (int dim : {0, 1, -1}) {
    CAPTURE(dim);
    Tensor x = ones({2, 0, 3}, {.requires_grad = true});
    check_empty(softmax(x, dim), {2, 0, 3});
    Tensor y = log_softmax(x, dim);
    check_empty(y, {2, 0, 3});
    sum(y).backward();
    check_empty(x.grad(), {2, 0, 3});
  }
  check_empty(softmax(ones({2, 0}), 1), {2, 0});
  check_empty(log_softmax(ones({2, 0}), -1), {2, 0});

  Tensor x = ones({2, 0, 4}, {.requires_grad = true});
  Tensor w = ones({4}, {.requires_grad = true}), b = zeros({4}, {.requires_grad = true});
  Tensor y = layer_norm(x, {4}, w, b);
  check_empty(y, {2, 0, 4});
  sum(y).backward();
  check_empty(x.grad(), {2, 0, 4});
  CHECK(w.grad().to_vector() == std::vector<double>(4, 0.0));
  CHECK(b.grad().to_vector() == std::vector<double>(4, 0.0));

  // Attention with an empty batch, head count or sequence.
  for (const Shape& shape : {Shape{0, 2, 3, 4}, Shape{1, 0, 3, 4}, Shape{1, 2, 0, 4}}) {
    CAPTURE(shape_str(shape));
    Tensor q = ones(shape, {.requires_grad = true});
    Tensor out = scaled_dot_product_attention(q, ones(shape), ones(shape));
    check_empty(out, shape);
    sum(out).backward();
    check_empty(q.grad(), shape);
  }
}

// ---- in-place writes and gradients -------------------------------------------------------------

TEST_CASE("copy_ reads an overlapping source in full before writing; an exact alias is a no-op") {
  Tensor a = arange(0, 9).reshape({3, 3});
  a.copy_(a.t());
  CHECK(a.to_vector() == std::vector<double>{0, 3, 6, 1, 4, 7, 2, 5, 8});

  Tensor shift = arange(0, 6);  // shift right by one, in place
  shift.slice(0, 1, 6).copy_(shift.slice(0, 0, 5));
  CHECK(shift.to_vector() == std::vector<double>{0, 0, 1, 2, 3, 4});

  Tensor rows = arange(0, 6).reshape({2, 3});  // a broadcast of its own second row
  rows.copy_(rows.select(0, 1));
  CHECK(rows.to_vector() == std::vector<double>{3, 4, 5, 3, 4, 5});

  Tensor halves = arange(0, 6);  // disjoint parts of one storage need no staging
  halves.slice(0, 0, 3).copy_(halves.slice(0, 3, 6));
  CHECK(halves.to_vector() == std::vector<double>{3, 4, 5, 3, 4, 5});

  Tensor same = arange(0, 4);
  const std::int64_t v0 = same.version();
  same.copy_(same);
  CHECK(same.to_vector() == std::vector<double>{0, 1, 2, 3});
  CHECK(same.version() == v0 + 1);  // still a write, for saved-tensor checks
}

TEST_CASE("writes into an expanded tensor: copy_ is refused, fill_ and zero_ give one value") {
  Tensor base = zeros({1});
  Tensor e = base.expand({3});
  CHECK(has_internal_overlap(e));
  check_throws_with([&] { e.copy_(arange(0, 3)); },
                    "[copy_] more than one element of the written-to tensor (shape (3,), strides "
                    "(0,)) refers to a single memory location; clone() it before writing");
  check_throws_with([&] { zeros({2, 1}).expand({2, 4}).copy_(ones({2, 4})); },
                    "[copy_] more than one element");
  check_throws_with([] { zeros({1}, {.device = kMeta}).expand({3}).copy_(ones({3})); },
                    "[copy_] more than one element");
  check_throws_with([&] { accumulate_(e, ones({3}), 0.5); }, "[accumulate_] more than one element");
  CHECK(base.to_vector() == std::vector<double>{0});
  // Every repeated location gets the same value, whatever the order: PyTorch allows these too.
  e.fill_(2);
  CHECK(base.to_vector() == std::vector<double>{2});
  e.zero_();
  CHECK(base.to_vector() == std::vector<double>{0});
  // No element repeats in an empty tensor, or along a size-1 dim of stride 0.
  Tensor none = base.expand({2, 0, 1});
  CHECK_FALSE(has_internal_overlap(none));
  none.copy_(ones({2, 0, 1}));
  Tensor one = base.expand({1, 1});
  CHECK_FALSE(has_internal_overlap(one));
  one.copy_(full({1, 1}, 5));
  CHECK(base.to_vector() == std::vector<double>{5});
}

TEST_CASE("set_grad refuses grads backward cannot add into; floating grads of other widths stay") {
  Tensor x = ones({3}, {.requires_grad = true});
  check_throws_with([&] { x.set_grad(ones({3}, {.dtype = DType::i64})); },
                    "[set_grad] grad dtype i64 for a tensor of dtype f32: backward accumulates "
                    "only floating-point grads");
  check_throws_with([&] { x.set_grad(zeros({1}).expand({3})); },
                    "[set_grad] more than one element of the written-to tensor (shape (3,), "
                    "strides (0,))");
  check_throws_with([&] { x.set_grad(zeros({3}, {.device = kMeta})); },
                    "[set_grad] grad is on meta, the tensor on cpu");
  CHECK_FALSE(x.grad().defined());

  // Wider accumulators (f64 for f32) and 16-bit ones (ParamStore's grad_dtype) are deliberate.
  x.set_grad(zeros({3}, {.dtype = DType::f64}));
  sum(x * 2.0).backward();
  CHECK(x.grad().dtype() == DType::f64);
  CHECK(x.grad().to_vector() == std::vector<double>{2, 2, 2});
  Tensor w = ones({3}, {.dtype = DType::bf16}).requires_grad_(true);
  w.set_grad(zeros({3}));
  Tensor h = ones({3}).requires_grad_(true);
  h.set_grad(zeros({3}, {.dtype = DType::bf16}));
  sum(h * 3.0).backward();
  CHECK(h.grad().to_vector() == std::vector<double>{3, 3, 3});
  x.set_grad({});
  CHECK_FALSE(x.grad().defined());
}

// ---- dtype conversions -------------------------------------------------------------------------

TEST_CASE("to(dtype): f16 rounds to nearest even, overflows to inf, keeps subnormals") {
  const float p = std::ldexp(1.0f, -11);  // half an f16 ulp at 1
  const std::vector<float> in = {
      1.0f,
      1.0f + 2 * p,                      // exactly representable: 0x3C01
      1.0f + p,                          // tie between 0x3C00 and 0x3C01: to even, down
      1.0f + 3 * p,                      // tie between 0x3C01 and 0x3C02: to even, up
      1.0f + p + std::ldexp(1.0f, -20),  // just above the tie: up
      -2.0f,
      0.1f,      // 1.6 * 2^-4: mantissa 614.4 -> 614
      65504.0f,  // largest finite f16
      65519.0f,  // below the tie with the next (infinite) step
      65520.0f,  // the tie: 0x7BFF is odd, so it rounds to inf
      1e6f,
      -1e6f,
      std::numeric_limits<float>::infinity(),
      std::ldexp(1.0f, -14),                          // smallest normal
      std::ldexp(1.0f, -14) - std::ldexp(1.0f, -24),  // largest subnormal
      std::ldexp(1.0f, -24),                          // smallest subnormal
      std::ldexp(1.0f, -25),                          // tie between 0 and 0x0001: to even, 0
      3 * std::ldexp(1.0f, -25),                      // tie between 0x0001 and 0x0002: to even, up
      std::ldexp(1.0f, -25) + std::ldexp(1.0f, -35),  // above the tie: 0x0001
      std::ldexp(1.0f, -26),                          // below half the smallest subnormal: 0
      -0.0f,
  };
  const std::vector<std::uint16_t> expected = {
      0x3C00, 0x3C01, 0x3C00, 0x3C02, 0x3C01, 0xC000, 0x2E66, 0x7BFF, 0x7BFF, 0x7C00, 0x7C00,
      0xFC00, 0x7C00, 0x0400, 0x03FF, 0x0001, 0x0000, 0x0002, 0x0001, 0x0000, 0x8000};
  REQUIRE(in.size() == expected.size());
  const std::vector<std::uint16_t> got = bits_after_cast(in, DType::f16);
  for (std::size_t i = 0; i < in.size(); ++i) {
    CAPTURE(i);
    CAPTURE(in[i]);
    CHECK(got[i] == expected[i]);
  }
  const std::uint16_t nan_bits = bits_after_cast({std::nanf("")}, DType::f16)[0];
  CHECK((nan_bits & 0x7C00) == 0x7C00);
  CHECK((nan_bits & 0x03FF) != 0);

  // Back to f32: each f16 value is exact in f32.
  Tensor h = from_vector({1.0 + std::ldexp(1.0, -10), 65504, std::ldexp(1.0, -24), 0.1, -1e6}, {5},
                         {.dtype = DType::f16});
  const std::vector<double> back = h.to(DType::f32).to_vector();
  CHECK(back[0] == 1.0 + std::ldexp(1.0, -10));
  CHECK(back[1] == 65504.0);
  CHECK(back[2] == std::ldexp(1.0, -24));
  CHECK(back[3] == 0.0999755859375);  // 0x2E66 = 1638 * 2^-14
  CHECK(std::isinf(back[4]));
  CHECK(back[4] < 0);
}

#if defined(MB_HAVE_F16C)
constexpr bool kHaveF16c = true;
#else
constexpr bool kHaveF16c = false;
#endif

TEST_CASE("f16 conversions by F16C instructions equal the integer conversions, bit for bit" *
          doctest::skip(!kHaveF16c) * doctest::description("a CPU and build with F16C")) {
  // core/half.h converts with vcvtps2ph / vcvtph2ps where the build has F16C and in integer
  // arithmetic elsewhere (and in CUDA host code), so the two must agree everywhere. Every f16
  // value; every f32 sign, exponent and top 10 mantissa bits with the low 13 bits at and around
  // the rounding tie; and random mantissas where f16 goes subnormal (the tie's bit moves there).
  std::uint64_t mismatches = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    if (float_bits(half_bits_to_float(b)) != float_bits(half_bits_to_float_portable(b))) ++mismatches;
  }
  auto check = [&](std::uint32_t u) {
    const float f = bits_float(u);
    if (float_to_half_bits(f) != float_to_half_bits_portable(f)) ++mismatches;
  };
  for (std::uint32_t top = 0; top < (1u << 19); ++top) {  // sign, exponent, 10 mantissa bits
    for (std::uint32_t low : {0x0u, 0x1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu}) check((top << 13) | low);
  }
  std::uint32_t state = 12345;
  for (std::uint32_t exponent = 100; exponent <= 113; ++exponent) {
    for (int i = 0; i < (1 << 18); ++i) {
      state = state * 1664525u + 1013904223u;  // an LCG's 23 low bits as the mantissa
      check((exponent << 23) | (state & 0x7fffffu));
      check(0x80000000u | (exponent << 23) | (state & 0x7fffffu));
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("to(dtype): bf16 rounds to nearest even, overflows to inf, keeps subnormals") {
  const float p = std::ldexp(1.0f, -8);  // half a bf16 ulp at 1
  const std::vector<float> in = {
      1.0f,
      1.0f + 2 * p,                      // exact: 0x3F81
      1.0f + p,                          // tie: to even, down
      1.0f + 3 * p,                      // tie: to even, up
      1.0f + p + std::ldexp(1.0f, -20),  // above the tie: up
      -3.0f,
      static_cast<float>(std::ldexp(2.0 - std::ldexp(1.0, -7), 127)),  // largest finite bf16
      std::numeric_limits<float>::max(),  // rounds past the largest: inf
      -std::numeric_limits<float>::infinity(),
      std::ldexp(1.0f, -126),      // smallest normal: 0x0080
      f32_from_bits(0x00010000u),  // a bf16 subnormal, exact: 0x0001
      f32_from_bits(0x00008000u),  // tie between 0 and 0x0001: 0
      f32_from_bits(0x00018000u),  // tie between 0x0001 and 0x0002: up
      f32_from_bits(0x00008001u),  // above the tie: 0x0001
  };
  const std::vector<std::uint16_t> expected = {0x3F80, 0x3F81, 0x3F80, 0x3F82, 0x3F81,
                                               0xC040, 0x7F7F, 0x7F80, 0xFF80, 0x0080,
                                               0x0001, 0x0000, 0x0002, 0x0001};
  REQUIRE(in.size() == expected.size());
  const std::vector<std::uint16_t> got = bits_after_cast(in, DType::bf16);
  for (std::size_t i = 0; i < in.size(); ++i) {
    CAPTURE(i);
    CAPTURE(in[i]);
    CHECK(got[i] == expected[i]);
  }
  const std::uint16_t nan_bits = bits_after_cast({std::nanf("")}, DType::bf16)[0];
  CHECK((nan_bits & 0x7F80) == 0x7F80);
  CHECK((nan_bits & 0x007F) != 0);

  Tensor b = from_vector({1.0 + std::ldexp(1.0, -7), 3.0}, {2}, {.dtype = DType::bf16});
  CHECK(b.to(DType::f64).to_vector() == std::vector<double>{1.0 + std::ldexp(1.0, -7), 3.0});
}

TEST_CASE("to(dtype): round trips between the other dtypes") {
  // f32 -> f64 -> f32 is exact for any f32 value.
  GeneratorStateGuard restore;
  manual_seed(5);
  Tensor x = randn({100});
  Tensor wide = x.to(DType::f64);
  CHECK(wide.dtype() == DType::f64);
  CHECK(wide.to(DType::f32).to_vector() == x.to_vector());
  CHECK(x.to(DType::f32).same_storage(x));  // same dtype: no copy

  // Integers survive float <-> int conversions while they are exact in the float type.
  const std::vector<double> ints = {-3, 0, 7, 1 << 24, -(1 << 24)};
  Tensor fi = from_vector(ints, {5});
  CHECK(fi.to(DType::i32).to_vector() == ints);
  CHECK(fi.to(DType::i64).to(DType::f32).to_vector() == ints);
  const double big = std::ldexp(1.0, 53);
  CHECK(from_vector({big, -big}, {2}, {.dtype = DType::i64}).to(DType::f64).to_vector() ==
        std::vector<double>{big, -big});
  CHECK(from_vector({0, 200, 255}, {3}, {.dtype = DType::u8})
            .to(DType::f16)
            .to(DType::u8)
            .to_vector() == std::vector<double>{0, 200, 255});
  // Float to int truncates toward zero (C++ conversion, as torch's .to(int)).
  CHECK(from_vector({2.75, -2.75}, {2}).to(DType::i32).to_vector() == std::vector<double>{2, -2});
  // bool: any nonzero is true, and true converts back to 1.
  CHECK(from_vector({0, -0.5, 2}, {3}).to(DType::boolean).to(DType::f32).to_vector() ==
        std::vector<double>{0, 1, 1});
  // f16 <-> bf16 goes through f32: 1 + 2^-10 is exact in f16 and rounds to 1 in bf16.
  Tensor h = from_vector({1.0 + std::ldexp(1.0, -10), 2.0}, {2}, {.dtype = DType::f16});
  CHECK(h.to(DType::bf16).to_vector() == std::vector<double>{1.0, 2.0});
  // Non-contiguous sources convert element by element in logical order.
  Tensor m = arange(0, 6).view({2, 3}).t();
  CHECK(m.to(DType::f16).to_vector() == std::vector<double>{0, 3, 1, 4, 2, 5});
}

// ---- values and printing -----------------------------------------------------------------------

TEST_CASE("item") {
  CHECK(scalar_tensor(-1.5).item() == -1.5);
  CHECK(from_vector({42}, {1, 1}, {.dtype = DType::i64}).item() == 42.0);
  CHECK(from_vector({42}, {1}, {.dtype = DType::i32}).item<int>() == 42);
  CHECK(scalar_tensor(1, {.dtype = DType::boolean}).item<bool>());
  CHECK(from_vector({0.1}, {1}, {.dtype = DType::f16}).item() == 0.0999755859375);
  CHECK(arange(0, 6).view({2, 3}).select(1, 2).select(0, 1).item() == 5.0);
  check_throws_with([] { zeros({2}).item(); },
                    "[item] expected a one-element tensor, got shape (2,)");
  check_throws_with([] { Tensor().item(); }, "undefined tensor");
}

TEST_CASE("item<T> of an integer T reads an integer element exactly, past 2^53") {
  // 2^53 + 1 has no double: through item() it read as 2^53.
  const std::int64_t big = (std::int64_t{1} << 53) + 1;
  Tensor one = scalar_tensor(1, {.dtype = DType::i64});
  Tensor t = full({}, 0x1p53, {.dtype = DType::i64}) + one;
  REQUIRE(*t.data<std::int64_t>() == big);
  CHECK(t.item<std::int64_t>() == big);
  CHECK(t.reshape({1, 1}).item<std::int64_t>() == big);
  CHECK(t.item<std::uint64_t>() == static_cast<std::uint64_t>(big));
  Tensor pair = full({2}, 0x1p62, {.dtype = DType::i64}) + one;  // a strided element
  CHECK(pair.slice(0, 1, 2).item<std::int64_t>() == (std::int64_t{1} << 62) + 1);
  CHECK(scalar_tensor(-7, {.dtype = DType::i32}).item<std::int64_t>() == -7);
  CHECK(scalar_tensor(1, {.dtype = DType::boolean}).item<int>() == 1);
  CHECK(scalar_tensor(2.75).item<std::int64_t>() == 2);  // a float still converts as before
  check_throws_with([] { zeros({2}, {.dtype = DType::i64}).item<std::int64_t>(); },
                    "[item] expected a one-element tensor, got shape (2,)");
}

TEST_CASE("printing shows values, shape and dtype") {
  Tensor a = from_vector({1.5, -2, 3}, {3});
  const std::string s = a.str();
  CHECK(s.find("1.5") != std::string::npos);
  CHECK(s.find("-2") != std::string::npos);
  CHECK(s.find("3") != std::string::npos);
  CHECK(s.find("shape=(3,)") != std::string::npos);
  CHECK(s.find("dtype=f32") != std::string::npos);
  std::ostringstream os;
  os << a;
  CHECK(os.str() == s);

  const std::string m = arange(0, 6, 1, {.dtype = DType::i64}).view({2, 3}).str();
  CHECK(m.find("[[0, 1, 2], [3, 4, 5]]") != std::string::npos);
  CHECK(m.find("shape=(2, 3)") != std::string::npos);
  CHECK(m.find("dtype=i64") != std::string::npos);

  // Long rows are elided in the middle.
  const std::string lng = arange(0, 100).str();
  CHECK(lng.find("...") != std::string::npos);
  CHECK(lng.find("99") != std::string::npos);
  CHECK(lng.find("50") == std::string::npos);

  CHECK(scalar_tensor(2.5, {.dtype = DType::bf16}).str().find("dtype=bf16") != std::string::npos);
  CHECK(zeros({2}, {.requires_grad = true}).str().find("requires_grad") != std::string::npos);
  const std::string meta = empty({2, 3}, {.dtype = DType::f16, .device = kMeta}).str();
  CHECK(meta.find("shape=(2, 3)") != std::string::npos);
  CHECK(meta.find("dtype=f16") != std::string::npos);
  CHECK(meta.find("device=meta") != std::string::npos);
  CHECK(Tensor().str() == "tensor(undefined)");
}

// ---- random factories --------------------------------------------------------------------------

TEST_CASE("rand in f16 and bf16 stays below 1, on the dtype's grid, as torch") {
  // Rounding a 24-bit uniform to nearest would give 1.0 about once in 4096 (f16) or 512 (bf16)
  // draws; the draw keeps as many random bits as the significand holds instead.
  GeneratorStateGuard restore;
  manual_seed(7);
  for (auto [dt, bits] : {std::pair{DType::f16, 11}, std::pair{DType::bf16, 8}}) {
    CAPTURE(dtype_name(dt));
    const std::vector<double> u = rand({1 << 20}, {.dtype = dt}).to_vector();
    const double grid = std::ldexp(1.0, bits);
    bool below_one = true, on_grid = true;
    double largest = 0;
    for (double x : u) {
      below_one = below_one && x >= 0 && x < 1;
      on_grid = on_grid && x * grid == std::floor(x * grid);
      largest = std::max(largest, x);
    }
    CHECK(below_one);
    CHECK(on_grid);
    CHECK(largest == 1 - 1 / grid);  // 2^20 draws reach the top of a 2^11 grid
  }
}

TEST_CASE("rand and randn are deterministic for a seed") {
  GeneratorStateGuard restore;
  for (DType dt : kFloatDTypes) {
    CAPTURE(dtype_name(dt));
    manual_seed(123);
    Tensor a = rand({257}, {.dtype = dt});
    Tensor an = randn({3, 5}, {.dtype = dt});
    Tensor next = rand({257}, {.dtype = dt});
    manual_seed(123);
    Tensor b = rand({257}, {.dtype = dt});
    Tensor bn = randn({3, 5}, {.dtype = dt});
    CHECK(a.dtype() == dt);
    CHECK(a.to_vector() == b.to_vector());
    CHECK(an.to_vector() == bn.to_vector());
    CHECK(a.to_vector() != next.to_vector());  // the stream moves on
    manual_seed(124);
    CHECK(rand({257}, {.dtype = dt}).to_vector() != a.to_vector());
  }
  // Every dtype draws the same underlying numbers: f64 holds the f32 values exactly.
  manual_seed(9);
  Tensor f32 = rand({64});
  manual_seed(9);
  Tensor f64 = rand({64}, {.dtype = DType::f64});
  CHECK(f32.to_vector() == f64.to_vector());
  // The generator state is plain data: restoring it replays the draws.
  const GeneratorState st = default_generator().state();
  Tensor r1 = randn({10});
  default_generator().set_state(st);
  CHECK(randn({10}).to_vector() == r1.to_vector());

  Tensor g = rand({3}, {.requires_grad = true});
  CHECK(g.requires_grad());
  check_throws_with([] { rand({2}, {.dtype = DType::i32}); }, "[rand] expected a floating dtype");
  check_throws_with([] { randn({2}, {.dtype = DType::boolean}); }, "expected a floating dtype");
}

TEST_CASE("rand is uniform on [0, 1) and randn standard normal, over 10^5 samples") {
  GeneratorStateGuard restore;
  manual_seed(2024);
  const int n = 100000;
  auto moments = [](const std::vector<double>& v) {
    double s = 0, s2 = 0;
    for (double x : v) s += x;
    const double mean = s / static_cast<double>(v.size());
    for (double x : v) s2 += (x - mean) * (x - mean);
    return std::pair{mean, std::sqrt(s2 / static_cast<double>(v.size() - 1))};
  };

  const std::vector<double> u = rand({n}).to_vector();
  auto [umean, ustd] = moments(u);
  CHECK(std::abs(umean - 0.5) < 0.01);
  CHECK(std::abs(ustd - std::sqrt(1.0 / 12.0)) < 0.01);
  double lo = 1, hi = 0;
  int below_tenth = 0;
  for (double x : u) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    below_tenth += x < 0.1;
  }
  CHECK(lo >= 0.0);
  CHECK(hi < 1.0);
  CHECK(std::abs(below_tenth / static_cast<double>(n) - 0.1) < 0.01);

  const std::vector<double> z = randn({n}).to_vector();
  auto [zmean, zstd] = moments(z);
  CHECK(std::abs(zmean) < 0.02);
  CHECK(std::abs(zstd - 1.0) < 0.02);
  int within_one = 0;
  for (double x : z) within_one += std::abs(x) < 1.0;
  CHECK(std::abs(within_one / static_cast<double>(n) - 0.6827) < 0.01);  // P(|Z| < 1)
}

// ---- meta tensors ------------------------------------------------------------------------------

TEST_CASE("meta tensors have shapes and simulated storage, but no values") {
  GeneratorStateGuard restore;
  Tensor m = empty({4, 8}, {.device = kMeta});
  CHECK(m.device() == kMeta);
  CHECK(m.shape() == Shape{4, 8});
  CHECK(m.numel() == 32);
  CHECK(m.nbytes() == 128);
  CHECK(m.raw_data() == nullptr);
  check_throws_with([&] { m.to_vector(); }, "[to_vector] a meta tensor has no values");
  check_throws_with([] { empty({1}, {.device = kMeta}).item(); }, "meta tensor has no values");
  check_throws_with([&] { m.data<float>(); }, "[data] tensor is on meta");

  // Factories and ops run on meta without touching data: shapes and dtypes only.
  Tensor z = zeros({4, 8}, {.device = kMeta});
  Tensor r = randn({8, 3}, {.device = kMeta});
  Tensor y = matmul(z, r) + 1.0;
  CHECK(y.device() == kMeta);
  CHECK(y.shape() == Shape{4, 3});
  CHECK(sum(y, {0}).shape() == Shape{3});
  CHECK(m.t().shape() == Shape{8, 4});
  CHECK(m.to(DType::f16).dtype() == DType::f16);
  CHECK(m.to(DType::f16).device() == kMeta);

  // CPU -> meta keeps the shape; meta -> CPU has nothing to copy.
  Tensor c = ones({2, 2}).to(kMeta);
  CHECK(c.device() == kMeta);
  CHECK(c.shape() == Shape{2, 2});
  check_throws_with([&] { m.to(kCPU); }, "[copy_] cannot copy from meta");

  // A meta tensor can be far larger than this machine's memory.
  {
    Tensor huge = empty({1 << 20, 1 << 20}, {.device = kMeta});  // 4 TiB of f32
    CHECK(huge.nbytes() == (std::size_t{1} << 42));
  }
  empty_cache(kMeta);  // leave no simulated terabytes cached for later tests
}

// ---- devices and dtypes by name ----------------------------------------------------------------

TEST_CASE("parse_device and parse_dtype") {
  CHECK(parse_device("cpu") == kCPU);
  CHECK(parse_device("meta") == kMeta);
  CHECK(parse_device("cuda") == cuda_device(0));
  CHECK(parse_device("cuda:3") == cuda_device(3));
  CHECK(parse_device("cuda:3").str() == "cuda:3");
  CHECK(kCPU.str() == "cpu");
  CHECK(kMeta.str() == "meta");
  for (const char* bad : {"gpu", "CPU", "", "cuda:", "cuda:-1", "cuda:1x", "cuda:x", "cuda0"}) {
    CAPTURE(bad);
    check_throws_with([&] { parse_device(bad); }, "[device]");
  }
  check_throws_with([] { parse_device("tpu"); }, "unknown device 'tpu'");
  check_throws_with([] { parse_device("cuda:1x"); }, "bad CUDA device 'cuda:1x'");

  for (DType dt : kAllDTypes) CHECK(parse_dtype(dtype_name(dt)) == dt);
  CHECK(parse_dtype("float32") == DType::f32);
  CHECK(parse_dtype("float16") == DType::f16);
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK(parse_dtype("float64") == DType::f64);
  check_throws_with([] { parse_dtype("f8"); }, "[dtype] unknown dtype 'f8'");
  check_throws_with([] { parse_dtype("F32"); }, "unknown dtype");
}

// ---- CUDA --------------------------------------------------------------------------------------

// In the test suite "cuda": with a GPU its CUDA branch runs in the GPU check.
TEST_CASE("a CUDA device that does not exist gives a clear error" * doctest::test_suite("cuda")) {
  // One past the last device exists in no build; in a CPU-only build that is cuda:0.
  const Device missing = cuda_device(cuda_device_count());
  check_throws_with([&] { empty({2}, {.device = missing}); }, "is not available");
  check_throws_with([&] { ones({2}).to(missing); }, missing.str());
  if (!has_cuda()) {
    CHECK(cuda_device_count() == 0);
    check_throws_with([] { zeros({2}, {.device = cuda_device(0)}); },
                      "cuda:0 is not available (0 CUDA devices)");
  }
}

MB_CUDA_ONLY_TEST_CASE("CPU -> cuda -> CPU copies round-trip values, dtypes and layouts") {
  const Device gpu = cuda_device(0);
  GeneratorStateGuard restore;
  manual_seed(77);
  Tensor x = randn({33, 65});
  const MemoryStats before = memory_stats(gpu);
  Tensor d = x.to(gpu);
  CHECK(d.device() == gpu);
  CHECK(d.shape() == x.shape());
  CHECK(memory_stats(gpu).allocated.current >=
        before.allocated.current + static_cast<std::int64_t>(x.nbytes()));
  CHECK(d.to(kCPU).to_vector() == x.to_vector());
  CHECK(d.to_vector() == x.to_vector());  // to_vector copies from the device itself

  // A non-contiguous source, and a conversion on the way up.
  Tensor t = x.t();
  CHECK(t.to(gpu).to(kCPU).to_vector() == t.to_vector());
  CHECK(x.to(gpu, DType::f16).to(kCPU).to_vector() == x.to(DType::f16).to_vector());
  Tensor z = zeros({5}, {.device = gpu});
  CHECK(z.to_vector() == std::vector<double>(5, 0.0));
  // Integers too.
  Tensor i = arange(0, 10, 1, {.dtype = DType::i64});
  CHECK(i.to(gpu).to(kCPU).to_vector() == i.to_vector());
}

MB_CUDA_ONLY_TEST_CASE(
    "cuda -> CPU: a view within twice its bytes comes over without a device copy") {
  // Padded 16-bit rows (a linear's output, Note [Padded rows]), a transposed view and rows out of
  // a wider tensor come over as their span, re-strided on the host; every third row is gathered
  // on the device first. Values as the CPU's either way, into the same and another dtype.
  const Device gpu = cuda_device(0);
  const Tensor x = input({40, 16}, -1, 1, 5).detach().to(DType::bf16);
  const Tensor w = input({33, 16}, -1, 1, 6).detach().to(DType::bf16);
  const Tensor wide = input({40, 40}, -1, 1, 7).detach();
  const Tensor logits = linear(x.to(gpu), w.to(gpu));
  REQUIRE_MESSAGE(!logits.is_contiguous(), "a 33-wide bf16 linear's rows are padded on the GPU");
  struct Case {
    const char* name;
    Tensor on_gpu, expected;
    bool staged;
  };
  const Tensor wide_gpu = wide.to(gpu);
  const std::vector<Case> cases = {
      {"padded bf16 rows", logits, logits.contiguous().to(kCPU), false},
      {"transposed", wide_gpu.t(), wide.t(), false},
      {"33 of 40 columns", wide_gpu.slice(1, 2, 35), wide.slice(1, 2, 35), false},
      {"every third row", wide_gpu.slice(0, 0, 40, 3), wide.slice(0, 0, 40, 3), true},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    reset_peak_memory_stats(gpu);
    const std::int64_t before = memory_stats(gpu).allocated.current;
    const Tensor same = c.on_gpu.to(kCPU);
    const std::int64_t extra = memory_stats(gpu).allocated.peak - before;
    CHECK(same.dtype() == c.on_gpu.dtype());
    CHECK(same.to_vector() == c.expected.to_vector());
    CHECK(c.on_gpu.to(kCPU, DType::f64).to_vector() == c.expected.to(DType::f64).to_vector());
    if (c.staged) {
      CHECK(extra > 0);
    } else {
      CHECK(extra == 0);
    }
  }
}
