// im2col / col2im for conv2d, max_pool2d forward and backward, and (with cuDNN) whole convolutions.
// im2col, max_pool2d and the cuDNN calls overwrite. col2im and max_pool2d_backward accumulate
// (`+=`) like their CPU twins, but gather instead of scatter: one thread per input element walks
// the windows that cover it, in the order the CPU loops add them, so no atomics are needed and the
// sums match the CPU bit for bit.
#include <climits>

#include "kernels/conv.h"
#include "kernels/cuda/common.cuh"

namespace microbatch::kernels::cuda {

namespace {

// One thread per element, each running the per-element function of kernels/conv.h.

// col (C*kH*kW, H'*W') contiguous; x (C, H, W) any strides.
template <class T, class C>
__global__ void im2col_kernel(StridedView x, C* col, Window2d w, std::int64_t total) {
  for (std::int64_t e = global_thread(); e < total; e += grid_threads())
    col[e] = im2col_element<T, C>(x, w, e);
}

// dx (C, H, W) contiguous, one thread per pixel gathering its column entries.
template <class C>
__global__ void col2im_kernel(const C* col, C* dx, Window2d w, std::int64_t total) {
  for (std::int64_t e = global_thread(); e < total; e += grid_threads())
    dx[e] = col2im_element(col, dx[e], w, e);
}

// out and indices (N, C, H', W') contiguous, one thread per window; x (N, C, H, W) any strides.
template <class T>
__global__ void max_pool2d_kernel(StridedView x, T* out, std::int64_t* indices, Window2d w,
                                  std::int64_t total) {
  for (std::int64_t e = global_thread(); e < total; e += grid_threads()) {
    std::int64_t argmax = -1;
    const compute_t<T> best = max_pool2d_element<T>(x, w, e, &argmax);
    store<T>(out, e, best);
    indices[e] = argmax;
  }
}

// dx (N, C, H, W) contiguous, one thread per pixel gathering dy of the windows it is the argmax
// of; dy and indices (N, C, H', W') any strides.
template <class T>
__global__ void max_pool2d_backward_kernel(StridedView dy, StridedView indices, T* dx, Window2d w,
                                           std::int64_t total) {
  for (std::int64_t e = global_thread(); e < total; e += grid_threads())
    dx[e] = max_pool2d_backward_element<T>(dy, indices, dx[e], w, e);
}

}  // namespace

void im2col(const StridedView& x, const StridedView& col, const Window2d& w) {
  MB_CHECK(x.ndim == 3 && col.ndim == 2 && col.is_contiguous() && col.shape[0] == w.col_rows() &&
               col.shape[1] == w.col_cols(),
           "[im2col] expected x (C, H, W) and a contiguous col ({}, {}), got {}-d x and col ({}, {})",
           w.col_rows(), w.col_cols(), x.ndim, col.shape[0], col.shape[1]);
  const std::int64_t total = w.col_rows() * w.col_cols();
  if (total == 0) return;
  dispatch_float(x.dtype, "im2col", [&]<class T>() {
    if (col.dtype == DType::f64) {
      im2col_kernel<T, double><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
          x, col.ptr<double>(), w, total);
    } else {
      MB_CHECK(col.dtype == DType::f32, "[im2col] col must be f32 or f64, got {}", dtype_name(col.dtype));
      im2col_kernel<T, float><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
          x, col.ptr<float>(), w, total);
    }
    MB_CUDA_CHECK_LAUNCH("im2col_kernel");
  });
}

void col2im(const StridedView& col, const StridedView& dx, const Window2d& w) {
  MB_CHECK(col.dtype == dx.dtype && (dx.dtype == DType::f32 || dx.dtype == DType::f64) &&
               col.is_contiguous() && dx.is_contiguous() &&
               dx.numel() == w.channels * w.height * w.width,
           "[col2im] expected contiguous f32 or f64 col and dx (C, H, W) of one dtype, got col {} and "
           "dx {} with {} elements for ({}, {}, {})", dtype_name(col.dtype), dtype_name(dx.dtype),
           dx.numel(), w.channels, w.height, w.width);
  const std::int64_t total = w.channels * w.height * w.width;
  if (total == 0) return;
  if (dx.dtype == DType::f64) {
    col2im_kernel<double><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
        col.ptr<const double>(), dx.ptr<double>(), w, total);
  } else {
    col2im_kernel<float><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
        col.ptr<const float>(), dx.ptr<float>(), w, total);
  }
  MB_CUDA_CHECK_LAUNCH("col2im_kernel");
}

