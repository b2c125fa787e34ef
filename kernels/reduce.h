// Row reductions: the op permutes the reduced dims last and makes the input contiguous, so a
// kernel reduces `inner` consecutive elements per output. Outputs are overwritten.
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

enum class ReduceOp { Sum, Max, ArgMax };

namespace cpu {
/// out[i] = op(in[i * inner : (i + 1) * inner]); in and out contiguous. Sum accumulates in f64
/// (integer and bool input: exactly, into an i64 output);
/// ArgMax writes i64 (first maximal index; NaN counts as maximal, as torch.argmax).
void reduce_rows(ReduceOp op, const StridedView& out, const StridedView& in, std::int64_t inner);
}  // namespace cpu

namespace cuda {
/// As cpu::reduce_rows, on the current device's stream. Each row is reduced by a thread, a warp
/// or a block (by its length) in a fixed tree, so results do not change from run to run.
void reduce_rows(ReduceOp op, const StridedView& out, const StridedView& in, std::int64_t inner);
}  // namespace cuda

}  // namespace microbatch::kernels
