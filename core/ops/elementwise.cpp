// Element-wise ops: checks, broadcast and dtype promotion, dispatch, and each backward right below.
// Backward formulas write fresh tensors (activation gradients are overwritten); they are written
// with the ops themselves, so they broadcast, cast and run on any device like the forward.
#include <cmath>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "kernels/elementwise.h"

namespace microbatch {

using kernels::BinaryOp;
using kernels::UnaryOp;

namespace {

Tensor unary_kernel(const char* op, UnaryOp kind, const Tensor& a) {
  Tensor out = empty(a.shape(), {.dtype = a.dtype(), .device = a.device()});
  launch(
      op, a.device(), [&] { kernels::cpu::unary(kind, out.kview(), a.kview()); },
      [&] { kernels::cuda::unary(kind, out.kview(), a.kview()); });
  return out;
}

Tensor unary_float(const char* op, UnaryOp kind, const Tensor& a) {
  check_floating(op, a);
  return unary_kernel(op, kind, a);
}

// Note [0-d operands in promotion]: as torch's result_type, a 0-d operand decides the dtype only
// when its category (bool < integer < floating) is above the dimensioned operand's: an f16 tensor
// plus a 0-d f32 tensor is f16, an i32 tensor plus a 0-d f64 tensor f64. Two 0-d or two
// dimensioned operands promote as promote_types. A C++ scalar is a 0-d operand (scalar_like).
DType result_type(const Tensor& a, const Tensor& b) {
  const bool a_0d = a.dim() == 0, b_0d = b.dim() == 0;
  if (a_0d == b_0d) return promote_types(a.dtype(), b.dtype());
  const DType dimensioned = a_0d ? b.dtype() : a.dtype(), zero_d = a_0d ? a.dtype() : b.dtype();
  auto category = [](DType d) { return is_floating(d) ? 2 : is_integer(d) ? 1 : 0; };
  return category(zero_d) > category(dimensioned) ? promote_types(dimensioned, zero_d)
                                                  : dimensioned;
}

// Broadcasts a and b, promotes them to one dtype (result_type), and runs the kernel; out is
// `out_dtype`, or the common dtype when out_dtype is not given.
Tensor binary_kernel(const char* op, BinaryOp kind, const Tensor& a, const Tensor& b,
                     std::optional<DType> out_dtype = std::nullopt) {
  check_same_device(op, {a, b});
  const DType common = result_type(a, b);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), op);
  Tensor x, y;
  {
    NoGradGuard no_grad;  // the casts and expands here are part of this op's own backward
    x = a.dtype() == common ? a : a.to(common);
    y = b.dtype() == common ? b : b.to(common);
    x = x.expand(shape);
    y = y.expand(shape);
  }
  Tensor out = empty(shape, {.dtype = out_dtype.value_or(common), .device = a.device()});
  launch(
      op, a.device(), [&] { kernels::cpu::binary(kind, out.kview(), x.kview(), y.kview()); },
      [&] { kernels::cuda::binary(kind, out.kview(), x.kview(), y.kview()); });
  return out;
}

// Note [Scalar operands]: a C++ scalar becomes a 0-d tensor for an op (`op`) with t. A double
// cannot tell 2 from 2.0, so with an integer or bool tensor a finite integral value acts as a
// Python int (an integer tensor keeps its dtype, so index arithmetic stays exact; bool takes i64,
// as True + 1 = 2) and any other value as a Python float, which gives f32 (arange(5) * 2.5 is f32,
// as torch). An integral value outside the integer dtype is refused rather than wrapped.
Tensor scalar_like(double v, const Tensor& t, const char* op) {
  DType dt = t.dtype();
  if (!is_floating(dt)) {
    if (dt == DType::boolean) dt = DType::i64;
    if (!std::isfinite(v) || v != std::floor(v)) {
      dt = DType::f32;
    } else {
      MB_CHECK(holds_value(dt, v),
               "[{}] the scalar {} does not fit in the tensor's dtype {}; convert the tensor to a "
               "wider or floating dtype first",
               op, v, dtype_name(t.dtype()));
    }
  }
  return scalar_tensor(v, {.dtype = dt, .device = t.device()});
}

