// CUDA element-wise kernels: unary, binary, where, copy (any dtype pair), fill and the Philox
// random fills. Outputs are overwritten.
//
// One map kernel applies an element function to N operand views of one shape (broadcast dims
// carry stride 0), in the first of three forms that fits:
// - vectorized: every operand contiguous, of one floating type and 16-byte aligned (checked at
//   run time): each thread moves 16 bytes per operand at a time;
// - contiguous: offset == index for every operand;
// - strided: offsets from kernels/indexer.h, whose merged dims keep the divisions few.
// The math is the functors of kernels/elementwise_ops.h in compute_t, as in the CPU loops, so the
// two backends differ only by the rounding of the device's math functions.
#include <cstdint>
#include <type_traits>
#include <utility>

#include "core/rng.h"
#include "kernels/cuda/common.cuh"
#include "kernels/elementwise.h"
#include "kernels/elementwise_ops.h"
#include "kernels/indexer.h"

namespace microbatch::kernels::cuda {

namespace {

template <int N>
struct Pointers {
  void* data[N];  // [0] is the output
};

template <class T>
struct alignas(16) Pack {
  T v[16 / sizeof(T)];
};

template <class T>
inline constexpr bool kFloatingStorage = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                         std::is_same_v<T, f16> || std::is_same_v<T, bf16>;

// ---- element functions: storage types in, storage type out, math in compute_t ----------------

template <class T, class R, class F>
struct UnaryFn {
  F f;
  __device__ R operator()(T x) const { return static_cast<R>(f(static_cast<compute_t<T>>(x))); }
};

template <class T, class R, class F>
struct BinaryFn {
  F f;
  __device__ R operator()(T a, T b) const {
    return static_cast<R>(f(static_cast<compute_t<T>>(a), static_cast<compute_t<T>>(b)));
  }
};

template <class T>
struct WhereFn {
  __device__ T operator()(bool c, T a, T b) const { return c ? a : b; }
};

// Converts as the CPU copy does: through both compute types; to bool, "is nonzero".
template <class O, class I>
struct ConvertFn {
  __device__ O operator()(I x) const {
    if constexpr (std::is_same_v<O, bool>) {
      return static_cast<double>(x) != 0.0;
    } else {
      return static_cast<O>(static_cast<compute_t<O>>(static_cast<compute_t<I>>(x)));
    }
  }
};

// Same-dtype copies move bits (NaN payloads included), by element size.
template <class T>
struct IdentityFn {
  __device__ T operator()(T x) const { return x; }
};

// ---- the map kernels ---------------------------------------------------------------------------

template <class R, class... In, class Op, std::size_t... K>
__device__ __forceinline__ void apply_at(const Op& op, const Pointers<1 + sizeof...(In)>& p,
                                         const std::int64_t* off, std::index_sequence<K...>) {
  static_cast<R*>(p.data[0])[off[0]] = op(static_cast<const In*>(p.data[K + 1])[off[K + 1]]...);
}

template <class Op, class R, class... In>
__global__ void map_contiguous(Op op, Pointers<1 + sizeof...(In)> p, std::int64_t n) {
  constexpr int N = 1 + sizeof...(In);
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    std::int64_t off[N];
    for (int k = 0; k < N; ++k) off[k] = i;
    apply_at<R, In...>(op, p, off, std::index_sequence_for<In...>{});
  }
}

template <class Op, class R, class... In>
__global__ void map_strided(Op op, Pointers<1 + sizeof...(In)> p, Indexer<1 + sizeof...(In)> ix,
                            std::int64_t n) {
  constexpr int N = 1 + sizeof...(In);
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    std::int64_t off[N];
    ix.offsets(i, off);
    apply_at<R, In...>(op, p, off, std::index_sequence_for<In...>{});
  }
}

template <class T, int M, class Op, std::size_t... K>
__device__ __forceinline__ T apply_values(const Op& op, const T (&x)[M],
                                          std::index_sequence<K...>) {
  return op(x[K]...);
}

// M inputs and the output all of type T, contiguous and 16-byte aligned: whole packs first, then
// the n % V elements left over, one per thread.
template <class Op, class T, int M>
__global__ void map_vectorized(Op op, Pointers<1 + M> p, std::int64_t n) {
  constexpr int V = 16 / sizeof(T);
  const std::int64_t packs = n / V;
  for (std::int64_t i = global_thread(); i < packs; i += grid_threads()) {
    Pack<T> in[M];
    for (int k = 0; k < M; ++k) in[k] = static_cast<const Pack<T>*>(p.data[k + 1])[i];
    Pack<T> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      T x[M];
      for (int k = 0; k < M; ++k) x[k] = in[k].v[j];
      out.v[j] = apply_values(op, x, std::make_index_sequence<M>{});
    }
    static_cast<Pack<T>*>(p.data[0])[i] = out;
  }
  for (std::int64_t i = packs * V + global_thread(); i < n; i += grid_threads()) {
    T x[M];
    for (int k = 0; k < M; ++k) x[k] = static_cast<const T*>(p.data[k + 1])[i];
    static_cast<T*>(p.data[0])[i] = apply_values(op, x, std::make_index_sequence<M>{});
  }
}

