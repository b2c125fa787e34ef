// Shared by the op families: running a kernel on the right device, broadcasting, dtype checks.
#pragma once

#include <utility>

#include "core/profiler.h"
#include "core/tensor.h"
#include "kernels/device.h"

namespace microbatch {

/// Which kernel family an op's allocations follow. A CUDA tensor runs the CUDA kernels; a meta
/// tensor runs none but must allocate what the device it stands in for would (Note [Meta
/// mirrors a backend]); a CPU tensor runs the CPU kernels.
enum class Backend { cpu, cuda };

/// Note [Meta mirrors a backend]: where the CPU and CUDA paths of an op allocate different
/// temporaries (a 16-bit GEMM converts its operands to f32 on the CPU and not on the GPU; the fused
/// attention kernel saves less than the composed one), the op asks backend_of(device), and a meta
/// tensor answers with the backend the planner is predicting for (MetaBackendGuard). The default
/// is the CPU's.
Backend meta_backend();
void set_meta_backend(Backend backend);

/// Sets the backend that meta tensors mirror for the guard's lifetime.
class MetaBackendGuard {
 public:
  explicit MetaBackendGuard(Backend backend) : saved_(meta_backend()) { set_meta_backend(backend); }
  ~MetaBackendGuard() { set_meta_backend(saved_); }
  MetaBackendGuard(const MetaBackendGuard&) = delete;
  MetaBackendGuard& operator=(const MetaBackendGuard&) = delete;

 private:
  Backend saved_;
};

inline Backend backend_of(Device device) {
  switch (device.type) {
    case DeviceType::cpu: return Backend::cpu;
    case DeviceType::cuda: return Backend::cuda;
    case DeviceType::meta: return meta_backend();
  }
  return Backend::cpu;
}

namespace detail {
template <class CpuFn, class CudaFn>
void run_kernel(Device device, CpuFn&& cpu_fn, CudaFn&& cuda_fn) {
  switch (device.type) {
    case DeviceType::meta: return;
    case DeviceType::cpu: std::forward<CpuFn>(cpu_fn)(); return;
    case DeviceType::cuda:
      kernels::cuda::set_device(device.index);
      std::forward<CudaFn>(cuda_fn)();
      return;
  }
}
}  // namespace detail

/// Runs cpu_fn for CPU tensors, cuda_fn (on the tensor's device) for CUDA tensors, and nothing on
/// meta (shapes and allocations only). A CPU-only build links kernels/cuda/no_cuda.cpp, whose
/// stubs throw, but a CUDA tensor cannot exist there in the first place. While the profiler runs,
/// the kernel is timed under `op` (Note [Profiler scopes] in core/profiler.h).
template <class CpuFn, class CudaFn>
void launch(const char* op, Device device, CpuFn&& cpu_fn, CudaFn&& cuda_fn) {
  if (profiler::enabled()) [[unlikely]] {
    profiler::Scope scope(op, device, profiler::Nesting::outermost_only);
    detail::run_kernel(device, std::forward<CpuFn>(cpu_fn), std::forward<CudaFn>(cuda_fn));
    return;
  }
  detail::run_kernel(device, std::forward<CpuFn>(cpu_fn), std::forward<CudaFn>(cuda_fn));
}

/// The broadcast of two shapes (numpy rules); `op` names the caller in the error.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

/// All tensors on one device; names the op and both devices otherwise.
void check_same_device(const char* op, std::initializer_list<Tensor> tensors);

void check_floating(const char* op, const Tensor& t);

/// Refuses, naming `op`, a value an integer dtype cannot hold (holds_value: NaN, out of range or
/// fractional) rather than store a wrapped or truncated one; torch refuses the first two. Bool
/// takes any value, as torch: nonzero is true.
void check_fill_value(const char* op, DType dtype, double value);

}  // namespace microbatch
