// The arithmetic the CUDA softmax and cross-entropy row kernels (kernels/cuda/nn.cu) rest on, as
// host-device functions so that the CPU tests check it: the online rule that finds a row's max
// and sum of exp(x - max) in one read, and the split of a row into 16-byte packs.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/half.h"
#include "kernels/elementwise_ops.h"

namespace microbatch::kernels {

/// max(a, b), NaN if either is NaN (as ops::Maximum, up to the NaN's payload); one instruction for
/// f32 on the device.
template <class A>
MB_HOST_DEVICE A max_or_nan(A a, A b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<A, float>) {
    float m;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
  }
#endif
  return ops::Maximum{}(a, b);
}

/// exp(x) for the row kernels: on the device for f32 the hardware's 2^(x log2(e)) (as __expf with
/// flushed subnormals: a few ulp from std::exp, 0 below 2^-126), two instructions where std::exp
/// takes about ten, which would bound the passes; std::exp elsewhere.
template <class A>
MB_HOST_DEVICE A row_exp(A x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * 1.44269504f));  // log2(e)
    return e;
  }
#endif
  return std::exp(x);
}

/// The max of some columns and their sum of exp(x - max) (online softmax). max == -inf holds no
/// live column (none, or all -inf) and then sum == 0. A NaN column becomes the max, so the sum and
/// every merge after it are NaN; a +inf column makes the sum NaN (exp(inf - inf)); both as the
/// CPU's two passes.
template <class A>
struct MaxSum {
  A max = -std::numeric_limits<A>::infinity();
  A sum = A(0);

  /// Adds N columns: the max moves once (the sum so far rescaled by exp(old - new); exp(-inf) = 0
  /// while empty), then each exp(v[k] - max) is at most 1, so none overflows. The N terms are
  /// summed pairwise (N a power of 2) before they join the sum.
  template <int N>
  MB_HOST_DEVICE void add(const A (&v)[N]) {
    static_assert(N > 0 && (N & (N - 1)) == 0, "columns come in powers of 2");
    A m = v[0];
    for (int k = 1; k < N; ++k) m = max_or_nan(m, v[k]);
    if (m > max || m != m) {
      sum = sum * row_exp(max - m);
      max = m;
    }
    if (max == -std::numeric_limits<A>::infinity()) return;
    A e[N];
    for (int k = 0; k < N; ++k) e[k] = row_exp(v[k] - max);
    for (int w = N / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) e[k] += e[k + w];
    sum += e[0];
  }
};

/// The pair of the union of two runs of columns: each sum rescaled to the larger max. Symmetric,
/// so the lanes of a butterfly reduction all end with the same pair.
template <class A>
MB_HOST_DEVICE MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  constexpr A kNone = -std::numeric_limits<A>::infinity();
  const A m = max_or_nan(a.max, b.max);
  if (m == kNone) return {m, A(0)};
  const A sa = a.max == kNone ? A(0) : a.sum * row_exp(a.max - m);
  const A sb = b.max == kNone ? A(0) : b.sum * row_exp(b.max - m);
  return {m, sa + sb};
}

/// A row of `cols` elements of `element_size` bytes read in 16-byte packs: scalar columns
/// [0, head) up to the first 16-byte boundary, `packs` packs of 16 / element_size columns, then
/// scalar columns [head + packs * 16 / element_size, cols).
struct RowSplit {
  std::int64_t head = 0;
  std::int64_t packs = 0;
};

/// The split of the row at `address`, for a pass that also reads or writes a row at `other`
/// (`address` again when there is none). Where one head cannot align both (their distance is not
/// a multiple of 16 bytes), or the address is not element-aligned, every column is head.
MB_HOST_DEVICE inline RowSplit row_split(std::uintptr_t address, std::uintptr_t other,
                                         std::int64_t cols, std::size_t element_size) {
  if (address % element_size != 0 || (address - other) % 16 != 0) return {cols, 0};
  std::int64_t head = static_cast<std::int64_t>((16 - address % 16) % 16 / element_size);
  if (head > cols) head = cols;
  return {head, (cols - head) / static_cast<std::int64_t>(16 / element_size)};
}

}  // namespace microbatch::kernels
