// matmul (torch.matmul's rules) and linear, composed around one batched GEMM op (`bmm`).
#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "kernels/gemm.h"

namespace microbatch {

namespace {

// A view whose two matrix dims have a unit stride on one side, as the GEMM kernel needs.
Tensor gemm_ready(const Tensor& t) {
  const auto& st = t.strides();
  const auto& sh = t.shape();
  const bool row = st[2] == 1 || sh[2] == 1;
  const bool col = st[1] == 1 || sh[1] == 1;
  return (row || col) ? t : t.contiguous();
}

// (B, M, K) @ (B, K, N) -> (B, M, N); a batch of size 1 in one operand broadcasts.
Tensor bmm(const Tensor& a, const Tensor& b) {
  MB_CHECK(a.shape()[2] == b.shape()[1], "[matmul] inner dimensions differ: {} @ {}",
           shape_str(a.shape()), shape_str(b.shape()));
  const std::int64_t batch = std::max(a.shape()[0], b.shape()[0]);
  MB_CHECK(a.shape()[0] == b.shape()[0] || a.shape()[0] == 1 || b.shape()[0] == 1,
           "[matmul] batch sizes differ: {} @ {}", shape_str(a.shape()), shape_str(b.shape()));
  const DType dt = a.dtype();
  // 16-bit inputs multiply in f32 and round once at the end.
  const DType math = dt == DType::f64 ? DType::f64 : DType::f32;
  Tensor out = empty({batch, a.shape()[1], b.shape()[2]}, {.dtype = dt, .device = a.device()});
  launch("matmul", a.device(), [&] {
    NoGradGuard no_grad;
    Tensor x = gemm_ready(a.to(math)), y = gemm_ready(b.to(math));
    auto xv = x.kview(), yv = y.kview();
    if (x.shape()[0] == 1) xv.strides[0] = 0, xv.shape[0] = batch;
    if (y.shape()[0] == 1) yv.strides[0] = 0, yv.shape[0] = batch;
    Tensor o = math == dt ? out : empty(out.shape(), {.dtype = math});
    kernels::cpu::gemm(xv, yv, o.kview(), 1.0, 0.0);
    if (!o.same_storage(out)) out.copy_(o);
  });
  record("matmul", {a, b}, out,
         [sa = SavedTensor(a, "matmul"), sb = SavedTensor(b, "matmul"), ra = a.requires_grad(),
          rb = b.requires_grad()](const Tensor& g) {
           Tensor x = sa.get(), y = sb.get();
           Tensor da, db;
           if (ra) {
             da = bmm(g, y.transpose(1, 2));
             if (x.shape()[0] == 1 && da.shape()[0] != 1) da = sum(da, {0}, {.keepdim = true});
           }
           if (rb) {
             db = bmm(x.transpose(1, 2), g);
             if (y.shape()[0] == 1 && db.shape()[0] != 1) db = sum(db, {0}, {.keepdim = true});
           }
           return std::vector<Tensor>{da, db};
         });
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_same_device("matmul", {a, b});
  check_floating("matmul", a);
  MB_CHECK(a.dtype() == b.dtype(), "[matmul] dtypes differ: {} @ {}", dtype_name(a.dtype()),
           dtype_name(b.dtype()));
  MB_CHECK(a.dim() >= 1 && b.dim() >= 1, "[matmul] both operands need at least 1 dim, got {} @ {}",
           shape_str(a.shape()), shape_str(b.shape()));
  const Shape sa = a.shape(), sb = b.shape();
  MB_CHECK(sa.back() == (b.dim() == 1 ? sb[0] : sb[sb.size() - 2]),
           "[matmul] inner dimensions differ: {} @ {}", shape_str(sa), shape_str(sb));
  Tensor x = a.dim() == 1 ? a.unsqueeze(0) : a;
  Tensor y = b.dim() == 1 ? b.unsqueeze(1) : b;
  const std::int64_t m = x.shape()[x.dim() - 2], k = x.shape()[x.dim() - 1], n = y.shape()[y.dim() - 1];
  Shape batch_x(x.shape().begin(), x.shape().end() - 2), batch_y(y.shape().begin(), y.shape().end() - 2);
  Tensor out;
  if (batch_y.empty()) {
    // (..., M, K) @ (K, N): fold the batch into the rows, one GEMM.
    Tensor flat = x.reshape({1, shape_numel(batch_x) * m, k});
    out = bmm(flat, y.unsqueeze(0));
    Shape s = batch_x;
    s.push_back(m);
    s.push_back(n);
    out = out.reshape(s);
  } else {
    const Shape batch = broadcast_shapes(batch_x, batch_y, "matmul");
    const std::int64_t nb = shape_numel(batch);
    auto fold = [&](const Tensor& t, const Shape& tb, std::int64_t r, std::int64_t c) {
      if (tb.empty() || shape_numel(tb) == 1) return t.reshape({1, r, c});
      Shape full = batch;
      full.push_back(r);
      full.push_back(c);
      return t.expand(full).reshape({nb, r, c});
    };
    out = bmm(fold(x, batch_x, m, k), fold(y, batch_y, k, n));
    Shape s = batch;
    s.push_back(m);
    s.push_back(n);
    out = out.reshape(s);
  }
  if (a.dim() == 1) out = out.squeeze(-2);
  if (b.dim() == 1) out = out.squeeze(-1);
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  MB_CHECK(weight.dim() == 2, "[linear] weight must be (out, in), got {}", shape_str(weight.shape()));
  MB_CHECK(x.dim() >= 1 && x.shape().back() == weight.shape()[1],
           "[linear] input {} does not match weight {} (expected last dim {})", shape_str(x.shape()),
           shape_str(weight.shape()), weight.shape()[1]);
  Tensor out = matmul(x, weight.t());
  if (bias.defined()) {
    MB_CHECK(bias.dim() == 1 && bias.shape()[0] == weight.shape()[0],
             "[linear] bias must be ({},), got {}", weight.shape()[0], shape_str(bias.shape()));
    out = out + bias;
  }
  return out;
}

}  // namespace microbatch
