// GEMM through Eigen: each operand is mapped as row- or column-major according to which of its
// strides is 1, so transposed views need no copy.
#include <Eigen/Core>

#include "kernels/gemm.h"

namespace microbatch::kernels::cpu {

namespace {

using Stride2 = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;

template <class T, int Order>
using MatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0,
                          Eigen::OuterStride<>>;

template <class T, int OrderA, int OrderB>
void gemm_batch(const StridedView& a, const StridedView& b, const StridedView& c, double alpha,
                double beta) {
  const std::int64_t batch = c.shape[0], m = c.shape[1], n = c.shape[2], k = a.shape[2];
  const std::int64_t lda = OrderA == Eigen::RowMajor ? a.strides[1] : a.strides[2];
  const std::int64_t ldb = OrderB == Eigen::RowMajor ? b.strides[1] : b.strides[2];
  using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0,
                            Eigen::OuterStride<>>;
  for (std::int64_t i = 0; i < batch; ++i) {
    MatMap<T, OrderA> A(a.ptr<const T>() + i * a.strides[0], m, k, Eigen::OuterStride<>(lda));
    MatMap<T, OrderB> B(b.ptr<const T>() + i * b.strides[0], k, n, Eigen::OuterStride<>(ldb));
    OutMap C(c.ptr<T>() + i * c.strides[0], m, n, Eigen::OuterStride<>(c.strides[1]));
    if (k == 0) {
      if (beta == 0.0) C.setZero(); else C *= static_cast<T>(beta);
      continue;
    }
    if (beta == 0.0) {
      C.noalias() = static_cast<T>(alpha) * (A * B);
    } else {
      if (beta != 1.0) C *= static_cast<T>(beta);
      C.noalias() += static_cast<T>(alpha) * (A * B);
    }
  }
}

template <class T>
void gemm_typed(const StridedView& a, const StridedView& b, const StridedView& c, double alpha,
                double beta) {
  const bool a_row = a.strides[2] == 1 || a.shape[2] == 1;
  const bool b_row = b.strides[2] == 1 || b.shape[2] == 1;
  if (a_row && b_row) gemm_batch<T, Eigen::RowMajor, Eigen::RowMajor>(a, b, c, alpha, beta);
  else if (a_row) gemm_batch<T, Eigen::RowMajor, Eigen::ColMajor>(a, b, c, alpha, beta);
  else if (b_row) gemm_batch<T, Eigen::ColMajor, Eigen::RowMajor>(a, b, c, alpha, beta);
  else gemm_batch<T, Eigen::ColMajor, Eigen::ColMajor>(a, b, c, alpha, beta);
}

}  // namespace

void gemm(const StridedView& a, const StridedView& b, const StridedView& c, double alpha, double beta) {
  if (c.dtype == DType::f64) gemm_typed<double>(a, b, c, alpha, beta);
  else gemm_typed<float>(a, b, c, alpha, beta);
}

}  // namespace microbatch::kernels::cpu
