// CUDA row reductions on contiguous input: out[i] = op(in[i * inner : (i + 1) * inner]), written
// once per row (overwrites). Sums accumulate in f64 for floating input and exactly in i64 for
// integer and bool input; Max and ArgMax take the first maximal element, NaN counting as maximal.
//
// A group of G threads reduces one row, G chosen by the row's length: one thread for rows of at
// most 16 elements (the CPU's order exactly), a warp up to 1024, a block of 256 or 1024 beyond.
// Lane l folds elements l, l + G, l + 2G, ... in order; the group then combines its partials in a
// fixed tree (warp butterflies, then the warps' results in warp order), so a result never depends
// on timing and a rerun gives the same bits.
//
// sum_columns (Note [Column sums] in kernels/reduce.h) sums a contiguous (rows, cols) input over
// its rows without transposing it. A block covers kColumnSumTile adjacent columns and one chunk of
// rows: its warps read whole 32-column segments of a row (coalesced), warp w folding rows w, w + 8,
// ... of the chunk in order; the block adds its warps' partials in warp order into the workspace,
// and a second kernel adds each column's chunk partials in chunk order. Every order is fixed by the
// shape, so reruns give the same bits. add_column_sums runs the same first pass; its second adds
// w * each column's sum into a gradient slot (Note [Bias gradients in place] in
// core/ops/linalg.cpp).
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/reduce.h"

