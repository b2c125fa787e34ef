// conv2d (im2col + GEMM, one image at a time; cuDNN on CUDA where the build has it) and
// max_pool2d, each with its backward below. Backward writes fresh tensors (activation and
// parameter gradients alike are overwritten here; the engine accumulates into leaves). 16-bit
// inputs are computed in f32 and the result is rounded once, as matmul does.
//
// Note [cuDNN convolutions]: in a build with cuDNN (kernels::cuda::has_cudnn()), conv2d on CUDA
// runs cudnnConvolutionForward / BackwardData / BackwardFilter over the whole batch, reading and
// writing the tensors' own dtype (16-bit with f32 math), so no f32 copies of x, weight or dy are
// made. Their workspace is a tensor the op allocates, as large as the im2col path's column buffer
// (cudnn_workspace): the cuDNN path never needs more memory than the other, and meta can size it
// without asking cuDNN. The fastest deterministic algorithm that fits runs; where none does (or a
// tensor is empty or past cuDNN's int sizes) the kernel says so and the op runs the im2col path
// instead, the one case meta does not foresee. Without cuDNN, and on the CPU, the im2col path runs;
// its code is the same on both backends (Im2colKernels).
//
// Note [Convolutions over images in parallel]: on the CPU the forward and the input's gradient
// share the batch's images among the OpenMP team's threads, each image with its own column buffer
// (slot = thread number; the buffers are one tensor of image_slots() slots) and a one-thread GEMM
// (Eigen keeps to one thread inside a parallel region). An image's result comes from the same
// operations whichever thread runs it, so the bits do not depend on the number of threads. The
// weight's gradient is summed per slot over its thread's run of images (the static schedule's
// contiguous runs, in order), then over the slots in order: deterministic for a given number of
// threads, as the README promises of a run, for one more weight-sized buffer a thread.
#include <algorithm>
#include <limits>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "kernels/conv.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"

