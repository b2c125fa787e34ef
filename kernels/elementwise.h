// Element-wise kernels. Every operand view has the output's shape (broadcast dims carry stride 0,
// set up by the op). Outputs are overwritten, except accumulate, which adds (`dst += w * src`).
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

enum class UnaryOp { Neg, Exp, Log, Sqrt, Rsqrt, Abs, Tanh, Sigmoid, Relu, GeluErf, GeluTanh, Silu };

enum class BinaryOp {
  Add, Sub, Mul, Div, Pow, Maximum, Minimum,
  Eq, Ne, Lt, Le, Gt, Ge,  // bool output
  ReluBackward, GeluErfBackward, GeluTanhBackward, SiluBackward, SigmoidBackward, TanhBackward,
};

/// Philox-backed random fills (see core/rng.h for the stream layout).
struct PhiloxArgs {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;  // in 128-bit Philox blocks
};

/// The random bits a uniform in `dt` keeps (core/rng.h uniform_truncated): the significand of f16
/// (11) and bf16 (8), else the 24 that uniform_from_bits draws.
inline int uniform_bits(DType dt) {
  return dt == DType::f16 ? 11 : dt == DType::bf16 ? 8 : 24;
}

namespace cpu {
/// out = op(in); out and in share a dtype.
void unary(UnaryOp op, const StridedView& out, const StridedView& in);
/// out = op(a, b); a and b share a dtype; out has it too, or bool for comparisons.
void binary(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b);
/// out = cond ? a : b; cond is bool.
void where(const StridedView& out, const StridedView& cond, const StridedView& a,
           const StridedView& b);
/// out = in, converting dtypes.
void copy(const StridedView& out, const StridedView& in);
void fill(const StridedView& out, double value);
/// dst += weight * src (src converted to dst's dtype; f32 math for 16-bit).
void accumulate(const StridedView& dst, const StridedView& src, double weight);
/// out = uniform [0, 1) for element i of the row-major order, from Philox.
void rand_uniform(const StridedView& out, PhiloxArgs philox);
/// out = standard normal (Box-Muller on Philox pairs).
void rand_normal(const StridedView& out, PhiloxArgs philox);
/// out = (uniform >= p) ? scale : 0, the dropout mask times 1 / (1 - p).
void dropout_mask(const StridedView& out, PhiloxArgs philox, double p);
}  // namespace cpu

// The CUDA kernels: the same contracts as cpu:: above, run on the current device's stream. The
// random fills give the CPU's bits for the same PhiloxArgs (Note [Portable normals]).
namespace cuda {
void unary(UnaryOp op, const StridedView& out, const StridedView& in);
void binary(BinaryOp op, const StridedView& out, const StridedView& a, const StridedView& b);
void where(const StridedView& out, const StridedView& cond, const StridedView& a,
           const StridedView& b);
void copy(const StridedView& out, const StridedView& in);
void fill(const StridedView& out, double value);
void rand_uniform(const StridedView& out, PhiloxArgs philox);
void rand_normal(const StridedView& out, PhiloxArgs philox);
void dropout_mask(const StridedView& out, PhiloxArgs philox, double p);
}  // namespace cuda

// The gradient sink on the device (kernels/cuda/accumulate.cu).
struct GradStatsBuffer;  // kernels/optim.h
namespace cuda {
/// dst += weight * src, as cpu::accumulate. With stats (device memory, or nullptr), the same pass
/// also reduces the updated dst into stats->result (Note [One-launch reduction] in kernels/optim.h).
void accumulate(const StridedView& dst, const StridedView& src, double weight,
                GradStatsBuffer* stats = nullptr);
}  // namespace cuda

}  // namespace microbatch::kernels
