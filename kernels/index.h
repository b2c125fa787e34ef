// Indexing kernels: gather (forward of gather, index_select and embedding) and scatter_add (their
// backward). index_select is a gather whose index view broadcasts a 1-D index over the other dims
// (stride 0), so one pair of kernels serves all three ops. gather overwrites its output;
// scatter_add accumulates (`dst += ...`) in sequential row-major order, so repeated indices sum
// the same way on every run. Index values are checked by the op: on the CPU before any kernel
// writes (first_out_of_range), on CUDA asynchronously (check_index_range).
//
// Note [Deferred index errors]: checking CUDA index values eagerly would cost a host
// synchronisation per embedding lookup. Instead check_index_range records the first bad value in a
// device slot, the kernels skip bad indices, and the error is raised at the next point where the
// host waits for the device anyway: a copy to the host (Tensor::copy_, item) and
// synchronize_checked (kernels/device.h).
//
// Note [Sorted scatter_add]: the embedding backward scatter-adds many rows (B*T positions) of few
// columns (C) along dim 0, one index per row. One thread per column walking every position leaves
// the device nearly idle, so where sorted_scatter_workspace_bytes allows, CUDA sorts the (index,
// position) pairs by index (a stable radix sort: positions stay in order within an index) and
// lets each block add runs of equal indices, a thread per column. Every destination element still
// receives its source elements in position order, rounded to its dtype after each addition, so the
// result has the bits of the CPU's loop.
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

/// Where the parts of a sorted scatter's workspace start, in bytes (each aligned to 256): two
/// buffers of n u32 keys and two of n i32 positions for the sort, then `sort_bytes` of the radix
/// sort's own scratch; `total` bytes in all.
struct SortedScatterLayout {
  std::int64_t keys[2] = {};
  std::int64_t positions[2] = {};
  std::int64_t sort = 0;
  std::int64_t sort_bytes = 0;
  std::int64_t total = 0;
};

/// The workspace layout for n positions. sort_bytes bounds what CUB's one-sweep radix sort of
/// 32-bit keys asks for: digit counters per pass and a look-back word per digit and tile (a tile
/// holds at least 256 keys). Should the sort ask for more, the CUDA kernel takes the unsorted path.
inline SortedScatterLayout sorted_scatter_layout(std::int64_t n) {
  constexpr std::int64_t kAlign = 256;
  const std::int64_t part = (4 * n + kAlign - 1) / kAlign * kAlign;  // n 4-byte words
  SortedScatterLayout l;
  l.keys[0] = 0;
  l.keys[1] = part;
  l.positions[0] = 2 * part;
  l.positions[1] = 3 * part;
  l.sort = 4 * part;
  l.sort_bytes = 4 * n + (std::int64_t{128} << 10);
  l.total = l.sort + l.sort_bytes;
  return l;
}

/// Fewest positions for which sorting pays (below it, one thread per column walks them all).
inline constexpr std::int64_t kSortedScatterMinPositions = 256;

/// Bytes of workspace cuda::scatter_add_sorted needs for these scatter_add views, or 0 where it
/// does not apply: dim 0 of 2-D views whose index is the same across dim 1 (the backward of
/// embedding, or of index_select along dim 0), with at least kSortedScatterMinPositions positions
/// and sizes below 2^31. Shapes and strides only, so that meta can mirror the allocation.
inline std::int64_t sorted_scatter_workspace_bytes(const StridedView& dst, const StridedView& src,
                                                   const StridedView& index, int dim) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 31;
  if (dim != 0 || dst.ndim != 2 || src.ndim != 2 || index.ndim != 2) return 0;
  if (index.strides[1] != 0 && src.shape[1] != 1) return 0;  // an index per element
  const std::int64_t n = src.shape[0];
  if (n < kSortedScatterMinPositions || n >= kLimit || src.shape[1] < 1) return 0;
  if (dst.shape[0] < 1 || dst.shape[0] >= kLimit - 1) return 0;  // keys up to dst.shape[0]
  return sorted_scatter_layout(n).total;
}

/// Where an index view first leaves [0, size): its row-major position and value
/// (position -1: nowhere).
struct IndexRangeError {
  std::int64_t position = -1;
  std::int64_t value = 0;
};

namespace cpu {
/// The first index value (i32 or i64, any strides) outside [0, size), in row-major order.
IndexRangeError first_out_of_range(const StridedView& index, std::int64_t size);
/// out[c] = in[c with c[dim] replaced by index[c]] for every coordinate c of out's shape;
/// index has out's shape, in has at least it on every dim but `dim`. out and in share a dtype.
void gather(const StridedView& out, const StridedView& in, const StridedView& index, int dim);
/// dst[c with c[dim] replaced by index[c]] += weight * src[c] for every coordinate c of src's
/// shape, in row-major order of c (deterministic); index has src's shape. dst and src share a
/// dtype, or both are floating (the embedding backward adds 16-bit rows straight into an f32
/// gradient slot: Note [Embedding gradients in place] in core/ops/index.cpp); 16-bit types add
/// in f32. With weight 1 and one dtype, dst += src; otherwise the product is rounded to dst's
/// compute type first, then the sum, as accumulate does.
void scatter_add(const StridedView& dst, const StridedView& src, const StridedView& index, int dim,
                 double weight = 1.0);
}  // namespace cpu

// The CUDA kernels check index values without stopping the host (Note [Deferred index errors]).
namespace cuda {
/// Records asynchronously (no host sync) the first row-major position of `index` whose value is
/// outside [0, size) and is not `allowed` (pass INT64_MIN for none), in a device slot of the
/// current device tagged with `op` (a string literal); gather/scatter_add skip such indices
/// instead of reading or writing out of bounds. The first error recorded is the one kept.
void check_index_range(const StridedView& index, std::int64_t size, std::int64_t allowed,
                       const char* op);
/// If a check recorded an error since the last call, clears it and throws
/// "[<op>] index <value> is out of range for size <size> (at position <p>)". Synchronises with
/// the device's stream when a check has run since the last call.
void raise_pending_index_error(int device);
/// As cpu::gather; an index outside [0, in.shape[dim]) gives 0.
void gather(const StridedView& out, const StridedView& in, const StridedView& index, int dim);
/// As cpu::scatter_add, with the CPU's order of additions: one thread per destination line (all
/// coordinates but `dim`) walks `dim` in order, so no two threads touch one element and no atomics
/// are needed; an index outside [0, dst.shape[dim]) adds nothing.
void scatter_add(const StridedView& dst, const StridedView& src, const StridedView& index, int dim,
                 double weight = 1.0);
/// As scatter_add, with the same bits (Note [Sorted scatter_add]), for views where
/// sorted_scatter_workspace_bytes is positive; `workspace` is a contiguous u8 buffer of at least
/// that many bytes.
void scatter_add_sorted(const StridedView& dst, const StridedView& src, const StridedView& index,
                        int dim, const StridedView& workspace, double weight = 1.0);
}  // namespace cuda

}  // namespace microbatch::kernels
