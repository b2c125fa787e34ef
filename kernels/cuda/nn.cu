// CUDA row kernels for softmax / log-softmax, fused cross-entropy and layer norm (kernels/nn.h).
// Rows are contiguous. A row of at most kWarpCols columns is owned by one warp, a longer one by a
// whole block; the row's threads stride over its columns and meet in warp or block reductions.
// Softmax and cross-entropy find a row's max and its sum of exp(x - max) in one read (online
// softmax, kernels/online_softmax.h: every exp is of a value minus a max at least as large, so none
// overflows), reading 16-byte packs (Note [Row packs]). Math runs in compute_t<T>: f32 for 16-bit
// storage, f64 for f64; their exps in f32 take the hardware's (row_exp). Every output is
// overwritten, the backward ones included, except layer norm's dweight and dbias: this call's
// sums, weighted, are added into them (the parameters' gradient slots, or zeroed buffers).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/nn.h"
#include "kernels/online_softmax.h"

namespace microbatch::kernels::cuda {

namespace {

constexpr std::int64_t kWarpCols = 1024;
// Note [Loads in flight]: one load at a time per thread leaves too few bytes in flight to cover the
// memory latency (the (8192, 50257) bf16 cross-entropy ran at a fifth of the copy bandwidth), so
// the hot row loops issue several loads before using them: kUnroll scalars, or kPackUnroll 16-byte
// packs (Note [Row packs]).
constexpr int kUnroll = 8;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr long long kMaxBlocks = 1 << 20;  // row loops stride past this many blocks

// Which threads share a row: one warp (short rows) or the whole block (long rows).
enum class RowGroup { Warp, Block };

// The rows this thread's group visits (first, first + step, ...) and its place in the group.
struct RowLoop {
  std::int64_t first;
  std::int64_t step;
  int lane;
  int size;
};

template <RowGroup G>
__device__ __forceinline__ RowLoop row_loop() {
  if constexpr (G == RowGroup::Warp) {
    return {static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32,
            static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock,
            static_cast<int>(threadIdx.x & 31), 32};
  } else {
    return {static_cast<std::int64_t>(blockIdx.x), static_cast<std::int64_t>(gridDim.x),
            static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
  }
}

// Reductions over a row's group; every thread of the group gets the result. The group's row loop
// is uniform over the group, so the block variant's __syncthreads are reached by all threads.
template <RowGroup G, class A>
__device__ __forceinline__ A group_sum(A v, A* scratch) {
  if constexpr (G == RowGroup::Warp) {
    return warp_sum(v);
  } else {
    return block_sum(v, scratch);
  }
}

// The row's (max, sum of exp(x - max)) over its group (MaxSum, kernels/online_softmax.h): each
// thread keeps the pair for its columns and the pairs are merged in a fixed tree, so a row gives
// the same bits on every run. `scratch` holds 64 values (block groups only).
template <class A>
__device__ __forceinline__ MaxSum<A> warp_merge(MaxSum<A> v) {
  for (int o = 16; o > 0; o >>= 1) {
    const MaxSum<A> other{__shfl_xor_sync(kFullMask, v.max, o),
                          __shfl_xor_sync(kFullMask, v.sum, o)};
    v = merge(v, other);
  }
  return v;
}

template <RowGroup G, class A>
__device__ __forceinline__ MaxSum<A> group_merge(MaxSum<A> v, A* scratch) {
  v = warp_merge(v);
  if constexpr (G == RowGroup::Block) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) {
      scratch[warp] = v.max;
      scratch[32 + warp] = v.sum;
    }
    __syncthreads();
    const bool live = lane < static_cast<int>(blockDim.x >> 5);
    v = warp_merge(live ? MaxSum<A>{scratch[lane], scratch[32 + lane]} : MaxSum<A>{});
  }
  return v;
}

// Note [Row packs]: a row of 16-bit values starts wherever r * cols puts it (row r of 50257 bf16
// columns is 2-byte aligned), so a row pass splits it by address (row_split): the group's first
// lanes take the scalar head up to the first 16-byte boundary, then every thread reads 16-byte
// packs (8 bf16 / f16, 4 f32, 2 f64), kPackUnroll of them in flight, then the first lanes take the
// scalar tail. A pass that writes a second row aligns both with the one head, or, where they sit
// at different offsets from a boundary, reads and writes every column as a scalar. A thread visits
// its columns in ascending order, head, packs, tail.
constexpr int kPackUnroll = 4;

// 16 bytes of a row in four 32-bit words, moved as one 128-bit access (a struct of T members is
// copied one member at a time); columns go in and out by their index k, a constant after
// unrolling, so the words stay in registers. Little-endian: column k is at bytes
// [k * sizeof(T), (k + 1) * sizeof(T)).
template <class T>
struct RowPack {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(T));
  std::uint32_t w[4];