void max_pool2d(const StridedView& x, const StridedView& out, const StridedView& indices,
                const Window2d& w) {
  MB_CHECK(x.ndim == 4 && out.is_contiguous() && indices.is_contiguous() &&
               indices.dtype == DType::i64 && out.dtype == x.dtype,
           "[max_pool2d] expected x (N, C, H, W), contiguous out of x's dtype and contiguous i64 "
           "indices, got {}-d x, out {} ({}), indices {}", x.ndim, dtype_name(out.dtype),
           out.is_contiguous() ? "contiguous" : "strided", dtype_name(indices.dtype));
  const std::int64_t total = x.shape[0] * w.channels * w.out_h * w.out_w;
  if (total == 0) return;
  dispatch_float(x.dtype, "max_pool2d", [&]<class T>() {
    max_pool2d_kernel<T><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
        x, out.ptr<T>(), indices.ptr<std::int64_t>(), w, total);
    MB_CUDA_CHECK_LAUNCH("max_pool2d_kernel");
  });
}

void max_pool2d_backward(const StridedView& dy, const StridedView& indices, const StridedView& dx,
                         const Window2d& w) {
  MB_CHECK(dy.ndim == 4 && indices.ndim == 4 && indices.dtype == DType::i64 && dx.is_contiguous() &&
               dx.dtype == dy.dtype,
           "[max_pool2d_backward] expected 4-d dy and i64 indices, and a contiguous dx of dy's dtype, "
           "got dy {} ({}-d), indices {}, dx {}", dtype_name(dy.dtype), dy.ndim,
           dtype_name(indices.dtype), dtype_name(dx.dtype));
  const std::int64_t total = dy.shape[0] * w.channels * w.height * w.width;
  if (total == 0) return;
  dispatch_float(dy.dtype, "max_pool2d_backward", [&]<class T>() {
    max_pool2d_backward_kernel<T><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
        dy, indices, dx.ptr<T>(), w, total);
    MB_CUDA_CHECK_LAUNCH("max_pool2d_backward_kernel");
  });
}

// ---- cuDNN -------------------------------------------------------------------------------------

#ifdef MB_HAVE_CUDNN

namespace {

// Descriptors, destroyed at scope exit (destroying never throws).
struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() { MB_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d)); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
};
struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  FilterDesc() { MB_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d)); }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};
struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ConvDesc() { MB_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d)); }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(d); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
};

cudnnDataType_t cudnn_type(DType dt) {
  switch (dt) {
    case DType::f32: return CUDNN_DATA_FLOAT;
    case DType::f64: return CUDNN_DATA_DOUBLE;
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: break;
  }
  MB_ASSERT(false, "[conv2d] no cuDNN type for {}", dtype_name(dt));
  return CUDNN_DATA_FLOAT;
}

// Whether cuDNN can take a view: not empty (it refuses zero sizes) and within its int indexing.
bool fits_cudnn(const StridedView& v) {
  if (v.numel() == 0 || v.numel() > INT_MAX) return false;
  for (int d = 0; d < v.ndim; ++d)
    if (v.shape[d] > INT_MAX) return false;
  return true;
}

// One convolution's descriptors: x (N, C, H, W), weight (O, C, kH, kW), y (N, O, H', W').
struct Convolution {
  TensorDesc x, y;
  FilterDesc weight;
  ConvDesc conv;
  DType dtype;
  std::size_t workspace_bytes;
  void* workspace;