template <int N>
bool aligned16(const Pointers<N>& p) {
  for (int k = 0; k < N; ++k) {
    if (reinterpret_cast<std::uintptr_t>(p.data[k]) % 16 != 0) return false;
  }
  return true;
}

// out[c] = op(in_0[c], ...) for every coordinate c of out's shape; views[0] is out (type R),
// views[k + 1] has type In_k.
template <class R, class... In, class Op>
void map(const char* name, const Op& op, const StridedView* const (&views)[1 + sizeof...(In)]) {
  constexpr int N = 1 + sizeof...(In);
  const std::int64_t n = views[0]->numel();
  if (n == 0) return;
  Pointers<N> p;
  for (int k = 0; k < N; ++k) p.data[k] = views[k]->data;
  const Indexer<N> ix = make_indexer(views);
  cudaStream_t stream = current_stream();
  if (!ix.is_contiguous()) {
    map_strided<Op, R, In...><<<grid_for(n, kThreads), kThreads, 0, stream>>>(op, p, ix, n);
  } else if constexpr (kFloatingStorage<R> && (std::is_same_v<In, R> && ...)) {
    if (aligned16(p)) {
      map_vectorized<Op, R, N - 1>
          <<<grid_for(ceil_div(n, 16 / sizeof(R)), kThreads), kThreads, 0, stream>>>(op, p, n);
    } else {
      map_contiguous<Op, R, In...><<<grid_for(n, kThreads), kThreads, 0, stream>>>(op, p, n);
    }
  } else {
    map_contiguous<Op, R, In...><<<grid_for(n, kThreads), kThreads, 0, stream>>>(op, p, n);
  }
  MB_CUDA_CHECK_LAUNCH(name);
}

// ---- generated values: out[c] = g(row-major index of c) -----------------------------------------

// A generator yields kPerBlock consecutive values from one Philox block (or any source indexed
// the same way): values[j] is element block * kPerBlock + j.
template <class T, class G>
__global__ void generate_contiguous(T* out, std::int64_t n, G g) {
  constexpr int P = G::kPerBlock;
  const std::int64_t blocks = ceil_div(n, P);
  for (std::int64_t b = global_thread(); b < blocks; b += grid_threads()) {
    double values[P];
    g(b, values);
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const std::int64_t i = b * P + j;
      if (i < n) out[i] = static_cast<T>(static_cast<compute_t<T>>(values[j]));
    }
  }
}

template <class T, class G>
__global__ void generate_strided(T* out, Indexer<1> ix, std::int64_t n, G g) {
  constexpr int P = G::kPerBlock;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    double values[P];
    g(i / P, values);
    std::int64_t off[1];
    ix.offsets(i, off);
    double v = values[0];
#pragma unroll
    for (int j = 1; j < P; ++j) v = i % P == j ? values[j] : v;  // no local-memory indexing
    out[off[0]] = static_cast<T>(static_cast<compute_t<T>>(v));
  }
}

template <class G>
void generate(const char* name, const StridedView& out, const G& g) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  const StridedView* const views[1] = {&out};
  const Indexer<1> ix = make_indexer(views);
  cudaStream_t stream = current_stream();
  dispatch_float(out.dtype, name, [&]<class T>() {
    T* o = out.ptr<T>();
    if (ix.is_contiguous()) {
      generate_contiguous<T>
          <<<grid_for(ceil_div(n, G::kPerBlock), kThreads), kThreads, 0, stream>>>(o, n, g);
    } else {
      generate_strided<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(o, ix, n, g);
    }
  });
  MB_CUDA_CHECK_LAUNCH(name);
}

// Element i = uniform of lane i % 4 of block offset + i / 4 (core/rng.h).
struct UniformGen {
  static constexpr int kPerBlock = 4;
  PhiloxArgs philox;
  int bits;  // uniform_bits of the output dtype
  __device__ void operator()(std::int64_t block, double* values) const {
    const PhiloxBlock b =
        philox4x32(philox.offset + static_cast<std::uint64_t>(block), philox.seed);
    for (int j = 0; j < 4; ++j) values[j] = uniform_truncated(uniform_from_bits(b.v[j]), bits);
  }
};

