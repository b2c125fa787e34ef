// Shared by the op families: running a kernel on the right device, broadcasting, dtype checks.
#pragma once

#include <utility>

#include "core/tensor.h"

namespace microbatch {

/// Runs cpu_fn for CPU tensors and nothing on meta (shapes and allocations only).
/// CUDA kernels arrive with the CUDA backend; until then an op names itself in the error.
template <class CpuFn>
void launch(const char* op, Device device, CpuFn&& cpu_fn) {
  switch (device.type) {
    case DeviceType::meta: return;
    case DeviceType::cpu: std::forward<CpuFn>(cpu_fn)(); return;
    case DeviceType::cuda: break;
  }
  MB_CHECK(false, "[{}] has no CUDA kernel in this build yet", op);
}

/// The broadcast of two shapes (numpy rules); `op` names the caller in the error.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

/// All tensors on one device; names the op and both devices otherwise.
void check_same_device(const char* op, std::initializer_list<Tensor> tensors);

void check_floating(const char* op, const Tensor& t);

}  // namespace microbatch
