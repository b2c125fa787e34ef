// CUDA row kernels for softmax / log-softmax, fused cross-entropy and layer norm (kernels/nn.h).
// Rows are contiguous. A row of at most kWarpCols columns is owned by one warp, a longer one by a
// whole block; the row's threads stride over its columns and meet in warp or block reductions.
// Softmax and cross-entropy find a row's max and its sum of exp(x - max) in one read (online
// softmax: every exp is of a value minus a max at least as large, so none overflows). Math runs
// in compute_t<T>: f32 for 16-bit storage, f64 for f64. Every output is overwritten, the backward
// ones included; layer norm's dweight and dbias are this call's sums, which the engine adds into
// the leaves.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cuda/common.cuh"
#include "kernels/nn.h"

namespace microbatch::kernels::cuda {

namespace {

constexpr std::int64_t kWarpCols = 1024;
// Note [Loads in flight]: a thread of a long-row kernel reads 2 to 8 bytes per column; one load at
// a time leaves too few bytes in flight to cover the memory latency (the (8192, 50257) bf16
// cross-entropy ran at a fifth of the copy bandwidth), so the hot row loops issue kUnroll loads
// before using them.
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

// A row's max and its sum of exp(x - max), found in one pass (online softmax): each thread keeps
// the pair for its columns, rescaling its sum when its max grows, and the pairs of a group are
// merged. A pair whose max is -inf holds nothing (all -inf, or no column). A NaN column makes the
// sum NaN, and so every result of the row, as on the CPU.
template <class A>
struct MaxSum {
  A max;
  A sum;
};

template <class A>
__device__ __forceinline__ void add_column(MaxSum<A>& acc, A x) {
  if (x > acc.max || x != x) {  // a NaN becomes the max, so that merges keep it
    acc.sum = acc.sum * std::exp(acc.max - x) + A(1);  // exp(-inf) = 0 on the first column
    acc.max = x;
  } else if (x != -std::numeric_limits<A>::infinity()) {
    acc.sum += std::exp(x - acc.max);
  }
}

template <class A>
__device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  constexpr A kNone = -std::numeric_limits<A>::infinity();
  const A m = max_nan(a.max, b.max);
  if (m == kNone) return {m, A(0)};
  const A sa = a.max == kNone ? A(0) : a.sum * std::exp(a.max - m);
  const A sb = b.max == kNone ? A(0) : b.sum * std::exp(b.max - m);
  return {m, sa + sb};
}

// merge is symmetric, so every lane ends with the same pair.
template <class A>
__device__ __forceinline__ MaxSum<A> warp_merge(MaxSum<A> v) {
  for (int o = 16; o > 0; o >>= 1) {
    const MaxSum<A> other{__shfl_xor_sync(kFullMask, v.max, o),
                          __shfl_xor_sync(kFullMask, v.sum, o)};
    v = merge(v, other);
  }
  return v;
}

// The row's (max, sum) over its group; `scratch` holds 64 values (block groups only).
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
    v = warp_merge(MaxSum<A>{live ? scratch[lane] : -std::numeric_limits<A>::infinity(),
                             live ? scratch[32 + lane] : A(0)});
  }
  return v;
}

// (max, sum of exp(x - max)) of row x, one read of the row.
template <RowGroup G, class T>
__device__ __forceinline__ MaxSum<compute_t<T>> row_max_sum(const T* x, std::int64_t cols,
                                                            const RowLoop& loop,
                                                            compute_t<T>* scratch) {
  using A = compute_t<T>;
  MaxSum<A> acc{-std::numeric_limits<A>::infinity(), A(0)};
  // kUnroll loads in flight before they are used (Note [Loads in flight]); the columns are still
  // added in ascending order, so the result is the same as one column at a time.
  std::int64_t j = loop.lane;
  for (; j + (kUnroll - 1) * loop.size < cols; j += kUnroll * loop.size) {
    A v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load<T>(x, j + u * loop.size);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) add_column(acc, v[u]);
  }
  for (; j < cols; j += loop.size) add_column(acc, load<T>(x, j));
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
    if (kind == SoftmaxKind::LogSoftmax) {
      const A log_s = std::log(s);
      for (std::int64_t j = loop.lane; j < cols; j += loop.size)
        store<T>(y, j, (load<T>(x, j) - m) - log_s);
    } else {
      const A inv = A(1) / s;
      for (std::int64_t j = loop.lane; j < cols; j += loop.size)
        store<T>(y, j, std::exp(load<T>(x, j) - m) * inv);
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
                                             compute_t<T>* stats, const T* logits, const I* target,
                                             std::int64_t target_stride, std::int64_t rows,
                                             std::int64_t cols, std::int64_t ignore_index,
                                             double smoothing) {
  using A = compute_t<T>;
  __shared__ A scratch[64];
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    // The same target for the whole group, so the branch is uniform.
    const std::int64_t t = live_target(target, target_stride, row, cols, ignore_index);
    if (t < 0) {
      if (loop.lane == 0) loss[row * loss_stride] = stats[2 * row] = stats[2 * row + 1] = A(0);
      continue;
    }
    const T* x = logits + row * cols;
    const MaxSum<A> ms = row_max_sum<G>(x, cols, loop, scratch);
    const A m = ms.max, s = ms.sum;
    A below = 0;  // sum(x - max), for the smoothing term
    if (smoothing > 0.0) {
      for (std::int64_t j = loop.lane; j < cols; j += loop.size) below += load<T>(x, j) - m;
      below = group_sum<G>(below, scratch);
    }
    if (loop.lane == 0) {
      const A log_sum = std::log(s);
      double value = (static_cast<double>(m) - static_cast<double>(load<T>(x, t))) +
                     static_cast<double>(log_sum);  // -log p[t]
      if (smoothing > 0.0) {
        // mean_c(-log p) = log_sum - mean(x - max)
        const double mean_below_max = static_cast<double>(below) / static_cast<double>(cols);
        value =
            (1.0 - smoothing) * value + smoothing * (static_cast<double>(log_sum) - mean_below_max);
      }
      loss[row * loss_stride] = static_cast<A>(value);
      stats[2 * row] = m;
      stats[2 * row + 1] = log_sum;
    }
  }
}

