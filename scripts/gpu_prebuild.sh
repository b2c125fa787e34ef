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
# src/ a link to its own checkout. The build is the check's own: the settings and targets of
# scripts/gpu_build_settings.sh.
#
# The archive holds build/ with the six programs the check runs, and build/prebuilt.manifest: the
# root, the settings, nvcc's version, the version of the cuDNN that CMake linked (or none), and the
# SHA-256 of every file the programs are compiled from (CMake's files, C++ and CUDA sources and
# headers). The check uses the programs only when its settings are these, every listed file is
# unchanged in its checkout, nvcc and cuDNN there are no older, and the programs load and run; else
# it builds as before. The build folder is kept between runs, and a file whose content changed since
# the last run is touched, so that make rebuilds it whatever its time; a change of settings starts
# the folder afresh.
#
# Environment: MB_DEPS_DIR (default deps), MB_PREBUILT_ROOT, BUILD_JOBS (default nproc).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 ARCHIVE.tar.xz" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/gpu_build_settings.sh
source "$ROOT/scripts/gpu_build_settings.sh"
ARCHIVE="$(realpath -m "$1")"
DEPS="$(realpath -m "${MB_DEPS_DIR:-$ROOT/deps}")"
P="$(realpath -m "${MB_PREBUILT_ROOT:-/tmp/microbatch-prebuilt}")"
JOBS="${BUILD_JOBS:-$(nproc)}"
SETTINGS="$(gpu_build_settings_line)"
say() { echo "[gpu_prebuild] $*"; }

[[ -f "$DEPS/include/fmt/format.h" ]] || {
  say "no dependency bundle at $DEPS: make it first with scripts/bundle_deps.sh $DEPS"
  exit 1
}
find_nvcc
[[ -n "$NVCC" ]] || {
  say "no nvcc on this machine: the GPU programs cannot be built here"
  exit 1
}

# The copy: the build's inputs only (no build folders, no dependency bundle, nothing ignored; a
# tracked file deleted from the working tree is left out). The checkout's times are kept, so that
# files unchanged since the last run are not rebuilt.
existing() { while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done; }
rm -rf "$P/src" "$P/deps"
mkdir -p "$P/src" "$P/build"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | existing | tar --null -T - -cf -) |
  tar -xf - -C "$P/src"
cp -a "$DEPS" "$P/deps"
# What the programs are compiled from (not the scripts, data or documents, which the check reads
# from its own checkout).
(cd "$P/src" && git -C "$ROOT" ls-files -co --exclude-standard -z | existing |
  grep -zE '(^|/)CMakeLists\.txt$|\.(cmake|h|hpp|cpp|cc|cu|cuh|inl)$' | xargs -0 sha256sum) \
  >"$P/sources.sha256.new"

# Against the last run's build: its settings, and the content of each file it was built from.
if [[ ! -f "$P/sources.sha256" || "$(cat "$P/settings" 2>/dev/null)" != "$SETTINGS" ]]; then
  rm -rf "$P/build"
  mkdir -p "$P/build"
else
  # A file that is new or whose content changed is touched: make then rebuilds it even when the
  # copy's time is older than the objects (another checkout, a copy that kept times).
  touched=0
  while IFS= read -r line; do
    f="${line#*  }"
    touch "$P/src/$f"
    touched=$((touched + 1))
  done < <(sort "$P/sources.sha256.new" | comm -23 - <(sort "$P/sources.sha256"))
  say "files changed since the last prebuild: $touched"
fi
mv "$P/sources.sha256.new" "$P/sources.sha256"
echo "$SETTINGS" >"$P/settings"

say "building in $P/build with nvcc $NVCC_VERSION, $JOBS jobs"
for p in "${GPU_PROGRAMS[@]}"; do rm -f "$P/build/$p"; done
cmake -S "$P/src" -B "$P/build" -DMB_DEPS_DIR="$P/deps" "${GPU_CMAKE_SETTINGS[@]}" \
  -DCMAKE_CUDA_COMPILER="$NVCC" >"$P/configure.log"
cmake --build "$P/build" -j "$JOBS" --target "${GPU_TARGETS[@]}"
for p in "${GPU_PROGRAMS[@]}"; do
  [[ -x "$P/build/$p" ]] || {
    say "$p was not built"
    exit 1
  }
done

# The cuDNN the programs link, as CMake found it: its version from the header beside it.
CUDNN=none
if grep -q 'microbatch: cuDNN /' "$P/configure.log"; then
  include="$(sed -n 's/^MB_CUDNN_INCLUDE:PATH=//p' "$P/build/CMakeCache.txt")"
  if [[ -f "$include/cudnn_version.h" ]]; then
    CUDNN="$(cudnn_version "$include/cudnn_version.h")"
  else
    say "CMake linked cuDNN, but $include has no cudnn_version.h"
    exit 1
  fi
fi

{
  echo "root $P"
  echo "settings $SETTINGS"
  echo "nvcc $NVCC_VERSION"
  echo "cudnn $CUDNN"
  echo "built $(date -u +%FT%TZ) on $(uname -n) from $(git -C "$ROOT" rev-parse --short HEAD)$(
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' with uncommitted changes')"
  sed 's/^/source /' "$P/sources.sha256"
} >"$P/build/prebuilt.manifest"
XZ_OPT="${XZ_OPT:--6 -T0}" tar -C "$P" -cJf "$ARCHIVE" build/prebuilt.manifest "${GPU_PROGRAMS[@]/#/build/}"
say "$(du -h "$ARCHIVE" | cut -f1) in $ARCHIVE (cuDNN $CUDNN; $(grep -c '^source ' "$P/build/prebuilt.manifest") source files listed)"
