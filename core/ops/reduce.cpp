// Reductions: sum, mean, max, argmax, var, and sum_to (the backward of broadcasting).
#include <algorithm>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "kernels/reduce.h"

namespace microbatch {

namespace {

struct ReducePlan {
  std::vector<bool> reduced;  // per input dim
  Shape out_shape;            // with keepdim applied
  Shape kept_shape;           // keepdim = true form
  std::int64_t inner = 1;     // elements reduced per output
};

ReducePlan plan_reduce(const Tensor& a, const std::vector<std::int64_t>& dims, bool keepdim,
                       const char* op) {
  ReducePlan p;
  p.reduced.assign(a.dim(), dims.empty());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const int w = wrap_dim(dims[i], a.dim(), op);
    // A 0-d tensor accepts dim 0 or -1, both its one pseudo-dim, and has no dim to mark: any
    // second dim repeats it, as torch counts it.
    MB_CHECK(a.dim() == 0 ? i == 0 : !p.reduced[w], "[{}] dim {} repeated", op, w);
    if (a.dim() > 0) p.reduced[w] = true;
  }
  for (int i = 0; i < a.dim(); ++i) {
    if (p.reduced[i]) {
      p.inner *= a.shape()[i];
      p.kept_shape.push_back(1);
      if (keepdim) p.out_shape.push_back(1);
    } else {
      p.kept_shape.push_back(a.shape()[i]);
      p.out_shape.push_back(a.shape()[i]);
    }
  }
  return p;
}

// The number of columns when `a` is a contiguous (rows, cols) matrix whose rows are the reduced
// dims, both sides holding more than one element (dims of size 1 may sit anywhere), or a 2-d
// (rows, cols) view of unit-stride rows (padded ones: Note [Padded rows] in core/ops/linalg.cpp)
// summed over its rows; 0 otherwise.
std::int64_t leading_columns(const Tensor& a, const ReducePlan& p) {
  if (a.dim() == 2 && p.reduced[0] && !p.reduced[1] && a.shape()[0] > 1 && a.shape()[1] > 1 &&
      a.kview().is_rows()) {
    return a.shape()[1];
  }
  if (!a.is_contiguous()) return 0;
  std::int64_t cols = 1;
  for (int i = 0; i < a.dim(); ++i) {
    const std::int64_t n = a.shape()[i];
    if (n == 1) continue;
    if (!p.reduced[i]) {
      cols *= n;
    } else if (cols > 1) {
      return 0;  // a reduced dim after a kept one
    }
  }
  return cols > 1 && p.inner > 1 ? cols : 0;
}

// Runs a row reduction: reduced dims are permuted last and made contiguous first. A CUDA sum over
// leading dims sums columns in place instead (Note [Column sums] in kernels/reduce.h); its
// workspace is allocated here so that meta mirrors it.
Tensor reduce_kernel(const char* op, kernels::ReduceOp kind, const Tensor& a, const ReducePlan& p,
                     DType out_dtype) {
  if (const std::int64_t cols = leading_columns(a, p);
      cols > 0 && kind == kernels::ReduceOp::Sum && backend_of(a.device()) == Backend::cuda) {
    const kernels::ColumnSplit split = kernels::column_split(p.inner, cols);
    Tensor partials =
        empty({split.chunks, cols},  // (chunks, C)
              {.dtype = is_floating(a.dtype()) ? DType::f64 : DType::i64, .device = a.device()});
    Tensor out = empty(p.out_shape, {.dtype = out_dtype, .device = a.device()});
    launch(
        op, a.device(), [&] { MB_ASSERT(false, "[{}] column sums run on CUDA only", op); },
        [&] { kernels::cuda::sum_columns(out.kview(), a.kview(), cols, partials.kview()); });
    return out;
  }
  std::vector<std::int64_t> perm;
  for (int i = 0; i < a.dim(); ++i) if (!p.reduced[i]) perm.push_back(i);
  for (int i = 0; i < a.dim(); ++i) if (p.reduced[i]) perm.push_back(i);
  Tensor x;
  {
    NoGradGuard no_grad;
    x = a.permute(perm).contiguous();
  }
  Tensor out = empty(p.out_shape, {.dtype = out_dtype, .device = a.device()});
  launch(
      op, a.device(), [&] { kernels::cpu::reduce_rows(kind, out.kview(), x.kview(), p.inner); },
      [&] { kernels::cuda::reduce_rows(kind, out.kview(), x.kview(), p.inner); });
  return out;
}

}  // namespace

Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims, ReduceOptions options) {
  const ReducePlan p = plan_reduce(a, dims, options.keepdim, "sum");
  // Integer and bool sums are exact and i64, as torch.sum.
  const DType out_dtype = is_floating(a.dtype()) ? a.dtype() : DType::i64;
  Tensor out = reduce_kernel("sum", kernels::ReduceOp::Sum, a, p, out_dtype);
  record("sum", {a}, out, [from = a.shape(), kept = p.kept_shape](const Tensor& g) {
    return std::vector<Tensor>{g.reshape(kept).expand(from).contiguous()};
  });
  return out;
}

