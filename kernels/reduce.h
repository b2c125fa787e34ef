// Row reductions: the op permutes the reduced dims last and makes the input contiguous, so a
// kernel reduces `inner` consecutive elements per output. Outputs are overwritten.
//
// Note [Column sums]: a sum over the leading dims of a contiguous input (a bias gradient: (B*T, C)
// summed to (C)) would need a transposing copy to become rows. On CUDA it is summed in place as a
// (rows, cols) matrix instead: the rows are split into column_split(rows, cols).chunks ranges, a
// first pass writes one partial per (chunk, column) into an f64 (i64 for integer input) workspace,
// and a second pass adds each column's partials in chunk order. The split depends on the shape
// only, so the op can size the workspace on any device (meta included) and results do not change
// from run to run.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

enum class ReduceOp { Sum, Max, ArgMax };

/// Adjacent columns one block of a column sum covers (a warp reads them from one row).
inline constexpr std::int64_t kColumnSumTile = 32;

/// How a column sum splits its rows: `chunks` consecutive ranges of `rows_per_chunk` rows (the
/// last one may be shorter; none is empty unless there are no rows).
struct ColumnSplit {
  std::int64_t chunks = 1;
  std::int64_t rows_per_chunk = 0;
};

/// The split of a (rows, cols) column sum (Note [Column sums]): enough chunks to give the device
/// about 1024 blocks of kColumnSumTile columns, each chunk at least 64 rows, at most 256 chunks.
inline ColumnSplit column_split(std::int64_t rows, std::int64_t cols) {
  constexpr std::int64_t kTargetBlocks = 1024, kMinRows = 64, kMaxChunks = 256;
  if (rows <= 0) return {};
  const std::int64_t tiles =
      std::max<std::int64_t>(1, (cols + kColumnSumTile - 1) / kColumnSumTile);
  const std::int64_t chunks = std::max<std::int64_t>(
      1, std::min({(kTargetBlocks + tiles - 1) / tiles, kMaxChunks, rows / kMinRows}));
  const std::int64_t per = (rows + chunks - 1) / chunks;
  return {(rows + per - 1) / per, per};
}

namespace cpu {
/// out[i] = op(in[i * inner : (i + 1) * inner]); in and out contiguous. Sum accumulates in f64
/// (integer and bool input: exactly, into an i64 output);
/// ArgMax writes i64 (first maximal index; NaN counts as maximal, as torch.argmax).
void reduce_rows(ReduceOp op, const StridedView& out, const StridedView& in, std::int64_t inner);
/// dst[c] += weight * sum over r of in[r, c], for any 2-d (rows, cols) floating view and a
/// contiguous floating dst of cols elements (a bias's gradient slot: Note [Bias gradients in
/// place] in core/ops/linalg.cpp). Each column is summed in f64 in row order, as reduce_rows sums,
/// rounded to dst's compute type, then multiplied and added as accumulate does. The sums live in
/// a scratch vector of cols doubles.
void add_column_sums(const StridedView& dst, const StridedView& in, double weight);
}  // namespace cpu

namespace cuda {
/// As cpu::reduce_rows, on the current device's stream. Each row is reduced by a thread, a warp
/// or a block (by its length) in a fixed tree, so results do not change from run to run.
void reduce_rows(ReduceOp op, const StridedView& out, const StridedView& in, std::int64_t inner);
/// out[c] = sum over r of in[r * cols + c] for a contiguous input of (rows, cols) elements, or of
/// in[r * ld + c] for a 2-d (rows, cols) view with strides (ld >= cols, 1), and a contiguous out of
/// cols (Note [Column sums]), accumulating as reduce_rows' Sum. `partials` is a
/// contiguous (column_split(rows, cols).chunks, cols) f64 workspace (i64 for integer and bool
/// input), overwritten; out is overwritten.
void sum_columns(const StridedView& out, const StridedView& in, std::int64_t cols,
                 const StridedView& partials);
/// As cpu::add_column_sums for a view of unit-stride rows (contiguous, or padded: Note [Padded
/// rows] in core/ops/linalg.cpp), through sum_columns' two passes: the second adds each column's
/// chunk partials in chunk order and then weight * that sum into dst. `partials` as for
/// sum_columns (f64).
void add_column_sums(const StridedView& dst, const StridedView& in, double weight,
                     const StridedView& partials);
}  // namespace cuda

}  // namespace microbatch::kernels