// Element-wise given the row's stats: no reduction, so any group shape works.
template <class T, class I, RowGroup G>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits,
                                              const compute_t<T>* stats, const I* target,
                                              std::int64_t target_stride, const compute_t<T>* g,
                                              std::int64_t g_stride, std::int64_t rows,
                                              std::int64_t cols, std::int64_t ignore_index,
                                              compute_t<T> off, compute_t<T> on) {
  using A = compute_t<T>;
  const RowLoop loop = row_loop<G>();
  for (std::int64_t row = loop.first; row < rows; row += loop.step) {
    const std::int64_t t = live_target(target, target_stride, row, cols, ignore_index);
    T* d = dlogits + row * cols;
    if (t < 0) {
      for (std::int64_t j = loop.lane; j < cols; j += loop.size) store<T>(d, j, A(0));
      continue;
    }
    const T* x = logits + row * cols;
    const A max = stats[2 * row], log_sum = stats[2 * row + 1], gi = g[row * g_stride];
    auto grad = [&](std::int64_t j, A xj) {
      return gi * (std::exp((xj - max) - log_sum) - off - (j == t ? on : A(0)));
    };
    std::int64_t j = loop.lane;
    for (; j + (kUnroll - 1) * loop.size < cols; j += kUnroll * loop.size) {
      A v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load<T>(x, j + u * loop.size);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        store<T>(d, j + u * loop.size, grad(j + u * loop.size, v[u]));
      }
    }
    for (; j < cols; j += loop.size) store<T>(d, j, grad(j, load<T>(x, j)));
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

template <class A>
__global__ void layer_norm_params_kernel(A* dweight, A* dbias, const A* partial_w,
                                         const A* partial_b, std::int64_t chunks,
                                         std::int64_t cols) {
  for (std::int64_t col = global_thread(); col < cols; col += grid_threads()) {
    A tw = 0, tb = 0;
    for (std::int64_t c = 0; c < chunks; ++c) {
      tw += partial_w[c * cols + col];
      tb += partial_b[c * cols + col];
    }
    if (dweight != nullptr) dweight[col] = tw;
    if (dbias != nullptr) dbias[col] = tb;
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
  MB_ASSERT(logits.is_contiguous() && logits.ndim == 2 && stats.is_contiguous(),
            "cross_entropy logits must be contiguous (N, C), stats (N, 2)");
  const std::int64_t rows = logits.shape[0], cols = logits.shape[1];
  if (rows == 0) return;
  dispatch_float(logits.dtype, "cross_entropy", [&]<class T>() {
    using A = compute_t<T>;
    dispatch_index(target.dtype, "cross_entropy", [&]<class I>() {
      with_row_group(cols, [&]<RowGroup G>() {
        cross_entropy_forward_kernel<T, I, G>
            <<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
                loss.ptr<A>(), loss.strides[0], stats.ptr<A>(), logits.ptr<T>(), target.ptr<I>(),
                target.strides[0], rows, cols, args.ignore_index, args.label_smoothing);
        MB_CUDA_CHECK_LAUNCH("cross_entropy_forward_kernel");
      });
    });
  });
}

void cross_entropy_backward(const StridedView& dlogits, const StridedView& logits,
                            const StridedView& stats, const StridedView& target,
                            const StridedView& g, CrossEntropyArgs args) {
  MB_ASSERT(logits.is_contiguous() && dlogits.is_contiguous() && logits.ndim == 2,
            "cross_entropy logits and dlogits must be contiguous (N, C)");
  const std::int64_t rows = logits.shape[0], cols = logits.shape[1];
  if (rows == 0) return;
  const double s = args.label_smoothing;
  dispatch_float(logits.dtype, "cross_entropy", [&]<class T>() {
    using A = compute_t<T>;
    // The smoothed target is off = s / C on every class, plus on = 1 - s on the label.
    const A off = static_cast<A>(s / static_cast<double>(cols));
    const A on = static_cast<A>(1.0 - s);
    dispatch_index(target.dtype, "cross_entropy", [&]<class I>() {
      with_row_group(cols, [&]<RowGroup G>() {
        cross_entropy_backward_kernel<T, I, G>
            <<<row_blocks<G>(rows), kThreads, 0, current_stream()>>>(
                dlogits.ptr<T>(), logits.ptr<T>(), stats.ptr<A>(), target.ptr<I>(),
                target.strides[0], g.ptr<A>(), g.strides[0], rows, cols, args.ignore_index, off,
                on);
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
  if (rows == 0) return;
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
                         const StridedView& weight, const StridedView& workspace) {
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
    if (!params || cols == 0) return;
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
        dweight.ptr<A>(), dbias.ptr<A>(), partial_w, partial_b, chunks, cols);
    MB_CUDA_CHECK_LAUNCH("layer_norm_params_kernel");
  });
}

}  // namespace microbatch::kernels::cuda
