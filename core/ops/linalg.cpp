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
#include "kernels/reduce.h"

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

// An empty (m, n) tensor in rows of ld >= n elements (a slice of (m, ld) when ld > n).
Tensor empty_rows(std::int64_t m, std::int64_t n, std::int64_t ld, const TensorOptions& options) {
  Tensor t = empty({m, ld}, options);
  return ld == n ? t : t.slice(1, 0, n);
}

// The dtype a GEMM on `backend` reads operands of dtype dt in (Note [16-bit GEMMs by backend]).
DType gemm_math(DType dt, Backend backend) {
  if (backend == Backend::cuda || dt == DType::f64) return dt;
  return DType::f32;
}

// (B, M, K) @ (B, K, N) -> (B, M, N); a batch of size 1 in one operand broadcasts (to 0 too).
Tensor bmm(const Tensor& a, const Tensor& b) {
  MB_CHECK(a.shape()[2] == b.shape()[1], "[matmul] inner dimensions differ: {} @ {}",
           shape_str(a.shape()), shape_str(b.shape()));
  MB_CHECK(a.shape()[0] == b.shape()[0] || a.shape()[0] == 1 || b.shape()[0] == 1,
           "[matmul] batch sizes differ: {} @ {}", shape_str(a.shape()), shape_str(b.shape()));
  // Not max(): a batch of 1 against an empty batch broadcasts to 0, as torch.
  const std::int64_t batch = a.shape()[0] == 1 ? b.shape()[0] : a.shape()[0];
  const DType dt = a.dtype();
  const Backend backend = backend_of(a.device());
  // 16-bit inputs multiply in f32 and round once at the end.
  const DType math = gemm_math(dt, backend);
  Tensor out = empty({batch, a.shape()[1], b.shape()[2]}, {.dtype = dt, .device = a.device()});
  // An empty output has nothing to compute on either backend (and no operand copies to make);
  // K = 0 with a non-empty output still runs, as the GEMM writes its zeros.
  if (out.numel() > 0) {
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
  // da = g b^T reads b, db = a^T g reads a (Note [Saving only what a gradient reads]).
  const bool ra = a.requires_grad(), rb = b.requires_grad();
  record("matmul", {a, b}, out,
         [sa = rb ? SavedTensor(a, "matmul") : SavedTensor(),
          sb = ra ? SavedTensor(b, "matmul") : SavedTensor(), ra, rb, a_batch = a.shape()[0],
          b_batch = b.shape()[0]](const Tensor& g) {
           Tensor da, db;
           if (ra) {
             da = bmm(g, sb.get().transpose(1, 2));
             if (a_batch == 1 && da.shape()[0] != 1) da = sum(da, {0}, {.keepdim = true});
           }
           if (rb) {
             db = bmm(sa.get().transpose(1, 2), g);
             if (b_batch == 1 && db.shape()[0] != 1) db = sum(db, {0}, {.keepdim = true});
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

namespace {
// Note [Bias gradients in place]: a bias's gradient is the column sum of the output gradient,
// (M, N) summed to (N). Where the bias accumulates in place (in_place_grad), the sum goes
// straight into its gradient slot as grad += w * sum (kernels::*::add_column_sums), as the weight's
// does through its GEMM (Note [Weight-gradient GEMM]), instead of a (N) temporary in the bias's
// dtype that AccumulateGrad then adds in a launch of its own. The CPU sums the columns without the
// transposed copy of the (M, N) gradient that a sum over dim 0 makes there; CUDA sums them in two
// fixed-order passes (Note [Column sums] in kernels/reduce.h). The slot takes the sum rounded to
// its compute type (f32 for f32 and 16-bit slots, f64 for f64 ones), where the temporary was
// rounded to the bias's dtype first: a 16-bit bias's gradient is summed in f32 and rounded once.
// Where the slot's dtype is the bias's f32 or f64 the bits are the temporary's route's for the
// layouts linear's gradients come in, (M, N) rows with N > 1 (a sum over dim 0 of other layouts
// may add in another order). Layer norm's weight and bias take their sums the same way, in its
// math dtype, where both slots are in that dtype (layer_norm_backward in kernels/nn.h); otherwise
// both go through AccumulateGrad.
void add_column_sums_into(const Tensor& slot, const Tensor& g2, double weight) {
  // No rows add zero (and CUDA's column split has no chunks for them); no columns, no bias.
  if (g2.numel() == 0) return;
  // The CPU reads any layout; CUDA reads unit-stride rows, copying others.
  Tensor partials, rows = g2;
  if (backend_of(g2.device()) == Backend::cuda) {
    const std::int64_t chunks = kernels::column_split(g2.shape()[0], g2.shape()[1]).chunks;
    partials = empty({chunks, g2.shape()[1]}, {.dtype = DType::f64, .device = g2.device()});
    if (!g2.kview().is_rows()) rows = g2.contiguous();
  }
  launch(
      "linear", g2.device(),
      [&] { kernels::cpu::add_column_sums(slot.kview(), rows.kview(), weight); },
      [&] {
        kernels::cuda::add_column_sums(slot.kview(), rows.kview(), weight, partials.kview());
      });
  slot.bump_version();
}

// grad (N, K) += weight * g2^T (N, M) @ x2 (M, K) in one GEMM, reading its operands in dtype
// `operands` (Note [Weight-gradient GEMM]).
void add_weight_grad_into(const Tensor& grad, const Tensor& g2, const Tensor& x2, DType operands,
                          double weight) {
  // M = 0 adds zero, and N = 0 or K = 0 leaves an empty buffer: nothing to launch.
  if (g2.numel() == 0 || x2.numel() == 0) return;
  const Backend backend = backend_of(grad.device());
  Tensor gm = gemm_ready(g2.t().unsqueeze(0).to(operands), backend);  // (1, N, M)
  Tensor xm = gemm_ready(x2.unsqueeze(0).to(operands), backend);      // (1, M, K)
  const Tensor acc = grad.unsqueeze(0);                               // (1, N, K)
  launch(
      "linear", grad.device(),
      [&] { kernels::cpu::gemm(gm.kview(), xm.kview(), acc.kview(), weight, 1.0); },
      [&] { kernels::cuda::gemm(gm.kview(), xm.kview(), acc.kview(), weight, 1.0); });
  grad.bump_version();
}

// linear's weight and bias gradients for the output gradient g2 (M, N) and the input x2 (M, K):
// each is added straight into its parameter's gradient buffer where that accumulates in place
// (Notes [Weight-gradient GEMM] and [Bias gradients in place]) and then returned undefined; else
// dweight = g2^T x2 and dbias = the column sum of g2. `b` is the bias's grad_leaf.
std::pair<Tensor, Tensor> linear_param_grads(const Tensor& g2, const Tensor& x2, const Tensor& w,
                                             const Tensor& b, bool rw, bool rb) {
  Tensor dw, db;
  if (rw) {
    // w is the weight's leaf, or undefined for a weight that is not one (it has no slot).
    Tensor grad = w.defined() ? w.grad() : Tensor();
    // Meta takes this path too, so that its allocations (no dw temporary) match the backend it
    // mirrors.
    const std::optional<DType> operands =
        accumulates_in_place(w) ? weight_grad_operands(grad, g2.dtype()) : std::nullopt;
    if (operands) {
      add_weight_grad_into(grad, g2, x2, *operands, grad_weight());
    } else {
      dw = matmul(g2.t(), x2);
    }
  }
  if (rb) {
    if (Tensor slot = in_place_grad(b); slot.defined()) {
      add_column_sums_into(slot, g2, grad_weight());
    } else {
      db = sum(g2, {0});
    }
  }
  return {dw, db};
}
}  // namespace

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
  // The rows from x's leading dims, not from the output's numel, which is 0 when n is.
  const std::int64_t m = shape_numel(out_shape);
  out_shape.push_back(n);
  // (M, N), rows padded where Note [Padded rows] says.
  Tensor out = empty_rows(m, n, padded_row(m, n, dt, backend), {.dtype = dt, .device = x.device()});
  // An empty output (M = 0 or N = 0) has nothing to compute on either backend; K = 0 with a
  // non-empty output still runs, as the GEMM writes the bias (or zeros).
  if (out.numel() > 0) {
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
  // dx reads the weight and dweight the input (Note [Saving only what a gradient reads]): a frozen
  // weight's linear keeps no activation, and a linear of data keeps no weight; the weight's
  // gradient slot is reached through its leaf.
  const bool rx = x.requires_grad(), rw = weight.requires_grad();
  record("linear", {x, weight, bias}, out,
         [sx = rw ? SavedTensor(x, "linear") : SavedTensor(),
          sw = rx ? SavedTensor(weight, "linear") : SavedTensor(), wl = grad_leaf(weight),
          x_shape = x.shape(), b = grad_leaf(bias), rx, rw,
          rb = bias.defined() && bias.requires_grad(), m, n, k](const Tensor& g) {
           Tensor g2 = g.reshape({m, n});
           Tensor dx;
           if (rx) dx = matmul(g2, sw.get()).reshape(x_shape);
           auto [dw, db] =
               linear_param_grads(g2, rw ? sx.get().reshape({m, k}) : Tensor(), wl, b, rw, rb);
           return std::vector<Tensor>{dx, dw, db};
         });
  return out.reshape(out_shape);
}

// Note [MLP in GEMM epilogues]: GPT's MLP, c_proj(gelu(c_fc(x))), as one node on CUDA. The
// forward's first GEMM adds b1 and applies GELU in cuBLASLt's GELU_AUX_BIAS epilogue, writing
// both GELU's input `pre` (kept for the backward, as gelu would keep it) and its output `h` (kept
// by the second GEMM's weight gradient, as linear would); the second is linear's GEMM with b2 in
// its epilogue. The backward's GEMM through w2 applies GELU's derivative in the DGELU epilogue and
// writes the gradient of `pre` directly, so neither GELU's forward nor its backward reads and
// writes the (M, hidden) activations in a pass of its own (at GPT-2 small's micro-batch 8 those
// passes move about 250 MB a layer). The weight and bias gradients are linear's (the weights'
// straight into their arena slots). Where Lt does not take a call the kernels compute the same in
// separate passes into the same buffers, so the node's allocations, and meta's, do not depend on
// it; GELU then takes the rounded `pre` where the epilogue takes the f32 sum. f32 always takes
// the separate passes (kernels/cuda/gemm.cu: cuBLASLt's GELU may use a fast tanh).
Tensor gelu_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                const Tensor& b2) {
  check_same_device("gelu_mlp", {x, w1, b1, w2, b2});
  const bool all = b1.defined() && b2.defined() && w1.dim() == 2 && w2.dim() == 2 && x.dim() >= 1;
  // An empty problem has no activations to keep out of memory: the composition handles it.
  const bool empty_problem = x.numel() == 0 || w1.numel() == 0 || w2.numel() == 0;
  if (backend_of(x.device()) != Backend::cuda || !all || empty_problem) {
    return linear(gelu(linear(x, w1, b1), GeluApproximate::Tanh), w2, b2);
  }
  check_floating("gelu_mlp", x);
  const std::int64_t k = w1.shape()[1], hidden = w1.shape()[0], n = w2.shape()[0];
  MB_CHECK(x.shape().back() == k && w2.shape()[1] == hidden && b1.dim() == 1 &&
               b1.shape()[0] == hidden && b2.dim() == 1 && b2.shape()[0] == n,
           "[gelu_mlp] shapes do not chain: x {}, w1 {}, b1 {}, w2 {}, b2 {}", shape_str(x.shape()),
           shape_str(w1.shape()), shape_str(b1.shape()), shape_str(w2.shape()),
           shape_str(b2.shape()));
  for (const Tensor* t : {&w1, &b1, &w2, &b2}) {
    MB_CHECK(t->dtype() == x.dtype(), "[gelu_mlp] input is {} but a parameter is {}",
             dtype_name(x.dtype()), dtype_name(t->dtype()));
  }
  const DType dt = x.dtype();
  const Backend backend = Backend::cuda;
  Shape out_shape(x.shape().begin(), x.shape().end() - 1);
  const std::int64_t m = shape_numel(out_shape);
  out_shape.push_back(n);
  // GELU's input and output, rows padded to 16 bytes (Lt wants aux rows a multiple of 8 apart).
  const std::int64_t ld_hidden = (hidden + 7) / 8 * 8;
  const TensorOptions options{.dtype = dt, .device = x.device()};
  Tensor pre = empty_rows(m, hidden, ld_hidden, options), h = empty_rows(m, hidden, ld_hidden, options);
  Tensor out = empty_rows(m, n, padded_row(m, n, dt, backend), options);
  {
    NoGradGuard no_grad;
    Tensor x2 = gemm_ready(x.reshape({1, m, k}), backend);          // (1, M, K)
    Tensor w1t = gemm_ready(w1.t().unsqueeze(0), backend);          // (1, K, hidden)
    Tensor w2t = gemm_ready(w2.t().unsqueeze(0), backend);          // (1, hidden, N)
    Tensor b1c = b1.contiguous(), b2c = b2.contiguous();
    launch(
        "gelu_mlp", x.device(), [] { MB_ASSERT(false, "[gelu_mlp] the fused node is CUDA's"); },
        [&] {
          kernels::cuda::gemm_bias_gelu(x2.kview(), w1t.kview(), b1c.kview(),
                                        h.unsqueeze(0).kview(), pre.unsqueeze(0).kview());
          kernels::cuda::gemm_bias(h.unsqueeze(0).kview(), w2t.kview(), b2c.kview(),
                                   out.unsqueeze(0).kview());
        });
  }
  // The node keeps what the composition's nodes would (Note [Saving only what a gradient reads]):
  // GELU's output `h` for w2's gradient; its input `pre` and w2 when anything before the MLP needs
  // a gradient (GELU's, through w2); x for w1's gradient; w1 for x's. The weights' gradient slots
  // are reached through their leaves. `pre` and `h` are dropped inside the backward as soon as it
  // is done with each, as the composition's nodes would have been released by then (Note
  // [Releasing saved tensors]).
  const bool rx = x.requires_grad(), rw1 = w1.requires_grad(), rb1 = b1.requires_grad(),
             rw2 = w2.requires_grad(), rb2 = b2.requires_grad();
  const bool through_gelu = rx || rw1 || rb1;
  struct Activations {
    Tensor pre, h;
  };
  auto acts = std::make_shared<Activations>(
      Activations{through_gelu ? pre : Tensor(), rw2 ? h : Tensor()});
  pre = Tensor();
  h = Tensor();
  record("gelu_mlp", {x, w1, b1, w2, b2}, out,
         [sx = rw1 ? SavedTensor(x, "gelu_mlp") : SavedTensor(),
          sw1 = rx ? SavedTensor(w1, "gelu_mlp") : SavedTensor(),
          sw2 = through_gelu ? SavedTensor(w2, "gelu_mlp") : SavedTensor(), acts,
          x_shape = x.shape(), m, k, hidden, n, ld_hidden, dt, w1l = grad_leaf(w1),
          w2l = grad_leaf(w2), b1l = grad_leaf(b1), b2l = grad_leaf(b2), rx, rw1, rb1, rw2, rb2,
          through_gelu](const Tensor& g) {
           Tensor g2 = g.reshape({m, n});
           if (g2.dtype() != dt) g2 = g2.to(dt);
           // A backward that failed part-way (out of memory, say) may have dropped what it was
           // done with, and cannot run again.
           MB_CHECK((!rw2 || acts->h.defined()) && (!through_gelu || acts->pre.defined()),
                    "[backward] gelu_mlp's backward failed part-way after releasing GELU's "
                    "activations; it cannot run again");
           // The saved tensors' version checks, before any gradient is written.
           const Tensor xv = sx.get(), w1v = sw1.get(), w2v = sw2.get();
           // The second linear's parameters, then GELU's input's gradient through w2.
           const bool keep = retaining_graph();
           auto [dw2, db2] = linear_param_grads(g2, acts->h, w2l, b2l, rw2, rb2);
           if (!keep) acts->h = Tensor();
           if (!through_gelu) return std::vector<Tensor>{Tensor(), Tensor(), Tensor(), dw2, db2};
           Tensor dpre =
               empty_rows(m, hidden, ld_hidden, {.dtype = g2.dtype(), .device = g2.device()});
           {
             NoGradGuard no_grad;
             Tensor g3 = gemm_ready(g2.unsqueeze(0), Backend::cuda);           // (1, M, N)
             Tensor w2m = gemm_ready(w2v.unsqueeze(0), Backend::cuda);         // (1, N, hidden)
             launch(
                 "gelu_mlp", g2.device(),
                 [] { MB_ASSERT(false, "[gelu_mlp] the fused node is CUDA's"); },
                 [&] {
                   kernels::cuda::gemm_dgelu(g3.kview(), w2m.kview(),
                                             acts->pre.unsqueeze(0).kview(),
                                             dpre.unsqueeze(0).kview());
                 });
           }
           if (!keep) acts->pre = Tensor();
           // The first linear's.
           auto [dw1, db1] =
               linear_param_grads(dpre, rw1 ? xv.reshape({m, k}) : Tensor(), w1l, b1l, rw1, rb1);
           Tensor dx;
           if (rx) dx = matmul(dpre, w1v).reshape(x_shape);
           return std::vector<Tensor>{dx, dw1, db1, dw2, db2};
         });
  return out.reshape(out_shape);
}

}  // namespace microbatch
