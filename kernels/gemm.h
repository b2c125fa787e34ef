// Batched matrix products C = alpha * A @ B + beta * C over 3-d views (batch, rows, cols).
// beta = 0 overwrites C; beta = 1 accumulates into it (the weight-gradient GEMM writes
// `grad += w * x^T dy` straight into the gradient arena this way, with alpha = w).
#pragma once

#include "kernels/view.h"

namespace microbatch::kernels::cpu {

/// a (B, M, K), b (B, K, N), c (B, M, N); one of each matrix's two strides must be 1, c's last.
/// A batch stride of 0 broadcasts. f32 and f64 (16-bit inputs are converted by the op).
void gemm(const StridedView& a, const StridedView& b, const StridedView& c, double alpha, double beta);

}  // namespace microbatch::kernels::cpu