namespace microbatch::kernels::cuda {

namespace {

// A reducer: Acc is trivially constructible (it lives in shared memory), identity() is the empty
// fold, element() lifts x at column j, combine() is associative up to rounding and commutative, and
// write() stores the row's result.

template <class T>
struct SumFloat {  // f64 accumulation, as the CPU
  using Acc = double;
  static __device__ Acc identity() { return 0.0; }
  static __device__ Acc element(T x, std::int64_t) {
    return static_cast<double>(static_cast<compute_t<T>>(x));
  }
  static __device__ Acc combine(Acc a, Acc b) { return a + b; }
  static __device__ Acc shuffle(Acc a, int lane_mask) {
    return __shfl_xor_sync(kFullMask, a, lane_mask);
  }
  static __device__ void write(void* out, std::int64_t row, Acc a) {
    static_cast<T*>(out)[row] = static_cast<T>(static_cast<compute_t<T>>(a));
  }
};

template <class T>
struct SumInt {  // exact, into i64 (as torch.sum)
  using Acc = long long;
  static __device__ Acc identity() { return 0; }
  static __device__ Acc element(T x, std::int64_t) { return static_cast<Acc>(x); }
  static __device__ Acc combine(Acc a, Acc b) { return a + b; }
  static __device__ Acc shuffle(Acc a, int lane_mask) {
    return __shfl_xor_sync(kFullMask, a, lane_mask);
  }
  static __device__ void write(void* out, std::int64_t row, Acc a) {
    static_cast<std::int64_t*>(out)[row] = static_cast<std::int64_t>(a);
  }
};

// The first maximal element of a row and its column; Arg selects which one is written.
template <class T, bool Arg>
struct MaxOf {
  using C = compute_t<T>;
  using Key = std::conditional_t<(sizeof(C) < 4), int, C>;  // u8 and bool compare as int (shuffles)
  struct Acc {
    Key value;
    long long index;  // -1: no element yet
  };
  static __device__ Acc identity() { return Acc{Key(0), -1}; }
  static __device__ Acc element(T x, std::int64_t j) {
    return Acc{static_cast<Key>(static_cast<C>(x)), j};
  }
  // Picks the same element whatever the argument order: NaN first, then the larger value, then the
  // smaller index.
  static __device__ Acc combine(Acc a, Acc b) {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
    if (a_nan != b_nan) return a_nan ? a : b;
    if (!a_nan && a.value != b.value) return a.value > b.value ? a : b;
    return a.index < b.index ? a : b;
  }
  static __device__ Acc shuffle(Acc a, int lane_mask) {
    return Acc{__shfl_xor_sync(kFullMask, a.value, lane_mask),
               __shfl_xor_sync(kFullMask, a.index, lane_mask)};
  }
  static __device__ void write(void* out, std::int64_t row, Acc a) {
    if constexpr (Arg) {
      static_cast<std::int64_t*>(out)[row] = a.index < 0 ? 0 : a.index;
    } else {
      static_cast<T*>(out)[row] = static_cast<T>(static_cast<C>(a.index < 0 ? Key(0) : a.value));
    }
  }
};

// Combines the partials of a group of G threads (a power of two; 32 * 2^k beyond a warp); every
// thread of the group gets the result. `scratch` holds one Acc per warp of the block.
template <class R, int G>
__device__ __forceinline__ typename R::Acc group_combine(typename R::Acc v,
                                                         typename R::Acc* scratch) {
  if constexpr (G > 1) {
    for (int o = (G < 32 ? G : 32) / 2; o > 0; o >>= 1) v = R::combine(v, R::shuffle(v, o));
  }
  if constexpr (G > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous row's scratch may still be read
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < G / 32; ++w) v = R::combine(v, scratch[w]);
  }
  return v;
}

// Groups of G threads, Threads per block (>= G); rows in a grid-stride loop over groups. With
// G == Threads every thread of a block runs the same rows, so the __syncthreads above are reached
// by all of them.
template <class R, class T, int G, int Threads>
__global__ void __launch_bounds__(Threads)
    reduce_rows_kernel(void* out, const T* in, std::int64_t rows, std::int64_t inner) {
  __shared__ typename R::Acc scratch[Threads / 32];
  constexpr int kGroupsPerBlock = Threads / G;
  const int lane = static_cast<int>(threadIdx.x) % G;
  const std::int64_t first =
      static_cast<std::int64_t>(blockIdx.x) * kGroupsPerBlock + threadIdx.x / G;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kGroupsPerBlock;
  for (std::int64_t row = first; row < rows; row += step) {
    const T* x = in + row * inner;
    typename R::Acc acc = R::identity();
    for (std::int64_t j = lane; j < inner; j += G) acc = R::combine(acc, R::element(x[j], j));
    acc = group_combine<R, G>(acc, scratch);
    if (lane == 0) R::write(out, row, acc);
  }
}

template <class R, class T, int G, int Threads>
void launch_rows(const StridedView& out, const StridedView& in, std::int64_t rows,
                 std::int64_t inner) {
  const unsigned blocks = grid_for(rows, Threads / G);
  reduce_rows_kernel<R, T, G, Threads>
      <<<blocks, Threads, 0, current_stream()>>>(out.data, in.ptr<T>(), rows, inner);
}

template <class R, class T>
void reduce_with(const StridedView& out, const StridedView& in, std::int64_t rows,
                 std::int64_t inner) {
  if (inner <= 16) {
    launch_rows<R, T, 1, kThreads>(out, in, rows, inner);
  } else if (inner <= 1024) {
    launch_rows<R, T, 32, kThreads>(out, in, rows, inner);
  } else if (inner < (std::int64_t{1} << 16)) {
    launch_rows<R, T, kThreads, kThreads>(out, in, rows, inner);
  } else {
    launch_rows<R, T, 1024, 1024>(out, in, rows, inner);
  }
}

constexpr int kColumnWarps = 8;  // row groups of a column-sum block
constexpr int kColumnThreads = kColumnWarps * static_cast<int>(kColumnSumTile);
static_assert(kColumnSumTile == 32, "a column-sum block's warps each read one tile of a row");

// Block (x, y) sums columns [32x, 32x + 32) over rows [y * rows_per_chunk, ...) into
// partials[y * cols + c]. Each thread loads kUnroll rows before adding them (independent loads in
// flight together) and adds in row order.
template <class R, class T>
__global__ void __launch_bounds__(kColumnThreads)
    sum_columns_partial(typename R::Acc* partials, const T* in, std::int64_t ld,
                        std::int64_t rows, std::int64_t cols, std::int64_t rows_per_chunk) {
  using Acc = typename R::Acc;
  constexpr int kUnroll = 8;
  __shared__ Acc scratch[kColumnWarps][kColumnSumTile];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kColumnSumTile + lane;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_chunk;
  const std::int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  Acc acc = R::identity();
  if (col < cols) {
    std::int64_t r = begin + warp;
    for (; r + (kUnroll - 1) * kColumnWarps < end; r += kUnroll * kColumnWarps) {
      T x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = in[(r + u * kColumnWarps) * ld + col];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc = R::combine(acc, R::element(x[u], 0));
    }
    for (; r < end; r += kColumnWarps) acc = R::combine(acc, R::element(in[r * ld + col], 0));
  }
  scratch[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && col < cols) {
    Acc total = scratch[0][lane];
    for (int w = 1; w < kColumnWarps; ++w) total = R::combine(total, scratch[w][lane]);
    partials[static_cast<std::int64_t>(blockIdx.y) * cols + col] = total;
  }
}

// The chunk partials of column `col` added in chunk order.
template <class R>
__device__ __forceinline__ typename R::Acc column_total(const typename R::Acc* partials,
                                                        std::int64_t chunks, std::int64_t cols,
                                                        std::int64_t col) {
  typename R::Acc acc = partials[col];
#pragma unroll 8
  for (std::int64_t s = 1; s < chunks; ++s) acc = R::combine(acc, partials[s * cols + col]);
  return acc;
}

// out[c] = column c's total.
template <class R>
__global__ void sum_columns_final(void* out, const typename R::Acc* partials, std::int64_t chunks,
                                  std::int64_t cols) {
  for (std::int64_t col = global_thread(); col < cols; col += grid_threads())
    R::write(out, col, column_total<R>(partials, chunks, cols, col));
}

// dst[c] += w * column c's total, as add_weighted.
template <class R, class D>
__global__ void add_column_sums_final(D* dst, const typename R::Acc* partials, std::int64_t chunks,
                                      std::int64_t cols, compute_t<D> w) {
  for (std::int64_t col = global_thread(); col < cols; col += grid_threads()) {
    const auto total = static_cast<compute_t<D>>(column_total<R>(partials, chunks, cols, col));
    dst[col] = add_weighted(dst[col], total, w);
  }
}

// The first pass of a column sum (Note [Column sums]) into `partials`; returns the chunk count.
template <class R, class T>
std::int64_t column_partials(const StridedView& in, std::int64_t ld, std::int64_t rows,
                             std::int64_t cols, const StridedView& partials) {
  using Acc = typename R::Acc;
  const ColumnSplit split = column_split(rows, cols);
  MB_ASSERT(partials.is_contiguous() && partials.numel() == split.chunks * cols &&
                dtype_size(partials.dtype) == sizeof(Acc),
            "column sums: the workspace has {} elements of {} bytes, expected ({}, {}) of {}",
            partials.numel(), dtype_size(partials.dtype), split.chunks, cols, sizeof(Acc));
  MB_ASSERT(split.chunks <= 65535, "column sums: {} chunks exceed the grid's y limit",
            split.chunks);
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kColumnSumTile)),
                  static_cast<unsigned>(split.chunks));
  sum_columns_partial<R, T><<<grid, kColumnThreads, 0, current_stream()>>>(
      partials.ptr<Acc>(), in.ptr<T>(), ld, rows, cols, split.rows_per_chunk);
  MB_CUDA_CHECK_LAUNCH("sum_columns_partial");
  return split.chunks;
}