// Element i = normal from lanes 2(i % 2), 2(i % 2) + 1 of block offset + i / 2.
struct NormalGen {
  static constexpr int kPerBlock = 2;
  PhiloxArgs philox;
  __device__ void operator()(std::int64_t block, double* values) const {
    const PhiloxBlock b =
        philox4x32(philox.offset + static_cast<std::uint64_t>(block), philox.seed);
    values[0] = normal_from_bits(b.v[0], b.v[1]);
    values[1] = normal_from_bits(b.v[2], b.v[3]);
  }
};

// The uniform draw kept or dropped: (u >= p) ? scale : 0, compared in double as on the CPU.
struct DropoutGen {
  static constexpr int kPerBlock = 4;
  PhiloxArgs philox;
  double p;
  double scale;
  __device__ void operator()(std::int64_t block, double* values) const {
    const PhiloxBlock b =
        philox4x32(philox.offset + static_cast<std::uint64_t>(block), philox.seed);
    for (int j = 0; j < 4; ++j) {
      values[j] = static_cast<double>(uniform_from_bits(b.v[j])) >= p ? scale : 0.0;
    }
  }
};

template <class T>
__global__ void fill_kernel(T* out, Indexer<1> ix, std::int64_t n, T value) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    std::int64_t off[1];
    ix.offsets(i, off);
    out[off[0]] = value;
  }
}

// abs of an unsigned type (u8, bool) is the value itself; ops::Abs would compare it with zero.
struct AbsAny {
  template <class T>
  __device__ T operator()(T x) const {
    if constexpr (std::is_unsigned_v<T>) {
      return x;
    } else {
      return ops::Abs{}(x);
    }
  }
};

// ---- dispatch helpers --------------------------------------------------------------------------

template <class F>
void unary_all(const char* name, const StridedView& out, const StridedView& in, F f) {
  const StridedView* const views[2] = {&out, &in};
  dispatch_all(in.dtype, [&]<class T>() { map<T, T>(name, UnaryFn<T, T, F>{f}, views); });
}

template <class F>
void unary_float(const char* name, const StridedView& out, const StridedView& in, F f) {
  const StridedView* const views[2] = {&out, &in};
  dispatch_float(in.dtype, name, [&]<class T>() { map<T, T>(name, UnaryFn<T, T, F>{f}, views); });
}

template <class F>
void binary_all(const char* name, const StridedView& out, const StridedView& a,
                const StridedView& b, F f) {
  const StridedView* const views[3] = {&out, &a, &b};
  dispatch_all(a.dtype, [&]<class T>() { map<T, T, T>(name, BinaryFn<T, T, F>{f}, views); });
}

template <class F>
void binary_float(const char* name, const StridedView& out, const StridedView& a,
                  const StridedView& b, F f) {
  const StridedView* const views[3] = {&out, &a, &b};
  dispatch_float(a.dtype, name,
                 [&]<class T>() { map<T, T, T>(name, BinaryFn<T, T, F>{f}, views); });
}

template <class F>
void compare(const char* name, const StridedView& out, const StridedView& a, const StridedView& b,
             F f) {
  const StridedView* const views[3] = {&out, &a, &b};
  dispatch_all(a.dtype, [&]<class T>() { map<bool, T, T>(name, BinaryFn<T, bool, F>{f}, views); });
}

// The unsigned integer of a dtype's size: same-dtype copies move bits.
template <class F>
void dispatch_bits(std::size_t bytes, F&& f) {
  switch (bytes) {
    case 1:
      return f.template operator()<std::uint8_t>();
    case 2:
      return f.template operator()<std::uint16_t>();
    case 4:
      return f.template operator()<std::uint32_t>();
    case 8:
      return f.template operator()<std::uint64_t>();
  }
  MB_ASSERT(false, "no {}-byte element type", bytes);
}

}  // namespace

void unary(UnaryOp op, const StridedView& out, const StridedView& in) {
  switch (op) {
    case UnaryOp::Neg:
      return unary_all("neg", out, in, ops::Neg{});
    case UnaryOp::Abs:
      return unary_all("abs", out, in, AbsAny{});
    case UnaryOp::Relu:
      return unary_all("relu", out, in, ops::Relu{});
    case UnaryOp::Exp:
      return unary_float("exp", out, in, ops::Exp{});
    case UnaryOp::Log:
      return unary_float("log", out, in, ops::Log{});
    case UnaryOp::Sqrt:
      return unary_float("sqrt", out, in, ops::Sqrt{});
    case UnaryOp::Rsqrt:
      return unary_float("rsqrt", out, in, ops::Rsqrt{});
    case UnaryOp::Tanh:
      return unary_float("tanh", out, in, ops::Tanh{});
    case UnaryOp::Sigmoid:
      return unary_float("sigmoid", out, in, ops::Sigmoid{});
    case UnaryOp::GeluErf:
      return unary_float("gelu", out, in, ops::GeluErf{});
    case UnaryOp::GeluTanh:
      return unary_float("gelu", out, in, ops::GeluTanh{});
    case UnaryOp::Silu:
      return unary_float("silu", out, in, ops::Silu{});
  }
}

