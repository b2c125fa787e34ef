// Element-wise CPU loops over strided views, with the math from kernels/elementwise_ops.h.
// Outputs are overwritten, except accumulate (`dst += w * src`).
#include <cmath>
#include <cstring>
#include <limits>

#include "core/rng.h"
#include "kernels/cpu/chunks.h"
#include "kernels/elementwise.h"
#include "kernels/elementwise_ops.h"

namespace microbatch::kernels::cpu {

namespace {

constexpr std::int64_t kParallelElements = 1 << 15;

// Calls f(offsets) for every index of views[0]'s shape, offsets[k] in elements of views[k].
template <int N, class F>
void for_each(const StridedView* const (&views)[N], F&& f) {
  const StridedView& v0 = *views[0];
  const std::int64_t n = v0.numel();
  if (n == 0) return;
  bool contiguous = true;
  for (int k = 0; k < N; ++k) contiguous = contiguous && views[k]->is_contiguous();
  std::int64_t off[N];
  if (contiguous) {
    // Large contiguous loops are split across threads (each element is written by one thread, so
    // results do not depend on the thread count).
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t o[N];
      for (int k = 0; k < N; ++k) o[k] = i;
      f(o);
    }
    return;
  }
  const int nd = v0.ndim;
  if (nd == 0) {
    for (int k = 0; k < N; ++k) off[k] = 0;
    f(off);
    return;
  }
  std::int64_t idx[kMaxDims] = {};
  for (int k = 0; k < N; ++k) off[k] = 0;
  const std::int64_t inner = v0.shape[nd - 1];
  std::int64_t inner_stride[N];
  for (int k = 0; k < N; ++k) inner_stride[k] = views[k]->strides[nd - 1];
  for (std::int64_t outer = 0; outer < n / inner; ++outer) {
    std::int64_t base[N];
    for (int k = 0; k < N; ++k) base[k] = off[k];
    for (std::int64_t j = 0; j < inner; ++j) {
      f(off);
      for (int k = 0; k < N; ++k) off[k] += inner_stride[k];
    }
    for (int k = 0; k < N; ++k) off[k] = base[k];
    for (int d = nd - 2; d >= 0; --d) {  // advance the outer counter
      ++idx[d];
      for (int k = 0; k < N; ++k) off[k] += views[k]->strides[d];
      if (idx[d] < v0.shape[d]) break;
      for (int k = 0; k < N; ++k) off[k] -= views[k]->strides[d] * v0.shape[d];
      idx[d] = 0;
    }
  }
}

template <class T, class F>
void unary_loop(const StridedView& out, const StridedView& in, F f) {
  using C = compute_t<T>;
  T* o = out.ptr<T>();
  const T* x = in.ptr<T>();
  const StridedView* views[2] = {&out, &in};
  for_each(views, [&](const std::int64_t* off) {
    o[off[0]] = static_cast<T>(f(static_cast<C>(x[off[1]])));
  });
}

template <class F>
void unary_any(const StridedView& out, const StridedView& in, F f) {
  dispatch_all(in.dtype, [&]<class T>() { unary_loop<T>(out, in, f); });
}

// Activations and their backward rules, which the ops allow on floating dtypes only.
template <class F>
void unary_floating(const StridedView& out, const StridedView& in, F f) {
  dispatch_float(in.dtype, "unary", [&]<class T>() { unary_loop<T>(out, in, f); });
}

template <class T, class R, class F>
void binary_loop(const StridedView& out, const StridedView& a, const StridedView& b, F f) {
  using C = compute_t<T>;
  R* o = out.ptr<R>();
  const T* x = a.ptr<T>();
  const T* y = b.ptr<T>();
  const StridedView* views[3] = {&out, &a, &b};
  for_each(views, [&](const std::int64_t* off) {
    o[off[0]] = static_cast<R>(f(static_cast<C>(x[off[1]]), static_cast<C>(y[off[2]])));
  });
}

template <class F>
void binary_same(const StridedView& out, const StridedView& a, const StridedView& b, F f) {
  dispatch_all(a.dtype, [&]<class T>() { binary_loop<T, T>(out, a, b, f); });
}

template <class F>
void binary_floating(const StridedView& out, const StridedView& a, const StridedView& b, F f) {
  dispatch_float(a.dtype, "binary", [&]<class T>() { binary_loop<T, T>(out, a, b, f); });
}

template <class F>
void binary_bool(const StridedView& out, const StridedView& a, const StridedView& b, F f) {
  dispatch_all(a.dtype, [&]<class T>() { binary_loop<T, bool>(out, a, b, f); });
}

// Note [Vectorized GELU]: GELU (tanh) and its backward over contiguous views with f32 math (f32,
// f16 and bf16 storage) run as Eigen array expressions, chunk by chunk, so that exp is
// vectorized; the scalar loop (a libm exp per element and an unpredictable branch on the sign in
// the stable sigmoid) made the GELU pair a quarter of a small GPT's CPU step. The expressions are
// ops::GeluTanh's and ops::GeluTanhBackward's, term for term and in the same order (the sigmoid's
// two branches become one exp of -|z| and a select), so they differ from the scalar functors,
// which the CUDA kernels run, only through exp: its last bits, and exps below f32's smallest
// normal, taken as zero (tests/core/test_ops_elementwise.cpp checks the two against each other,
// in a -march=native build and in a portable one). f64, the reference dtype of gradchecks, keeps
// the scalar loop.
// The stable sigmoid, 0 where z is at or below log of C's smallest normal: there Eigen's exp
// flushes to zero with some instruction sets and clamps its input (giving about that normal, even
// for -inf) with others, and zero gives every build the same results (NaN still comes through x
// in the callers). Eigen evaluates select coefficient by coefficient, so the exps are evaluated
// before it, in packets.
template <class C, class X>
chunks::ChunkValue<C> stable_sigmoid(const X& z) {
  static const C log_min_normal = std::log(std::numeric_limits<C>::min());
  const chunks::ChunkValue<C> e = (-z.abs()).exp();
  return (z >= C(0)).select(C(1) / (C(1) + e),
                            (z > log_min_normal).select(e / (C(1) + e), C(0)));
}

// Calls f(i0, len) over chunks of n elements, in parallel when n is large (each chunk written by
// one thread, so results do not depend on the thread count).
template <class F>
void parallel_chunks(std::int64_t n, F&& f) {
  const std::int64_t count = (n + chunks::kChunk - 1) / chunks::kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (std::int64_t c = 0; c < count; ++c) {
    const std::int64_t i0 = c * chunks::kChunk;
    f(i0, std::min(chunks::kChunk, n - i0));
  }
}

// Whether the vectorized GELU loops take these views: contiguous, with f32 math.
bool vectorized_gelu(std::initializer_list<const StridedView*> views) {
  for (const StridedView* v : views) {
    if (!v->is_contiguous() || v->dtype == DType::f64) return false;
  }
  return true;
}

void gelu_tanh_forward(const StridedView& out, const StridedView& in) {
  dispatch_float(in.dtype, "gelu", [&]<class T>() {
    using C = compute_t<T>;
    parallel_chunks(in.numel(), [&](std::int64_t i0, std::int64_t len) {
      C buf[chunks::kChunk];
      const auto x = chunks::load(in.ptr<T>() + i0, len, buf);
      const chunks::ChunkValue<C> u =
          C(ops::kSqrt2OverPi) * (x + C(ops::kGeluCoeff) * x * x * x);
      const chunks::ChunkValue<C> s = stable_sigmoid<C>(C(2) * u);
      chunks::store(out.ptr<T>() + i0, x * s);
    });
  });
}

void gelu_tanh_backward(const StridedView& out, const StridedView& in, const StridedView& grad) {
  dispatch_float(in.dtype, "gelu", [&]<class T>() {
    using C = compute_t<T>;
    parallel_chunks(in.numel(), [&](std::int64_t i0, std::int64_t len) {
      C xbuf[chunks::kChunk], gbuf[chunks::kChunk];
      const auto x = chunks::load(in.ptr<T>() + i0, len, xbuf);
      const auto dy = chunks::load(grad.ptr<T>() + i0, len, gbuf);
      const chunks::ChunkValue<C> x2 = x * x;
      const chunks::ChunkValue<C> u = C(ops::kSqrt2OverPi) * (x + C(ops::kGeluCoeff) * x2 * x);
      const chunks::ChunkValue<C> s = stable_sigmoid<C>(C(2) * u);
      const chunks::ChunkValue<C> du =
          C(ops::kSqrt2OverPi) * (C(1) + C(3.0 * ops::kGeluCoeff) * x2);
      chunks::store(out.ptr<T>() + i0, dy * (s + C(2) * x * s * (C(1) - s) * du));
    });
  });
}

}  // namespace

