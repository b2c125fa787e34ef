// dst += weight * src: the sink of parameter gradients (Note [Gradient writes] in
// core/autograd.h). It accumulates, never overwrites: a window's micro-batches add their weighted
// shares into the f32 (or f64, or 16-bit) gradient arena. Math as cpu::accumulate, in
// compute_t<dst> (f32 for 16-bit accumulators).
//
// Contiguous operands take the vector path: a scalar head brings dst to a 16-byte boundary, packs
// of 16 / min(sizeof dst, sizeof src) elements move as 128-bit words, a scalar tail ends it (all
// scalar when src cannot be aligned by the same head). Any other layout takes the strided path.
// With stats, the pass also reduces the updated values (Note [One-launch reduction]), so the last
// micro-batch of a window can yield its norm and non-finite flag without a second read.
#include <type_traits>

#include "kernels/cuda/grad_stats.cuh"
#include "kernels/elementwise.h"

namespace microbatch::kernels::cuda {

namespace {

// The product and the sum are rounded separately, as the CPU loop writes them: nvcc would fuse them
// into one multiply-add, whose single rounding differs from the CPU's in the last bit.
template <class D, class S>
__device__ __forceinline__ D accumulate_one(D d, S s, compute_t<D> w) {
  using C = compute_t<D>;
  const C x = static_cast<C>(static_cast<compute_t<S>>(s));
  if constexpr (std::is_same_v<C, double>) {
    return static_cast<D>(__dadd_rn(static_cast<C>(d), __dmul_rn(w, x)));
  } else {
    return static_cast<D>(__fadd_rn(static_cast<C>(d), __fmul_rn(w, x)));
  }
}

template <class D>
__device__ __forceinline__ double stat_value(D d) {
  return static_cast<double>(static_cast<compute_t<D>>(d));
}

template <class D, class S>
__global__ void accumulate_contiguous_kernel(D* dst, const S* src, compute_t<D> w, PackSplit split,
                                             GradStatsBuffer* stats) {
  constexpr int kPack = kPackOf<D, S>;
  StatsAccumulator acc;
  const std::int64_t packs = split.packs();
  const std::int64_t stride = grid_threads();
  for (std::int64_t p = global_thread(); p < packs; p += stride) {
    const std::int64_t i = split.pack_start(p);
    Pack<D, kPack> d = load_pack<D, kPack>(dst + i);
    const Pack<S, kPack> s = load_pack<S, kPack>(src + i);
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      d.v[k] = accumulate_one(d.v[k], s.v[k], w);
      if (stats != nullptr) acc.add(stat_value(d.v[k]), i + k);
    }
    store_pack(dst + i, d);
  }
  for (std::int64_t j = global_thread(); j < split.scalar_count(); j += stride) {  // head and tail
    const std::int64_t i = split.scalar_index(j);
    dst[i] = accumulate_one(dst[i], src[i], w);
    if (stats != nullptr) acc.add(stat_value(dst[i]), i);
  }
  if (stats != nullptr) finish_stats(acc, stats);  // uniform branch: every thread or none
}

template <class D, class S>
__global__ void accumulate_strided_kernel(StridedView dst, StridedView src, compute_t<D> w, std::int64_t n,
                                          GradStatsBuffer* stats) {
  D* d = static_cast<D*>(dst.data);
  const S* s = static_cast<const S*>(src.data);
  StatsAccumulator acc;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const std::int64_t od = strided_offset(dst, i);
    d[od] = accumulate_one(d[od], s[strided_offset(src, i)], w);
    if (stats != nullptr) acc.add(stat_value(d[od]), i);
  }
  if (stats != nullptr) finish_stats(acc, stats);
}

}  // namespace

void accumulate(const StridedView& dst, const StridedView& src, double weight, GradStatsBuffer* stats) {
  const std::int64_t n = dst.numel();
  MB_CHECK(src.numel() == n, "[accumulate] dst has {} elements, src {}", n, src.numel());
  if (n == 0 && stats == nullptr) return;
  cudaStream_t stream = current_stream();
  dispatch_float(dst.dtype, "accumulate", [&]<class D>() {
    dispatch_float(src.dtype, "accumulate", [&]<class S>() {
      const auto w = static_cast<compute_t<D>>(weight);
      if (dst.is_contiguous() && src.is_contiguous()) {
        const PackSplit split = pack_split(n, kPackOf<D, S>, address_of<D>(dst.data), {address_of<S>(src.data)});
        constexpr auto kernel = &accumulate_contiguous_kernel<D, S>;
        const unsigned grid = resident_grid<kernel>(split.items(), kMaxStatsBlocks);
        kernel<<<grid, kThreads, 0, stream>>>(static_cast<D*>(dst.data), static_cast<const S*>(src.data), w, split,
                                              stats);
      } else {
        constexpr auto kernel = &accumulate_strided_kernel<D, S>;
        const unsigned grid = resident_grid<kernel>(n, kMaxStatsBlocks);
        kernel<<<grid, kThreads, 0, stream>>>(dst, src, w, n, stats);
      }
      MB_CUDA_CHECK_LAUNCH("accumulate");
    });
  });
}

}  // namespace microbatch::kernels::cuda