  // The intrinsics keep the access one instruction (a plain uint4 store was split in four).
  // kReadOnly: through the read-only (non-coherent) cache, for a row no thread of the kernel
  // writes; otherwise a coherent load, evict-first (read once).
  template <bool kReadOnly = true>
  __device__ __forceinline__ static RowPack load(const T* p) {
    const uint4 u = kReadOnly ? __ldg(reinterpret_cast<const uint4*>(p))
                              : __ldcs(reinterpret_cast<const uint4*>(p));
    return {{u.x, u.y, u.z, u.w}};
  }
  __device__ __forceinline__ void store(T* p) const {
    __stwb(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
  }
  __device__ __forceinline__ compute_t<T> get(int k) const {
    T e;
    if constexpr (sizeof(T) == 2) {
      const auto bits = static_cast<std::uint16_t>(w[k / 2] >> (16 * (k % 2)));
      memcpy(&e, &bits, 2);
    } else if constexpr (sizeof(T) == 4) {
      memcpy(&e, &w[k], 4);
    } else {
      const std::uint64_t bits = w[2 * k] | static_cast<std::uint64_t>(w[2 * k + 1]) << 32;
      memcpy(&e, &bits, 8);
    }
    return static_cast<compute_t<T>>(e);
  }
  // Columns from the compute type, rounded to nearest even; 16-bit pairs in one conversion (a
  // NaN comes out as the canonical NaN).
  __device__ __forceinline__ static RowPack from(const compute_t<T> (&v)[kSize]) {
    RowPack pack;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, bf16>) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        memcpy(&pack.w[i], &pair, 4);
      } else if constexpr (std::is_same_v<T, f16>) {
        const __half2 pair = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        memcpy(&pack.w[i], &pair, 4);
      } else if constexpr (sizeof(T) == 4) {
        memcpy(&pack.w[i], &v[i], 4);
      } else if (i % 2 == 0) {
        memcpy(&pack.w[i], &v[i / 2], 8);
      }
    }
    return pack;
  }
};

template <class T>
__device__ __forceinline__ RowSplit split_of(const T* row, const T* other, std::int64_t cols) {
  return row_split(reinterpret_cast<std::uintptr_t>(row), reinterpret_cast<std::uintptr_t>(other),
                   cols, sizeof(T));
}

// Calls visit(j, v) for columns [begin, end) of this thread's share, one column at a time
// (v an A[1]), kUnroll loads ahead (Note [Loads in flight]).
template <class T, class Visit>
__device__ __forceinline__ void visit_scalars(const T* row, std::int64_t begin, std::int64_t end,
                                              const RowLoop& loop, Visit& visit) {
  using A = compute_t<T>;
  std::int64_t j = begin + loop.lane;
  for (; j + (kUnroll - 1) * loop.size < end; j += kUnroll * loop.size) {
    A v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load<T>(row, j + u * loop.size);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const A one[1] = {v[u]};
      visit(j + u * loop.size, one);
    }
  }
  for (; j < end; j += loop.size) {
    const A one[1] = {load<T>(row, j)};
    visit(j, one);
  }
}

