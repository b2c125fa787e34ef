// Scaled dot-product attention. On CUDA (and on meta standing in for it), without dropout and with
// D = Dv <= 128, one fused kernel (kernels/attention.h) computes it tile by tile and saves q, k, v,
// out and one log-sum-exp per query; its backward recomputes the scores and writes dq, dk, dv
// fresh. Everywhere else it is composed from matmul, masked_fill, softmax, dropout and matmul, so
// its backward is the composition's (every gradient written fresh by those ops), which saves the
// (T, S) probabilities; the composition is also the fused kernel's test reference.
#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"

namespace microbatch {

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";

// Whether the fused kernel takes this call. It depends on shapes, dtypes and backend_of alone, so
// that a meta tensor standing in for a CUDA one makes the same choice (Note [Meta mirrors a
// backend]).
bool takes_fused(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  const std::int64_t d = q.shape().back();
  return backend_of(q.device()) == Backend::cuda && o.dropout_p == 0.0 &&
         q.dtype() != DType::f64 && d <= kernels::kAttentionMaxHeadDim && v.shape().back() == d &&
         q.numel() > 0 && k.numel() > 0;
}

// The kernel reads rows with unit stride along D; any other strides are taken as they are.
Tensor unit_stride_rows(const Tensor& t) {
  return t.shape().back() == 1 || t.strides().back() == 1 ? t : t.contiguous();
}

// Note [Attention outputs where the inputs lie]: out is allocated with its dims in the memory
// order of q's, and dq, dk, dv in those of q, k and v (as torch's empty_like keeps a dense input's
// strides). A model that makes its heads with x.reshape(B, T, H, D).transpose(1, 2) then gets out
// as the transpose of a dense (B, T, H, D), so out.transpose(1, 2).reshape(B, T, C) is a view and
// not a copy, and the gradients come back to the reshape the same way: four (B, T, C) copies a
// layer fewer. The kernels write any strides with unit stride along D.
Tensor empty_laid_out_like(const Tensor& like) {
  const int n = like.dim();
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return like.strides()[static_cast<std::size_t>(a)] > like.strides()[static_cast<std::size_t>(b)];
  });
  const TensorOptions options{.dtype = like.dtype(), .device = like.device()};
  if (order.back() != n - 1) return empty(like.shape(), options);  // D must stay innermost
  Shape dense_shape;
  std::vector<std::int64_t> inverse(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    dense_shape.push_back(like.shape()[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]);
    inverse[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = i;
  }
  NoGradGuard no_grad;
  return empty(dense_shape, options).permute(inverse);
}

// Whether q, k and v are three disjoint, equally laid out pieces of one buffer w elements apart
// (GPT's heads, split from one (B, T, 3C) projection): same storage, shape, strides and dtype,
// offsets o, o + w, o + 2w, and, with the dims of unit-stride-chained strides forming a dense
// inner block of E elements, w >= E and 2w + E within the smallest other stride, the other dims
// not overlapping one another. Then their gradients can be laid out the same way in one buffer,
// which split's backward takes whole (Note [Pieces that tile their input] in core/ops/shape.cpp).
// Returns w, or 0.
std::int64_t sibling_spacing(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!q.same_storage(k) || !q.same_storage(v) || q.shape() != k.shape() || q.shape() != v.shape() ||
      q.strides() != k.strides() || q.strides() != v.strides() || q.dtype() != k.dtype() ||
      q.dtype() != v.dtype()) {
    return 0;
  }
  const std::int64_t w = k.offset() - q.offset();
  if (w <= 0 || v.offset() - k.offset() != w) return 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of dims of size > 1
  for (int i = 0; i < q.dim(); ++i) {
    if (q.shape()[i] > 1) dims.emplace_back(q.strides()[i], q.shape()[i]);
  }
  std::sort(dims.begin(), dims.end());
  std::int64_t inner = 1;
  std::size_t i = 0;
  for (; i < dims.size() && dims[i].first == inner; ++i) inner *= dims[i].second;
  if (w < inner) return 0;
  std::int64_t reach = 2 * w + inner;  // one outer position's three blocks end before this
  for (; i < dims.size(); ++i) {
    if (dims[i].first < reach) return 0;
    reach = dims[i].first * dims[i].second;
  }
  return w;
}

// Empty gradients for q, k and v: one buffer laid out as their common one when they are siblings
// (sibling_spacing), else each laid out as its input (empty_laid_out_like).
std::vector<Tensor> attention_gradients(const Tensor& q, const Tensor& k, const Tensor& v) {
  const std::int64_t w = sibling_spacing(q, k, v);
  if (w == 0) return {empty_laid_out_like(q), empty_laid_out_like(k), empty_laid_out_like(v)};
  std::int64_t extent = 1;  // elements from q's first to its last, inclusive
  for (int i = 0; i < q.dim(); ++i) extent += (q.shape()[i] - 1) * q.strides()[i];
  Tensor buffer = empty({2 * w + extent}, {.dtype = q.dtype(), .device = q.device()});
  std::vector<Tensor> out;
  for (std::int64_t piece = 0; piece < 3; ++piece) {
    out.push_back(make_strided(buffer.storage(), q.shape(), q.strides(),
                               buffer.offset() + piece * w, q.dtype()));
  }
  return out;
}