  Convolution(const char* op, const StridedView& xv, const StridedView& wv, const StridedView& yv,
              const StridedView& ws, const Window2d& w)
      : dtype(xv.dtype),
        workspace_bytes(static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype)),
        workspace(ws.data) {
    MB_CHECK(xv.ndim == 4 && wv.ndim == 4 && yv.ndim == 4 && xv.is_contiguous() &&
                 wv.is_contiguous() && yv.is_contiguous() && ws.is_contiguous(),
             "[{}] cuDNN takes contiguous 4-d x, weight and y and a contiguous workspace", op);
    MB_CHECK(wv.dtype == dtype && yv.dtype == dtype && is_floating(dtype),
             "[{}] cuDNN takes one floating dtype, got x {}, weight {}, y {}", op, dtype_name(dtype),
             dtype_name(wv.dtype), dtype_name(yv.dtype));
    MB_CHECK(xv.shape[1] == w.channels && xv.shape[2] == w.height && xv.shape[3] == w.width &&
                 wv.shape[1] == w.channels && wv.shape[2] == w.kernel_h &&
                 wv.shape[3] == w.kernel_w && yv.shape[0] == xv.shape[0] &&
                 yv.shape[1] == wv.shape[0] && yv.shape[2] == w.out_h && yv.shape[3] == w.out_w,
             "[{}] shapes disagree with the window: x ({}, {}, {}, {}), weight ({}, {}, {}, {}), "
             "y ({}, {}, {}, {})",
             op, xv.shape[0], xv.shape[1], xv.shape[2], xv.shape[3], wv.shape[0], wv.shape[1],
             wv.shape[2], wv.shape[3], yv.shape[0], yv.shape[1], yv.shape[2], yv.shape[3]);
    const cudnnDataType_t type = cudnn_type(dtype);
    MB_CUDNN_CHECK(cudnnSetTensor4dDescriptor(x.d, CUDNN_TENSOR_NCHW, type, int(xv.shape[0]),
                                              int(xv.shape[1]), int(xv.shape[2]), int(xv.shape[3])));
    MB_CUDNN_CHECK(cudnnSetTensor4dDescriptor(y.d, CUDNN_TENSOR_NCHW, type, int(yv.shape[0]),
                                              int(yv.shape[1]), int(yv.shape[2]), int(yv.shape[3])));
    MB_CUDNN_CHECK(cudnnSetFilter4dDescriptor(weight.d, type, CUDNN_TENSOR_NCHW, int(wv.shape[0]),
                                              int(wv.shape[1]), int(wv.shape[2]), int(wv.shape[3])));
    // 16-bit tensors are read and written as such; the math runs in f32 (f64 for f64).
    const cudnnDataType_t math = dtype == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    MB_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv.d, int(w.padding), int(w.padding),
                                                   int(w.stride), int(w.stride), 1, 1,
                                                   CUDNN_CROSS_CORRELATION, math));
    MB_CUDNN_CHECK(cudnnSetConvolutionMathType(conv.d, default_math()));
  }

  // f32 stays on FMA kernels (TF32 tensor cores would break f32's 1e-3 parity); 16-bit may use
  // tensor cores, which accumulate in f32.
  cudnnMathType_t default_math() const {
    if (dtype == DType::f32) return CUDNN_FMA_MATH;
    if (dtype == DType::f64) return CUDNN_DEFAULT_MATH;
    return CUDNN_TENSOR_OP_MATH;
  }

  // Whether a heuristic's candidate may run: it is supported, deterministic (the backward must
  // give the same gradients on every run) and, for f32, not a TF32 kernel. Sets its math type.
  template <class Perf>
  bool acceptable(const Perf& perf) {
    if (perf.status != CUDNN_STATUS_SUCCESS) return false;
    if (perf.determinism != CUDNN_DETERMINISTIC) return false;
    if (dtype == DType::f32 && (perf.mathType == CUDNN_TENSOR_OP_MATH ||
                                perf.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION))
      return false;
    const cudnnMathType_t math = dtype == DType::f32 ? CUDNN_FMA_MATH : perf.mathType;
    MB_CUDNN_CHECK(cudnnSetConvolutionMathType(conv.d, math));
    return true;
  }

  // alpha = 1 and beta in the math type (double for f64, float otherwise), as cuDNN reads them.
  const void* alpha() const {
    return dtype == DType::f64 ? static_cast<const void*>(&one64_) : &one32_;
  }
  const void* beta(double b) {
    beta64_ = b;
    beta32_ = static_cast<float>(b);
    return dtype == DType::f64 ? static_cast<const void*>(&beta64_) : &beta32_;
  }

 private:
  double one64_ = 1.0, beta64_ = 0.0;
  float one32_ = 1.0f, beta32_ = 0.0f;
};

}  // namespace

bool has_cudnn() { return true; }