// Calls visit(j, v) over this thread's share of a row split by `split` (Note [Row packs]): v is
// an A[1] for a head or tail column j, an A[RowPack<T>::kSize] for the pack starting at column j.
// kReadOnly = false where the kernel writes the row it reads (in place), visit(j, v) writing only
// the columns it was given.
template <bool kReadOnly = true, class T, class Visit>
__device__ __forceinline__ void visit_row(const T* row, std::int64_t cols, RowSplit split,
                                          const RowLoop& loop, Visit&& visit) {
  using A = compute_t<T>;
  constexpr int P = RowPack<T>::kSize;
  auto to_compute = [](const RowPack<T>& pack, A(&v)[P]) {
#pragma unroll
    for (int k = 0; k < P; ++k) v[k] = pack.get(k);
  };
  visit_scalars(row, 0, split.head, loop, visit);
  const T* packs = row + split.head;  // pack p is columns [head + p * P, head + (p + 1) * P)
  std::int64_t p = loop.lane;
  for (; p + (kPackUnroll - 1) * loop.size < split.packs; p += kPackUnroll * loop.size) {
    RowPack<T> raw[kPackUnroll];
#pragma unroll
    for (int u = 0; u < kPackUnroll; ++u)
      raw[u] = RowPack<T>::template load<kReadOnly>(packs + (p + u * loop.size) * P);
#pragma unroll
    for (int u = 0; u < kPackUnroll; ++u) {
      A v[P];
      to_compute(raw[u], v);
      visit(split.head + (p + u * loop.size) * P, v);
    }
  }
  for (; p < split.packs; p += loop.size) {
    A v[P];
    to_compute(RowPack<T>::template load<kReadOnly>(packs + p * P), v);
    visit(split.head + p * P, v);
  }
  visit_scalars(row, split.head + split.packs * P, cols, loop, visit);
}

// Stores N computed columns from column j: one scalar, or a pack (j at a 16-byte boundary).
template <class T, int N>
__device__ __forceinline__ void store_columns(T* row, std::int64_t j, const compute_t<T> (&v)[N]) {
  if constexpr (N == 1) {
    store<T>(row, j, v[0]);
  } else {
    static_assert(N == RowPack<T>::kSize, "a pack or one column");
    RowPack<T>::from(v).store(row + j);
  }
}

// (max, sum of exp(x - max)) of row x, one read of the row.
template <RowGroup G, class T>
__device__ __forceinline__ MaxSum<compute_t<T>> row_max_sum(const T* x, std::int64_t cols,
                                                            const RowLoop& loop,
                                                            compute_t<T>* scratch) {
  using A = compute_t<T>;
  MaxSum<A> acc;
  visit_row(x, cols, split_of(x, x, cols), loop,
            [&]<int N>(std::int64_t, const A(&v)[N]) { acc.add(v); });
  return group_merge<G>(acc, scratch);
}

// ---- softmax -----------------------------------------------------------------------------------

template <class T, RowGroup G>
__global__ void softmax_forward_kernel(SoftmaxKind kind, T* out, const T* in, std::int64_t rows,
                                       std::int64_t cols) {
  using A = compute_t<T>;
  __shared__ A scratch[64];
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    const T* x = in + row * cols;
    T* y = out + row * cols;
    const MaxSum<A> ms = row_max_sum<G>(x, cols, loop, scratch);
    const A m = ms.max, s = ms.sum;
    const RowSplit split = split_of(x, static_cast<const T*>(y), cols);
    if (kind == SoftmaxKind::LogSoftmax) {
      const A log_s = std::log(s);
      visit_row(x, cols, split, loop, [&]<int N>(std::int64_t j, const A(&v)[N]) {
        A out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = (v[k] - m) - log_s;
        store_columns<T>(y, j, out);
      });
    } else {
      const A inv = A(1) / s;
      visit_row(x, cols, split, loop, [&]<int N>(std::int64_t j, const A(&v)[N]) {
        A out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = row_exp(v[k] - m) * inv;
        store_columns<T>(y, j, out);
      });
    }
  }
}

template <class T, RowGroup G>
__global__ void softmax_backward_kernel(SoftmaxKind kind, T* dx, const T* y, const T* dy,
                                        std::int64_t rows, std::int64_t cols) {
  using A = compute_t<T>;
  __shared__ A scratch[32];
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    const T* yr = y + row * cols;
    const T* gr = dy + row * cols;
    T* out = dx + row * cols;
    A s = 0;  // softmax: sum(dy * y); log_softmax: sum(dy)
    for (std::int64_t j = loop.lane; j < cols; j += loop.size)
      s += kind == SoftmaxKind::Softmax ? load<T>(gr, j) * load<T>(yr, j) : load<T>(gr, j);
    s = group_sum<G>(s, scratch);
    for (std::int64_t j = loop.lane; j < cols; j += loop.size) {
      const A yj = load<T>(yr, j), gj = load<T>(gr, j);
      store<T>(out, j, kind == SoftmaxKind::Softmax ? yj * (gj - s) : gj - std::exp(yj) * s);
    }
  }
}

