// Device-side helpers shared by the CUDA kernels: element loads and stores in the compute type,
// strided offsets, grid-stride loops, warp and block reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "core/half.h"
#include "kernels/cuda/runtime.h"
#include "kernels/elementwise_ops.h"
#include "kernels/view.h"

namespace microbatch::kernels::cuda {

inline constexpr int kThreads = 256;
inline constexpr unsigned kFullMask = 0xffffffffu;

/// Element offset (in elements) of the row-major `linear`-th coordinate of a view.
__device__ __forceinline__ std::int64_t strided_offset(const StridedView& v, std::int64_t linear) {
  std::int64_t off = 0;
  for (int d = v.ndim - 1; d >= 0; --d) {
    const std::int64_t n = v.shape[d];
    off += (linear % n) * v.strides[d];
    linear /= n;
  }
  return off;
}

/// Loads element `offset` of a T array as its compute type (f32 for 16-bit storage).
template <class T>
__device__ __forceinline__ compute_t<T> load(const void* data, std::int64_t offset) {
  return static_cast<compute_t<T>>(static_cast<const T*>(data)[offset]);
}

template <class T>
__device__ __forceinline__ void store(void* data, std::int64_t offset, compute_t<T> value) {
  static_cast<T*>(data)[offset] = static_cast<T>(value);
}

/// d + w * x in D's compute type, the product rounded first, then the sum: the gradient
/// accumulation of Note [Gradient writes] (core/autograd.h) as the CPU's loops compute it. The
/// explicit roundings keep nvcc from fusing the two into one multiply-add, whose single rounding
/// would differ from the CPU's in the last bit.
template <class D>
__device__ __forceinline__ D add_weighted(D d, compute_t<D> x, compute_t<D> w) {
  using C = compute_t<D>;
  if constexpr (std::is_same_v<C, double>) {
    return static_cast<D>(__dadd_rn(static_cast<C>(d), __dmul_rn(w, x)));
  } else {
    return static_cast<D>(__fadd_rn(static_cast<C>(d), __fmul_rn(w, x)));
  }
}

/// Grid-stride loop index helpers.
__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_threads() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

/// max(a, b) with NaN winning, as torch.maximum and the CPU kernels (ops::Maximum).
template <class T>
__device__ __forceinline__ T max_nan(T a, T b) {
  return ops::Maximum{}(a, b);
}

template <class T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
/// `scratch` holds 32 values in shared memory; the call synchronises the block twice.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  T total = lane < warps ? scratch[lane] : T(0);
  return warp_sum(total);
}

}  // namespace microbatch::kernels::cuda
