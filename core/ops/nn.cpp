// Neural-network functions: softmax, log_softmax, cross_entropy, layer_norm, dropout.
// softmax, cross-entropy and layer norm run row kernels (kernels/nn.h) forward and backward; their
// backward kernels overwrite fresh tensors (dx, dlogits, and this call's dweight/dbias, which the
// engine then adds into the leaves). Dropout's backward is an op, dy * mask.
#include "kernels/nn.h"

#include <cmath>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "core/rng.h"
#include "kernels/elementwise.h"
#include "kernels/index.h"

namespace microbatch {

using kernels::SoftmaxKind;

namespace {

// The dtype row statistics and per-row losses are kept in: f64 for f64, f32 otherwise.
DType math_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

kernels::StridedView view_or_none(const Tensor& t) {
  return t.defined() ? t.kview() : kernels::StridedView{};
}

// ---- softmax and log_softmax -------------------------------------------------------------------

// The kernel reduces the last dim of a contiguous tensor, so `dim` is moved last (order of the
// other dims kept) and the input copied when that is not already its layout. The output is the
// kernel's buffer permuted back: a view, contiguous whenever `dim` is the last dim.
Tensor softmax_rows(const char* op, SoftmaxKind kind, const Tensor& a, std::int64_t dim) {
  check_floating(op, a);
  if (a.dim() == 0) {
    wrap_dim(dim, 0, op);
    return softmax_rows(op, kind, a.reshape({1}), 0).reshape({});
  }
  const int d = wrap_dim(dim, a.dim(), op);
  const bool last = d == a.dim() - 1;
  std::vector<std::int64_t> perm, inverse(a.dim());
  for (int i = 0; i < a.dim(); ++i)
    if (i != d) perm.push_back(i);
  perm.push_back(d);
  for (int i = 0; i < a.dim(); ++i) inverse[perm[i]] = i;
  const std::int64_t cols = a.shape()[d];

  Tensor x;
  {
    NoGradGuard no_grad;
    x = (last ? a : a.permute(perm)).contiguous();
  }
  Tensor y = empty(x.shape(), {.dtype = a.dtype(), .device = a.device()});  // (..., cols)
  launch(
      op, a.device(), [&] { kernels::cpu::softmax_forward(kind, y.kview(), x.kview(), cols); },
      [&] { kernels::cuda::softmax_forward(kind, y.kview(), x.kview(), cols); });
  Tensor out;
  {
    NoGradGuard no_grad;
    out = last ? y.detach() : y.permute(inverse);
  }
  // Saves only the output's buffer y, a different handle from the returned one, so that the node
  // does not keep itself alive through its own output.
  record(op, {a}, out,
         [sy = SavedTensor(y, op), kind, op, last, perm, inverse, cols](const Tensor& g) {
           Tensor yv = sy.get();
           Tensor dy = (last ? g : g.permute(perm)).contiguous();
           if (dy.dtype() != yv.dtype()) dy = dy.to(yv.dtype());
           Tensor dx = empty(yv.shape(), {.dtype = yv.dtype(), .device = yv.device()});
           launch(
               op, yv.device(),
               [&] {
                 kernels::cpu::softmax_backward(kind, dx.kview(), yv.kview(), dy.kview(), cols);
               },
               [&] {
                 kernels::cuda::softmax_backward(kind, dx.kview(), yv.kview(), dy.kview(), cols);
               });
           return std::vector<Tensor>{last ? dx : dx.permute(inverse)};
         });
  return out;
}

// ---- cross-entropy -----------------------------------------------------------------------------

// (N, C) logits against (N) targets; the fused kernel writes per-row losses (math dtype) and the
// reduction is done with ops. Saves the logits, the targets and two numbers per row (max and
// log-sum-exp), from which the backward recomputes the softmax: no (N, C) probabilities are kept.
Tensor cross_entropy_2d(const Tensor& logits, const Tensor& target,
                        const CrossEntropyOptions& options) {
  const std::int64_t n = logits.shape()[0], c = logits.shape()[1];
  MB_CHECK(target.dim() == 1 && target.shape()[0] == n,
           "[cross_entropy] target {} does not match logits {}: expected ({})",
           shape_str(target.shape()), shape_str(logits.shape()), n);
  const DType loss_dt = options.loss_dtype.value_or(logits.dtype()), math = math_dtype(logits.dtype());
  const kernels::CrossEntropyArgs args{.ignore_index = options.ignore_index,
                                       .label_smoothing = options.label_smoothing};
  // CUDA reads rows where they lie, padded ones included (Note [Padded rows] in
  // core/ops/linalg.cpp); the CPU reads dense rows.
  const bool cuda = backend_of(logits.device()) == Backend::cuda;
  Tensor x;
  {
    NoGradGuard no_grad;
    x = cuda && logits.kview().is_rows() ? logits : logits.contiguous();
  }
  Tensor rows = empty({n}, {.dtype = math, .device = logits.device()});  // (N) per-row loss
  Tensor stats =
      empty({n, 2}, {.dtype = math, .device = logits.device()});  // (N, 2) row max, log-sum
  launch(
      "cross_entropy", logits.device(),
      [&] {
        kernels::cpu::cross_entropy_forward(rows.kview(), stats.kview(), x.kview(),
                                            target.kview(), args);
      },
      [&] {
        // Targets are checked on the device, without waiting for it: a bad one is reported at the
        // next host copy, and the kernels give its row zeros meanwhile.
        kernels::cuda::check_index_range(target.kview(), c, options.ignore_index, "cross_entropy");
        kernels::cuda::cross_entropy_forward(rows.kview(), stats.kview(), x.kview(),
                                             target.kview(), args);
      });

  Tensor out, count;  // count: 0-d, the number of non-ignored targets (for Mean)
  {
    NoGradGuard no_grad;
    switch (options.reduction) {
      case Reduction::None:
        out = rows.to(loss_dt);
        break;
      case Reduction::Sum:
        out = sum(rows).to(loss_dt);
        break;
      case Reduction::Mean: {
        // As PyTorch: divide by the non-ignored count; 0 / 0 gives NaN when every target is
        // ignored.
        Tensor ignore = scalar_tensor(static_cast<double>(options.ignore_index),
                                      {.dtype = target.dtype(), .device = target.device()});
        count = sum(ne(target, ignore).to(math));
        out = (sum(rows) / count).to(loss_dt);
        break;
      }
    }
  }
  record("cross_entropy", {logits}, out,
         [sx = SavedTensor(x, "cross_entropy"), st = SavedTensor(target, "cross_entropy"), stats,
          count, n, c, args, reduction = options.reduction,
          math](const Tensor& g) mutable {
           // Whether nothing else sees the logits, before get() makes a second handle.
           const bool alone = sx.only_handle();
           Tensor xv = sx.get(), tv = st.get();
           Tensor gm = g.dtype() == math ? g : g.to(math);
           Tensor g_row;  // (N) the weight of each row's loss, possibly a stride-0 expansion
           switch (reduction) {
             case Reduction::None:
               g_row = gm;
               break;
             case Reduction::Sum:
               g_row = gm.reshape({1}).expand({n});
               break;
             case Reduction::Mean:
               g_row = (gm / count).reshape({1}).expand({n});
               break;
           }
           // (N, C), with the logits' row padding, if any: the GEMMs that read it want it too.
           // Written over the logits when nothing else can see them (Note [Reusing an input's
           // memory], core/autograd.h): the kernels read each logit before writing its gradient.
           const std::int64_t pad = n > 1 ? xv.strides()[0] - c : 0;
           const std::int64_t ld = pad > 0 && pad < 8 ? c + pad : c;
           const bool reuse = alone && xv.strides()[1] == 1 && (n <= 1 || pad == ld - c);
           Tensor dlogits;
           if (reuse) {
             dlogits = xv.detach();
             xv = sx.take();  // last, after all that can throw: a failed backward can be rerun
           } else {
             dlogits = empty({n, ld}, {.dtype = xv.dtype(), .device = xv.device()});
             if (ld != c) dlogits = dlogits.slice(1, 0, c);
           }
           launch(
               "cross_entropy", xv.device(),
               [&] {
                 kernels::cpu::cross_entropy_backward(dlogits.kview(), xv.kview(), stats.kview(),
                                                      tv.kview(), g_row.kview(), args);
               },
               [&] {
                 kernels::cuda::cross_entropy_backward(dlogits.kview(), xv.kview(), stats.kview(),
                                                       tv.kview(), g_row.kview(), args);
               });
           return std::vector<Tensor>{dlogits};
         });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& a, std::int64_t dim) {
  return softmax_rows("softmax", SoftmaxKind::Softmax, a, dim);
}

Tensor log_softmax(const Tensor& a, std::int64_t dim) {
  return softmax_rows("log_softmax", SoftmaxKind::LogSoftmax, a, dim);
}

// Logits (N, C, d1, ...) with targets (N, d1, ...) are handled as torch does, by moving the class
// dim last and flattening to (N * d1 * ..., C); a language model's (B, T, V) logits are reshaped
// by the caller to (B * T, V) with targets (B * T).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, CrossEntropyOptions options) {
  check_floating("cross_entropy", logits);
  check_same_device("cross_entropy", {logits, target});
  MB_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32,
           "[cross_entropy] target must hold class indices (i64 or i32), got {}",
           dtype_name(target.dtype()));
  MB_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0,
           "[cross_entropy] label_smoothing must be in [0, 1], got {}", options.label_smoothing);
  MB_CHECK(logits.dim() >= 2, "[cross_entropy] logits must be (N, C) or (N, C, d1, ...), got {}",
           shape_str(logits.shape()));
  MB_CHECK(logits.shape()[1] > 0, "[cross_entropy] logits {} have no classes",
           shape_str(logits.shape()));
  MB_CHECK(!options.loss_dtype || is_floating(*options.loss_dtype),
           "[cross_entropy] loss_dtype must be a floating dtype, got {}",
           dtype_name(options.loss_dtype.value_or(DType::f32)));
  if (logits.dim() == 2) return cross_entropy_2d(logits, target, options);

  Shape expected{logits.shape()[0]};
  std::vector<std::int64_t> perm{0};
  for (int i = 2; i < logits.dim(); ++i) {
    expected.push_back(logits.shape()[i]);
    perm.push_back(i);
  }
  perm.push_back(1);
  MB_CHECK(target.shape() == expected,
           "[cross_entropy] target {} does not match logits {}: expected {}",
           shape_str(target.shape()), shape_str(logits.shape()), shape_str(expected));
  Tensor flat = logits.permute(perm).reshape({-1, logits.shape()[1]});
  Tensor loss = cross_entropy_2d(flat, target.reshape({-1}), options);
  return options.reduction == Reduction::None ? loss.reshape(expected) : loss;
}

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  check_floating("layer_norm", x);
  const std::size_t k = normalized_shape.size();
  bool trailing = k >= 1 && k <= static_cast<std::size_t>(x.dim());
  for (std::size_t i = 0; trailing && i < k; ++i)
    trailing = x.shape()[x.dim() - k + i] == normalized_shape[i];
  MB_CHECK(trailing,
           "[layer_norm] normalized_shape {} does not match the trailing dims of input {}",
           shape_str(normalized_shape), shape_str(x.shape()));
  const std::int64_t cols = shape_numel(normalized_shape);
  MB_CHECK(cols > 0, "[layer_norm] normalized_shape {} is empty", shape_str(normalized_shape));
  for (const Tensor* p : {&weight, &bias}) {
    if (!p->defined()) continue;
    const char* name = p == &weight ? "weight" : "bias";
    MB_CHECK(p->shape() == normalized_shape,
             "[layer_norm] {} has shape {}, expected normalized_shape {}", name,
             shape_str(p->shape()), shape_str(normalized_shape));
    MB_CHECK(p->dtype() == x.dtype(), "[layer_norm] {} is {} but input is {}", name,
             dtype_name(p->dtype()), dtype_name(x.dtype()));
    check_same_device("layer_norm", {x, *p});
  }
  const std::int64_t rows = x.numel() / cols;
  const DType math = math_dtype(x.dtype());
  Tensor xc, wc, bc;
  {
    NoGradGuard no_grad;
    xc = x.contiguous();
    if (weight.defined()) wc = weight.contiguous();
    if (bias.defined()) bc = bias.contiguous();
  }
  Tensor y = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  Tensor mean = empty({rows}, {.dtype = math, .device = x.device()});  // (rows)
  Tensor rstd = empty({rows}, {.dtype = math, .device = x.device()});  // (rows)
  launch(
      "layer_norm", x.device(),
      [&] {
        kernels::cpu::layer_norm_forward(y.kview(), mean.kview(), rstd.kview(), xc.kview(),
                                         view_or_none(wc), view_or_none(bc), eps);
      },
      [&] {
        kernels::cuda::layer_norm_forward(y.kview(), mean.kview(), rstd.kview(), xc.kview(),
                                          view_or_none(wc), view_or_none(bc), eps);
      });
  // Saves x, the weight and the two per-row statistics (2 * rows values).
  // The weight and bias are kept as grad_leaf handles, to reach their gradient slots (Note [Bias
  // gradients in place] in core/ops/linalg.cpp).
  record("layer_norm", {x, weight, bias}, y,
         [sx = SavedTensor(xc, "layer_norm"), sw = SavedTensor(wc, "layer_norm"), mean, rstd,
          normalized_shape, cols, math, weight_leaf = grad_leaf(weight),
          bias_leaf = grad_leaf(bias), rx = x.requires_grad(),
          rw = weight.defined() && weight.requires_grad(),
          rb = bias.defined() && bias.requires_grad()](const Tensor& g) {
           Tensor xv = sx.get(), wv = sw.get();
           Tensor dy = g.contiguous();
           if (dy.dtype() != xv.dtype()) dy = dy.to(xv.dtype());
           Tensor dx =
               rx ? empty(xv.shape(), {.dtype = xv.dtype(), .device = xv.device()}) : Tensor();
           // The parameters' gradients go into their slots, in place, where every one wanted has
           // a slot in the math dtype; else into zeroed (cols) buffers in the math dtype, returned.
           Tensor weight_slot = rw ? in_place_grad(weight_leaf) : Tensor();
           Tensor bias_slot = rb ? in_place_grad(bias_leaf) : Tensor();
           auto takes = [&](bool wanted, const Tensor& slot) {
             return !wanted || (slot.defined() && slot.dtype() == math);
           };
           const bool in_place = takes(rw, weight_slot) && takes(rb, bias_slot);
           auto buffer = [&](bool wanted, const Tensor& slot) {
             if (!wanted) return Tensor();
             return in_place ? slot : zeros({cols}, {.dtype = math, .device = xv.device()});
           };
           Tensor dweight = buffer(rw, weight_slot), dbias = buffer(rb, bias_slot);
           const double param_weight = in_place ? grad_weight() : 1.0;
           // CUDA sums dweight and dbias in two fixed-order passes through per-chunk partials
           // (kernels/nn.h, layer_norm_chunks).
           Tensor partials;  // (2, chunks, cols)
           if ((rw || rb) && backend_of(xv.device()) == Backend::cuda) {
             const std::int64_t chunks = kernels::layer_norm_chunks(mean.numel());
             partials = empty({2, chunks, cols}, {.dtype = math, .device = xv.device()});
           }
           launch(
               "layer_norm", xv.device(),
               [&] {
                 kernels::cpu::layer_norm_backward(view_or_none(dx), view_or_none(dweight),
                                                   view_or_none(dbias), dy.kview(), xv.kview(),
                                                   mean.kview(), rstd.kview(), view_or_none(wv),
                                                   param_weight);
               },
               [&] {
                 kernels::cuda::layer_norm_backward(
                     view_or_none(dx), view_or_none(dweight), view_or_none(dbias), dy.kview(),
                     xv.kview(), mean.kview(), rstd.kview(), view_or_none(wv),
                     view_or_none(partials), param_weight);
               });
           auto finish = [&](Tensor& t) {
             if (!t.defined()) return t;
             if (in_place) {
               t.bump_version();
               return Tensor();
             }
             return t.reshape(normalized_shape).to(xv.dtype());
           };
           return std::vector<Tensor>{dx, finish(dweight), finish(dbias)};
         });
  return y;
}

