#!/usr/bin/env bash
# Installs the Debian packages microbatch needs (only those missing), then configures and builds.
#
#   scripts/setup.sh [extra cmake arguments...]
#
# Environment: BUILD_DIR (default: build/ in the repository), MB_CUDA (ON, OFF or AUTO; AUTO uses
# /usr/local/cuda/bin/nvcc when it exists), CMAKE_BUILD_TYPE (Release), MB_INSTALL_TORCH=1 to also
# install python3-torch, which only the fixture-regenerating scripts and the CPU comparison need,
# with OpenBLAS (libopenblas0-pthread), without which that PyTorch runs on the reference BLAS.
# Meant for Debian 12, run as root (or with sudo available).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"

packages=(build-essential cmake ccache libeigen3-dev doctest-dev nlohmann-json3-dev libcli11-dev
          libfmt-dev zlib1g-dev dataset-fashion-mnist python3 xz-utils libopenmpi-dev openmpi-bin)
if [[ "${MB_INSTALL_TORCH:-0}" == 1 ]]; then
  packages+=(python3-torch libopenblas0-pthread)
fi

# `dpkg -s` also succeeds for removed packages whose configuration files remain: check the status.
missing=()
for p in "${packages[@]}"; do
  if ! dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  sudo=()
  if [[ "$(id -u)" -ne 0 ]]; then
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi

cmake -S "$ROOT" -B "$BUILD_DIR" \
  -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" \
  -DMB_CUDA="${MB_CUDA:-AUTO}" \
  "$@"
cmake --build "$BUILD_DIR" -j"$(nproc)"
echo "setup: built into $BUILD_DIR"
