// Neural-network row kernels: softmax and log-softmax, fused cross-entropy, layer norm.
// Every operand is contiguous and row-major: the op permutes the reduced dim last and copies when
// needed, so a row is `cols` consecutive elements. Math runs in f32 for 16-bit storage and in f64
// for f64; a row's sum adds its chunk sums in f64. All outputs are overwritten, the backward ones
// included (dx, dlogits, and the per-call dweight/dbias: the engine adds them into the leaves'
// .grad).
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

enum class SoftmaxKind { Softmax, LogSoftmax };

struct CrossEntropyArgs {
  std::int64_t ignore_index = -100;
  double label_smoothing = 0.0;  // s in [0, 1]
};

namespace cpu {

/// out = softmax(in) or log_softmax(in) per row, with the row max subtracted first (stable for any
/// finite logits). out and in (rows, cols) share a dtype.
void softmax_forward(SoftmaxKind kind, const StridedView& out, const StridedView& in,
                     std::int64_t cols);

/// From the saved output y, per row: softmax dx = y * (dy - sum(dy * y));
/// log_softmax dx = dy - exp(y) * sum(dy). dx, y, dy (rows, cols) share a dtype.
void softmax_backward(SoftmaxKind kind, const StridedView& dx, const StridedView& y,
                      const StridedView& dy, std::int64_t cols);

/// loss[i] = (1 - s) * (lse_i - x[i, t_i]) + s * (lse_i - mean_c x[i, c]), with lse_i the row's
/// log-sum-exp; 0 where t_i == ignore_index. Probabilities are never stored.
/// logits (N, C); target (N) i32 or i64; loss (N) and stats (N, 2) in the math dtype (f32, or f64
/// for f64). stats[i] = (max_i, log(sum_c exp(x[i, c] - max_i))), kept for the backward (two parts,
/// so that a large max does not round the sum away); 0 on ignored rows.
/// Throws naming the target and C when a target is neither ignore_index nor in [0, C).
void cross_entropy_forward(const StridedView& loss, const StridedView& stats,
                           const StridedView& logits, const StridedView& target,
                           CrossEntropyArgs args);

/// dlogits[i, c] = g[i] * (softmax(x_i)_c - (1 - s) * [c == t_i] - s / C), 0 on ignored rows
/// (whatever g[i] is, so an all-ignored mean gives zeros as in PyTorch). The softmax is recomputed
/// from the logits and the forward's stats, one exp per element. dlogits and logits (N, C) share a
/// dtype; g (N, any stride) and stats (N, 2) are in the math dtype.
void cross_entropy_backward(const StridedView& dlogits, const StridedView& logits,
                            const StridedView& stats, const StridedView& target,
                            const StridedView& g, CrossEntropyArgs args);

/// y = (x - mean) * rstd * weight + bias per row, rstd = 1 / sqrt(var + eps) (biased variance).
/// x, y (rows, cols); weight, bias (cols) in x's dtype, or data == nullptr for none;
/// mean, rstd (rows) in the math dtype, written for the backward.
void layer_norm_forward(const StridedView& y, const StridedView& mean, const StridedView& rstd,
                        const StridedView& x, const StridedView& weight, const StridedView& bias,
                        double eps);

/// With xhat = (x - mean) * rstd and wdy = dy * weight (dy without weight), per row:
/// dx = rstd * (wdy - mean(wdy) - xhat * mean(wdy * xhat)), written; over rows, added:
/// dweight += grad_weight * sum(dy * xhat), dbias += grad_weight * sum(dy), each sum rounded to
/// the math dtype, then the product, then the sum (as accumulate): the parameters' gradient slots
/// take them in place (Note [Bias gradients in place] in core/ops/linalg.cpp), a zeroed buffer
/// with grad_weight 1 takes the plain sums. dx in x's dtype; dweight, dbias (cols, contiguous) in
/// the math dtype; each of the three is skipped when its data == nullptr.
void layer_norm_backward(const StridedView& dx, const StridedView& dweight,
                         const StridedView& dbias, const StridedView& dy, const StridedView& x,
                         const StridedView& mean, const StridedView& rstd,
                         const StridedView& weight, double grad_weight);

}  // namespace cpu

/// Row chunks of the CUDA layer-norm backward's dweight / dbias partial sums (Note [Deterministic
/// parameter sums] in kernels/cuda/nn.cu): at least 32 rows each, at most 128 chunks, 0 for no
/// rows. The op sizes the backward's workspace with it.
inline std::int64_t layer_norm_chunks(std::int64_t rows) {
  const std::int64_t chunks = (rows + 31) / 32;
  return chunks < 128 ? chunks : 128;
}

namespace cuda {

// The contracts of the cpu:: kernels above, with these differences. A row is owned by one warp
// up to 1024 columns, by one block beyond; its sums run in the math dtype over a tree of the row's
// threads (no f64 chunk sums for f32). None of them synchronises the host.

void softmax_forward(SoftmaxKind kind, const StridedView& out, const StridedView& in,
                     std::int64_t cols);
void softmax_backward(SoftmaxKind kind, const StridedView& dx, const StridedView& y,
                      const StridedView& dy, std::int64_t cols);

/// A target outside [0, C) that is not ignore_index gives a zero row, like an ignored one, instead
/// of an error: the op reports it through check_index_range (kernels/index.h) at the next host
/// copy.
void cross_entropy_forward(const StridedView& loss, const StridedView& stats,
                           const StridedView& logits, const StridedView& target,
                           CrossEntropyArgs args);
/// Out-of-range targets give a zero row, as in the forward.
void cross_entropy_backward(const StridedView& dlogits, const StridedView& logits,
                            const StridedView& stats, const StridedView& target,
                            const StridedView& g, CrossEntropyArgs args);

void layer_norm_forward(const StridedView& y, const StridedView& mean, const StridedView& rstd,
                        const StridedView& x, const StridedView& weight, const StridedView& bias,
                        double eps);
/// One argument more than the CPU's: `workspace` (2, layer_norm_chunks(rows), cols), contiguous in
/// the math dtype, holds the per-chunk partial sums of dweight and dbias; the op allocates it (so
/// that the meta device sees it) whenever dweight or dbias is wanted; it may be empty otherwise.
void layer_norm_backward(const StridedView& dx, const StridedView& dweight,
                         const StridedView& dbias, const StridedView& dy, const StridedView& x,
                         const StridedView& mean, const StridedView& rstd,
                         const StridedView& weight, const StridedView& workspace,
                         double grad_weight);

}  // namespace cuda

}  // namespace microbatch::kernels
