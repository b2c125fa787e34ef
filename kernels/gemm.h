// Batched matrix products C = alpha * A @ B + beta * C over 3-d views (batch, rows, cols).
// beta = 0 overwrites C; beta = 1 accumulates into it (the weight-gradient GEMM writes
// `grad += w * x^T dy` straight into the gradient arena this way, with alpha = w).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/view.h"

namespace microbatch::kernels {

/// How a column-major BLAS sees one row-major matrix view (rows, cols) with element strides
/// (row_stride, col_stride): as its transpose stored column-major (`row_major`: col_stride is 1,
/// ld = row_stride) or as itself (ld = col_stride). A dim of size 1 lets its stride be anything.
/// `ok` is false when no leading dimension is valid for the BLAS (ld >= the unit-stride extent:
/// zero or overlapping strides); such an operand needs a contiguous copy first.
struct BlasMatrix {
  bool ok = false;
  bool row_major = true;
  std::int64_t ld = 1;
};

inline BlasMatrix blas_matrix(std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                              std::int64_t col_stride) {
  const std::int64_t min_row_ld = cols > 1 ? cols : 1, min_col_ld = rows > 1 ? rows : 1;
  if (col_stride == 1 || cols <= 1) {
    if (rows <= 1) return {true, true, min_row_ld};
    if (row_stride >= min_row_ld) return {true, true, row_stride};
  }
  if (row_stride == 1 || rows <= 1) {
    if (cols <= 1) return {true, false, min_col_ld};
    if (col_stride >= min_col_ld) return {true, false, col_stride};
  }
  return {};
}

namespace cpu {
/// a (B, M, K), b (B, K, N), c (B, M, N); one of each matrix's two strides must be 1, c's last.
/// A batch stride of 0 broadcasts. f32 and f64 (16-bit inputs are converted by the op).
void gemm(const StridedView& a, const StridedView& b, const StridedView& c, double alpha,
          double beta);
}  // namespace cpu

namespace cuda {
/// The same product through cuBLAS (Note [Row-major GEMM on cuBLAS] in kernels/cuda/gemm.cu):
/// each matrix must pass blas_matrix, c row-major; a batch of size 1 or stride 0 broadcasts a or b.
/// a and b share a dtype: f64, f32 (no TF32), or f16 / bf16 multiplied with f32 accumulation; c has
/// their dtype, or f32 for 16-bit a and b. alpha and beta are applied in the accumulation type.
void gemm(const StridedView& a, const StridedView& b, const StridedView& c, double alpha,
          double beta);

/// c = a @ b + bias, the bias (N,) added to every row of c (1, M, N) in the f32 accumulation and
/// rounded once, by cuBLASLt's bias epilogue where it applies, else by writing the bias rows and
/// adding the product onto them (Note [Bias in the GEMM's epilogue] in kernels/cuda/gemm.cu).
/// a (1, M, K) and b (1, K, N) as for gemm; bias has c's dtype. Overwrites c.
void gemm_bias(const StridedView& a, const StridedView& b, const StridedView& bias,
               const StridedView& c);

/// out = gelu_tanh(a @ b + bias) and pre = a @ b + bias (GELU's input, kept for the backward),
/// through cuBLASLt's GELU_AUX_BIAS epilogue where it applies (GELU of the f32 sum; pre's rows a
/// multiple of 8 apart), else as gemm_bias into pre and GELU's kernel into out. a, b as for
/// gemm_bias; out and pre (1, M, N) row-major, bias (N,), all of one dtype. Overwrites both.
void gemm_bias_gelu(const StridedView& a, const StridedView& b, const StridedView& bias,
                    const StridedView& out, const StridedView& pre);

/// out = (a @ b) * gelu_tanh'(pre): the gradient of GELU's input from the gradient of its output
/// a @ b, through cuBLASLt's DGELU epilogue where it applies, else as gemm into out and GELU's
/// backward kernel in place. Shapes as gemm_bias_gelu. Overwrites out.
void gemm_dgelu(const StridedView& a, const StridedView& b, const StridedView& pre,
                const StridedView& out);

/// Whether gemm_bias, gemm_bias_gelu and gemm_dgelu use cuBLASLt's epilogues where they apply: on
/// unless MB_CUBLASLT_EPILOGUE=0 (read at first use); set_gemm_bias_epilogue changes it for the
/// process (tests compare both ways).
bool gemm_bias_epilogue();
void set_gemm_bias_epilogue(bool on);

/// How many cuBLASLt calls with each epilogue this process has run (not counting those that fell
/// back to separate passes): tests check that the epilogues are taken where they should be.
enum class LtCall { bias, gelu, dgelu };
std::int64_t lt_epilogue_calls(LtCall kind);

/// Why cuBLASLt last declined a call that then took the separate passes (its status or "no
/// algorithm", the epilogue, shape, leading dimensions and alignments), or "" when none has: the
/// tests print it when an epilogue they expected did not run. Other cuBLASLt failures are errors.
std::string lt_last_refusal();
}  // namespace cuda

}  // namespace microbatch::kernels