template <class R, class T>
void launch_columns(const StridedView& out, const StridedView& in, std::int64_t ld,
                    std::int64_t rows, std::int64_t cols, const StridedView& partials) {
  using Acc = typename R::Acc;
  const std::int64_t chunks = column_partials<R, T>(in, ld, rows, cols, partials);
  sum_columns_final<R><<<grid_for(cols, kThreads), kThreads, 0, current_stream()>>>(
      out.data, partials.ptr<Acc>(), chunks, cols);
  MB_CUDA_CHECK_LAUNCH("sum_columns_final");
}

}  // namespace

void reduce_rows(ReduceOp op, const StridedView& out, const StridedView& in, std::int64_t inner) {
  MB_ASSERT(inner == 0 || in.is_contiguous(), "reduce_rows needs a contiguous input");
  const std::int64_t rows = inner == 0 ? out.numel() : in.numel() / inner;
  if (rows == 0) return;
  dispatch_all(in.dtype, [&]<class T>() {
    switch (op) {
      case ReduceOp::Sum:
        if constexpr (std::is_integral_v<T>) {
          reduce_with<SumInt<T>, T>(out, in, rows, inner);
        } else {
          reduce_with<SumFloat<T>, T>(out, in, rows, inner);
        }
        break;
      case ReduceOp::Max:
        reduce_with<MaxOf<T, false>, T>(out, in, rows, inner);
        break;
      case ReduceOp::ArgMax:
        reduce_with<MaxOf<T, true>, T>(out, in, rows, inner);
        break;
    }
  });
  MB_CUDA_CHECK_LAUNCH("reduce_rows");
}

void sum_columns(const StridedView& out, const StridedView& in, std::int64_t cols,
                 const StridedView& partials) {
  // Contiguous, or (rows, cols) rows of a wider matrix (Note [Padded rows] in core/ops/linalg.cpp).
  const bool padded = in.is_rows() && in.shape[1] == cols;
  MB_ASSERT((in.is_contiguous() || padded) && out.is_contiguous() && cols > 0 &&
                in.numel() % cols == 0 && out.numel() == cols,
            "sum_columns: input of {} elements and output of {} do not make {} columns", in.numel(),
            out.numel(), cols);
  const std::int64_t rows = in.numel() / cols;  // 0 rows: one empty chunk, out = 0
  const std::int64_t ld = in.is_contiguous() ? cols : in.strides[0];
  dispatch_all(in.dtype, [&]<class T>() {
    if constexpr (std::is_integral_v<T>) {
      launch_columns<SumInt<T>, T>(out, in, ld, rows, cols, partials);
    } else {
      launch_columns<SumFloat<T>, T>(out, in, ld, rows, cols, partials);
    }
  });
}

void add_column_sums(const StridedView& dst, const StridedView& in, double weight,
                     const StridedView& partials) {
  MB_ASSERT(in.is_rows() && dst.is_contiguous() && dst.numel() == in.shape[1],
            "add_column_sums: a ({}) destination for {}-d input of {} elements", dst.numel(),
            in.ndim, in.numel());
  const std::int64_t rows = in.shape[0], cols = in.shape[1];
  if (cols == 0) return;
  dispatch_float(in.dtype, "add_column_sums", [&]<class T>() {
    using R = SumFloat<T>;
    const std::int64_t chunks = column_partials<R, T>(in, in.strides[0], rows, cols, partials);
    dispatch_float(dst.dtype, "add_column_sums", [&]<class D>() {
      add_column_sums_final<R, D><<<grid_for(cols, kThreads), kThreads, 0, current_stream()>>>(
          dst.ptr<D>(), partials.ptr<typename R::Acc>(), chunks, cols,
          static_cast<compute_t<D>>(weight));
      MB_CUDA_CHECK_LAUNCH("add_column_sums_final");
    });
  });
}

}  // namespace microbatch::kernels::cuda
