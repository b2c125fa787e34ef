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
  /// Row-major dense; an empty view is contiguous whatever its strides, as Tensor::is_contiguous.
  bool is_contiguous() const {
    if (numel() == 0) return true;
    std::int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  /// A 2-d view of unit-stride rows that do not overlap: dense, or rows of a wider matrix (the
  /// padded rows of Note [Padded rows] in core/ops/linalg.cpp), which row kernels take in place.
  bool is_rows() const {
    return ndim == 2 && (shape[1] <= 1 || strides[1] == 1) &&
           (shape[0] <= 1 || strides[0] >= shape[1]);
  }
  template <class T> T* ptr() const { return static_cast<T*>(data); }
};

}  // namespace microbatch::kernels
