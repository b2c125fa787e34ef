// Convolution and pooling kernels. conv2d is im2col + GEMM (kernels/gemm.h): im2col unfolds one
// image into a column buffer the op allocates, and col2im folds a column gradient back into an
// image gradient. max_pool2d writes the maximum of each window and where it was, so that the
// backward scatters dy there. Outputs are overwritten, except col2im and max_pool2d_backward,
// which accumulate (`+=`): overlapping windows add their contributions to one input element.
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

/// The sizes of one 2-d window sweep; shared by conv2d and max_pool2d.
struct Window2d {
  std::int64_t channels = 0;
  std::int64_t height = 0, width = 0;          // input plane
  std::int64_t kernel_h = 0, kernel_w = 0;
  std::int64_t stride = 1;
  std::int64_t padding = 0;                    // on all four sides
  std::int64_t out_h = 0, out_w = 0;           // (height + 2 * padding - kernel_h) / stride + 1

  std::int64_t col_rows() const { return channels * kernel_h * kernel_w; }
  std::int64_t col_cols() const { return out_h * out_w; }
};

namespace cpu {
/// col[(c, i, j), (oh, ow)] = x[c, oh * stride - padding + i, ow * stride - padding + j], 0 where
/// that falls in the padding. x (C, H, W) any strides and floating dtype; col (C*kH*kW, H'*W')
/// contiguous, f32 or f64 (16-bit x is widened here). Overwrites col.
void im2col(const StridedView& x, const StridedView& col, const Window2d& w);
/// The adjoint of im2col: dx[c, h, w] += every col entry that im2col read from (c, h, w).
/// col (C*kH*kW, H'*W') contiguous; dx (C, H, W) contiguous, same dtype as col. Accumulates.
void col2im(const StridedView& col, const StridedView& dx, const Window2d& w);

/// out[n, c, oh, ow] = max over the window (padding counts as -inf; NaN wins, as torch), and
/// indices[n, c, oh, ow] = h * W + w of the first maximal element. x (N, C, H, W) any strides;
/// out (same dtype) and indices (i64) contiguous (N, C, H', W'). Overwrites both.
void max_pool2d(const StridedView& x, const StridedView& out, const StridedView& indices,
                const Window2d& w);
/// dx[n, c, indices[n, c, oh, ow]] += dy[n, c, oh, ow]. dy and indices (N, C, H', W') any strides;
/// dx (N, C, H, W) contiguous, same dtype as dy. Accumulates (windows may overlap).
void max_pool2d_backward(const StridedView& dy, const StridedView& indices, const StridedView& dx,
                         const Window2d& w);
}  // namespace cpu

}  // namespace microbatch::kernels