// ---- cross-entropy -----------------------------------------------------------------------------


// A row's target, or -1 when the row contributes nothing (ignored, or out of [0, cols): the op's
// check_index_range reports the latter without a host synchronisation).
template <class I>
__device__ __forceinline__ std::int64_t live_target(const I* target, std::int64_t stride,
                                                    std::int64_t row, std::int64_t cols,
                                                    std::int64_t ignore_index) {
  const std::int64_t t = static_cast<std::int64_t>(target[row * stride]);
  return (t == ignore_index || t < 0 || t >= cols) ? -1 : t;
}

template <class T, class I, RowGroup G>
__global__ void cross_entropy_forward_kernel(compute_t<T>* loss, std::int64_t loss_stride,
                                             compute_t<T>* stats, const T* logits, std::int64_t ld,
                                             const I* target, std::int64_t target_stride,
                                             std::int64_t rows, std::int64_t cols,
                                             std::int64_t ignore_index, double smoothing) {
  using A = compute_t<T>;
  __shared__ A scratch[64];
  const RowLoop loop = row_loop<G>();
  const bool smooth = smoothing > 0.0;  // the same for the whole grid
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    // The same target for the whole group, so the branch is uniform.
    const std::int64_t t = live_target(target, target_stride, row, cols, ignore_index);
    if (t < 0) {
      if (loop.lane == 0) loss[row * loss_stride] = stats[2 * row] = stats[2 * row + 1] = A(0);
      continue;
    }
    const T* x = logits + row * ld;
    const A xt = loop.lane == 0 ? load<T>(x, t) : A(0);  // issued before the row pass
    // Smoothing's sum(x - max) is summed in the same pass as sum(x - x0), shifted by the row's
    // first value so that values far from zero keep their precision (0 where x0 is not finite).
    A x0 = smooth ? load<T>(x, 0) : A(0);
    if (!isfinite(x0)) x0 = A(0);
    MaxSum<A> acc;
    A shifted = 0;
    visit_row(x, cols, split_of(x, x, cols), loop, [&]<int N>(std::int64_t, const A(&v)[N]) {
      acc.add(v);
      if (smooth) {
#pragma unroll
        for (int k = 0; k < N; ++k) shifted += v[k] - x0;
      }
    });
    const MaxSum<A> ms = group_merge<G>(acc, scratch);
    if (smooth) shifted = group_sum<G>(shifted, scratch);
    if (loop.lane == 0) {
      const A m = ms.max, log_sum = std::log(ms.sum);
      double value = (static_cast<double>(m) - static_cast<double>(xt)) +
                     static_cast<double>(log_sum);  // -log p[t]
      if (smooth) {
        // mean_c(-log p) = log_sum - mean(x - max), mean(x - max) = mean(x - x0) + (x0 - max)
        const double mean_below_max = static_cast<double>(shifted) / static_cast<double>(cols) +
                                      (static_cast<double>(x0) - static_cast<double>(m));
        value =
            (1.0 - smoothing) * value + smoothing * (static_cast<double>(log_sum) - mean_below_max);
      }
      loss[row * loss_stride] = static_cast<A>(value);
      stats[2 * row] = m;
      stats[2 * row + 1] = log_sum;
    }
  }
}