Tensor mean(const Tensor& a, const std::vector<std::int64_t>& dims, ReduceOptions options) {
  check_floating("mean", a);
  const ReducePlan p = plan_reduce(a, dims, options.keepdim, "mean");
  MB_CHECK(p.inner > 0, "[mean] of an empty selection (shape {})", shape_str(a.shape()));
  // A 16-bit mean is taken in f32 and rounded once: its sum, or its count (70000 is inf in f16),
  // may pass the dtype's range where the mean does not (as torch on CUDA).
  if (is_16bit_float(a.dtype())) return mean(a.to(DType::f32), dims, options).to(a.dtype());
  return sum(a, dims, options) / static_cast<double>(p.inner);
}

Tensor max(const Tensor& a, std::int64_t dim, ReduceOptions options) {
  const int d = wrap_dim(dim, a.dim(), "max");
  MB_CHECK(a.dim() == 0 || a.shape()[d] > 0, "[max] of an empty dim {} (shape {})", d, shape_str(a.shape()));
  const ReducePlan p = plan_reduce(a, {d}, options.keepdim, "max");
  Tensor out = reduce_kernel("max", kernels::ReduceOp::Max, a, p, a.dtype());
  if (needs_grad({a})) {
    Tensor index = reduce_kernel("max", kernels::ReduceOp::ArgMax, a, plan_reduce(a, {d}, true, "max"),
                                 DType::i64);
    record("max", {a}, out, [index, from = a.shape(), kept = p.kept_shape, d](const Tensor& g) {
      // The gradient goes to the first maximal element: a one-hot mask along d.
      Shape pos_shape(from.size(), 1);
      if (!from.empty()) pos_shape[d] = from[d];
      Tensor positions = arange(0, static_cast<double>(from.empty() ? 1 : from[d]), 1,
                                {.dtype = DType::i64, .device = g.device()}).reshape(pos_shape);
      Tensor hit = eq(positions, index);
      return std::vector<Tensor>{where(hit, g.reshape(kept), zeros({}, {.dtype = g.dtype(), .device = g.device()})).expand(from).contiguous()};
    });
  }
  return out;
}

Tensor max(const Tensor& a) {
  MB_CHECK(a.numel() > 0, "[max] of an empty tensor");
  Tensor out;
  {
    NoGradGuard no_grad;  // the node below is this op's backward
    out = max(a.reshape({-1}), 0);
  }
  // As torch, the gradient is shared evenly among the elements equal to the maximum (among the
  // NaNs when it is NaN), unlike max along a dim, which picks one.
  record("max", {a}, out,
         [sa = SavedTensor(a, "max"), so = SavedTensor::output(out, "max")](const Tensor& g) {
           const Tensor x = sa.get(), m = so.get();
           const Tensor hit = where(ne(m, m), ne(x, x), eq(x, m));  // a's shape, bool
           const Tensor share = g / sum(hit).to(g.dtype());
           return std::vector<Tensor>{
               where(hit, share, zeros({}, {.dtype = g.dtype(), .device = g.device()}))};
         });
  return out;
}

Tensor argmax(const Tensor& a, std::int64_t dim, ReduceOptions options) {
  const int d = wrap_dim(dim, a.dim(), "argmax");
  MB_CHECK(a.dim() == 0 || a.shape()[d] > 0, "[argmax] of an empty dim {} (shape {})", d, shape_str(a.shape()));
  return reduce_kernel("argmax", kernels::ReduceOp::ArgMax, a, plan_reduce(a, {d}, options.keepdim, "argmax"),
                       DType::i64);
}

Tensor var(const Tensor& a, const std::vector<std::int64_t>& dims, VarOptions options) {
  check_floating("var", a);
  const ReducePlan p = plan_reduce(a, dims, options.keepdim, "var");
  const std::int64_t denom = p.inner - options.correction;
  MB_CHECK(denom > 0, "[var] {} elements with correction {} leave no degrees of freedom", p.inner,
           options.correction);
  // In f32 for 16-bit input, rounded once: the sum of squares may pass f16's range where the
  // variance does not (as torch).
  if (is_16bit_float(a.dtype())) return var(a.to(DType::f32), dims, options).to(a.dtype());
  Tensor centered = a - mean(a, dims, {.keepdim = true});
  return sum(centered * centered, dims, {.keepdim = options.keepdim}) / static_cast<double>(denom);
}

Tensor sum_to(const Tensor& a, const Shape& shape) {
  if (a.shape() == shape) return a;
  MB_CHECK(a.dim() >= static_cast<int>(shape.size()), "[sum_to] cannot sum shape {} to {}",
           shape_str(a.shape()), shape_str(shape));
  const std::size_t lead = a.dim() - shape.size();
  std::vector<std::int64_t> dims;
  for (std::size_t i = 0; i < static_cast<std::size_t>(a.dim()); ++i) {
    if (i < lead) {
      dims.push_back(static_cast<std::int64_t>(i));
    } else if (shape[i - lead] == 1 && a.shape()[i] != 1) {
      dims.push_back(static_cast<std::int64_t>(i));
    } else {
      MB_CHECK(shape[i - lead] == a.shape()[i], "[sum_to] cannot sum shape {} to {}",
               shape_str(a.shape()), shape_str(shape));
    }
  }
  if (dims.empty()) return a.reshape(shape);
  return sum(a, dims, {.keepdim = true}).reshape(shape);
}

}  // namespace microbatch
