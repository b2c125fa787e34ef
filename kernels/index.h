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
void scatter_add(const StridedView& dst, const StridedView& src, const StridedView& index, int dim);
}  // namespace cuda

}  // namespace microbatch::kernels
