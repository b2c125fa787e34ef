#!/usr/bin/env bash
# Builds here the programs the GPU check runs, so that the GPU machine, lent for a few minutes,
# spends none of them compiling (scripts/gpu_check.sh, MB_GPU_CHECK_PREBUILT):
#
#   scripts/bundle_deps.sh deps                      where the Debian -dev packages are
#   scripts/gpu_prebuild.sh gpu-prebuilt.tar.xz      here, with nvcc (no GPU needed)
#   MB_GPU_CHECK_PREBUILT=gpu-prebuilt.tar.xz scripts/gpu_check.sh OUTDIR     on the GPU machine
#
# The programs hold absolute paths of the tree they were built from (the test fixtures, the CLI the
# train tests run), so they are built from a copy of the working tree (its tracked files and the
# untracked ones git does not ignore) in a fixed folder, MB_PREBUILT_ROOT (default
# /tmp/microbatch-prebuilt: src/, deps/, build/), which the check recreates on the GPU machine with
# src/ a link to its own checkout. The build is the check's own: the same CMake settings (Release,
# -DMB_DEPS_DIR, -DMB_CUDA=ON, -DMB_BUILD_BENCHMARKS=ON, -DMB_NATIVE=OFF) and the same targets.
#
# The archive holds build/ with the six programs the check runs, and build/prebuilt.manifest: the
# root, nvcc's and cuDNN's versions, and the SHA-256 of every file they are compiled from (CMake's
# files, C++ and CUDA sources and headers). The check uses the programs only when every listed
# file is unchanged in its checkout, nvcc and cuDNN there are no older, and the programs load and
# run; else it builds as before.
#
# Environment: MB_DEPS_DIR (default deps), MB_PREBUILT_ROOT, BUILD_JOBS (default nproc).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 ARCHIVE.tar.xz" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCHIVE="$(realpath -m "$1")"
DEPS="$(realpath -m "${MB_DEPS_DIR:-$ROOT/deps}")"
P="${MB_PREBUILT_ROOT:-/tmp/microbatch-prebuilt}"
JOBS="${BUILD_JOBS:-$(nproc)}"
say() { echo "[gpu_prebuild] $*"; }

[[ -f "$DEPS/include/fmt/format.h" ]] || {
  say "no dependency bundle at $DEPS: make it first with scripts/bundle_deps.sh $DEPS"
  exit 1
}
NVCC="$(command -v nvcc || true)"
[[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
[[ -n "$NVCC" ]] || {
  say "no nvcc on this machine: the GPU programs cannot be built here"
  exit 1
}
NVCC_VERSION="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
CUDA_ROOT="$(dirname "$(dirname "$(realpath "$NVCC")")")"
CUDNN="none"
for h in "$CUDA_ROOT/include/cudnn_version.h" /usr/include/cudnn_version.h; do
  if [[ -f "$h" ]]; then
    CUDNN="$(awk '/#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) / { v[$2] = $3 }
                  END { print v["CUDNN_MAJOR"] "." v["CUDNN_MINOR"] "." v["CUDNN_PATCHLEVEL"] }' "$h")"
    break
  fi
done

# The copy: the build's inputs only (no build folders, no dependency bundle, nothing ignored).
rm -rf "$P/src" "$P/deps"
mkdir -p "$P/src" "$P/build"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$P/src"
cp -a "$DEPS" "$P/deps"
# What the programs are compiled from: CMake's files and the C++ and CUDA sources and headers (not
# the scripts, data or documents, which the check reads from its own checkout).
(cd "$P/src" && git -C "$ROOT" ls-files -co --exclude-standard |
  grep -E '(^|/)CMakeLists\.txt$|\.(cmake|h|hpp|cpp|cc|cu|cuh|inl)$' | tr '\n' '\0' |
  xargs -0 sha256sum) >"$P/sources.sha256"

PROGRAMS=(microbatch bench_gpt2_cuda bench_attention_cuda bench_kernels_cuda tests_core tests_train)
say "building in $P/build with nvcc $NVCC_VERSION, cuDNN $CUDNN, $JOBS jobs"
cmake -S "$P/src" -B "$P/build" -DCMAKE_BUILD_TYPE=Release -DMB_DEPS_DIR="$P/deps" -DMB_CUDA=ON \
  -DMB_BUILD_BENCHMARKS=ON -DMB_NATIVE=OFF -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
for p in "${PROGRAMS[@]}"; do rm -f "$P/build/$p"; done
cmake --build "$P/build" -j "$JOBS" --target microbatch_cli bench_gpt2_cuda bench_attention_cuda \
  bench_kernels_cuda tests_core tests_train
for p in "${PROGRAMS[@]}"; do
  [[ -x "$P/build/$p" ]] || {
    say "$p was not built"
    exit 1
  }
done

{
  echo "root $P"
  echo "nvcc $NVCC_VERSION"
  echo "cudnn $CUDNN"
  echo "built $(date -u +%FT%TZ) on $(uname -n)"
  sed 's/^/source /' "$P/sources.sha256"
} >"$P/build/prebuilt.manifest"
XZ_OPT="${XZ_OPT:--6 -T0}" tar -C "$P" -cJf "$ARCHIVE" build/prebuilt.manifest "${PROGRAMS[@]/#/build/}"
say "$(du -h "$ARCHIVE" | cut -f1) in $ARCHIVE ($(grep -c '^source ' "$P/build/prebuilt.manifest") source files listed)"
