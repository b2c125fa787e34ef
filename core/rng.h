// Counter-based random numbers (Philox-4x32-10), so that CPU and GPU draw the same values and a run
// can be resumed bit for bit. A draw of n values starting at block `offset` gives value i from
// block offset + i / 4, lane i % 4 (normals use pairs: block offset + i / 2, lanes 2(i%2), 2(i%2)+1).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"

namespace microbatch {

struct PhiloxBlock {
  std::uint32_t v[4];
};

/// One Philox-4x32-10 block for a 64-bit counter and a 64-bit key.
MB_HOST_DEVICE inline PhiloxBlock philox4x32(std::uint64_t counter, std::uint64_t key) {
  std::uint32_t c0 = static_cast<std::uint32_t>(counter), c1 = static_cast<std::uint32_t>(counter >> 32);
  std::uint32_t c2 = 0, c3 = 0;
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c0;
    std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c2;
    std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

/// A uniform float in [0, 1) from 24 random bits.
MB_HOST_DEVICE inline float uniform_from_bits(std::uint32_t x) {
  return static_cast<float>(x >> 8) * 5.9604644775390625e-08f;
}

/// A uniform value from uniform_from_bits (k * 2^-24) kept to its first `bits` random bits,
/// floor(u * 2^bits) * 2^-bits: the significand of f16 (11) or bf16 (8) holds it exactly, so
/// rounding to the dtype cannot reach 1, as torch draws 16-bit uniforms. Exact in float; u itself
/// for 24 bits or more.
MB_HOST_DEVICE inline float uniform_truncated(float u, int bits) {
  if (bits >= 24) return u;
  const float scale = static_cast<float>(1u << bits);
  return std::floor(u * scale) / scale;
}

/// A uniform float in (0, 1], safe for log().
MB_HOST_DEVICE inline float uniform_open0_from_bits(std::uint32_t x) {
  return static_cast<float>((x >> 8) + 1u) * 5.9604644775390625e-08f;
}

// Note [Portable normals]: libm's logf and cosf differ between glibc versions and CUDA by an ulp
// or two, so Box-Muller written with them would give the CPU and the GPU different bits. These
// two use only operations IEEE 754 rounds exactly (+, -, *, /, sqrt, fma) and no expression a
// compiler could contract into an fma, so every host and device computes the same float.

/// ln(x) for a positive normal float x, to about 1e-7 relative.
MB_HOST_DEVICE inline float portable_log(float x) {
  const std::uint32_t bits = float_bits(x);
  int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
  float m = bits_float((bits & 0x7fffffu) | 0x3f800000u);  // x = m 2^e, m in [1, 2)
  if (m > 1.41421356f) {
    m = m * 0.5f;  // exact; m in [0.707, 1.414]
    e += 1;
  }
  // ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172: the series to s^9 is within 2e-9.
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float p = std::fma(s2, 1.0f / 9.0f, 1.0f / 7.0f);
  p = std::fma(s2, p, 1.0f / 5.0f);
  p = std::fma(s2, p, 1.0f / 3.0f);
  const float two_s = s + s;
  const float ln_m = std::fma(two_s, s2 * p, two_s);
  const float ef = static_cast<float>(e);
  // ln 2 split so that e * hi is exact (fdlibm's constants).
  return std::fma(ef, 6.9313812256e-01f, std::fma(ef, 9.0580006145e-06f, ln_m));
}

/// cos(2 pi u) for u in [0, 1) a multiple of 2^-24, to about 1e-7.
MB_HOST_DEVICE inline float portable_cos_2pi(float u) {
  float a = u >= 0.5f ? 1.0f - u : u;  // exact; cos is even and 1-periodic in u
  float sign = 1.0f;
  if (a > 0.25f) {  // cos(2 pi a) = -cos(2 pi (1/2 - a))
    a = 0.5f - a;
    sign = -1.0f;
  }
  constexpr float kTwoPi = 6.28318530717958647692f;
  if (a <= 0.125f) {  // x in [0, pi/4]: Taylor to x^10, within 2e-10
    const float x = a * kTwoPi;
    const float z = x * x;
    float p = std::fma(z, -1.0f / 3628800.0f, 1.0f / 40320.0f);
    p = std::fma(z, p, -1.0f / 720.0f);
    p = std::fma(z, p, 1.0f / 24.0f);
    p = std::fma(z, p, -0.5f);
    return sign * std::fma(z, p, 1.0f);
  }
  const float x = (0.25f - a) * kTwoPi;  // cos(2 pi a) = sin(2 pi (1/4 - a)), x in [0, pi/4)
  const float z = x * x;
  float p = std::fma(z, 1.0f / 362880.0f, -1.0f / 5040.0f);
  p = std::fma(z, p, 1.0f / 120.0f);
  p = std::fma(z, p, -1.0f / 6.0f);
  return sign * std::fma(x * z, p, x);
}

/// A standard normal from two random words (Box-Muller, cosine branch):
/// sqrt(-2 ln u1) cos(2 pi u2), u1 in (0, 1], u2 in [0, 1). The same bits on every device.
MB_HOST_DEVICE inline float normal_from_bits(std::uint32_t x1, std::uint32_t x2) {
  const float radius = std::sqrt(-2.0f * portable_log(uniform_open0_from_bits(x1)));
  return radius * portable_cos_2pi(uniform_from_bits(x2));
}

/// The seed and position of the default stream; draws advance the offset.
struct GeneratorState {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;  // Philox blocks consumed
};

/// The process-wide default generator (per thread of control; not synchronized).
class Generator {
 public:
  void manual_seed(std::uint64_t seed) { state_ = GeneratorState{seed, 0}; }
  GeneratorState state() const { return state_; }
  void set_state(GeneratorState state) { state_ = state; }
  /// Reserves `blocks` Philox blocks and returns the first one's offset.
  std::uint64_t reserve(std::uint64_t blocks) {
    std::uint64_t first = state_.offset;
    state_.offset += blocks;
    return first;
  }

 private:
  GeneratorState state_{};
};

Generator& default_generator();
/// Seeds the default generator (like torch.manual_seed; the streams differ from PyTorch's).
void manual_seed(std::uint64_t seed);

/// Puts the default generator back to its state at construction on every exit, exceptions
/// included.
class GeneratorStateGuard {
 public:
  GeneratorStateGuard() : state_(default_generator().state()) {}
  ~GeneratorStateGuard() { default_generator().set_state(state_); }
  GeneratorStateGuard(const GeneratorStateGuard&) = delete;
  GeneratorStateGuard& operator=(const GeneratorStateGuard&) = delete;

 private:
  GeneratorState state_;
};

}  // namespace microbatch
