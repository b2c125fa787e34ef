// MB_CUDA_CHECK: turns a failing CUDA runtime status into microbatch::Error naming the call,
// the file and the line.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define MB_CUDA_CHECK(call)                                                                  \
  do {                                                                                       \
    cudaError_t mb_status_ = (call);                                                         \
    if (mb_status_ != cudaSuccess)                                                           \
      ::microbatch::detail::throw_error(MB_FORMAT("[cuda] {} failed at {}:{}: {}", #call,   \
                                                    __FILE__, __LINE__,                      \
                                                    cudaGetErrorString(mb_status_)));        \
  } while (0)

namespace microbatch::kernels::cuda {
constexpr long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }
}  // namespace microbatch::kernels::cuda