Tensor dropout(const Tensor& x, double p) {
  check_floating("dropout", x);
  MB_CHECK(p >= 0.0 && p <= 1.0, "[dropout] probability p must be in [0, 1], got {}", p);
  if (p == 0.0) return x;
  if (p == 1.0) {
    // Everything dropped: no draws, and a zero gradient (as x * 0 would give).
    Tensor out = zeros(x.shape(), {.dtype = x.dtype(), .device = x.device()});
    record("dropout", {x}, out, [](const Tensor& g) { return std::vector<Tensor>{zeros_like(g)}; });
    return out;
  }
  // The mask holds 0 or 1 / (1 - p) in x's dtype; a 1-byte keep mask would save memory for the
  // backward, at the cost of a dedicated kernel. Element i of the row-major order draws lane i % 4
  // of Philox block offset + i / 4, so the same seed gives the same mask, and a checkpointed
  // segment that rewinds the generator (core/checkpoint.cpp) recomputes it exactly.
  Tensor mask = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  const std::uint64_t n = static_cast<std::uint64_t>(x.numel());
  const std::uint64_t seed = default_generator().state().seed;
  const std::uint64_t offset = default_generator().reserve((n + 3) / 4);
  launch(
      "dropout", x.device(),
      [&] { kernels::cpu::dropout_mask(mask.kview(), kernels::PhiloxArgs{seed, offset}, p); },
      [&] { kernels::cuda::dropout_mask(mask.kview(), kernels::PhiloxArgs{seed, offset}, p); });
  Tensor out;
  {
    NoGradGuard no_grad;
    out = mul(x, mask);
  }
  record("dropout", {x}, out, [sm = SavedTensor(mask, "dropout")](const Tensor& g) {
    return std::vector<Tensor>{g * sm.get()};
  });
  return out;
}

}  // namespace microbatch
