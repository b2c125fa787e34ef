// Raw device memory and copies. CPU-only builds link kernels/cuda/no_cuda.cpp, whose entry points
// throw "this build has no CUDA backend" (device_count returns 0 there).
#pragma once

#include <cstddef>

namespace microbatch::kernels::cuda {

/// Number of visible CUDA devices; 0 when none (or no driver) is present.
int device_count();
void* malloc(std::size_t bytes, int device);
void free(void* ptr, int device) noexcept;
void memcpy_host_to_device(void* dst, const void* src, std::size_t bytes, int device);
void memcpy_device_to_host(void* dst, const void* src, std::size_t bytes, int device);
void memcpy_device_to_device(void* dst, const void* src, std::size_t bytes, int device);
void memset_zero(void* dst, std::size_t bytes, int device);
/// Waits for all work on the device.
void synchronize(int device);

}  // namespace microbatch::kernels::cuda
