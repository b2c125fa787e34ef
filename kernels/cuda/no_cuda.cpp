// Stubs for builds without the CUDA backend: one line per entry point.
#include "core/error.h"
#include "kernels/device.h"

namespace microbatch::kernels::cuda {

namespace {
[[noreturn]] void no_cuda(const char* op) {
  detail::throw_error(fmt::format("[{}] this build has no CUDA backend", op));
}
}  // namespace

int device_count() { return 0; }
void set_device(int) { no_cuda("cuda::set_device"); }
void* malloc(std::size_t, int) { no_cuda("cuda::malloc"); }
void free(void*, int) noexcept {}
void memcpy_host_to_device(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy"); }
void memcpy_device_to_host(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy"); }
void memcpy_device_to_device(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy"); }
void memset_zero(void*, std::size_t, int) { no_cuda("cuda::memset"); }
void synchronize(int) { no_cuda("cuda::synchronize"); }
std::uintptr_t current_stream_id(int) { return 0; }
void memory_info(int, std::size_t*, std::size_t*) { no_cuda("cuda::memory_info"); }

// ---- elementwise, reduce, index (kernels/elementwise.h, reduce.h, index.h) ----

// ---- nn, attention (kernels/nn.h, attention.h) ----

// ---- gemm, conv (kernels/gemm.h, conv.h) ----

// ---- accumulate, optim (kernels/elementwise.h accumulate, optim.h) ----

}  // namespace microbatch::kernels::cuda