// Element-wise given the row's stats: no reduction, so any group shape works. Reads the logits
// and writes dlogits in packs where the two rows share an offset from a 16-byte boundary (Note
// [Row packs]). kInPlace: dlogits is the logits (Note [Reusing an input's memory],
// core/autograd.h); a thread reads each of its columns once, before it writes it.
template <class T, class I, RowGroup G, bool kInPlace>
__global__ void cross_entropy_backward_kernel(T* dlogits, std::int64_t dld, const T* logits,
                                              std::int64_t ld, const compute_t<T>* stats,
                                              const I* target,
                                              std::int64_t target_stride, const compute_t<T>* g,
                                              std::int64_t g_stride, std::int64_t rows,
                                              std::int64_t cols, std::int64_t ignore_index,
                                              compute_t<T> off, compute_t<T> on) {
  using A = compute_t<T>;
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    const std::int64_t t = live_target(target, target_stride, row, cols, ignore_index);
    T* d = dlogits + row * dld;
    if (t < 0) {
      for (std::int64_t j = loop.lane; j < cols; j += loop.size) store<T>(d, j, A(0));
      continue;
    }
    const T* x = logits + row * ld;
    const A max = stats[2 * row], log_sum = stats[2 * row + 1], gi = g[row * g_stride];
    visit_row<!kInPlace>(x, cols, split_of(x, static_cast<const T*>(d), cols), loop,
              [&]<int N>(std::int64_t j, const A(&v)[N]) {
                A out[N];
#pragma unroll
                for (int k = 0; k < N; ++k) out[k] = row_exp((v[k] - max) - log_sum) - off;
                const std::int64_t label = t - j;  // the label's place in v, if it is there
                if (label >= 0 && label < N) {
#pragma unroll
                  for (int k = 0; k < N; ++k)
                    if (k == label) out[k] -= on;
                }
#pragma unroll
                for (int k = 0; k < N; ++k) out[k] *= gi;
                store_columns<T>(d, j, out);
              });
  }
}

// ---- layer norm --------------------------------------------------------------------------------

template <class T, RowGroup G>
__global__ void layer_norm_forward_kernel(T* y, compute_t<T>* mean, compute_t<T>* rstd, const T* x,
                                          const T* weight, const T* bias, std::int64_t rows,
                                          std::int64_t cols, double eps) {
  using A = compute_t<T>;
  __shared__ A scratch[32];
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    // As the CPU kernel: the mean as hi + lo from a sum shifted by the row's first element, then
    // the variance in a second pass, so values far from zero (1e4 + noise) keep their precision.
    const A x0 = load<T>(xr, 0);
    A s = 0;
    for (std::int64_t j = loop.lane; j < cols; j += loop.size) s += load<T>(xr, j) - x0;
    s = group_sum<G>(s, scratch);
    const double mu = static_cast<double>(x0) + static_cast<double>(s) / static_cast<double>(cols);
    const A hi = static_cast<A>(mu), lo = static_cast<A>(mu - static_cast<double>(hi));
    A sq = 0;
    for (std::int64_t j = loop.lane; j < cols; j += loop.size) {
      const A d = (load<T>(xr, j) - hi) - lo;
      sq += d * d;
    }
    sq = group_sum<G>(sq, scratch);
    const A r =
        static_cast<A>(1.0 / std::sqrt(static_cast<double>(sq) / static_cast<double>(cols) + eps));
    if (loop.lane == 0) {
      mean[row] = hi;
      rstd[row] = r;
    }
    for (std::int64_t j = loop.lane; j < cols; j += loop.size) {
      A v = ((load<T>(xr, j) - hi) - lo) * r;
      if (weight != nullptr) v *= load<T>(weight, j);
      if (bias != nullptr) v += load<T>(bias, j);
      store<T>(yr, j, v);
    }
  }
}

template <class T, RowGroup G>
__global__ void layer_norm_dx_kernel(T* dx, const T* dy, const T* x, const compute_t<T>* mean,
                                     const compute_t<T>* rstd, const T* weight, std::int64_t rows,
                                     std::int64_t cols) {
  using A = compute_t<T>;
  __shared__ A scratch[32];
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    const T* xr = x + row * cols;
    const T* gr = dy + row * cols;
    T* out = dx + row * cols;
    const A m = mean[row], r = rstd[row];
    A sum_wdy = 0, sum_wdy_xhat = 0;
    for (std::int64_t j = loop.lane; j < cols; j += loop.size) {
      const A xhat = (load<T>(xr, j) - m) * r;
      const A wdy = weight != nullptr ? load<T>(gr, j) * load<T>(weight, j) : load<T>(gr, j);
      sum_wdy += wdy;
      sum_wdy_xhat += wdy * xhat;
    }
    sum_wdy = group_sum<G>(sum_wdy, scratch);
    sum_wdy_xhat = group_sum<G>(sum_wdy_xhat, scratch);
    const A a = static_cast<A>(static_cast<double>(sum_wdy) / static_cast<double>(cols));
    const A b = static_cast<A>(static_cast<double>(sum_wdy_xhat) / static_cast<double>(cols));
    for (std::int64_t j = loop.lane; j < cols; j += loop.size) {
      const A xhat = (load<T>(xr, j) - m) * r;
      const A wdy = weight != nullptr ? load<T>(gr, j) * load<T>(weight, j) : load<T>(gr, j);
      store<T>(out, j, r * (wdy - a - xhat * b));
    }
  }
}

