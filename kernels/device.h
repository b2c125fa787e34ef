// Raw device memory, copies and streams, callable from host C++. CPU-only builds link
// kernels/cuda/no_cuda.cpp, whose entry points throw "this build has no CUDA backend"
// (device_count returns 0 there).
//
// Note [One stream per device]: every kernel, copy and memset for a device is issued on that
// device's current stream (by default the legacy default stream), so work is ordered without host
// synchronisation; a copy to the host waits for that stream. The caching allocator tags blocks with
// the stream they were allocated on and reuses them only there.
#pragma once

#include <cstddef>
#include <cstdint>

namespace microbatch::kernels::cuda {

/// Number of visible CUDA devices; 0 when none (or no driver) is present.
int device_count();
/// Makes `device` current for this thread (kernels launch there).
void set_device(int device);
void* malloc(std::size_t bytes, int device);
void free(void* ptr, int device) noexcept;
void memcpy_host_to_device(void* dst, const void* src, std::size_t bytes, int device);
/// Waits for the device's stream, then copies.
void memcpy_device_to_host(void* dst, const void* src, std::size_t bytes, int device);
void memcpy_device_to_device(void* dst, const void* src, std::size_t bytes, int device);
void memset_zero(void* dst, std::size_t bytes, int device);
/// Waits for all work on the device.
void synchronize(int device);
/// synchronize, then raises an index error that a CUDA kernel recorded since the last check
/// (Note [Deferred index errors] in kernels/index.h). Host code that waits for a device calls this.
void synchronize_checked(int device);
/// An identity of the device's current stream, for the allocator's stream tags (0: default).
std::uintptr_t current_stream_id(int device);
/// Bytes free and in total on the device, as the driver reports them.
void memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes);

}  // namespace microbatch::kernels::cuda
