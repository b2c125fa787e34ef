// Indexing kernels: gather (forward of gather, index_select and embedding) and scatter_add (their
// backward). index_select is a gather whose index view broadcasts a 1-D index over the other dims
// (stride 0), so one pair of kernels serves all three ops. gather overwrites its output;
// scatter_add accumulates (`dst += ...`) in sequential row-major order, so repeated indices sum
// the same way on every run. Index values are checked by the op (first_out_of_range) before any
// kernel writes.
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

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
/// dst[c with c[dim] replaced by index[c]] += src[c] for every coordinate c of src's shape, in
/// row-major order of c (deterministic); index has src's shape. dst and src share a dtype;
/// 16-bit types add in f32.
void scatter_add(const StridedView& dst, const StridedView& src, const StridedView& index, int dim);
}  // namespace cpu

}  // namespace microbatch::kernels