bool conv2d_forward(const StridedView& x, const StridedView& weight, const StridedView& y,
                    const StridedView& workspace, const Window2d& w, double beta) {
  if (!fits_cudnn(x) || !fits_cudnn(weight) || !fits_cudnn(y)) return false;
  Convolution conv("conv2d", x, weight, y, workspace, w);
  cudnnHandle_t handle = cudnn_handle();
  cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int found = 0;
  MB_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(
      handle, conv.x.d, conv.weight.d, conv.conv.d, conv.y.d, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
      &found, perf));
  for (int i = 0; i < found; ++i) {  // the heuristic lists the fastest first
    if (!conv.acceptable(perf[i])) continue;
    std::size_t bytes = 0;
    const cudnnStatus_t sized = cudnnGetConvolutionForwardWorkspaceSize(
        handle, conv.x.d, conv.weight.d, conv.conv.d, conv.y.d, perf[i].algo, &bytes);
    if (sized != CUDNN_STATUS_SUCCESS || bytes > conv.workspace_bytes) continue;
    MB_CUDNN_CHECK(cudnnConvolutionForward(
        handle, conv.alpha(), conv.x.d, x.data, conv.weight.d, weight.data, conv.conv.d,
        perf[i].algo, conv.workspace, conv.workspace_bytes, conv.beta(beta), conv.y.d, y.data));
    return true;
  }
  return false;
}

bool conv2d_backward_data(const StridedView& weight, const StridedView& dy, const StridedView& dx,
                          const StridedView& workspace, const Window2d& w) {
  if (!fits_cudnn(dx) || !fits_cudnn(weight) || !fits_cudnn(dy)) return false;
  Convolution conv("conv2d", dx, weight, dy, workspace, w);
  cudnnHandle_t handle = cudnn_handle();
  cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
  int found = 0;
  MB_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(
      handle, conv.weight.d, conv.y.d, conv.conv.d, conv.x.d, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
      &found, perf));
  for (int i = 0; i < found; ++i) {
    if (!conv.acceptable(perf[i])) continue;
    std::size_t bytes = 0;
    const cudnnStatus_t sized = cudnnGetConvolutionBackwardDataWorkspaceSize(
        handle, conv.weight.d, conv.y.d, conv.conv.d, conv.x.d, perf[i].algo, &bytes);
    if (sized != CUDNN_STATUS_SUCCESS || bytes > conv.workspace_bytes) continue;
    MB_CUDNN_CHECK(cudnnConvolutionBackwardData(
        handle, conv.alpha(), conv.weight.d, weight.data, conv.y.d, dy.data, conv.conv.d,
        perf[i].algo, conv.workspace, conv.workspace_bytes, conv.beta(0.0), conv.x.d, dx.data));
    return true;
  }
  return false;
}

bool conv2d_backward_filter(const StridedView& x, const StridedView& dy, const StridedView& dweight,
                            const StridedView& workspace, const Window2d& w) {
  if (!fits_cudnn(x) || !fits_cudnn(dweight) || !fits_cudnn(dy)) return false;
  Convolution conv("conv2d", x, dweight, dy, workspace, w);
  cudnnHandle_t handle = cudnn_handle();
  cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
  int found = 0;
  MB_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
      handle, conv.x.d, conv.y.d, conv.conv.d, conv.weight.d,
      CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &found, perf));
  for (int i = 0; i < found; ++i) {
    if (!conv.acceptable(perf[i])) continue;
    std::size_t bytes = 0;
    const cudnnStatus_t sized = cudnnGetConvolutionBackwardFilterWorkspaceSize(
        handle, conv.x.d, conv.y.d, conv.conv.d, conv.weight.d, perf[i].algo, &bytes);
    if (sized != CUDNN_STATUS_SUCCESS || bytes > conv.workspace_bytes) continue;
    MB_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
        handle, conv.alpha(), conv.x.d, x.data, conv.y.d, dy.data, conv.conv.d, perf[i].algo,
        conv.workspace, conv.workspace_bytes, conv.beta(0.0), conv.weight.d, dweight.data));
    return true;
  }
  return false;
}

#else  // no cuDNN: conv2d runs im2col + cuBLAS on CUDA

bool has_cudnn() { return false; }
bool conv2d_forward(const StridedView&, const StridedView&, const StridedView&, const StridedView&,
                    const Window2d&, double) { return false; }
bool conv2d_backward_data(const StridedView&, const StridedView&, const StridedView&,
                          const StridedView&, const Window2d&) { return false; }
bool conv2d_backward_filter(const StridedView&, const StridedView&, const StridedView&,
                            const StridedView&, const Window2d&) { return false; }

#endif

}  // namespace microbatch::kernels::cuda