void unary(UnaryOp op, const StridedView& out, const StridedView& in) {
  switch (op) {
    case UnaryOp::Neg: return unary_any(out, in, ops::Neg{});
    case UnaryOp::Exp: return unary_any(out, in, ops::Exp{});
    case UnaryOp::Log: return unary_any(out, in, ops::Log{});
    case UnaryOp::Sqrt: return unary_any(out, in, ops::Sqrt{});
    case UnaryOp::Rsqrt: return unary_any(out, in, ops::Rsqrt{});
    case UnaryOp::Abs: return unary_any(out, in, ops::Abs{});
    case UnaryOp::Tanh: return unary_floating(out, in, ops::Tanh{});
    case UnaryOp::Sigmoid: return unary_floating(out, in, ops::Sigmoid{});
    case UnaryOp::Relu: return unary_any(out, in, ops::Relu{});
    case UnaryOp::GeluErf: return unary_floating(out, in, ops::GeluErf{});
    case UnaryOp::GeluTanh:
      if (vectorized_gelu({&out, &in})) return gelu_tanh_forward(out, in);  // Note [Vectorized GELU]
      return unary_floating(out, in, ops::GeluTanh{});
    case UnaryOp::Silu: return unary_floating(out, in, ops::Silu{});
  }
}

void binary(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b) {
  switch (op) {
    case BinaryOp::Add: return binary_same(out, a, b, ops::Add{});
    case BinaryOp::Sub: return binary_same(out, a, b, ops::Sub{});
    case BinaryOp::Mul: return binary_same(out, a, b, ops::Mul{});
    case BinaryOp::Div: return binary_floating(out, a, b, ops::Div{});
    case BinaryOp::Pow: return binary_same(out, a, b, ops::Pow{});
    case BinaryOp::Maximum: return binary_same(out, a, b, ops::Maximum{});
    case BinaryOp::Minimum: return binary_same(out, a, b, ops::Minimum{});
    case BinaryOp::Eq: return binary_bool(out, a, b, ops::Eq{});
    case BinaryOp::Ne: return binary_bool(out, a, b, ops::Ne{});
    case BinaryOp::Lt: return binary_bool(out, a, b, ops::Lt{});
    case BinaryOp::Le: return binary_bool(out, a, b, ops::Le{});
    case BinaryOp::Gt: return binary_bool(out, a, b, ops::Gt{});
    case BinaryOp::Ge: return binary_bool(out, a, b, ops::Ge{});
    case BinaryOp::ReluBackward: return binary_same(out, a, b, ops::ReluBackward{});
    case BinaryOp::GeluErfBackward: return binary_floating(out, a, b, ops::GeluErfBackward{});
    case BinaryOp::GeluTanhBackward:
      if (vectorized_gelu({&out, &a, &b})) return gelu_tanh_backward(out, a, b);
      return binary_floating(out, a, b, ops::GeluTanhBackward{});
    case BinaryOp::SiluBackward: return binary_floating(out, a, b, ops::SiluBackward{});
    case BinaryOp::SigmoidBackward: return binary_floating(out, a, b, ops::SigmoidBackward{});
    case BinaryOp::TanhBackward: return binary_floating(out, a, b, ops::TanhBackward{});
  }
}

