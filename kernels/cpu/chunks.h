// Eigen arrays over chunks of contiguous rows, for the CPU kernels that vectorize their math
// (kernels/cpu/nn.cpp, and the GELU loops of kernels/cpu/elementwise.cpp): a chunk of kChunk
// elements is mapped in place for f32 and f64, widened into a stack buffer for 16-bit storage, and
// stored back rounded once.
//
// GCC 12 reports the AVX-512 intrinsics that Eigen's vectorized double exp inlines as using an
// uninitialized value (their deliberately undefined pass-through operand) when -march=native
// offers AVX-512; the warning is about the compiler's own headers, so it is off in the files that
// vectorize through this header.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"

namespace microbatch::kernels::cpu::chunks {

inline constexpr std::int64_t kChunk = 256;

template <class C>
using ConstChunk = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>;
template <class C>
using Chunk = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
template <class C>
using ChunkValue = Eigen::Array<C, Eigen::Dynamic, 1, 0, kChunk, 1>;  // on the stack

template <class T>
constexpr bool kWide = std::is_same_v<T, compute_t<T>>;

// Calls f(j0, len) for consecutive chunks of a row of `cols` elements.
template <class F>
void for_chunks(std::int64_t cols, F&& f) {
  for (std::int64_t j0 = 0; j0 < cols; j0 += kChunk) f(j0, std::min(kChunk, cols - j0));
}

// src[0 : len] in the math type: in place for f32 and f64, widened into buf for 16-bit storage.
template <class T>
ConstChunk<compute_t<T>> load(const T* src, std::int64_t len, compute_t<T>* buf) {
  if constexpr (kWide<T>) {
    return ConstChunk<T>(src, len);
  } else {
    for (std::int64_t k = 0; k < len; ++k) buf[k] = static_cast<compute_t<T>>(src[k]);
    return ConstChunk<compute_t<T>>(buf, len);
  }
}

// dst[0 : value.size()] = value, rounded once to the storage type.
template <class T, class E>
void store(T* dst, const E& value) {
  using C = compute_t<T>;
  if constexpr (kWide<T>) {
    Chunk<C>(dst, value.size()) = value;
  } else {
    const ChunkValue<C> v = value;
    for (Eigen::Index k = 0; k < v.size(); ++k) dst[k] = static_cast<T>(v[k]);
  }
}

}  // namespace microbatch::kernels::cpu::chunks
