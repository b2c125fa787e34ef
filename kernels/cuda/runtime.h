// What CUDA kernels and library calls share: the current stream, the cuBLAS and cuDNN handles
// bound to it, error checks for launches and libraries. Included by .cu files only.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/check.h"

#ifdef MB_HAVE_CUDNN
#include <cudnn.h>
#endif

namespace microbatch::kernels::cuda {

/// The current device's stream (Note [One stream per device] in kernels/device.h).
cudaStream_t current_stream();
/// Replaces the current device's stream for this process (nullptr: the legacy default stream).
void set_current_stream(cudaStream_t stream);

/// cuBLAS handle of the current device, bound to current_stream(), with its workspace set.
cublasHandle_t cublas_handle();

/// cuBLASLt handle of the current device (made on first use; Lt calls take the stream themselves).
cublasLtHandle_t cublaslt_handle();

/// The current device's cuBLAS workspace and its size in bytes. cuBLASLt calls use it too: every
/// library call goes on current_stream(), so no two of them use it at once.
void* cublas_workspace(std::size_t* bytes);

/// Streaming multiprocessors on the current device (cached).
int multiprocessor_count();

/// Blocks for a grid-stride loop over n items with `threads` per block: enough to fill the device
/// a few times over, never more than the items need.
unsigned grid_for(long long n, int threads);

const char* cublas_status_name(cublasStatus_t status);

#ifdef MB_HAVE_CUDNN
/// cuDNN handle of the current device, bound to current_stream().
cudnnHandle_t cudnn_handle();
#endif

}  // namespace microbatch::kernels::cuda

/// After a kernel launch: a bad configuration names the kernel.
#define MB_CUDA_CHECK_LAUNCH(kernel_name)                                                       \
  do {                                                                                          \
    cudaError_t mb_status_ = cudaGetLastError();                                                \
    if (mb_status_ != cudaSuccess)                                                              \
      ::microbatch::detail::throw_error(MB_FORMAT("[cuda] launching {} failed at {}:{}: {}",   \
                                                    kernel_name, __FILE__, __LINE__,            \
                                                    cudaGetErrorString(mb_status_)));           \
  } while (0)

#define MB_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                          \
    cublasStatus_t mb_status_ = (call);                                                         \
    if (mb_status_ != CUBLAS_STATUS_SUCCESS)                                                    \
      ::microbatch::detail::throw_error(MB_FORMAT(                                              \
          "[cublas] {} failed at {}:{}: {}", #call, __FILE__, __LINE__,                         \
          ::microbatch::kernels::cuda::cublas_status_name(mb_status_)));                        \
  } while (0)

#ifdef MB_HAVE_CUDNN
#define MB_CUDNN_CHECK(call)                                                                    \
  do {                                                                                          \
    cudnnStatus_t mb_status_ = (call);                                                          \
    if (mb_status_ != CUDNN_STATUS_SUCCESS)                                                     \
      ::microbatch::detail::throw_error(MB_FORMAT("[cudnn] {} failed at {}:{}: {}", #call,     \
                                                    __FILE__, __LINE__,                         \
                                                    cudnnGetErrorString(mb_status_)));          \
  } while (0)
#endif