// Saves q, k, v, out and lse (.., T) f32; backward writes dq, dk, dv (and a (.., T) f32 delta).
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                       bool causal) {
  const kernels::AttentionArgs args{.scale = scale, .causal = causal};
  Tensor qc, kc, vc;
  {
    NoGradGuard no_grad;
    qc = unit_stride_rows(q);
    kc = unit_stride_rows(k);
    vc = unit_stride_rows(v);
  }
  const Shape rows_shape(q.shape().begin(), q.shape().end() - 1);  // (.., T)
  Tensor o = empty_laid_out_like(qc);  // (.., T, D), laid out as q
  Tensor lse = empty(rows_shape, {.dtype = DType::f32, .device = q.device()});  // (.., T)
  launch(
      kOp, q.device(), [] { MB_ASSERT(false, "the fused attention kernel has no CPU version"); },
      [&] {
        kernels::cuda::attention_forward(qc.kview(), kc.kview(), vc.kview(), o.kview(),
                                         lse.kview(), args);
      });
  Tensor out;
  {
    NoGradGuard no_grad;
    out = o.detach();
  }
  // Saves the output's buffer o, a different handle from the returned one, so that the node does
  // not keep itself alive through its own output.
  record(kOp, {q, k, v}, out,
         [sq = SavedTensor(qc, kOp), sk = SavedTensor(kc, kOp), sv = SavedTensor(vc, kOp),
          so = SavedTensor(o, kOp), lse, rows_shape, args](const Tensor& g) {
           Tensor qv = sq.get(), kv = sk.get(), vv = sv.get(), ov = so.get();
           Tensor dout = unit_stride_rows(g.dtype() == ov.dtype() ? g : g.to(ov.dtype()));
           Tensor delta =
               empty(rows_shape, {.dtype = DType::f32, .device = qv.device()});  // (.., T)
           const std::vector<Tensor> grads = attention_gradients(qv, kv, vv);
           const Tensor &dq = grads[0], &dk = grads[1], &dv = grads[2];
           launch(
               kOp, qv.device(),
               [] { MB_ASSERT(false, "the fused attention kernel has no CPU version"); },
               [&] {
                 kernels::cuda::attention_backward(qv.kview(), kv.kview(), vv.kview(), ov.kview(),
                                                   dout.kview(), lse.kview(), delta.kview(),
                                                   dq.kview(), dk.kview(), dv.kview(), args);
               });
           return grads;
         });
  return out;
}

}  // namespace

// q (B, H, T, D) or (B, T, D); k (.., S, D); v (.., S, Dv) -> (.., T, Dv).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    AttentionOptions options) {
  constexpr const char* op = kOp;
  check_same_device(op, {q, k, v});
  check_floating(op, q);
  MB_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype(),
           "[{}] q, k and v dtypes differ: {}, {}, {}", op, dtype_name(q.dtype()),
           dtype_name(k.dtype()), dtype_name(v.dtype()));
  MB_CHECK(q.dim() == 3 || q.dim() == 4,
           "[{}] expected q of shape (B, H, T, D) or (B, T, D), got {}", op, shape_str(q.shape()));
  MB_CHECK(k.dim() == q.dim() && v.dim() == q.dim(),
           "[{}] q {}, k {} and v {} must have the same number of dims", op, shape_str(q.shape()),
           shape_str(k.shape()), shape_str(v.shape()));
  const int n = q.dim();
  for (int i = 0; i < n - 2; ++i) {
    MB_CHECK(k.shape()[i] == q.shape()[i] && v.shape()[i] == q.shape()[i],
             "[{}] batch and head dims differ: q {}, k {}, v {}", op, shape_str(q.shape()),
             shape_str(k.shape()), shape_str(v.shape()));
  }
  const std::int64_t t = q.shape()[n - 2], s = k.shape()[n - 2], d = q.shape()[n - 1];
  MB_CHECK(k.shape()[n - 1] == d, "[{}] q and k head dims differ: q {} has D = {}, k {} has D = {}",
           op, shape_str(q.shape()), d, shape_str(k.shape()), k.shape()[n - 1]);
  MB_CHECK(v.shape()[n - 2] == s, "[{}] k and v lengths differ: k {} has {} keys, v {} has {}", op,
           shape_str(k.shape()), s, shape_str(v.shape()), v.shape()[n - 2]);
  MB_CHECK(d > 0, "[{}] head dim D is 0 (q {})", op, shape_str(q.shape()));
  MB_CHECK(options.dropout_p >= 0.0 && options.dropout_p <= 1.0,
           "[{}] dropout_p must be in [0, 1], got {}", op, options.dropout_p);
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
  if (takes_fused(q, k, v, options)) return fused_attention(q, k, v, scale, options.causal);

  // Scaling q (T x D) rather than the scores (T x S) keeps the T x S tensors saved for backward to
  // the softmax output alone.
  Tensor scores = matmul(q * scale, k.transpose(-2, -1));  // (.., T, S)
  if (options.causal) {
    // Query i sees keys 0..i (top-left aligned when T != S, as torch's is_causal).
    const TensorOptions index{.dtype = DType::i64, .device = q.device()};
    Tensor query = arange(0, static_cast<double>(t), 1, index).reshape({t, 1});
    Tensor key = arange(0, static_cast<double>(s), 1, index).reshape({1, s});
    scores = masked_fill(scores, gt(key, query), -std::numeric_limits<double>::infinity());
  }
  Tensor probs = softmax(scores, -1);  // (.., T, S)
  if (options.dropout_p > 0.0) probs = dropout(probs, options.dropout_p);
  return matmul(probs, v);  // (.., T, Dv)
}

}  // namespace microbatch
