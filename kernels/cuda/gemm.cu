// cuda::gemm: C = alpha * A @ B + beta * C through cublasGemmStridedBatchedEx. Overwrites C
// (beta = 0) or accumulates into it (beta = 1: the weight-gradient GEMM adds w * dy^T x straight
// into the gradient arena, Note [Weight-gradient GEMM] in core/ops/linalg.cpp).
//
// Note [Row-major GEMM on cuBLAS]: cuBLAS is column-major, and a row-major (R, C) matrix with row
// stride ld reads, column-major, as its transpose (C, R) with leading dimension ld. So C = A B is
// computed as C^T = B^T A^T: cuBLAS's first operand is B, its second A, and its (N, M) output is C
// as stored. An operand stored row-major (column stride 1) is thus already the transpose cuBLAS
// wants (CUBLAS_OP_N, ld = row stride); one stored column-major (row stride 1: a transposed view)
// is passed with CUBLAS_OP_T and ld = column stride. blas_matrix (kernels/gemm.h) decides which.
//
// Precision: f32 runs with CUBLAS_COMPUTE_32F, never TF32 (f32 means f32); f16 and bf16 inputs
// accumulate in f32 (CUBLAS_COMPUTE_32F, tensor cores) and round once into a 16-bit or f32 C; f64
// runs in f64. alpha and beta are passed in the compute type (float, or double for f64).
#include <climits>
#include <sstream>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/gemm.h"

namespace microbatch::kernels::cuda {

namespace {

// c = beta * c where the product is empty (k = 0); beta = 0 writes zeros without reading c, as
// the CPU kernel does. Overwrites c.
template <class T>
__global__ void scale_kernel(StridedView c, compute_t<T> beta, std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const std::int64_t off = strided_offset(c, i);
    const compute_t<T> v = beta == compute_t<T>(0) ? compute_t<T>(0) : beta * load<T>(c.data, off);
    store<T>(c.data, off, v);
  }
}

// "(2, 3, 4) strides (12, 4, 1) bf16", for error messages.
std::string describe(const StridedView& v) {
  std::ostringstream os;
  os << '(';
  for (int d = 0; d < v.ndim; ++d) os << (d ? ", " : "") << v.shape[d];
  os << ") strides (";
  for (int d = 0; d < v.ndim; ++d) os << (d ? ", " : "") << v.strides[d];
  os << ") " << dtype_name(v.dtype);
  return os.str();
}

cudaDataType_t blas_type(DType dt) {
  switch (dt) {
    case DType::f32: return CUDA_R_32F;
    case DType::f64: return CUDA_R_64F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: break;
  }
  MB_ASSERT(false, "[gemm] no cuBLAS type for {}", dtype_name(dt));
  return CUDA_R_32F;
}

// One operand as cuBLAS takes it: the op applied to its stored matrix, ld, and batch stride.
struct Operand {
  cublasOperation_t op = CUBLAS_OP_N;
  std::int64_t ld = 1;
  long long batch_stride = 0;
};

Operand operand(const char* name, const StridedView& v, std::int64_t batch, const StridedView& a,
                const StridedView& b, const StridedView& c) {
  const BlasMatrix m = blas_matrix(v.shape[1], v.shape[2], v.strides[1], v.strides[2]);
  MB_CHECK(m.ok,
           "[gemm] operand {} has no unit stride with a valid leading dimension (make it contiguous): "
           "a {}, b {}, c {}", name, describe(a), describe(b), describe(c));
  MB_CHECK(v.shape[0] == batch || v.shape[0] == 1,
           "[gemm] operand {} has batch {} but c has {}: a {}, b {}, c {}", name, v.shape[0], batch,
           describe(a), describe(b), describe(c));
  Operand o;
  o.op = m.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  o.ld = m.ld;
  o.batch_stride = v.shape[0] == 1 ? 0 : v.strides[0];
  return o;
}

}  // namespace

void gemm(const StridedView& a, const StridedView& b, const StridedView& c, double alpha,
          double beta) {
  MB_CHECK(a.ndim == 3 && b.ndim == 3 && c.ndim == 3,
           "[gemm] expected 3-d views (batch, rows, cols): a {}, b {}, c {}", describe(a), describe(b),
           describe(c));
  const std::int64_t batch = c.shape[0], m = c.shape[1], n = c.shape[2], k = a.shape[2];
  MB_CHECK(a.shape[1] == m && b.shape[1] == k && b.shape[2] == n,
           "[gemm] shapes do not chain: a {} @ b {} -> c {}", describe(a), describe(b), describe(c));
  MB_CHECK(a.dtype == b.dtype, "[gemm] a and b differ in dtype: a {}, b {}", describe(a), describe(b));
  const bool sixteen = a.dtype == DType::f16 || a.dtype == DType::bf16;
  MB_CHECK(is_floating(a.dtype) && (c.dtype == a.dtype || (sixteen && c.dtype == DType::f32)),
           "[gemm] unsupported dtypes (c must have a's dtype, or f32 for 16-bit a and b): a {}, b {}, "
           "c {}", describe(a), describe(b), describe(c));
  if (batch == 0 || m == 0 || n == 0) return;

  if (k == 0) {
    const std::int64_t total = batch * m * n;
    dispatch_float(c.dtype, "gemm", [&]<class T>() {
      scale_kernel<T><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
          c, static_cast<compute_t<T>>(beta), total);
      MB_CUDA_CHECK_LAUNCH("gemm scale_kernel");
    });
    return;
  }

  const Operand oa = operand("a", a, batch, a, b, c), ob = operand("b", b, batch, a, b, c);
  const BlasMatrix mc = blas_matrix(m, n, c.strides[1], c.strides[2]);
  MB_CHECK(mc.ok && mc.row_major && (batch == 1 || c.strides[0] >= (m - 1) * mc.ld + n),
           "[gemm] c must be row-major (last stride 1) without overlapping rows or batches: a {}, b {}, "
           "c {}", describe(a), describe(b), describe(c));
  MB_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && batch <= INT_MAX && oa.ld <= INT_MAX &&
               ob.ld <= INT_MAX && mc.ld <= INT_MAX,
           "[gemm] a size or leading dimension exceeds cuBLAS's int range: a {}, b {}, c {}",
           describe(a), describe(b), describe(c));

  // C^T (N, M) = op(B) (N, K) @ op(A) (K, M), Note [Row-major GEMM on cuBLAS].
  const cudaDataType_t in_type = blas_type(a.dtype), out_type = blas_type(c.dtype);
  const bool f64 = a.dtype == DType::f64;
  const cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
  const void* alpha_ptr = f64 ? static_cast<const void*>(&alpha) : &alpha32;
  const void* beta_ptr = f64 ? static_cast<const void*>(&beta) : &beta32;
  const long long c_batch_stride = batch == 1 ? 0 : c.strides[0];
  cublasHandle_t handle = cublas_handle();
  // Split-K partial sums stay in f32 too, rather than in a 16-bit C's type: one rounding at the end.
  MB_CUBLAS_CHECK(cublasSetMathMode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                        CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  MB_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, ob.op, oa.op, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
      alpha_ptr, b.data, in_type, static_cast<int>(ob.ld), ob.batch_stride, a.data, in_type,
      static_cast<int>(oa.ld), oa.batch_stride, beta_ptr, c.data, out_type, static_cast<int>(mc.ld),
      c_batch_stride, static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace microbatch::kernels::cuda
