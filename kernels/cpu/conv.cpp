// im2col / col2im for conv2d, and max_pool2d forward and backward, as plain loops.
// im2col, max_pool2d: overwrite. col2im, max_pool2d_backward: accumulate (`+=`), because one
// input element is read by several overlapping windows and its gradient is their sum.
#include "kernels/conv.h"

#include <algorithm>
#include <limits>

#include "core/dtype.h"

namespace microbatch::kernels::cpu {

namespace {

// Outputs below which a pooling pass runs on one thread (a team's start costs more than it saves).
constexpr std::int64_t kParallelOutputs = 1 << 14;

// The output range [lo, hi) of positions o whose tap i lands inside [0, size): o * stride -
// padding + i in range. Lets the inner loops skip bounds tests.
void valid_range(std::int64_t size, std::int64_t out, std::int64_t stride, std::int64_t padding,
                 std::int64_t tap, std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t shift = padding - tap;  // o * stride >= shift and o * stride < size + shift
  lo = shift <= 0 ? 0 : (shift + stride - 1) / stride;
  const std::int64_t end = size + shift;  // exclusive bound on o * stride
  hi = end <= 0 ? 0 : (end + stride - 1) / stride;
  if (hi > out) hi = out;
  if (lo > hi) lo = hi;
}

// One tap (i, j) of im2col where the stride is 1 and x's rows (contiguous, one after another) are
// as wide as the output's: the tap's valid rows [oh_lo, oh_hi) read one contiguous run of the
// plane, shifted by j - padding, so they are copied as one run (which the compiler vectorizes); the
// columns outside [ow_lo, ow_hi), which that run filled with the neighbouring rows' ends, and the
// rows outside [oh_lo, oh_hi) are then zeroed. The values are those of the row-by-row loop.
template <class T, class C>
void im2col_tap_block(const T* plane, C* row, const Window2d& w, std::int64_t i, std::int64_t j,
                      std::int64_t oh_lo, std::int64_t oh_hi, std::int64_t ow_lo,
                      std::int64_t ow_hi) {
  const std::int64_t width = w.out_w;
  for (std::int64_t e = 0; e < oh_lo * width; ++e) row[e] = C(0);
  for (std::int64_t e = oh_hi * width; e < w.out_h * width; ++e) row[e] = C(0);
  if (oh_hi <= oh_lo || ow_hi <= ow_lo) {
    for (std::int64_t e = oh_lo * width; e < oh_hi * width; ++e) row[e] = C(0);
    return;
  }
  C* block = row + oh_lo * width;
  const T* from = plane + (oh_lo - w.padding + i) * width;  // x's row of output row oh_lo
  const std::int64_t shift = j - w.padding;
  const std::int64_t end = (oh_hi - oh_lo - 1) * width + ow_hi;  // one past the last valid element
  for (std::int64_t e = ow_lo; e < end; ++e)
    block[e] = static_cast<C>(static_cast<compute_t<T>>(from[e + shift]));
  for (std::int64_t r = 0; r < oh_hi - oh_lo; ++r) {
    C* out = block + r * width;
    for (std::int64_t ow = 0; ow < ow_lo; ++ow) out[ow] = C(0);
    for (std::int64_t ow = ow_hi; ow < width; ++ow) out[ow] = C(0);
  }
}

template <class T, class C>
void im2col_typed(const StridedView& x, const StridedView& col, const Window2d& w) {
  const T* src = x.ptr<const T>();
  C* dst = col.ptr<C>();
  const std::int64_t sc = x.strides[0], sh = x.strides[1], sw = x.strides[2];
  const std::int64_t cols = w.col_cols();
  // Stride 1 over contiguous rows as wide as the output's ("same" padding): a tap's rows are one
  // run.
  const bool same_size_rows = w.stride == 1 && sw == 1 && sh == w.width && w.out_w == w.width;
  for (std::int64_t c = 0; c < w.channels; ++c) {
    for (std::int64_t i = 0; i < w.kernel_h; ++i) {
      std::int64_t oh_lo, oh_hi;
      valid_range(w.height, w.out_h, w.stride, w.padding, i, oh_lo, oh_hi);
      for (std::int64_t j = 0; j < w.kernel_w; ++j) {
        std::int64_t ow_lo, ow_hi;
        valid_range(w.width, w.out_w, w.stride, w.padding, j, ow_lo, ow_hi);
        C* row = dst + ((c * w.kernel_h + i) * w.kernel_w + j) * cols;  // (H', W') of this tap
        if (same_size_rows) {
          im2col_tap_block(src + c * sc, row, w, i, j, oh_lo, oh_hi, ow_lo, ow_hi);
          continue;
        }
        for (std::int64_t oh = 0; oh < w.out_h; ++oh) {
          C* out = row + oh * w.out_w;
          if (oh < oh_lo || oh >= oh_hi) {
            for (std::int64_t ow = 0; ow < w.out_w; ++ow) out[ow] = C(0);
            continue;
          }
          const T* in = src + c * sc + (oh * w.stride - w.padding + i) * sh;
          for (std::int64_t ow = 0; ow < ow_lo; ++ow) out[ow] = C(0);
          if (w.stride == 1 && sw == 1) {  // a contiguous run: a copy the compiler vectorizes
            const T* run = in - w.padding + j;
            for (std::int64_t ow = ow_lo; ow < ow_hi; ++ow)
              out[ow] = static_cast<C>(static_cast<compute_t<T>>(run[ow]));
          } else {
            for (std::int64_t ow = ow_lo; ow < ow_hi; ++ow)
              out[ow] = static_cast<C>(
                  static_cast<compute_t<T>>(in[(ow * w.stride - w.padding + j) * sw]));
          }
          for (std::int64_t ow = ow_hi; ow < w.out_w; ++ow) out[ow] = C(0);
        }
      }
    }
  }
}

template <class C>
void col2im_typed(const StridedView& col, const StridedView& dx, const Window2d& w) {
  const C* src = col.ptr<const C>();
  C* dst = dx.ptr<C>();
  const std::int64_t cols = w.col_cols();
  for (std::int64_t c = 0; c < w.channels; ++c) {
    for (std::int64_t i = 0; i < w.kernel_h; ++i) {
      std::int64_t oh_lo, oh_hi;
      valid_range(w.height, w.out_h, w.stride, w.padding, i, oh_lo, oh_hi);
      for (std::int64_t j = 0; j < w.kernel_w; ++j) {
        std::int64_t ow_lo, ow_hi;
        valid_range(w.width, w.out_w, w.stride, w.padding, j, ow_lo, ow_hi);
        const C* row = src + ((c * w.kernel_h + i) * w.kernel_w + j) * cols;
        for (std::int64_t oh = oh_lo; oh < oh_hi; ++oh) {
          C* out = dst + (c * w.height + oh * w.stride - w.padding + i) * w.width;
          const C* in = row + oh * w.out_w;
          if (w.stride == 1) {  // contiguous runs on both sides: vectorized adds
            C* run = out - w.padding + j;
            for (std::int64_t ow = ow_lo; ow < ow_hi; ++ow) run[ow] += in[ow];
          } else {
            for (std::int64_t ow = ow_lo; ow < ow_hi; ++ow)
              out[ow * w.stride - w.padding + j] += in[ow];
          }
        }
      }
    }
  }
}

}  // namespace

void im2col(const StridedView& x, const StridedView& col, const Window2d& w) {
  dispatch_float(x.dtype, "im2col", [&]<class T>() {
    if (col.dtype == DType::f64) im2col_typed<T, double>(x, col, w);
    else im2col_typed<T, float>(x, col, w);
  });
}

void col2im(const StridedView& col, const StridedView& dx, const Window2d& w) {
  if (col.dtype == DType::f64) col2im_typed<double>(col, dx, w);
  else col2im_typed<float>(col, dx, w);
}

void max_pool2d(const StridedView& x, const StridedView& out, const StridedView& indices,
                const Window2d& w) {
  dispatch_float(x.dtype, "max_pool2d", [&]<class T>() {
    using C = compute_t<T>;
    // A plane (n, c) at a time, the planes shared among the threads. Each window is scanned as the
    // CUDA kernel scans it (max_pool2d_element in kernels/conv.h: rows, then columns, with
    // pool_takes), so the values and indices are the same, without that function's index
    // arithmetic per output.
    const std::int64_t planes = x.shape[0] * w.channels, plane_out = w.out_h * w.out_w;
#pragma omp parallel for schedule(static) if (planes * plane_out >= kParallelOutputs)
    for (std::int64_t p = 0; p < planes; ++p) {
      const std::int64_t n = p / w.channels, c = p % w.channels;
      const T* plane = x.ptr<const T>() + n * x.strides[0] + c * x.strides[1];
      T* o = out.ptr<T>() + p * plane_out;
      std::int64_t* at = indices.ptr<std::int64_t>() + p * plane_out;
      for (std::int64_t oh = 0; oh < w.out_h; ++oh) {
        const std::int64_t h0 = oh * w.stride - w.padding;
        const std::int64_t h_lo = h0 < 0 ? 0 : h0, h_hi = std::min(h0 + w.kernel_h, w.height);
        for (std::int64_t ow = 0; ow < w.out_w; ++ow) {
          const std::int64_t w0 = ow * w.stride - w.padding;
          const std::int64_t w_lo = w0 < 0 ? 0 : w0, w_hi = std::min(w0 + w.kernel_w, w.width);
          C best = -std::numeric_limits<C>::infinity();
          std::int64_t best_at = -1;
          for (std::int64_t h = h_lo; h < h_hi; ++h) {
            const T* row = plane + h * x.strides[2];
            for (std::int64_t ww = w_lo; ww < w_hi; ++ww) {
              const C v = static_cast<C>(row[ww * x.strides[3]]);
              if (pool_takes(v, best, best_at >= 0)) {
                best = v;
                best_at = h * w.width + ww;
              }
            }
          }
          o[oh * w.out_w + ow] = static_cast<T>(best);
          at[oh * w.out_w + ow] = best_at;
        }
      }
    }
  });
}

void max_pool2d_backward(const StridedView& dy, const StridedView& indices, const StridedView& dx,
                         const Window2d& w) {
  dispatch_float(dy.dtype, "max_pool2d_backward", [&]<class T>() {
    const T* g = dy.ptr<const T>();
    const std::int64_t* idx = indices.ptr<const std::int64_t>();
    T* dst = dx.ptr<T>();
    const std::int64_t planes = dy.shape[0] * w.channels, plane = w.height * w.width;
    // Each plane (n, c) takes only its own windows' gradients, in the same order whichever
    // thread adds them: the planes are shared among the threads.
#pragma omp parallel for schedule(static) if (planes * w.out_h * w.out_w >= kParallelOutputs)
    for (std::int64_t p = 0; p < planes; ++p) {
      const std::int64_t n = p / w.channels, c = p % w.channels;
      T* out = dst + p * plane;
      const std::int64_t* plane_idx = idx + n * indices.strides[0] + c * indices.strides[1];
      const T* plane_g = g + n * dy.strides[0] + c * dy.strides[1];
      for (std::int64_t oh = 0; oh < w.out_h; ++oh) {
        for (std::int64_t ow = 0; ow < w.out_w; ++ow) {
          const std::int64_t at = plane_idx[oh * indices.strides[2] + ow * indices.strides[3]];
          const T v = plane_g[oh * dy.strides[2] + ow * dy.strides[3]];
          out[at] =
              static_cast<T>(static_cast<compute_t<T>>(out[at]) + static_cast<compute_t<T>>(v));
        }
      }
    }
  });
}

}  // namespace microbatch::kernels::cpu