void binary(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b) {
  switch (op) {
    case BinaryOp::Add:
      return binary_all("add", out, a, b, ops::Add{});
    case BinaryOp::Sub:
      return binary_all("sub", out, a, b, ops::Sub{});
    case BinaryOp::Mul:
      return binary_all("mul", out, a, b, ops::Mul{});
    case BinaryOp::Div:
      return binary_float("div", out, a, b, ops::Div{});
    case BinaryOp::Maximum:
      return binary_all("maximum", out, a, b, ops::Maximum{});
    case BinaryOp::Minimum:
      return binary_all("minimum", out, a, b, ops::Minimum{});
    case BinaryOp::Pow:
      return binary_float("pow", out, a, b, ops::Pow{});
    case BinaryOp::Eq:
      return compare("eq", out, a, b, ops::Eq{});
    case BinaryOp::Ne:
      return compare("ne", out, a, b, ops::Ne{});
    case BinaryOp::Lt:
      return compare("lt", out, a, b, ops::Lt{});
    case BinaryOp::Le:
      return compare("le", out, a, b, ops::Le{});
    case BinaryOp::Gt:
      return compare("gt", out, a, b, ops::Gt{});
    case BinaryOp::Ge:
      return compare("ge", out, a, b, ops::Ge{});
    case BinaryOp::ReluBackward:
      return binary_float("relu", out, a, b, ops::ReluBackward{});
    case BinaryOp::GeluErfBackward:
      return binary_float("gelu", out, a, b, ops::GeluErfBackward{});
    case BinaryOp::GeluTanhBackward:
      return binary_float("gelu", out, a, b, ops::GeluTanhBackward{});
    case BinaryOp::SiluBackward:
      return binary_float("silu", out, a, b, ops::SiluBackward{});
    case BinaryOp::SigmoidBackward:
      return binary_float("sigmoid", out, a, b, ops::SigmoidBackward{});
    case BinaryOp::TanhBackward:
      return binary_float("tanh", out, a, b, ops::TanhBackward{});
  }
}

void where(const StridedView& out, const StridedView& cond, const StridedView& a,
           const StridedView& b) {
  const StridedView* const views[4] = {&out, &cond, &a, &b};
  dispatch_all(a.dtype, [&]<class T>() { map<T, bool, T, T>("where", WhereFn<T>{}, views); });
}

void copy(const StridedView& out, const StridedView& in) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  const StridedView* const views[2] = {&out, &in};
  if (out.dtype == in.dtype) {
    if (out.is_contiguous() && in.is_contiguous()) {
      MB_CUDA_CHECK(cudaMemcpyAsync(out.data, in.data,
                                    static_cast<std::size_t>(n) * dtype_size(out.dtype),
                                    cudaMemcpyDeviceToDevice, current_stream()));
      return;
    }
    dispatch_bits(dtype_size(out.dtype),
                  [&]<class B>() { map<B, B>("copy", IdentityFn<B>{}, views); });
    return;
  }
  dispatch_all(out.dtype, [&]<class O>() {
    dispatch_all(in.dtype, [&]<class I>() { map<O, I>("copy", ConvertFn<O, I>{}, views); });
  });
}

void fill(const StridedView& out, double value) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  const StridedView* const views[1] = {&out};
  const Indexer<1> ix = make_indexer(views);
  dispatch_all(out.dtype, [&]<class T>() {
    const T v = static_cast<T>(static_cast<compute_t<T>>(value));  // converted as the CPU does
    fill_kernel<T>
        <<<grid_for(n, kThreads), kThreads, 0, current_stream()>>>(out.ptr<T>(), ix, n, v);
  });
  MB_CUDA_CHECK_LAUNCH("fill");
}

void rand_uniform(const StridedView& out, PhiloxArgs philox) {
  generate("rand", out, UniformGen{philox, uniform_bits(out.dtype)});
}

void rand_normal(const StridedView& out, PhiloxArgs philox) {
  generate("randn", out, NormalGen{philox});
}

void dropout_mask(const StridedView& out, PhiloxArgs philox, double p) {
  generate("dropout", out, DropoutGen{philox, p, 1.0 / (1.0 - p)});
}

}  // namespace microbatch::kernels::cuda
