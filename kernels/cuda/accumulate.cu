// dst += weight * src: the sink of parameter gradients (Note [Gradient writes] in
// core/autograd.h). It accumulates, never overwrites: a window's micro-batches add their weighted
// shares into the f32 (or f64, or 16-bit) gradient arena. Math as cpu::accumulate, in
// compute_t<dst> (f32 for 16-bit accumulators).
//
// Contiguous operands take the vector path: a scalar head brings dst to a 16-byte boundary, packs
// of kAccumulatePack elements move as 128-bit (or, for the narrower operand, 64-bit) words, a
// scalar tail ends it (all scalar when src cannot be aligned by the same head); each thread takes
// two packs a grid stride apart per step, their loads in flight together. Any other layout takes
// the strided path.
// With stats, the pass also reduces the updated values (Note [One-launch reduction]), so the last
// micro-batch of a window can yield its norm and non-finite flag without a second read.
#include <algorithm>

#include "kernels/cuda/grad_stats.cuh"
#include "kernels/elementwise.h"

namespace microbatch::kernels::cuda {

namespace {

template <class D, class S>
__device__ __forceinline__ D accumulate_one(D d, S s, compute_t<D> w) {
  return add_weighted(d, static_cast<compute_t<D>>(static_cast<compute_t<S>>(s)), w);
}

template <class D>
__device__ __forceinline__ double stat_value(D d) {
  return static_cast<double>(static_cast<compute_t<D>>(d));
}

// Elements per pack: 16 bytes of the wider operand, so that a warp's load of either array covers
// one contiguous span (f32 += bf16: 4 elements, 16 + 8 bytes; a pack of 8 would read the f32 side
// as two 16-byte halves 32 bytes apart). Where the narrower side would get less than 8 bytes
// (f64 += 16-bit), 16 bytes of the narrower one.
template <class D, class S>
constexpr int accumulate_pack() {
  constexpr int wide = kNarrowPackOf<D, S>;
  return wide * std::min(sizeof(D), sizeof(S)) >= 8 ? wide : kPackOf<D, S>;
}
template <class D, class S>
inline constexpr int kAccumulatePack = accumulate_pack<D, S>();

template <class D, class S>
__global__ void accumulate_contiguous_kernel(D* dst, const S* src, compute_t<D> w, PackSplit split,
                                             GradStatsBuffer* stats) {
  constexpr int kPack = kAccumulatePack<D, S>;
  StatsAccumulator acc;
  const std::int64_t packs = split.packs();
  const std::int64_t stride = grid_threads();
  for (std::int64_t p = global_thread(); p < packs; p += 2 * stride) {
    const bool second = p + stride < packs;  // the pair's other pack, a grid stride on
    const std::int64_t i0 = split.pack_start(p), i1 = split.pack_start(second ? p + stride : p);
    Pack<D, kPack> d[2] = {load_pack<D, kPack>(dst + i0), load_pack<D, kPack>(dst + i1)};
    const Pack<S, kPack> s[2] = {load_pack<S, kPack>(src + i0), load_pack<S, kPack>(src + i1)};
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && !second) break;
      const std::int64_t i = u == 0 ? i0 : i1;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        d[u].v[k] = accumulate_one(d[u].v[k], s[u].v[k], w);
        if (stats != nullptr) acc.add(stat_value(d[u].v[k]), i + k);
      }
      store_pack(dst + i, d[u]);
    }
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
        const PackSplit split =
            pack_split(n, kAccumulatePack<D, S>, address_of<D>(dst.data), {address_of<S>(src.data)});
        constexpr auto kernel = &accumulate_contiguous_kernel<D, S>;
        const unsigned grid = resident_grid<kernel>(
            std::max((split.packs() + 1) / 2, split.scalar_count()), kMaxStatsBlocks);
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
