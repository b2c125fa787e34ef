// Convolution and pooling kernels. conv2d is im2col + GEMM (kernels/gemm.h): im2col unfolds one
// image into a column buffer the op allocates, and col2im folds a column gradient back into an
// image gradient (builds with cuDNN run conv2d on CUDA through cuDNN instead). max_pool2d writes
// the maximum of each window and where it was, so that the backward scatters dy there. Outputs
// are overwritten, except col2im and max_pool2d_backward, which accumulate (`+=`): overlapping
// windows add their contributions to one input element.
#pragma once

#include <cstdint>
#include <limits>

#include "core/dtype.h"
#include "core/half.h"
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

  MB_HOST_DEVICE std::int64_t col_rows() const { return channels * kernel_h * kernel_w; }
  MB_HOST_DEVICE std::int64_t col_cols() const { return out_h * out_w; }
};

/// Along one axis, the window positions o in [0, out) whose taps cover input position x, i.e.
/// o * stride - padding <= x < o * stride - padding + kernel, as [*first, *last] (empty when
/// *first > *last). Lets the backward kernels gather, one thread per input element.
MB_HOST_DEVICE inline void covering_windows(std::int64_t x, std::int64_t kernel,
                                            std::int64_t stride, std::int64_t padding,
                                            std::int64_t out, std::int64_t* first,
                                            std::int64_t* last) {
  const std::int64_t lowest = x + padding - kernel + 1;  // o * stride >= lowest
  *first = lowest <= 0 ? 0 : (lowest + stride - 1) / stride;
  const std::int64_t highest = (x + padding) / stride;   // x + padding >= 0 for x >= 0
  *last = highest < out - 1 ? highest : out - 1;
}

// Per-element math of the CUDA kernels (one thread per element), kept here so that the CPU tests
// can check it against the cpu:: kernels bit for bit.

/// im2col's entry e of col (C*kH*kW, H'*W'), row-major: x under tap (i, j) of window (oh, ow),
/// 0 in the padding. x (C, H, W) any strides, storage type T; C is col's type.
template <class T, class C>
MB_HOST_DEVICE C im2col_element(const StridedView& x, const Window2d& w, std::int64_t e) {
  const std::int64_t cols = w.out_h * w.out_w;
  const std::int64_t row = e / cols, at = e - row * cols;  // row = (c, i, j), at = (oh, ow)
  const std::int64_t j = row % w.kernel_w, i = (row / w.kernel_w) % w.kernel_h;
  const std::int64_t c = row / (w.kernel_w * w.kernel_h);
  const std::int64_t oh = at / w.out_w, ow = at - oh * w.out_w;
  const std::int64_t h = oh * w.stride - w.padding + i, ww = ow * w.stride - w.padding + j;
  if (h < 0 || h >= w.height || ww < 0 || ww >= w.width) return C(0);
  const T v = static_cast<const T*>(x.data)[c * x.strides[0] + h * x.strides[1] + ww * x.strides[2]];
  return static_cast<C>(static_cast<compute_t<T>>(v));
}

/// col2im for element e = (c, h, x) of the (C, H, W) image: `acc` plus every col entry im2col read
/// from there, added in cpu::col2im's order (tap i, then j; tap i = h + padding - oh * stride rises
/// as oh falls, so the windows are walked from the last down).
template <class C>
MB_HOST_DEVICE C col2im_element(const C* col, C acc, const Window2d& w, std::int64_t e) {
  const std::int64_t cols = w.out_h * w.out_w, plane = w.height * w.width;
  const std::int64_t c = e / plane, rem = e - c * plane;
  const std::int64_t h = rem / w.width, x = rem - h * w.width;
  std::int64_t oh_first, oh_last, ow_first, ow_last;
  covering_windows(h, w.kernel_h, w.stride, w.padding, w.out_h, &oh_first, &oh_last);
  covering_windows(x, w.kernel_w, w.stride, w.padding, w.out_w, &ow_first, &ow_last);
  for (std::int64_t oh = oh_last; oh >= oh_first; --oh) {
    const std::int64_t i = h + w.padding - oh * w.stride;
    for (std::int64_t ow = ow_last; ow >= ow_first; --ow) {
      const std::int64_t j = x + w.padding - ow * w.stride;
      acc += col[((c * w.kernel_h + i) * w.kernel_w + j) * cols + oh * w.out_w + ow];
    }
  }
  return acc;
}

/// Whether a max-pooling scan replaces its best value so far with v: the first element, a larger
/// one, or a NaN over a number (NaN beats anything and stays; among equals the first wins).
template <class C>
MB_HOST_DEVICE bool pool_takes(C v, C best, bool have_best) {
  return !have_best || v > best || (v != v && best == best);
}