void where(const StridedView& out, const StridedView& cond, const StridedView& a,
           const StridedView& b) {
  dispatch_all(a.dtype, [&]<class T>() {
    T* o = out.ptr<T>();
    const bool* c = cond.ptr<bool>();
    const T* x = a.ptr<T>();
    const T* y = b.ptr<T>();
    const StridedView* views[4] = {&out, &cond, &a, &b};
    for_each(views, [&](const std::int64_t* off) { o[off[0]] = c[off[1]] ? x[off[2]] : y[off[3]]; });
  });
}

void copy(const StridedView& out, const StridedView& in) {
  if (out.numel() == 0) return;  // an empty tensor may have no data pointer, even for memcpy
  if (out.dtype == in.dtype && out.is_contiguous() && in.is_contiguous()) {
    std::memcpy(out.data, in.data, static_cast<std::size_t>(out.numel()) * dtype_size(out.dtype));
    return;
  }
  dispatch_all(out.dtype, [&]<class O>() {
    dispatch_all(in.dtype, [&]<class I>() {
      O* o = out.ptr<O>();
      const I* x = in.ptr<I>();
      const StridedView* views[2] = {&out, &in};
      for_each(views, [&](const std::int64_t* off) {
        if constexpr (std::is_same_v<O, bool>) {
          o[off[0]] = static_cast<double>(x[off[1]]) != 0.0;
        } else {
          o[off[0]] = static_cast<O>(static_cast<compute_t<O>>(static_cast<compute_t<I>>(x[off[1]])));
        }
      });
    });
  });
}

