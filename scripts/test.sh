#!/usr/bin/env bash
# Builds (scripts/setup.sh) and runs every test suite with ctest; each suite's own doctest output,
# down to its summary line, is shown whether it passes or not.
#
#   scripts/test.sh [extra ctest arguments...]     (BUILD_DIR as for setup.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export BUILD_DIR="${BUILD_DIR:-$ROOT/build}"

# The GPU benchmarks too (in a CUDA build): their logic runs on the CPU among the tests.
bash "$ROOT/scripts/setup.sh" -DMB_BUILD_BENCHMARKS=ON
cd "$BUILD_DIR"
ctest --output-on-failure --verbose "$@"