/// max_pool2d for window e = (n, c, oh, ow) of the (N, C, H', W') output: its maximum (padding
/// is -inf; the first maximum wins; NaN beats anything and stays) and where it is, h * W + w.
/// x (N, C, H, W) any strides, storage type T.
template <class T>
MB_HOST_DEVICE compute_t<T> max_pool2d_element(const StridedView& x, const Window2d& w,
                                               std::int64_t e, std::int64_t* argmax) {
  using C = compute_t<T>;
  const std::int64_t ow = e % w.out_w, oh = (e / w.out_w) % w.out_h;
  const std::int64_t c = (e / (w.out_w * w.out_h)) % w.channels;
  const std::int64_t n = e / (w.out_w * w.out_h * w.channels);
  const T* plane = static_cast<const T*>(x.data) + n * x.strides[0] + c * x.strides[1];
  const std::int64_t h0 = oh * w.stride - w.padding, w0 = ow * w.stride - w.padding;
  C best = -std::numeric_limits<C>::infinity();
  std::int64_t best_at = -1;
  for (std::int64_t h = h0 < 0 ? 0 : h0; h < h0 + w.kernel_h && h < w.height; ++h) {
    for (std::int64_t ww = w0 < 0 ? 0 : w0; ww < w0 + w.kernel_w && ww < w.width; ++ww) {
      const C v = static_cast<C>(plane[h * x.strides[2] + ww * x.strides[3]]);
      if (pool_takes(v, best, best_at >= 0)) {
        best = v;
        best_at = h * w.width + ww;
      }
    }
  }
  *argmax = best_at;
  return best;
}

/// max_pool2d_backward for input element e = (n, c, h, x) of (N, C, H, W): `acc` plus dy of every
/// window whose argmax it is, in cpu::max_pool2d_backward's order and rounding to T after each
/// add as it does. dy (storage type T) and indices (N, C, H', W') any strides.
template <class T>
MB_HOST_DEVICE T max_pool2d_backward_element(const StridedView& dy, const StridedView& indices,
                                             T acc, const Window2d& w, std::int64_t e) {
  using C = compute_t<T>;
  const std::int64_t x = e % w.width, h = (e / w.width) % w.height;
  const std::int64_t c = (e / (w.width * w.height)) % w.channels;
  const std::int64_t n = e / (w.width * w.height * w.channels);
  std::int64_t oh_first, oh_last, ow_first, ow_last;
  covering_windows(h, w.kernel_h, w.stride, w.padding, w.out_h, &oh_first, &oh_last);
  covering_windows(x, w.kernel_w, w.stride, w.padding, w.out_w, &ow_first, &ow_last);
  const std::int64_t at = h * w.width + x;
  const std::int64_t* idx = static_cast<const std::int64_t*>(indices.data) +
                            n * indices.strides[0] + c * indices.strides[1];
  const T* g = static_cast<const T*>(dy.data) + n * dy.strides[0] + c * dy.strides[1];
  for (std::int64_t oh = oh_first; oh <= oh_last; ++oh) {
    for (std::int64_t ow = ow_first; ow <= ow_last; ++ow) {
      if (idx[oh * indices.strides[2] + ow * indices.strides[3]] != at) continue;
      const C v = static_cast<C>(g[oh * dy.strides[2] + ow * dy.strides[3]]);
      acc = static_cast<T>(static_cast<C>(acc) + v);
    }
  }
  return acc;
}

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

namespace cuda {
/// The same four kernels, same views and contracts. col2im and max_pool2d_backward gather (one
/// thread per input element, in the CPU's order), so they are deterministic and match the CPU
/// bit for bit.
void im2col(const StridedView& x, const StridedView& col, const Window2d& w);
void col2im(const StridedView& col, const StridedView& dx, const Window2d& w);
void max_pool2d(const StridedView& x, const StridedView& out, const StridedView& indices,
                const Window2d& w);
void max_pool2d_backward(const StridedView& dy, const StridedView& indices, const StridedView& dx,
                         const Window2d& w);

/// Whether this build runs convolutions through cuDNN (false: conv2d uses im2col + cuBLAS on CUDA).
bool has_cudnn();

// cuDNN convolutions (cross-correlation, NCHW, every view contiguous, one floating dtype; 16-bit
// tensors are read and written as such with f32 math, f32 without TF32). `workspace` is any
// contiguous buffer the op allocated; the fastest deterministic algorithm that fits in it runs.
// Each returns false, having run nothing, when no such algorithm fits or a tensor is empty or
// past cuDNN's int sizes; the op then falls back to im2col.

/// y (N, O, H', W') = conv(x (N, C, H, W), weight (O, C, kH, kW)) + beta * y; beta 0 or 1.
bool conv2d_forward(const StridedView& x, const StridedView& weight, const StridedView& y,
                    const StridedView& workspace, const Window2d& w, double beta);
/// dx (N, C, H, W) = the gradient of conv2d with respect to x, given dy. Overwrites dx.
bool conv2d_backward_data(const StridedView& weight, const StridedView& dy, const StridedView& dx,
                          const StridedView& workspace, const Window2d& w);
/// dweight (O, C, kH, kW) = the gradient with respect to the weight, summed over the batch.
/// Overwrites dweight.
bool conv2d_backward_filter(const StridedView& x, const StridedView& dy, const StridedView& dweight,
                            const StridedView& workspace, const Window2d& w);
}  // namespace cuda

}  // namespace microbatch::kernels