void fill(const StridedView& out, double value) {
  dispatch_all(out.dtype, [&]<class T>() {
    T* o = out.ptr<T>();
    const T v = static_cast<T>(static_cast<compute_t<T>>(value));
    const StridedView* views[1] = {&out};
    for_each(views, [&](const std::int64_t* off) { o[off[0]] = v; });
  });
}

void accumulate(const StridedView& dst, const StridedView& src, double weight) {
  dispatch_float(dst.dtype, "accumulate", [&]<class D>() {
    dispatch_float(src.dtype, "accumulate", [&]<class S>() {
      using C = compute_t<D>;
      D* d = dst.ptr<D>();
      const S* s = src.ptr<S>();
      const C w = static_cast<C>(weight);
      const StridedView* views[2] = {&dst, &src};
      if (weight == 1.0) {
        for_each(views, [&](const std::int64_t* off) {
          d[off[0]] = static_cast<D>(static_cast<C>(d[off[0]]) + static_cast<C>(static_cast<compute_t<S>>(s[off[1]])));
        });
      } else {
        for_each(views, [&](const std::int64_t* off) {
          d[off[0]] = static_cast<D>(static_cast<C>(d[off[0]]) + w * static_cast<C>(static_cast<compute_t<S>>(s[off[1]])));
        });
      }
    });
  });
}

namespace {
template <class F>
void fill_indexed(const StridedView& out, F f) {
  dispatch_float(out.dtype, "rand", [&]<class T>() {
    T* o = out.ptr<T>();
    const StridedView* views[1] = {&out};
    if (out.is_contiguous()) {  // the offset is the row-major index; the loop may run in parallel
      for_each(views, [&](const std::int64_t* off) {
        o[off[0]] = static_cast<T>(static_cast<compute_t<T>>(f(off[0])));
      });
      return;
    }
    std::int64_t i = 0;  // strided: for_each walks row-major order on one thread
    for_each(views, [&](const std::int64_t* off) {
      o[off[0]] = static_cast<T>(static_cast<compute_t<T>>(f(i)));
      ++i;
    });
  });
}
}  // namespace

void rand_uniform(const StridedView& out, PhiloxArgs philox) {
  const int bits = uniform_bits(out.dtype);
  fill_indexed(out, [&](std::int64_t i) {
    PhiloxBlock b = philox4x32(philox.offset + static_cast<std::uint64_t>(i / 4), philox.seed);
    return uniform_truncated(uniform_from_bits(b.v[i % 4]), bits);
  });
}

void rand_normal(const StridedView& out, PhiloxArgs philox) {
  fill_indexed(out, [&](std::int64_t i) {
    PhiloxBlock b = philox4x32(philox.offset + static_cast<std::uint64_t>(i / 2), philox.seed);
    int lane = 2 * static_cast<int>(i % 2);
    return normal_from_bits(b.v[lane], b.v[lane + 1]);  // Note [Portable normals] in core/rng.h
  });
}

void dropout_mask(const StridedView& out, PhiloxArgs philox, double p) {
  const double scale = 1.0 / (1.0 - p);
  fill_indexed(out, [&](std::int64_t i) {
    PhiloxBlock b = philox4x32(philox.offset + static_cast<std::uint64_t>(i / 4), philox.seed);
    return static_cast<double>(uniform_from_bits(b.v[i % 4])) >= p ? scale : 0.0;
  });
}

}  // namespace microbatch::kernels::cpu