// Note [Deterministic parameter sums]: dweight = sum over rows of dy * xhat and dbias = sum of dy
// are column sums over every row. Atomics would add in a different order on every run, so the sum
// is split in two fixed-order passes. (1) Block (column tile, chunk) sums its chunk's rows for 32
// columns: thread (tx, ty) adds rows ty, ty + 8, ... in order, then the 8 partials of a column are
// added in ty order and written to workspace[0 or 1][chunk][col]. (2) One thread per column adds
// the chunks' partials in chunk order. Chunks come from layer_norm_chunks(rows), a function of the
// shape alone, so a given shape always sums in the same order.
constexpr int kTileCols = 32;
constexpr int kTileRows = kThreads / kTileCols;  // 8

template <class T>
__global__ void layer_norm_partials_kernel(compute_t<T>* partial_w, compute_t<T>* partial_b,
                                           const T* dy, const T* x, const compute_t<T>* mean,
                                           const compute_t<T>* rstd, std::int64_t rows,
                                           std::int64_t cols, std::int64_t rows_per_chunk) {
  using A = compute_t<T>;
  __shared__ A tile_w[kTileRows][kTileCols];
  __shared__ A tile_b[kTileRows][kTileCols];
  const int tx = threadIdx.x % kTileCols, ty = threadIdx.x / kTileCols;
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kTileCols + tx;
  const std::int64_t chunk = blockIdx.y;
  const std::int64_t begin = chunk * rows_per_chunk;
  const std::int64_t end = std::min(rows, begin + rows_per_chunk);
  A sw = 0, sb = 0;
  if (col < cols) {
    for (std::int64_t row = begin + ty; row < end; row += kTileRows) {
      const A g = load<T>(dy, row * cols + col);
      sw += g * ((load<T>(x, row * cols + col) - mean[row]) * rstd[row]);
      sb += g;
    }
  }
  tile_w[ty][tx] = sw;
  tile_b[ty][tx] = sb;
  __syncthreads();
  if (ty != 0 || col >= cols) return;
  A tw = 0, tb = 0;
#pragma unroll
  for (int k = 0; k < kTileRows; ++k) {
    tw += tile_w[k][tx];
    tb += tile_b[k][tx];
  }
  partial_w[chunk * cols + col] = tw;
  partial_b[chunk * cols + col] = tb;
}

// Adds grad_weight * (the chunk partials in chunk order) into dweight and dbias, as add_weighted.
template <class A>
__global__ void layer_norm_params_kernel(A* dweight, A* dbias, const A* partial_w,
                                         const A* partial_b, std::int64_t chunks,
                                         std::int64_t cols, A grad_weight) {
  for (std::int64_t col = global_thread(); col < cols; col += grid_threads()) {
    A tw = 0, tb = 0;
    for (std::int64_t c = 0; c < chunks; ++c) {
      tw += partial_w[c * cols + col];
      tb += partial_b[c * cols + col];
    }
    if (dweight != nullptr) dweight[col] = add_weighted(dweight[col], tw, grad_weight);
    if (dbias != nullptr) dbias[col] = add_weighted(dbias[col], tb, grad_weight);
  }
}

// ---- launch helpers ----------------------------------------------------------------------------

// Calls f.template operator()<G>() with the row group for rows of `cols` columns.
template <class F>
void with_row_group(std::int64_t cols, F&& f) {
  if (cols <= kWarpCols) {
    f.template operator()<RowGroup::Warp>();
  } else {
    f.template operator()<RowGroup::Block>();
  }
}

// Blocks for `rows` rows: one per kWarpsPerBlock rows (warp groups) or per row (block groups).
template <RowGroup G>
unsigned row_blocks(std::int64_t rows) {
  const long long per_block = G == RowGroup::Warp ? kWarpsPerBlock : 1;
  return static_cast<unsigned>(std::max(1LL, std::min(ceil_div(rows, per_block), kMaxBlocks)));
}

std::int64_t row_count(const StridedView& v, std::int64_t cols) {
  return cols > 0 ? v.numel() / cols : 0;
}

}  // namespace

