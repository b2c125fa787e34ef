#!/usr/bin/env bash
# Copies the header-only dependencies into OUTDIR, so that a machine without the Debian -dev
# packages can build with `cmake -DMB_DEPS_DIR=OUTDIR`:
#
#   OUTDIR/eigen3/Eigen/...         Eigen (libeigen3-dev)
#   OUTDIR/include/doctest/         doctest (doctest-dev)
#   OUTDIR/include/nlohmann/        nlohmann json (nlohmann-json3-dev)
#   OUTDIR/include/CLI/             CLI11 (libcli11-dev)
#   OUTDIR/include/fmt/             fmt headers (libfmt-dev); CMake defines FMT_HEADER_ONLY in this
#                                   mode, where fmt/format.h includes fmt/format-inl.h (shipped by
#                                   Debian), so no fmt source file is needed
#   OUTDIR/include/zlib.h, zconf.h  zlib's headers (zlib1g-dev); the library itself (libz.so.1)
#                                   is on every Debian system
#
#   scripts/bundle_deps.sh OUTDIR
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
OUT="$1"

need() {
  if [[ ! -e "$1" ]]; then
    echo "bundle_deps: $1 is missing; install $2 first (scripts/setup.sh does)" >&2
    exit 1
  fi
}
need /usr/include/eigen3/Eigen/Core libeigen3-dev
need /usr/include/doctest/doctest.h doctest-dev
need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need /usr/include/CLI/CLI.hpp libcli11-dev
need /usr/include/fmt/format-inl.h libfmt-dev
need /usr/include/zlib.h zlib1g-dev
need /usr/include/zconf.h zlib1g-dev

mkdir -p "$OUT/eigen3" "$OUT/include"
rm -rf "$OUT/eigen3/Eigen" "$OUT/include/doctest" "$OUT/include/nlohmann" "$OUT/include/CLI" \
  "$OUT/include/fmt"
# Only Eigen proper: nothing here uses Eigen's unsupported modules.
cp -r /usr/include/eigen3/Eigen /usr/include/eigen3/signature_of_eigen3_matrix_library \
  "$OUT/eigen3/"
cp -r /usr/include/doctest /usr/include/nlohmann /usr/include/CLI /usr/include/fmt "$OUT/include/"
cp /usr/include/zlib.h /usr/include/zconf.h "$OUT/include/"

# Licences travel with the code they cover.
mkdir -p "$OUT/licenses"
for pkg in libeigen3-dev doctest-dev nlohmann-json3-dev libcli11-dev libfmt-dev zlib1g-dev; do
  if [[ -f "/usr/share/doc/$pkg/copyright" ]]; then
    cp "/usr/share/doc/$pkg/copyright" "$OUT/licenses/$pkg.copyright"
  fi
done

echo "bundle_deps: $(du -sh "$OUT" | cut -f1) in $OUT"
echo "bundle_deps: build with cmake -DMB_DEPS_DIR=$(realpath "$OUT")"
