// Offsets of N operand views that share one shape, for the generic CUDA element-wise and indexing
// kernels. make_indexer drops size-1 dims and merges neighbouring dims that every operand lays out
// one after the other, so a contiguous operand costs no division at all and a broadcast bias or a
// transposed matrix one or two per element. Plain data, passed to kernels by value; the math is
// MB_HOST_DEVICE so that tests check it on the CPU.
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

template <int N>
struct Indexer {
  int ndim = 0;
  bool small = true;  // numel < 2^31: 32-bit divisions suffice
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[N][kMaxDims] = {};  // in elements, per operand

  /// off[k] = the element offset in operand k of the row-major `linear`-th coordinate.
  MB_HOST_DEVICE void offsets(std::int64_t linear, std::int64_t (&off)[N]) const {
    for (int k = 0; k < N; ++k) off[k] = 0;
    if (small) {
      std::uint32_t rest = static_cast<std::uint32_t>(linear);
      for (int d = ndim - 1; d > 0; --d) {
        const std::uint32_t n = static_cast<std::uint32_t>(shape[d]);
        const std::uint32_t q = rest / n;
        const std::int64_t c = rest - q * n;
        for (int k = 0; k < N; ++k) off[k] += c * strides[k][d];
        rest = q;
      }
      if (ndim > 0)
        for (int k = 0; k < N; ++k) off[k] += static_cast<std::int64_t>(rest) * strides[k][0];
      return;
    }
    std::int64_t rest = linear;
    for (int d = ndim - 1; d > 0; --d) {
      const std::int64_t q = rest / shape[d];
      const std::int64_t c = rest - q * shape[d];
      for (int k = 0; k < N; ++k) off[k] += c * strides[k][d];
      rest = q;
    }
    if (ndim > 0)
      for (int k = 0; k < N; ++k) off[k] += rest * strides[k][0];
  }

  /// Every operand is contiguous: offset == linear index for all of them.
  MB_HOST_DEVICE bool is_contiguous() const {
    if (ndim > 1) return false;
    for (int k = 0; k < N && ndim == 1; ++k) {
      if (strides[k][0] != 1) return false;
    }
    return true;
  }
};

/// The indexer of views[0]'s shape over all views (each with that shape; broadcast dims stride 0).
template <int N>
Indexer<N> make_indexer(const StridedView* const (&views)[N]) {
  const StridedView& v0 = *views[0];
  Indexer<N> ix;
  ix.small = v0.numel() < (std::int64_t{1} << 31);
  // Walk dims from the innermost outwards, keeping dims of size > 1 and merging dim d into the
  // kept dim to its right when every operand has strides[d] == strides[right] * shape[right].
  std::int64_t shape[kMaxDims];
  std::int64_t strides[N][kMaxDims];
  int kept = 0;  // dims collected so far, innermost first
  for (int d = v0.ndim - 1; d >= 0; --d) {
    if (v0.shape[d] == 1) continue;
    bool merge = kept > 0;
    for (int k = 0; k < N && merge; ++k) {
      merge = views[k]->strides[d] == strides[k][kept - 1] * shape[kept - 1];
    }
    if (merge) {
      shape[kept - 1] *= v0.shape[d];
      continue;
    }
    shape[kept] = v0.shape[d];
    for (int k = 0; k < N; ++k) strides[k][kept] = views[k]->strides[d];
    ++kept;
  }
  ix.ndim = kept;
  for (int i = 0; i < kept; ++i) {  // back to outermost-first order
    ix.shape[i] = shape[kept - 1 - i];
    for (int k = 0; k < N; ++k) ix.strides[k][i] = strides[k][kept - 1 - i];
  }
  return ix;
}

}  // namespace microbatch::kernels
