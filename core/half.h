// 16-bit floating-point storage types. Math is done in f32; these only convert, rounding to
// nearest even. Shared by host and device code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MB_HOST_DEVICE __host__ __device__
#else
#define MB_HOST_DEVICE
#endif

// x86's F16C instructions (vcvtps2ph / vcvtph2ps) convert in one instruction where the software
// conversion below takes a dozen branchy ones; a -march=native build on a CPU that has them
// defines __F16C__. Their results are the software's for every value but NaN, whose payload they
// keep where the software makes one quiet NaN, so NaN takes the software path. Host code that nvcc
// compiles (without -march=native) converts in software: the same bits (checked over every f32
// value once, and sampled by a test), so either definition of these inline functions serves.
#if defined(__F16C__) && !defined(__CUDA_ARCH__)
#include <immintrin.h>
#define MB_HAVE_F16C 1
#endif

namespace microbatch {

MB_HOST_DEVICE inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

MB_HOST_DEVICE inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float_to_half_bits in integer arithmetic alone: what host code without F16C computes, and the
/// reference the instruction path is checked against (tests/core/test_tensor.cpp).
MB_HOST_DEVICE inline std::uint16_t float_to_half_bits_portable(float f) {
  std::uint32_t x = float_bits(f);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t exp = (x >> 23) & 0xffu;
  std::uint32_t mant = x & 0x7fffffu;
  if (exp == 0xffu) return static_cast<std::uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (e <= 0) {  // subnormal half (or zero): value = h * 2^-24
    if (e < -10) return static_cast<std::uint16_t>(sign);
    mant |= 0x800000u;
    int shift = 14 - e;
    std::uint32_t h = mant >> shift;
    std::uint32_t rem = mant & ((1u << shift) - 1u);
    std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = (static_cast<std::uint32_t>(e) << 10) | (mant >> 13);
  std::uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is correct
  return static_cast<std::uint16_t>(sign | h);
}

/// half_bits_to_float in integer arithmetic alone (see float_to_half_bits_portable).
MB_HOST_DEVICE inline float half_bits_to_float_portable(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// IEEE 754 binary16, round to nearest even; overflow gives inf (like a CUDA __float2half_rn).
MB_HOST_DEVICE inline std::uint16_t float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));  // the same rounding, one instruction
#elif defined(MB_HAVE_F16C)
  if ((float_bits(f) & 0x7fffffffu) > 0x7f800000u) return float_to_half_bits_portable(f);  // NaN
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  return float_to_half_bits_portable(f);
#endif
}

MB_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#elif defined(MB_HAVE_F16C)
  if ((h & 0x7fffu) > 0x7c00u) return half_bits_to_float_portable(h);  // NaN
  return _cvtsh_ss(h);
#else
  return half_bits_to_float_portable(h);
#endif
}

/// bfloat16: the top half of an f32, round to nearest even; NaN stays NaN. On the device the
/// conversion instruction, as for f16 (the same rounding; a NaN comes out as the canonical 0x7FFF,
/// as the paired conversion the 16-byte stores use gives it, so a NaN's bits do not depend on
/// which store wrote it).
MB_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
#endif
}

MB_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t b) {
#if defined(__CUDA_ARCH__)
  return __bfloat162float(__ushort_as_bfloat16(b));
#else
  return bits_float(static_cast<std::uint32_t>(b) << 16);
#endif
}

/// Half-precision storage element.
struct f16 {
  std::uint16_t bits = 0;
  f16() = default;
  MB_HOST_DEVICE f16(float f) : bits(float_to_half_bits(f)) {}  // NOLINT: implicit like a float
  MB_HOST_DEVICE operator float() const { return half_bits_to_float(bits); }
};

/// bfloat16 storage element.
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  MB_HOST_DEVICE bf16(float f) : bits(float_to_bf16_bits(f)) {}  // NOLINT: implicit like a float
  MB_HOST_DEVICE operator float() const { return bf16_bits_to_float(bits); }
};

}  // namespace microbatch