// What a backward needs to know of an input it did not save: its shape and dtype.
struct InputMeta {
  Shape shape;
  DType dtype;
  bool requires_grad;
};
InputMeta meta_of(const Tensor& t) { return {t.shape(), t.dtype(), t.requires_grad()}; }

// The gradient of a broadcast input: the incoming gradient summed back to its shape and dtype.
Tensor reduce_grad(const Tensor& g, const InputMeta& input) {
  if (!input.requires_grad) return Tensor();
  Tensor r = sum_to(g, input.shape);
  return r.dtype() == input.dtype ? r : r.to(input.dtype);
}
Tensor reduce_grad(const Tensor& g, const Tensor& input) { return reduce_grad(g, meta_of(input)); }

}  // namespace

// ---- arithmetic --------------------------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel("add", BinaryOp::Add, a, b);
  record("add", {a, b}, out, [a = meta_of(a), b = meta_of(b)](const Tensor& g) {
    return std::vector<Tensor>{reduce_grad(g, a), reduce_grad(g, b)};
  });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  // Refused as torch refuses it: a bool operand makes no sense here, and the message names what
  // was probably meant.
  MB_CHECK(a.dtype() != DType::boolean && b.dtype() != DType::boolean,
           "[sub] subtraction with a bool tensor is not supported (got {} - {}); ne(a, b) is the "
           "exclusive or of two masks, eq(mask, false) inverts one",
           dtype_name(a.dtype()), dtype_name(b.dtype()));
  Tensor out = binary_kernel("sub", BinaryOp::Sub, a, b);
  record("sub", {a, b}, out, [a = meta_of(a), b = meta_of(b)](const Tensor& g) {
    return std::vector<Tensor>{reduce_grad(g, a), reduce_grad(neg(g), b)};
  });
  return out;
}

// Note [Saving only what a gradient reads]: as torch, a product saves each operand only for the
// other's gradient (da = g * b reads b, db = g * a reads a): `x * 2.0` keeps nothing of x, and a
// constant's product keeps the activation it multiplies alive only when the constant requires
// grad. An operand that is not saved may change in place before backward without an error, and
// its memory is freed as soon as nothing else holds it. div, matmul and linear follow the rule.
Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel("mul", BinaryOp::Mul, a, b);
  const bool ra = a.requires_grad(), rb = b.requires_grad();
  record("mul", {a, b}, out,
         [sa = rb ? SavedTensor(a, "mul") : SavedTensor(), sb = ra ? SavedTensor(b, "mul") : SavedTensor(),
          ma = meta_of(a), mb = meta_of(b)](const Tensor& g) {
           return std::vector<Tensor>{ma.requires_grad ? reduce_grad(g * sb.get(), ma) : Tensor(),
                                      mb.requires_grad ? reduce_grad(g * sa.get(), mb) : Tensor()};
         });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  // True division, as torch.div: integer and bool operands give f32 (the default float dtype), so
  // 5 / 2 = 2.5 and 1 / 0 = inf. They never require grad, so the casts record nothing.
  if (!is_floating(result_type(a, b))) {
    return div(a.to(DType::f32), b.to(DType::f32));
  }
  Tensor out = binary_kernel("div", BinaryOp::Div, a, b);
  // da = g / b reads b; db = -g a / b^2 reads both (Note [Saving only what a gradient reads]).
  record("div", {a, b}, out,
         [sa = b.requires_grad() ? SavedTensor(a, "div") : SavedTensor(), sb = SavedTensor(b, "div"),
          ma = meta_of(a), mb = meta_of(b)](const Tensor& g) {
           const Tensor y = sb.get();
           Tensor da = reduce_grad(g / y, ma);
           Tensor db = mb.requires_grad ? reduce_grad(neg(g) * sa.get() / (y * y), mb) : Tensor();
           return std::vector<Tensor>{da, db};
         });
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  check_floating("pow", a);
  Tensor out = binary_kernel("pow", BinaryOp::Pow, a, b);
  // As torch, the terms that the formulas would make 0 * inf = NaN at a = 0 are 0: d/da where
  // b == 0 (b * a^(b-1)), and d/db where a == 0 and b >= 0 (a^b * log a).
  record(
      "pow", {a, b}, out,
      [sa = SavedTensor(a, "pow"), sb = SavedTensor(b, "pow"), so = SavedTensor::output(out, "pow"),
       ra = a.requires_grad(), rb = b.requires_grad()](const Tensor& g) {
        Tensor x = sa.get(), y = sb.get();
        const Tensor zero = scalar_tensor(0.0, {.dtype = g.dtype(), .device = g.device()});
        Tensor da, db;
        if (ra) da = reduce_grad(where(eq(y, zero), zero, g * y * pow(x, y - 1.0)), x);
        if (rb) {
          const Tensor base_zero = mul(eq(x, zero), ge(y, zero));  // bool mul is logical and
          db = reduce_grad(where(base_zero, zero, g * so.get() * log(x)), y);
        }
        return std::vector<Tensor>{da, db};
      });
  return out;
}

