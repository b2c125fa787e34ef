// matmul (torch.matmul's rules), composed around one batched GEMM op (`bmm`), and linear, a
// GEMM with the bias added before rounding and a weight gradient that lands in place.
//
// Note [16-bit GEMMs by backend]: both backends multiply 16-bit operands with f32 accumulation and
// round once. The CPU's Eigen GEMM takes f32 or f64 only, so there the op makes f32 copies of
// 16-bit operands and output; cuBLAS reads and writes 16-bit itself (kernels/gemm.h), so on CUDA no
// copy is made. A meta tensor takes the path backend_of() names (Note [Meta mirrors a backend]).
#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "kernels/gemm.h"

namespace microbatch {

namespace {

// A view whose two matrix dims the backend's GEMM can read in place (a unit stride on one side;
// cuBLAS also needs a valid leading dimension, kernels::blas_matrix), or a contiguous copy.
Tensor gemm_ready(const Tensor& t, Backend backend) {
  const auto& st = t.strides();
  const auto& sh = t.shape();
  if (backend == Backend::cuda)
    return kernels::blas_matrix(sh[1], sh[2], st[1], st[2]).ok ? t : t.contiguous();
  const bool row = st[2] == 1 || sh[2] == 1;
  const bool col = st[1] == 1 || sh[1] == 1;
  return (row || col) ? t : t.contiguous();
}

// Note [Padded rows]: on CUDA, a 16-bit linear whose output rows are not a whole number of 16-byte
// units (GPT-2's 50257-wide logits) gets rows padded to the next 16 bytes, and returns the (M, N)
// view of them. Unaligned rows keep cuBLAS's tensor-core kernels from loading them 16 bytes at a
// time (and from using the TMA, which needs 16-byte strides), both when the GEMM writes them and when
// the backward's GEMMs read their gradient; the cross-entropy kernels then run scalar heads on
// every row. The rows' consumers take them where they lie: cross_entropy on CUDA reads the padded
// rows and writes dlogits with the same padding, and reshapes of the leading dims stay views. The
// padding (at most 7 elements per row) is never read. The CPU, which copies 16-bit operands to f32
// anyway, keeps dense rows; meta mirrors the backend it stands in for. What a caller sees: such an
// output is not contiguous (view() of it throws where reshape() copies), and cross_entropy saves it
// without a copy, so changing it in place before the backward trips the version check.
std::int64_t padded_row(std::int64_t m, std::int64_t n, DType dt, Backend backend) {
  if (backend != Backend::cuda || !is_16bit_float(dt) || m <= 1 || n % 8 == 0) return n;
  return (n + 7) / 8 * 8;
}

// The dtype a GEMM on `backend` reads operands of dtype dt in (Note [16-bit GEMMs by backend]).
DType gemm_math(DType dt, Backend backend) {
  if (backend == Backend::cuda || dt == DType::f64) return dt;
  return DType::f32;
}

// (B, M, K) @ (B, K, N) -> (B, M, N); a batch of size 1 in one operand broadcasts.
Tensor bmm(const Tensor& a, const Tensor& b) {
  MB_CHECK(a.shape()[2] == b.shape()[1], "[matmul] inner dimensions differ: {} @ {}",
           shape_str(a.shape()), shape_str(b.shape()));
  const std::int64_t batch = std::max(a.shape()[0], b.shape()[0]);
  MB_CHECK(a.shape()[0] == b.shape()[0] || a.shape()[0] == 1 || b.shape()[0] == 1,
           "[matmul] batch sizes differ: {} @ {}", shape_str(a.shape()), shape_str(b.shape()));
  const DType dt = a.dtype();
  const Backend backend = backend_of(a.device());
  // 16-bit inputs multiply in f32 and round once at the end.
  const DType math = gemm_math(dt, backend);
  Tensor out = empty({batch, a.shape()[1], b.shape()[2]}, {.dtype = dt, .device = a.device()});
  {
    // The operand copies are made outside launch() so that the meta device sees them too.
    NoGradGuard no_grad;
    Tensor x = gemm_ready(a.to(math), backend), y = gemm_ready(b.to(math), backend);
    Tensor o = math == dt ? out : empty(out.shape(), {.dtype = math, .device = a.device()});
    auto views = [&] {
      auto xv = x.kview(), yv = y.kview();
      if (x.shape()[0] == 1) xv.strides[0] = 0, xv.shape[0] = batch;
      if (y.shape()[0] == 1) yv.strides[0] = 0, yv.shape[0] = batch;
      return std::pair{xv, yv};
    };
    launch(
        "matmul", a.device(),
        [&] {
          const auto [xv, yv] = views();
          kernels::cpu::gemm(xv, yv, o.kview(), 1.0, 0.0);
        },
        [&] {
          const auto [xv, yv] = views();
          kernels::cuda::gemm(xv, yv, o.kview(), 1.0, 0.0);
        });
    if (!o.same_storage(out)) out.copy_(o);
  }
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

// The dtype the weight-gradient GEMM reads its operands in when it can add into `grad` directly
// (Note [Weight-gradient GEMM]), for inputs of dtype `input`; nullopt when it cannot. The CPU
// accumulates into f32 or f64 from operands converted to that dtype; cuBLAS reads 16-bit operands
// into an f32 or same-dtype accumulator as they are, and converts others to an f32 or f64 one.
std::optional<DType> weight_grad_operands(const Tensor& grad, DType input) {
  if (!grad.is_contiguous() || !is_floating(grad.dtype())) return std::nullopt;
  const DType acc = grad.dtype();
  if (backend_of(grad.device()) == Backend::cuda &&
      (acc == input || (acc == DType::f32 && is_16bit_float(input))))
    return input;
  if (is_16bit_float(acc)) return std::nullopt;
  return acc;
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

// Note [Weight-gradient GEMM]: linear's backward writes dweight straight into the weight's
// gradient buffer (a slot of the gradient arena) as `grad = w * dy^T x + 1 * grad`, the GEMM's
// alpha = w (the micro-batch's accumulation weight) and beta = 1, so no temporary of the weight's
// size is allocated and AccumulateGrad has nothing left to do for it. Where that is not allowed
// (no buffer yet, or grad() is capturing the weight) it returns dweight like any other op.
// On CUDA, cuBLAS reads 16-bit dy and x as they are and accumulates in f32 into an f32 or
// same-dtype gradient (weight_grad_operands says which dtypes each backend can take).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_same_device("linear", {x, weight, bias});
  check_floating("linear", x);
  MB_CHECK(weight.dim() == 2, "[linear] weight must be (out, in), got {}", shape_str(weight.shape()));
  MB_CHECK(x.dim() >= 1 && x.shape().back() == weight.shape()[1],
           "[linear] input {} does not match weight {} (expected last dim {})", shape_str(x.shape()),
           shape_str(weight.shape()), weight.shape()[1]);
  MB_CHECK(x.dtype() == weight.dtype(), "[linear] input is {} but weight is {}", dtype_name(x.dtype()),
           dtype_name(weight.dtype()));
  const std::int64_t n = weight.shape()[0], k = weight.shape()[1];
  if (bias.defined()) {
    MB_CHECK(bias.dim() == 1 && bias.shape()[0] == n, "[linear] bias must be ({},), got {}", n,
             shape_str(bias.shape()));
    MB_CHECK(bias.dtype() == x.dtype(), "[linear] bias is {} but input is {}", dtype_name(bias.dtype()),
             dtype_name(x.dtype()));
  }
  const DType dt = x.dtype();
  const Backend backend = backend_of(x.device());
  const DType math = gemm_math(dt, backend);
  Shape out_shape(x.shape().begin(), x.shape().end() - 1);
  out_shape.push_back(n);
  const std::int64_t m = shape_numel(out_shape) / std::max<std::int64_t>(n, 1);
  const std::int64_t ld = padded_row(m, n, dt, backend);
  Tensor out = empty({m, ld}, {.dtype = dt, .device = x.device()});
  if (ld != n) out = out.slice(1, 0, n);  // (M, N) rows of ld elements (Note [Padded rows])
  {
    // 16-bit inputs multiply in f32, the bias is added in f32, and the result is rounded once
    // (Note [16-bit GEMMs by backend]). Copies are made outside launch() so that meta sees them.
    NoGradGuard no_grad;
    Tensor x2 = gemm_ready(x.reshape({1, m, k}).to(math), backend);        // (1, M, K)
    Tensor wt = gemm_ready(weight.to(math).t().unsqueeze(0), backend);     // (1, K, N)
    Tensor o = math == dt ? out : empty({m, n}, {.dtype = math, .device = x.device()});  // (M, N)
    // The bias is added to the f32 sum and rounded with it, once: on CUDA in cuBLASLt's epilogue
    // (Note [Bias in the GEMM's epilogue] in kernels/cuda/gemm.cu); on the CPU it is copied into
    // the output rows and the GEMM adds onto it (beta = 1).
    const bool fused_bias = bias.defined() && backend == Backend::cuda;
    double beta = 0.0;
    if (bias.defined() && !fused_bias) {
      o.copy_(bias.expand({m, n}));
      beta = 1.0;
    }
    launch(
        "linear", x.device(),
        [&] { kernels::cpu::gemm(x2.kview(), wt.kview(), o.unsqueeze(0).kview(), 1.0, beta); },
        [&] {
          if (fused_bias) {
            kernels::cuda::gemm_bias(x2.kview(), wt.kview(), bias.kview(), o.unsqueeze(0).kview());
          } else {
            kernels::cuda::gemm(x2.kview(), wt.kview(), o.unsqueeze(0).kview(), 1.0, beta);
          }
        });
    if (!o.same_storage(out)) out.copy_(o);
  }
  record("linear", {x, weight, bias}, out,
         [sx = SavedTensor(x, "linear"), sw = SavedTensor(weight, "linear"), x_shape = x.shape(),
          rx = x.requires_grad(), rw = weight.requires_grad(),
          rb = bias.defined() && bias.requires_grad(), m, n, k](const Tensor& g) {
           Tensor g2 = g.reshape({m, n});
           Tensor w = sw.get();
           Tensor dx, dw, db;
           if (rx) dx = matmul(g2, w).reshape(x_shape);
           if (rw) {
             Tensor x2 = sx.get().reshape({m, k});
             Tensor grad = w.grad();
             // Meta takes this path too, so that its allocations (no dw temporary) match the
             // backend it mirrors.
             const std::optional<DType> operands =
                 accumulates_in_place(w) ? weight_grad_operands(grad, g2.dtype()) : std::nullopt;
             if (operands) {
               const Backend backend = backend_of(grad.device());
               Tensor gm = gemm_ready(g2.t().unsqueeze(0).to(*operands), backend);  // (1, N, M)
               Tensor xm = gemm_ready(x2.unsqueeze(0).to(*operands), backend);      // (1, M, K)
               const double alpha = grad_weight();
               const Tensor acc = grad.unsqueeze(0);  // (1, N, K)
               launch(
                   "linear", grad.device(),
                   [&] { kernels::cpu::gemm(gm.kview(), xm.kview(), acc.kview(), alpha, 1.0); },
                   [&] { kernels::cuda::gemm(gm.kview(), xm.kview(), acc.kview(), alpha, 1.0); });
               grad.bump_version();
             } else {
               dw = matmul(g2.t(), x2);
             }
           }
           if (rb) db = sum(g2, {0});
           return std::vector<Tensor>{dx, dw, db};
         });
  return out.reshape(out_shape);
}

}  // namespace microbatch