void softmax_forward(SoftmaxKind kind, const StridedView& out, const StridedView& in,
                     std::int64_t cols) {
  MB_ASSERT(in.is_contiguous() && out.is_contiguous(), "softmax rows must be contiguous");
  const std::int64_t rows = row_count(in, cols);
  if (rows == 0) return;
  dispatch_float(in.dtype, "softmax", [&]<class T>() {
    with_row_group(cols, [&]<RowGroup G>() {
      softmax_forward_kernel<T, G><<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
          kind, out.ptr<T>(), in.ptr<T>(), rows, cols);
      MB_CUDA_CHECK_LAUNCH("softmax_forward_kernel");
    });
  });
}

void softmax_backward(SoftmaxKind kind, const StridedView& dx, const StridedView& y,
                      const StridedView& dy, std::int64_t cols) {
  MB_ASSERT(dx.is_contiguous() && y.is_contiguous() && dy.is_contiguous(),
            "softmax backward rows must be contiguous");
  const std::int64_t rows = row_count(y, cols);
  if (rows == 0) return;
  dispatch_float(y.dtype, "softmax", [&]<class T>() {
    with_row_group(cols, [&]<RowGroup G>() {
      softmax_backward_kernel<T, G><<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
          kind, dx.ptr<T>(), y.ptr<T>(), dy.ptr<T>(), rows, cols);
      MB_CUDA_CHECK_LAUNCH("softmax_backward_kernel");
    });
  });
}

void cross_entropy_forward(const StridedView& loss, const StridedView& stats,
                           const StridedView& logits, const StridedView& target,
                           CrossEntropyArgs args) {
  MB_ASSERT(logits.is_rows() && stats.is_contiguous(),
            "cross_entropy logits must be (N, C) rows with unit column stride, stats (N, 2)");
  const std::int64_t rows = logits.shape[0], cols = logits.shape[1];
  if (rows == 0) return;
  dispatch_float(logits.dtype, "cross_entropy", [&]<class T>() {
    using A = compute_t<T>;
    dispatch_index(target.dtype, "cross_entropy", [&]<class I>() {
      with_row_group(cols, [&]<RowGroup G>() {
        cross_entropy_forward_kernel<T, I, G>
            <<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
                loss.ptr<A>(), loss.strides[0], stats.ptr<A>(), logits.ptr<T>(), logits.strides[0],
                target.ptr<I>(), target.strides[0], rows, cols, args.ignore_index,
                args.label_smoothing);
        MB_CUDA_CHECK_LAUNCH("cross_entropy_forward_kernel");
      });
    });
  });
}

void cross_entropy_backward(const StridedView& dlogits, const StridedView& logits,
                            const StridedView& stats, const StridedView& target,
                            const StridedView& g, CrossEntropyArgs args) {
  MB_ASSERT(logits.is_rows() && dlogits.is_rows() &&
                dlogits.shape[0] == logits.shape[0] && dlogits.shape[1] == logits.shape[1],
            "cross_entropy logits and dlogits must be (N, C) rows with unit column stride");
  const std::int64_t rows = logits.shape[0], cols = logits.shape[1];
  if (rows == 0) return;
  // In place only as the same rows; any other overlap is the caller's bug.
  const bool in_place = dlogits.data == logits.data;
  MB_ASSERT(!in_place || dlogits.strides[0] == logits.strides[0],
            "cross_entropy in place needs dlogits laid out as the logits");
  const double s = args.label_smoothing;
  dispatch_float(logits.dtype, "cross_entropy", [&]<class T>() {
    using A = compute_t<T>;
    // The smoothed target is off = s / C on every class, plus on = 1 - s on the label.
    const A off = static_cast<A>(s / static_cast<double>(cols));
    const A on = static_cast<A>(1.0 - s);
    dispatch_index(target.dtype, "cross_entropy", [&]<class I>() {
      with_row_group(cols, [&]<RowGroup G>() {
        const auto run = [&]<bool kInPlace>() {
          cross_entropy_backward_kernel<T, I, G, kInPlace>
              <<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
                  dlogits.ptr<T>(), dlogits.strides[0], logits.ptr<T>(), logits.strides[0],
                  stats.ptr<A>(), target.ptr<I>(), target.strides[0], g.ptr<A>(), g.strides[0],
                  rows, cols, args.ignore_index, off, on);
        };
        if (in_place) {
          run.template operator()<true>();
        } else {
          run.template operator()<false>();
        }
        MB_CUDA_CHECK_LAUNCH("cross_entropy_backward_kernel");
      });
    });
  });
}

