// Device helpers of the arena passes (accumulate.cu, optim.cu): 128-bit packs (split by
// PackSplit, kernels/optim.h), the one-launch reduction of Note [One-launch reduction] (kernels/optim.h), and
// a grid of exactly the resident blocks.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/optim.h"

namespace microbatch::kernels::cuda {

/// N elements loaded or stored as one 64-bit access or one or more 128-bit accesses.
template <class T, int N>
struct alignas(N * sizeof(T) < 16 ? N * sizeof(T) : 16) Pack {
  static_assert(N * sizeof(T) == 8 || N * sizeof(T) % 16 == 0,
                "a pack is one 64-bit word or a whole number of 128-bit words");
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

/// Elements per pack when every array involved is read in 128-bit words: 16 / the narrowest size.
template <class... T>
inline constexpr int kPackOf = static_cast<int>(16 / std::min({sizeof(T)...}));

/// Elements per pack when the widest array is read in 128-bit words and the others in 64-bit ones
/// or 128-bit ones: each load instruction of a warp then covers one contiguous span of every
/// array, with no partly used sectors.
template <class... T>
inline constexpr int kNarrowPackOf = static_cast<int>(16 / std::max({sizeof(T)...}));

/// A pointer as pack_split sees it.
template <class T>
ArrayAddress address_of(const void* p) {
  return {reinterpret_cast<std::uintptr_t>(p), sizeof(T)};
}

inline constexpr std::int64_t kNoIndex = INT64_MAX;

/// One thread's share of a reduction: sum of squares in f64 and its first non-finite index.
struct StatsAccumulator {
  double sum_sq = 0.0;
  std::int64_t first = kNoIndex;

  __device__ __forceinline__ void add(double v, std::int64_t index) {
    sum_sq += v * v;  // exact for f32 and 16-bit values: their squares fit in a double
    if (!isfinite(v) && index < first) first = index;
  }
};

__device__ __forceinline__ std::int64_t warp_min_index(std::int64_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    const std::int64_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other < v ? other : v;
  }
  return v;
}

/// Minimum over the block; every thread gets it (same contract as block_sum).
__device__ __forceinline__ std::int64_t block_min_index(std::int64_t v, std::int64_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_min_index(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  return warp_min_index(lane < warps ? scratch[lane] : kNoIndex);
}

/// Ends a one-launch reduction (Note [One-launch reduction]). Every thread of every block must
/// call it (it synchronises the block); gridDim.x <= kMaxStatsBlocks.
__device__ __forceinline__ void finish_stats(const StatsAccumulator& mine, GradStatsBuffer* buffer) {
  __shared__ double sum_scratch[32];
  __shared__ std::int64_t index_scratch[32];
  __shared__ bool last_block;
  const double block_total = block_sum(mine.sum_sq, sum_scratch);
  const std::int64_t block_first = block_min_index(mine.first, index_scratch);
  if (threadIdx.x == 0) {
    buffer->partial_sum_sq[blockIdx.x] = block_total;
    buffer->partial_first[blockIdx.x] = block_first;
    __threadfence();  // the partials are visible device-wide before the ticket says so
    last_block = atomicAdd(&buffer->ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  double total = 0.0;
  std::int64_t first = kNoIndex;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) {  // fixed order: deterministic
    total += __ldcg(&buffer->partial_sum_sq[b]);
    const std::int64_t f = static_cast<std::int64_t>(
        __ldcg(reinterpret_cast<const long long*>(&buffer->partial_first[b])));
    first = f < first ? f : first;
  }
  total = block_sum(total, sum_scratch);
  first = block_min_index(first, index_scratch);
  if (threadIdx.x == 0) {
    buffer->result.sum_sq = total;
    buffer->result.first_non_finite = first == kNoIndex ? -1 : first;
    buffer->result.non_finite = first == kNoIndex ? 0u : 1u;
    buffer->ticket = 0;  // every other block has taken its ticket: ready for the next launch
  }
}

/// Blocks of kThreads for a grid-stride pass of `Kernel` over `items`: one full wave of resident
/// blocks (a partial second wave would leave most SMs idle at the end), at most `cap`, at least 1.
template <auto Kernel>
unsigned resident_grid(std::int64_t items, unsigned cap) {
  static const int per_sm = [] {
    int blocks = 0;
    MB_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, kThreads, 0));
    return blocks < 1 ? 1 : blocks;
  }();
  const std::int64_t needed = (items + kThreads - 1) / kThreads;
  std::int64_t grid = static_cast<std::int64_t>(per_sm) * multiprocessor_count();
  if (needed < grid) grid = needed;
  if (grid > static_cast<std::int64_t>(cap)) grid = cap;
  return static_cast<unsigned>(grid < 1 ? 1 : grid);
}

}  // namespace microbatch::kernels::cuda