Tensor pow(const Tensor& a, double exponent) {
  check_floating("pow", a);
  Tensor out = binary_kernel("pow", BinaryOp::Pow, a, scalar_like(exponent, a, "pow"));
  record("pow", {a}, out, [sa = SavedTensor(a, "pow"), exponent](const Tensor& g) {
    Tensor x = sa.get();
    if (exponent == 0.0) return std::vector<Tensor>{zeros_like(x)};
    return std::vector<Tensor>{g * exponent * pow(x, exponent - 1.0)};
  });
  return out;
}

namespace {
// maximum/minimum, with torch 1.13's backward: each side gets the gradient unless it loses; ties
// split it in half. A NaN loses no comparison, so with a NaN on either side both get all of it.
Tensor extremum(const char* op, BinaryOp kind, const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel(op, kind, a, b);
  const bool is_max = kind == BinaryOp::Maximum;
  record(op, {a, b}, out,
         [sa = SavedTensor(a, op), sb = SavedTensor(b, op), is_max](const Tensor& g) {
           Tensor x = sa.get(), y = sb.get();
           Tensor a_loses = is_max ? lt(x, y) : gt(x, y);
           Tensor b_loses = is_max ? gt(x, y) : lt(x, y);
           Tensor share = where(eq(x, y), g * 0.5, g);
           Tensor zero = zeros_like(g);
           Tensor da = where(a_loses, zero, share);
           Tensor db = where(b_loses, zero, share);
           return std::vector<Tensor>{reduce_grad(da, x), reduce_grad(db, y)};
         });
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum("maximum", BinaryOp::Maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum("minimum", BinaryOp::Minimum, a, b); }

// ---- unary -------------------------------------------------------------------------------------

Tensor neg(const Tensor& a) {
  MB_CHECK(a.dtype() != DType::boolean, "[neg] not supported for bool tensors");
  Tensor out = unary_kernel("neg", UnaryOp::Neg, a);
  record("neg", {a}, out, [](const Tensor& g) { return std::vector<Tensor>{neg(g)}; });
  return out;
}

Tensor exp(const Tensor& a) {
  Tensor out = unary_float("exp", UnaryOp::Exp, a);
  record("exp", {a}, out, [so = SavedTensor::output(out, "exp")](const Tensor& g) {
    return std::vector<Tensor>{g * so.get()};
  });
  return out;
}

Tensor log(const Tensor& a) {
  Tensor out = unary_float("log", UnaryOp::Log, a);
  record("log", {a}, out, [sa = SavedTensor(a, "log")](const Tensor& g) {
    return std::vector<Tensor>{g / sa.get()};
  });
  return out;
}

Tensor sqrt(const Tensor& a) {
  Tensor out = unary_float("sqrt", UnaryOp::Sqrt, a);
  record("sqrt", {a}, out, [so = SavedTensor::output(out, "sqrt")](const Tensor& g) {
    return std::vector<Tensor>{g / (so.get() * 2.0)};
  });
  return out;
}

Tensor rsqrt(const Tensor& a) {
  Tensor out = unary_float("rsqrt", UnaryOp::Rsqrt, a);
  record("rsqrt", {a}, out, [so = SavedTensor::output(out, "rsqrt")](const Tensor& g) {
    Tensor y = so.get();
    return std::vector<Tensor>{g * y * y * y * -0.5};
  });
  return out;
}

Tensor abs(const Tensor& a) {
  Tensor out = unary_kernel("abs", UnaryOp::Abs, a);
  record("abs", {a}, out, [sa = SavedTensor(a, "abs")](const Tensor& g) {
    Tensor x = sa.get();
    const Tensor zero = scalar_like(0.0, x, "abs");
    Tensor sign = gt(x, zero).to(x.dtype()) - lt(x, zero).to(x.dtype());
    return std::vector<Tensor>{g * sign};
  });
  return out;
}

namespace {
// An activation whose backward is one kernel of (saved, dy).
Tensor activation(const char* op, UnaryOp forward, BinaryOp backward, const Tensor& a,
                  bool save_output) {
  Tensor out = unary_float(op, forward, a);
  record(op, {a}, out, [s = save_output ? SavedTensor::output(out, op) : SavedTensor(a, op), backward, op](const Tensor& g) {
    return std::vector<Tensor>{binary_kernel(op, backward, s.get(), g)};
  });
  return out;
}
}  // namespace

Tensor tanh(const Tensor& a) { return activation("tanh", UnaryOp::Tanh, BinaryOp::TanhBackward, a, true); }
Tensor sigmoid(const Tensor& a) {
  return activation("sigmoid", UnaryOp::Sigmoid, BinaryOp::SigmoidBackward, a, true);
}
Tensor relu(const Tensor& a) { return activation("relu", UnaryOp::Relu, BinaryOp::ReluBackward, a, true); }
Tensor silu(const Tensor& a) { return activation("silu", UnaryOp::Silu, BinaryOp::SiluBackward, a, false); }
Tensor gelu(const Tensor& a, GeluApproximate approximate) {
  if (approximate == GeluApproximate::Tanh)
    return activation("gelu", UnaryOp::GeluTanh, BinaryOp::GeluTanhBackward, a, false);
  return activation("gelu", UnaryOp::GeluErf, BinaryOp::GeluErfBackward, a, false);
}

// ---- comparisons and selection -----------------------------------------------------------------

Tensor eq(const Tensor& a, const Tensor& b) { return binary_kernel("eq", BinaryOp::Eq, a, b, DType::boolean); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_kernel("ne", BinaryOp::Ne, a, b, DType::boolean); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_kernel("lt", BinaryOp::Lt, a, b, DType::boolean); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_kernel("le", BinaryOp::Le, a, b, DType::boolean); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_kernel("gt", BinaryOp::Gt, a, b, DType::boolean); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_kernel("ge", BinaryOp::Ge, a, b, DType::boolean); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_same_device("where", {cond, a, b});
  MB_CHECK(cond.dtype() == DType::boolean, "[where] condition must be bool, got {}",
           dtype_name(cond.dtype()));
  const DType common = result_type(a, b);  // the condition plays no part, as in torch
  const Shape shape =
      broadcast_shapes(cond.shape(), broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  Tensor c, x, y;
  {
    NoGradGuard no_grad;
    c = cond.expand(shape);
    x = (a.dtype() == common ? a : a.to(common)).expand(shape);
    y = (b.dtype() == common ? b : b.to(common)).expand(shape);
  }
  Tensor out = empty(shape, {.dtype = common, .device = a.device()});
  launch(
      "where", a.device(),
      [&] { kernels::cpu::where(out.kview(), c.kview(), x.kview(), y.kview()); },
      [&] { kernels::cuda::where(out.kview(), c.kview(), x.kview(), y.kview()); });
  // The condition is saved like any input: changed in place, it would route the gradient wrongly.
  record("where", {a, b}, out,
         [sc = SavedTensor(cond, "where"), a = meta_of(a), b = meta_of(b)](const Tensor& g) {
           Tensor c = sc.get(), zero = zeros_like(g);
           return std::vector<Tensor>{reduce_grad(where(c, g, zero), a),
                                      reduce_grad(where(c, zero, g), b)};
         });
  return out;
}

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  MB_CHECK(mask.dtype() == DType::boolean, "[masked_fill] mask must be bool, got {}",
           dtype_name(mask.dtype()));
  Shape b = broadcast_shapes(a.shape(), mask.shape(), "masked_fill");
  MB_CHECK(b == a.shape(), "[masked_fill] mask of shape {} does not broadcast to the input's {}",
           shape_str(mask.shape()), shape_str(a.shape()));
  check_fill_value("masked_fill", a.dtype(), value);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = where(mask, scalar_tensor(value, {.dtype = a.dtype(), .device = a.device()}), a);
  }
  record("masked_fill", {a}, out, [sm = SavedTensor(mask, "masked_fill")](const Tensor& g) {
    return std::vector<Tensor>{where(sm.get(), zeros_like(g), g)};
  });
  return out;
}

Tensor cast(const Tensor& a, DType dtype) {
  if (a.dtype() == dtype) return a;
  Tensor out = empty(a.shape(), {.dtype = dtype, .device = a.device()});
  launch(
      "cast", a.device(), [&] { kernels::cpu::copy(out.kview(), a.kview()); },
      [&] { kernels::cuda::copy(out.kview(), a.kview()); });
  if (is_floating(dtype)) {
    const DType from = a.dtype();
    record("cast", {a}, out, [from](const Tensor& g) { return std::vector<Tensor>{g.to(from)}; });
  }
  return out;
}

void accumulate_(Tensor& dst, const Tensor& src, double weight) {
  check_inplace(dst, "accumulate_");  // not recorded, as copy_ (backward runs under no_grad)
  check_same_device("accumulate_", {dst, src});
  MB_CHECK(dst.shape() == src.shape(), "[accumulate_] shapes differ: {} += {}",
           shape_str(dst.shape()), shape_str(src.shape()));
  check_floating("accumulate_", dst);
  check_floating("accumulate_", src);
  // Repeated locations would each receive every element's share, in no defined order on CUDA.
  check_no_internal_overlap("accumulate_", dst);
  // A source that partly overlaps dst would be read after some of it was written (a running sum
  // on the CPU, no set order on CUDA): it is read in full first, as copy_ does. dst += w * dst
  // itself reads each element before writing it.
  Tensor from = src;
  if (may_overlap(dst, src) && !same_elements(dst, src)) {
    NoGradGuard no_grad;
    from = src.clone();
  }
  launch("accumulate_", dst.device(), [&] { kernels::cpu::accumulate(dst.kview(), from.kview(), weight); },
         [&] { kernels::cuda::accumulate(dst.kview(), from.kview(), weight); });
  dst.bump_version();
}

// ---- operators ---------------------------------------------------------------------------------

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return neg(a); }
// Note [Scalar operands] says which dtype the scalar takes.
Tensor operator+(const Tensor& a, double b) { return add(a, scalar_like(b, a, "add")); }
Tensor operator-(const Tensor& a, double b) { return sub(a, scalar_like(b, a, "sub")); }
Tensor operator*(const Tensor& a, double b) { return mul(a, scalar_like(b, a, "mul")); }
Tensor operator/(const Tensor& a, double b) { return div(a, scalar_like(b, a, "div")); }
Tensor operator+(double a, const Tensor& b) { return add(scalar_like(a, b, "add"), b); }
Tensor operator-(double a, const Tensor& b) { return sub(scalar_like(a, b, "sub"), b); }
Tensor operator*(double a, const Tensor& b) { return mul(scalar_like(a, b, "mul"), b); }
Tensor operator/(double a, const Tensor& b) { return div(scalar_like(a, b, "div"), b); }

}  // namespace microbatch