namespace microbatch {

using kernels::StridedView;
using kernels::Window2d;

namespace {

DType math_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

// The kernels the im2col path calls, all from one backend.
struct Im2colKernels {
  void (*im2col)(const StridedView&, const StridedView&, const Window2d&);
  void (*col2im)(const StridedView&, const StridedView&, const Window2d&);
  void (*gemm)(const StridedView&, const StridedView&, const StridedView&, double, double);
  void (*fill)(const StridedView&, double);
  void (*copy)(const StridedView&, const StridedView&);
};
constexpr Im2colKernels kCpuKernels{kernels::cpu::im2col, kernels::cpu::col2im, kernels::cpu::gemm,
                                    kernels::cpu::fill, kernels::cpu::copy};
constexpr Im2colKernels kCudaKernels{kernels::cuda::im2col, kernels::cuda::col2im,
                                     kernels::cuda::gemm, kernels::cuda::fill, kernels::cuda::copy};

// Runs body(kernels) with the kernels of the device's backend (nothing on meta).
template <class Body>
void launch_im2col(const char* op, Device device, Body&& body) {
  launch(op, device, [&] { body(kCpuKernels); }, [&] { body(kCudaKernels); });
}

// Whether conv2d on this device takes the cuDNN path (Note [cuDNN convolutions]).
bool uses_cudnn(Device device) {
  return backend_of(device) == Backend::cuda && kernels::cuda::has_cudnn();
}

// Scratch for a cuDNN convolution: the bytes of the im2col path's column buffer.
Tensor cudnn_workspace(const Window2d& w, DType dtype, Device device) {
  const auto element = static_cast<std::int64_t>(dtype_size(math_dtype(dtype)));
  const std::int64_t bytes = w.col_rows() * w.col_cols() * element;
  return empty({bytes}, {.dtype = DType::u8, .device = device});
}

// Runs a cuDNN kernel on CUDA; meta runs nothing and takes the cuDNN path as run. Returns whether
// the kernel ran (false: no algorithm fitted, the caller falls back to im2col).
template <class Fn>
bool launch_cudnn(const char* op, Device device, Fn&& fn) {
  bool ran = true;
  launch(op, device, [&] { MB_ASSERT(false, "[{}] the cuDNN path does not run on the CPU", op); },
         [&] { ran = fn(); });
  return ran;
}

// Images the im2col path works on at once: on the CPU one per thread of the OpenMP team (Note
// [Convolutions over images in parallel]), else one. Meta counts as the backend it mirrors, so that
// its column buffers are the run's.
std::int64_t image_slots(Device device, std::int64_t batch) {
  if (backend_of(device) != Backend::cpu) return 1;
#if defined(_OPENMP)
  return std::clamp<std::int64_t>(omp_get_max_threads(), 1, std::max<std::int64_t>(batch, 1));
#else
  return 1;
#endif
}

// The slot of the image the calling thread works on: its number in the team (0 outside one).
std::int64_t image_slot() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Item n of a view's leading dim, with that dim removed: (N, ...) -> (...).
StridedView drop_first(StridedView v, std::int64_t n) {
  v.data = static_cast<char*>(v.data) + n * v.strides[0] * static_cast<std::int64_t>(dtype_size(v.dtype));
  for (int i = 1; i < v.ndim; ++i) v.shape[i - 1] = v.shape[i], v.strides[i - 1] = v.strides[i];
  --v.ndim;
  return v;
}

// Item n of a view's leading dim, kept as a dim of size 1: (N, R, C) -> (1, R, C), as gemm takes.
StridedView keep_one(StridedView v, std::int64_t n) {
  v.data = static_cast<char*>(v.data) + n * v.strides[0] * static_cast<std::int64_t>(dtype_size(v.dtype));
  v.shape[0] = 1;
  return v;
}

// (B, R, C) -> (B, C, R) without moving data.
StridedView transposed(StridedView v) {
  std::swap(v.shape[1], v.shape[2]);
  std::swap(v.strides[1], v.strides[2]);
  return v;
}

// (B, R, C) -> (R, C) for a batch of one.
StridedView matrix(const StridedView& v) { return drop_first(v, 0); }

// The geometry of a window sweep over x (N, C, H, W); `op` names the caller in errors.
Window2d plan_window(const char* op, const Tensor& x, std::int64_t kernel_h, std::int64_t kernel_w,
                     std::int64_t stride, std::int64_t padding) {
  MB_CHECK(x.dim() == 4, "[{}] input must be (N, C, H, W), got shape {}", op, shape_str(x.shape()));
  // A kernel with no taps gives windows that see nothing (conv2d summed them to zeros); torch
  // refuses it.
  MB_CHECK(kernel_h > 0 && kernel_w > 0, "[{}] kernel size must be greater than zero, got ({}, {})",
           op, kernel_h, kernel_w);
  MB_CHECK(stride > 0, "[{}] stride must be positive, got {}", op, stride);
  MB_CHECK(padding >= 0, "[{}] padding must be non-negative, got {}", op, padding);
  // As torch: an empty plane padded to a non-empty one would leave windows that see only padding
  // (max_pool2d's would have no argmax for its backward to scatter to).
  MB_CHECK(x.shape()[2] > 0 && x.shape()[3] > 0,
           "[{}] input {} has an empty plane: only the batch and channel dims may be 0", op,
           shape_str(x.shape()));
  Window2d w;
  w.channels = x.shape()[1];
  w.height = x.shape()[2];
  w.width = x.shape()[3];
  w.kernel_h = kernel_h;
  w.kernel_w = kernel_w;
  w.stride = stride;
  w.padding = padding;
  // Checked: a padding near int64's maximum would wrap the padded size.
  MB_CHECK(padding <= (std::numeric_limits<std::int64_t>::max() - std::max(w.height, w.width)) / 2,
           "[{}] padding {} makes the input {} larger than int64 can count", op, padding,
           shape_str(x.shape()));
  const std::int64_t padded_h = w.height + 2 * padding, padded_w = w.width + 2 * padding;
  MB_CHECK(kernel_h <= padded_h && kernel_w <= padded_w,
           "[{}] kernel ({}, {}) is larger than the padded input ({}, {}) (input {}, padding {})", op,
           kernel_h, kernel_w, padded_h, padded_w, shape_str(x.shape()), padding);
  w.out_h = (padded_h - kernel_h) / stride + 1;
  w.out_w = (padded_w - kernel_w) / stride + 1;
  return w;
}

// dweight (O, C, kH, kW) = sum over images of dy_n (O, L) @ col_n^T (L, C*kH*kW); the columns are
// recomputed from x rather than saved, so the forward keeps only x alive.
Tensor conv2d_dweight(const Tensor& dy, const Tensor& x, const Window2d& w, const Shape& weight_shape,
                      DType dtype) {
  const DType math = dy.dtype();
  const std::int64_t batch = x.shape()[0], rows = w.col_rows(), cols = w.col_cols();
  const std::int64_t slots = image_slots(x.device(), batch);
  // A sum per slot over its run of images, in order (one slot: the whole sum).
  Tensor partial = zeros({slots, weight_shape[0], rows}, {.dtype = math, .device = x.device()});
  Tensor col =
      empty({slots, rows, cols}, {.dtype = math, .device = x.device()});  // a CkHkW x H'W' each
  launch_im2col("conv2d", x.device(), [&](const Im2colKernels& k) {
    const StridedView xv = x.kview(), gv = dy.kview(), cv = col.kview(), pv = partial.kview();
    const int team = static_cast<int>(slots);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (std::int64_t n = 0; n < batch; ++n) {
      const std::int64_t slot = image_slot();
      const StridedView mine = keep_one(cv, slot);
      k.im2col(drop_first(xv, n), matrix(mine), w);
      k.gemm(keep_one(gv, n), transposed(mine), keep_one(pv, slot), 1.0, 1.0);
    }
  });
  Tensor dweight;
  {
    NoGradGuard no_grad;
    dweight = slots == 1 ? partial : sum(partial, {0});  // the slots' sums in slot order
  }
  Tensor out = dweight.view(weight_shape);
  return out.dtype() == dtype ? out : out.to(dtype);
}

// dx (N, C, H, W): dcol_n = weight^T (CkHkW, O) @ dy_n (O, L), folded back by col2im.
Tensor conv2d_dx(const Tensor& dy, const Tensor& weight, const Window2d& w, const Shape& x_shape,
                 DType dtype) {
  const DType math = dy.dtype();
  const std::int64_t batch = x_shape[0], rows = w.col_rows(), cols = w.col_cols();
  const std::int64_t slots = image_slots(dy.device(), batch);
  Tensor wm = weight.to(math).contiguous().view({1, weight.shape()[0], rows});  // (1, O, CkHkW)
  Tensor dcol =
      empty({slots, rows, cols}, {.dtype = math, .device = dy.device()});  // a CkHkW x H'W' each
  Tensor dx = empty(x_shape, {.dtype = dtype, .device = dy.device()});
  // 16-bit: each image's gradient is summed in an f32 plane, then rounded once into dx.
  Tensor image = math == dtype ? Tensor()
                               : empty({slots, x_shape[1], x_shape[2], x_shape[3]},
                                       {.dtype = math, .device = dy.device()});
  launch_im2col("conv2d", dy.device(), [&](const Im2colKernels& k) {
    const StridedView gv = dy.kview(), dv = dcol.kview(), xv = dx.kview();
    const StridedView planes = image.defined() ? image.kview() : StridedView{};
    const int team = static_cast<int>(slots);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (std::int64_t n = 0; n < batch; ++n) {
      const std::int64_t slot = image_slot();
      const StridedView mine = keep_one(dv, slot);
      k.gemm(transposed(wm.kview()), keep_one(gv, n), mine, 1.0, 0.0);
      const StridedView target = image.defined() ? drop_first(planes, slot) : drop_first(xv, n);
      k.fill(target, 0.0);
      k.col2im(matrix(mine), target, w);
      if (image.defined()) k.copy(drop_first(xv, n), target);
    }
  });
  return dx;
}

// dbias (O) = g (N, O, H', W') summed over all but O. In f32 and f64 first along each row of H'W'
// (contiguous: twice as fast as one sum over dims 0, 2 and 3), then over the images; a 16-bit g in
// one sum, whose f64 accumulator rounds once (16-bit row sums would each round first).
Tensor bias_gradient(const Tensor& g) {
  if (is_16bit_float(g.dtype())) return sum(g, {0, 2, 3});
  const std::int64_t batch = g.shape()[0], channels = g.shape()[1];
  const Tensor rows = sum(g.reshape({batch * channels, g.shape()[2] * g.shape()[3]}), {1});
  return sum(rows.view({batch, channels}), {0});
}

// out (N, O, H', W') = conv(x, weight) + bias through cuDNN; false when it could not run.
bool conv2d_forward_cudnn(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& out,
                          const Window2d& w) {
  NoGradGuard no_grad;
  const Tensor xc = x.contiguous(), wc = weight.contiguous();
  const Tensor workspace = cudnn_workspace(w, x.dtype(), x.device());
  // With a bias, cuDNN adds onto rows pre-filled with it (beta = 1), rounding once.
  if (bias.defined()) out.copy_(bias.reshape({1, weight.shape()[0], 1, 1}).expand(out.shape()));
  return launch_cudnn("conv2d", x.device(), [&] {
    return kernels::cuda::conv2d_forward(xc.kview(), wc.kview(), out.kview(), workspace.kview(), w,
                                         bias.defined() ? 1.0 : 0.0);
  });
}

// dx (N, C, H, W) through cuDNN, in dy's dtype; undefined when it could not run.
Tensor conv2d_dx_cudnn(const Tensor& dy, const Tensor& weight, const Window2d& w,
                       const Shape& x_shape) {
  const Tensor wc = weight.contiguous();
  const Tensor workspace = cudnn_workspace(w, dy.dtype(), dy.device());
  Tensor dx = empty(x_shape, {.dtype = dy.dtype(), .device = dy.device()});
  const bool ran = launch_cudnn("conv2d", dy.device(), [&] {
    return kernels::cuda::conv2d_backward_data(wc.kview(), dy.kview(), dx.kview(),
                                               workspace.kview(), w);
  });
  return ran ? dx : Tensor();
}

// dweight (O, C, kH, kW) through cuDNN, in dy's dtype; undefined when it could not run.
Tensor conv2d_dweight_cudnn(const Tensor& dy, const Tensor& x, const Window2d& w,
                            const Shape& weight_shape) {
  const Tensor xc = x.contiguous();
  const Tensor workspace = cudnn_workspace(w, dy.dtype(), dy.device());
  Tensor dweight = empty(weight_shape, {.dtype = dy.dtype(), .device = dy.device()});
  const bool ran = launch_cudnn("conv2d", dy.device(), [&] {
    return kernels::cuda::conv2d_backward_filter(xc.kview(), dy.kview(), dweight.kview(),
                                                 workspace.kview(), w);
  });
  return ran ? dweight : Tensor();
}

// out (N, O, H', W') = conv(x, weight) + bias by im2col + GEMM, one image at a time.
void conv2d_forward_im2col(const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& out, const Window2d& w) {
  const DType dtype = x.dtype(), math = math_dtype(dtype);
  const std::int64_t channels_out = weight.shape()[0];
  const std::int64_t batch = x.shape()[0], rows = w.col_rows(), cols = w.col_cols();
  Tensor wm, bm;  // weight (1, O, CkHkW) and bias (O) in the math dtype
  {
    NoGradGuard no_grad;
    wm = weight.to(math).contiguous().view({1, channels_out, rows});
    if (bias.defined()) bm = bias.to(math);
  }
  const std::int64_t slots = image_slots(x.device(), batch);
  Tensor col =
      empty({slots, rows, cols}, {.dtype = math, .device = x.device()});  // a CkHkW x H'W' each
  // 16-bit: each image is computed in f32 and rounded once into out.
  Tensor acc = math == dtype
                   ? Tensor()
                   : empty({slots, channels_out, cols}, {.dtype = math, .device = x.device()});
  launch_im2col("conv2d", x.device(), [&](const Im2colKernels& k) {
    const StridedView xv = x.kview(), cv = col.kview();
    const StridedView av = acc.defined() ? acc.kview() : StridedView{};
    StridedView ov = out.kview();
    ov.ndim = 3, ov.shape[2] = cols, ov.strides[1] = cols, ov.strides[2] = 1;  // (N, O, H'W')
    StridedView bias_rows;  // (1, O, H'W'), bias broadcast along each row
    if (bm.defined()) {
      bias_rows = bm.kview();
      bias_rows.ndim = 3;
      bias_rows.shape[0] = 1, bias_rows.shape[1] = channels_out, bias_rows.shape[2] = cols;
      bias_rows.strides[0] = 0, bias_rows.strides[1] = bm.strides()[0], bias_rows.strides[2] = 0;
    }
    const int team = static_cast<int>(slots);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (std::int64_t n = 0; n < batch; ++n) {
      const std::int64_t slot = image_slot();
      const StridedView mine = keep_one(cv, slot);
      k.im2col(drop_first(xv, n), matrix(mine), w);
      const StridedView target = acc.defined() ? keep_one(av, slot) : keep_one(ov, n);
      // With a bias, the GEMM adds onto rows pre-filled with it (beta = 1): no extra pass.
      if (bm.defined()) k.copy(target, bias_rows);
      k.gemm(wm.kview(), mine, target, 1.0, bm.defined() ? 1.0 : 0.0);
      if (acc.defined()) k.copy(keep_one(ov, n), target);
    }
  });
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, Conv2dOptions options) {
  check_same_device("conv2d", {x, weight});
  check_floating("conv2d", x);
  MB_CHECK(weight.dim() == 4, "[conv2d] weight must be (O, C, kH, kW), got shape {}",
           shape_str(weight.shape()));
  MB_CHECK(x.dtype() == weight.dtype(), "[conv2d] input is {} but weight is {}", dtype_name(x.dtype()),
           dtype_name(weight.dtype()));
  MB_CHECK(x.dim() != 4 || x.shape()[1] == weight.shape()[1],
           "[conv2d] input {} has {} channels but weight {} expects {}", shape_str(x.shape()),
           x.shape()[1], shape_str(weight.shape()), weight.shape()[1]);
  const std::int64_t channels_out = weight.shape()[0];
  if (bias.defined()) {
    check_same_device("conv2d", {x, bias});
    MB_CHECK(bias.dim() == 1 && bias.shape()[0] == channels_out,
             "[conv2d] bias must be ({},) for weight {}, got {}", channels_out,
             shape_str(weight.shape()), shape_str(bias.shape()));
    MB_CHECK(bias.dtype() == x.dtype(), "[conv2d] input is {} but bias is {}", dtype_name(x.dtype()),
             dtype_name(bias.dtype()));
  }
  const Window2d w = plan_window("conv2d", x, weight.shape()[2], weight.shape()[3], options.stride,
                                 options.padding);
  const DType dtype = x.dtype(), math = math_dtype(dtype);
  Tensor out = empty({x.shape()[0], channels_out, w.out_h, w.out_w},
                     {.dtype = dtype, .device = x.device()});
  if (!uses_cudnn(x.device()) || !conv2d_forward_cudnn(x, weight, bias, out, w))
    conv2d_forward_im2col(x, weight, bias, out, w);

  record("conv2d", {x, weight, bias}, out,
         // dweight needs x and dx needs the weight: each is kept only when its partner is wanted.
         [sx = weight.requires_grad() ? SavedTensor(x, "conv2d") : SavedTensor(),
          sw = x.requires_grad() ? SavedTensor(weight, "conv2d") : SavedTensor(), w, math,
          x_shape = x.shape(), weight_shape = weight.shape(), rx = x.requires_grad(),
          rw = weight.requires_grad(), rb = bias.defined() && bias.requires_grad()](const Tensor& g) {
           Tensor dx, dweight, dbias;
           const bool cudnn = uses_cudnn(g.device());
           if (cudnn) {
             const Tensor dy = g.contiguous();  // (N, O, H', W') in g's dtype
             if (rx) dx = conv2d_dx_cudnn(dy, sw.get(), w, x_shape);
             if (rw) dweight = conv2d_dweight_cudnn(dy, sx.get(), w, weight_shape);
           }
           if (!cudnn || (rx && !dx.defined()) || (rw && !dweight.defined())) {
             const Tensor dy =  // (N, O, H'W') in the math dtype
                 g.to(math).contiguous().view({x_shape[0], weight_shape[0], w.col_cols()});
             if (rx && !dx.defined()) dx = conv2d_dx(dy, sw.get(), w, x_shape, g.dtype());
             if (rw && !dweight.defined())
               dweight = conv2d_dweight(dy, sx.get(), w, weight_shape, g.dtype());
           }
           if (rb) dbias = bias_gradient(g);
           return std::vector<Tensor>{dx, dweight, dbias};
         });
  return out;
}

Tensor max_pool2d(const Tensor& x, MaxPool2dOptions options) {
  check_floating("max_pool2d", x);
  const std::int64_t k = options.kernel_size;
  MB_CHECK(k > 0, "[max_pool2d] kernel_size must be positive, got {}", k);
  MB_CHECK(options.stride >= 0, "[max_pool2d] stride must be positive (or 0 for kernel_size), got {}",
           options.stride);
  // As torch: more padding would allow windows that see only padding (and no argmax).
  MB_CHECK(options.padding <= k / 2, "[max_pool2d] padding {} is more than half the kernel size {}",
           options.padding, k);
  const Window2d w = plan_window("max_pool2d", x, k, k, options.stride == 0 ? k : options.stride,
                                 options.padding);
  const Shape out_shape{x.shape()[0], w.channels, w.out_h, w.out_w};
  Tensor out = empty(out_shape, {.dtype = x.dtype(), .device = x.device()});
  Tensor indices = empty(out_shape, {.dtype = DType::i64, .device = x.device()});  // h * W + w
  launch(
      "max_pool2d", x.device(),
      [&] { kernels::cpu::max_pool2d(x.kview(), out.kview(), indices.kview(), w); },
      [&] { kernels::cuda::max_pool2d(x.kview(), out.kview(), indices.kview(), w); });

  // The backward needs only where each maximum was, not x.
  record("max_pool2d", {x}, out, [indices, w, x_shape = x.shape()](const Tensor& g) {
    const DType math = math_dtype(g.dtype());
    const Tensor dy = g.to(math);
    Tensor dx = zeros(x_shape, {.dtype = math, .device = g.device()});
    launch(
        "max_pool2d", g.device(),
        [&] { kernels::cpu::max_pool2d_backward(dy.kview(), indices.kview(), dx.kview(), w); },
        [&] { kernels::cuda::max_pool2d_backward(dy.kview(), indices.kview(), dx.kview(), w); });
    return std::vector<Tensor>{dx.dtype() == g.dtype() ? dx : dx.to(g.dtype())};
  });
  return out;
}

}  // namespace microbatch