void layer_norm_forward(const StridedView& y, const StridedView& mean, const StridedView& rstd,
                        const StridedView& x, const StridedView& weight, const StridedView& bias,
                        double eps) {
  MB_ASSERT(x.is_contiguous() && y.is_contiguous() && mean.is_contiguous() && rstd.is_contiguous(),
            "layer_norm rows and statistics must be contiguous");
  const std::int64_t rows = mean.numel();
  if (rows == 0 || x.numel() == 0) return;  // the kernel reads each row's first element
  const std::int64_t cols = x.numel() / rows;
  dispatch_float(x.dtype, "layer_norm", [&]<class T>() {
    using A = compute_t<T>;
    with_row_group(cols, [&]<RowGroup G>() {
      layer_norm_forward_kernel<T, G><<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
          y.ptr<T>(), mean.ptr<A>(), rstd.ptr<A>(), x.ptr<T>(), weight.ptr<T>(), bias.ptr<T>(),
          rows, cols, eps);
      MB_CUDA_CHECK_LAUNCH("layer_norm_forward_kernel");
    });
  });
}

void layer_norm_backward(const StridedView& dx, const StridedView& dweight,
                         const StridedView& dbias, const StridedView& dy, const StridedView& x,
                         const StridedView& mean, const StridedView& rstd,
                         const StridedView& weight, const StridedView& workspace,
                         double grad_weight) {
  MB_ASSERT(x.is_contiguous() && dy.is_contiguous() && (!dx.data || dx.is_contiguous()) &&
                mean.is_contiguous() && rstd.is_contiguous(),
            "layer_norm backward rows and statistics must be contiguous");
  const std::int64_t rows = mean.numel();
  const bool params = dweight.data != nullptr || dbias.data != nullptr;
  const std::int64_t cols = dweight.data != nullptr ? dweight.numel() : dbias.numel();
  const std::int64_t chunks = layer_norm_chunks(rows);
  if (params) {
    MB_ASSERT(workspace.numel() == 2 * chunks * cols && workspace.is_contiguous() &&
                  workspace.dtype == (x.dtype == DType::f64 ? DType::f64 : DType::f32),
              "layer_norm backward workspace has {} elements of {}, expected 2 * {} * {}",
              workspace.numel(), dtype_name(workspace.dtype), chunks, cols);
  }
  dispatch_float(x.dtype, "layer_norm", [&]<class T>() {
    using A = compute_t<T>;
    if (dx.data != nullptr && rows > 0) {
      const std::int64_t row_cols = x.numel() / rows;
      with_row_group(row_cols, [&]<RowGroup G>() {
        layer_norm_dx_kernel<T, G><<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
            dx.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), mean.ptr<A>(), rstd.ptr<A>(), weight.ptr<T>(),
            rows, row_cols);
        MB_CUDA_CHECK_LAUNCH("layer_norm_dx_kernel");
      });
    }
    if (!params || cols == 0 || rows == 0) return;  // as the CPU: no rows add nothing, not 0
    A* partial_w = workspace.ptr<A>();
    A* partial_b = partial_w + chunks * cols;
    if (chunks > 0) {
      const dim3 grid(static_cast<unsigned>(ceil_div(cols, kTileCols)),
                      static_cast<unsigned>(chunks));
      layer_norm_partials_kernel<T><<<grid, kThreads, 0, current_stream()>>>(
          partial_w, partial_b, dy.ptr<T>(), x.ptr<T>(), mean.ptr<A>(), rstd.ptr<A>(), rows, cols,
          ceil_div(rows, chunks));
      MB_CUDA_CHECK_LAUNCH("layer_norm_partials_kernel");
    }
    layer_norm_params_kernel<A><<<grid_for(cols, kThreads), kThreads, 0, current_stream()>>>(
        dweight.ptr<A>(), dbias.ptr<A>(), partial_w, partial_b, chunks, cols,
        static_cast<A>(grad_weight));
    MB_CUDA_CHECK_LAUNCH("layer_norm_params_kernel");
  });
}

}  // namespace microbatch::kernels::cuda
