// im2col / col2im for conv2d, and max_pool2d forward and backward, as plain loops.
// im2col, max_pool2d: overwrite. col2im, max_pool2d_backward: accumulate (`+=`), because one
// input element is read by several overlapping windows and its gradient is their sum.
#include <limits>

#include "core/dtype.h"
#include "kernels/conv.h"

namespace microbatch::kernels::cpu {

namespace {

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

template <class T, class C>
void im2col_typed(const StridedView& x, const StridedView& col, const Window2d& w) {
  const T* src = x.ptr<const T>();
  C* dst = col.ptr<C>();
  const std::int64_t sc = x.strides[0], sh = x.strides[1], sw = x.strides[2];
  const std::int64_t cols = w.col_cols();
  for (std::int64_t c = 0; c < w.channels; ++c) {
    for (std::int64_t i = 0; i < w.kernel_h; ++i) {
      std::int64_t oh_lo, oh_hi;
      valid_range(w.height, w.out_h, w.stride, w.padding, i, oh_lo, oh_hi);
      for (std::int64_t j = 0; j < w.kernel_w; ++j) {
        std::int64_t ow_lo, ow_hi;
        valid_range(w.width, w.out_w, w.stride, w.padding, j, ow_lo, ow_hi);
        C* row = dst + ((c * w.kernel_h + i) * w.kernel_w + j) * cols;  // (H', W') of this tap
        for (std::int64_t oh = 0; oh < w.out_h; ++oh) {
          C* out = row + oh * w.out_w;
          if (oh < oh_lo || oh >= oh_hi) {
            for (std::int64_t ow = 0; ow < w.out_w; ++ow) out[ow] = C(0);
            continue;
          }
          const T* in = src + c * sc + (oh * w.stride - w.padding + i) * sh;
          for (std::int64_t ow = 0; ow < ow_lo; ++ow) out[ow] = C(0);
          for (std::int64_t ow = ow_lo; ow < ow_hi; ++ow)
            out[ow] = static_cast<C>(static_cast<compute_t<T>>(in[(ow * w.stride - w.padding + j) * sw]));
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
          for (std::int64_t ow = ow_lo; ow < ow_hi; ++ow) out[ow * w.stride - w.padding + j] += in[ow];
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
    T* dst = out.ptr<T>();
    std::int64_t* idx = indices.ptr<std::int64_t>();
    // One output element at a time, with the window scan the CUDA kernel runs too (kernels/conv.h).
    const std::int64_t total = x.shape[0] * w.channels * w.out_h * w.out_w;
    for (std::int64_t e = 0; e < total; ++e) {
      dst[e] = static_cast<T>(max_pool2d_element<T>(x, w, e, &idx[e]));
    }
  });
}

void max_pool2d_backward(const StridedView& dy, const StridedView& indices, const StridedView& dx,
                         const Window2d& w) {
  dispatch_float(dy.dtype, "max_pool2d_backward", [&]<class T>() {
    const T* g = dy.ptr<const T>();
    const std::int64_t* idx = indices.ptr<const std::int64_t>();
    T* dst = dx.ptr<T>();
    const std::int64_t batch = dy.shape[0], plane = w.height * w.width;
    for (std::int64_t n = 0; n < batch; ++n) {
      for (std::int64_t c = 0; c < w.channels; ++c) {
        T* out = dst + (n * w.channels + c) * plane;
        for (std::int64_t oh = 0; oh < w.out_h; ++oh) {
          for (std::int64_t ow = 0; ow < w.out_w; ++ow) {
            const std::int64_t at = idx[n * indices.strides[0] + c * indices.strides[1] +
                                        oh * indices.strides[2] + ow * indices.strides[3]];
            const T v = g[n * dy.strides[0] + c * dy.strides[1] + oh * dy.strides[2] + ow * dy.strides[3]];
            out[at] = static_cast<T>(static_cast<compute_t<T>>(out[at]) + static_cast<compute_t<T>>(v));
          }
        }
      }
    }
  });
}

}  // namespace microbatch::kernels::cpu
