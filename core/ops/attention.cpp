// Scaled dot-product attention, composed from matmul, masked_fill, softmax, dropout and matmul, so
// its backward is the composition's (every gradient written fresh by those ops). A fused kernel may
// replace it once a benchmark shows the gain; this composition then stays as its test reference.
#include <cmath>
#include <limits>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"

namespace microbatch {

// q (B, H, T, D) or (B, T, D); k (.., S, D); v (.., S, Dv) -> (.., T, Dv).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    AttentionOptions options) {
  constexpr const char* op = "scaled_dot_product_attention";
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
