#include "core/rng.h"

namespace microbatch {

Generator& default_generator() {
  static Generator generator;
  return generator;
}

void manual_seed(std::uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace microbatch
