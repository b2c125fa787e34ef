// Counter-based random numbers (Philox-4x32-10), so that CPU and GPU draw the same values and a run
// can be resumed bit for bit. A draw of n values starting at block `offset` gives value i from
// block offset + i / 4, lane i % 4 (normals use pairs: block offset + i / 2, lanes 2(i%2), 2(i%2)+1).
#pragma once

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

/// A uniform float in (0, 1], safe for log().
MB_HOST_DEVICE inline float uniform_open0_from_bits(std::uint32_t x) {
  return static_cast<float>((x >> 8) + 1u) * 5.9604644775390625e-08f;
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

}  // namespace microbatch
