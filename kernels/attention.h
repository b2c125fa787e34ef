// Fused scaled-dot-product attention, out = softmax(q k^T * scale + causal mask) v, computed tile
// by tile with an online softmax (flash-attention style): only out and one log-sum-exp per query
// are stored, never the (T, S) scores. CUDA only: the CPU, and the CUDA cases the kernel does not
// take, run the composition in core/ops/attention.cpp, which is also this kernel's test reference.
// All outputs are overwritten (out and lse; dq, dk and dv in the backward).
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

/// The largest head dim D the fused kernel takes.
inline constexpr std::int64_t kAttentionMaxHeadDim = 128;

struct AttentionArgs {
  double scale = 1.0;  // multiplies q . k
  bool causal = true;  // query i sees keys 0..i (top-left aligned when T != S)
};

/// Where the heads of a (B, H, rows, D) or (B, rows, D) view lie, in elements: head bh = b * H + h
/// starts at b * batch + h * head, and its rows are `row` apart.
struct HeadStrides {
  std::int64_t heads = 1;  // H; 1 for a 3-d view
  std::int64_t batch = 0;
  std::int64_t head = 0;
  std::int64_t row = 0;
};

MB_HOST_DEVICE inline HeadStrides head_strides(const StridedView& v) {
  if (v.ndim == 4) return {v.shape[1], v.strides[0], v.strides[1], v.strides[2]};
  return {1, v.strides[0], 0, v.strides[1]};
}

/// Offset of head bh's first row (bh in [0, B * H)).
MB_HOST_DEVICE inline std::int64_t head_offset(const HeadStrides& s, std::int64_t bh) {
  return (bh / s.heads) * s.batch + (bh % s.heads) * s.head;
}

namespace cuda {

/// Which kernels f16 and bf16 attention runs: on tensor cores (the default) or the f32-math kernels
/// that f32 always runs. The first call reads MB_ATTENTION_KERNEL ("tensor" or "simt").
enum class AttentionKernel { tensor, simt };
AttentionKernel attention_kernel();
void set_attention_kernel(AttentionKernel kernel);
/// Whether the tensor-core kernels run on the current device: sm_80 or later, running code
/// compiled for sm_80 or later (where not, f16 and bf16 take the f32-math kernels whatever the
/// setting). False in a build without CUDA.
bool tensor_core_attention_here();

/// out = softmax(q k^T * scale, causal mask) v and lse[bh, i] = log(sum_j exp(scale * q_i . k_j))
/// over the keys query i sees. q (B, H, T, D) or (B, T, D); k, v (.., S, D); each with unit stride
/// along D, any other strides; f32, f16 or bf16 (one dtype); 0 < D <= 128, T, S > 0. f32 runs in
/// f32 on CUDA cores; f16 and bf16 multiply on tensor cores with f32 accumulation, P rounded to
/// the input dtype before P v (kernels/attention_tc.h; MB_ATTENTION_KERNEL=simt for f32 math).
/// out (.., T, D) in q's dtype with unit stride along D and any other strides; lse (.., T)
/// contiguous f32.
void attention_forward(const StridedView& q, const StridedView& k, const StridedView& v,
                       const StridedView& out, const StridedView& lse, AttentionArgs args);

/// From the forward's out and lse: first delta = rowsum(dout * out) into `delta` (.., T), a
/// contiguous f32 workspace the op allocates (so that the meta device sees it), then
/// dv = P^T dout, dk = scale * dS^T q and dq = scale * dS k with P = exp(scores - lse) and
/// dS = P * (dout v^T - delta), recomputed tile by tile. dout has out's shape, unit stride along D
/// and any other strides; dq, dk, dv have q's, k's and v's shapes and dtype, unit stride along D
/// and any other strides (the op lays them out as q, k and v lie). Each element is written by
/// exactly one thread, in a fixed order: the result is the same on every run.
void attention_backward(const StridedView& q, const StridedView& k, const StridedView& v,
                        const StridedView& out, const StridedView& dout, const StridedView& lse,
                        const StridedView& delta, const StridedView& dq, const StridedView& dk,
                        const StridedView& dv, AttentionArgs args);

}  // namespace cuda

}  // namespace microbatch::kernels
