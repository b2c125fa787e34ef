// What a kernel sees of a tensor: a data pointer (offset applied), a dtype, and up to kMaxDims
// sizes and element strides. Plain data, passed to CUDA kernels by value.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace microbatch::kernels {

inline constexpr int kMaxDims = 8;

struct StridedView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[kMaxDims] = {};  // in elements

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    std::int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  template <class T> T* ptr() const { return static_cast<T*>(data); }
};

}  // namespace microbatch::kernels
