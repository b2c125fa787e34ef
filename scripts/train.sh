#!/usr/bin/env bash
# Trains the default example: an MLP on Fashion-MNIST (Debian's dataset-fashion-mnist), on the CPU.
# Installs what is missing and builds first (scripts/setup.sh). Extra flags go to `microbatch train`,
# e.g. `bash scripts/train.sh --model cnn` or `--gradient-accumulation-steps 4`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR="${BUILD_DIR:-build}"
exec "$BUILD_DIR/microbatch" train --model mlp --per-device-train-batch-size 64 \
  --num-train-epochs 10 --learning-rate 1e-3 --logging-steps 500 --eval-strategy epoch "$@"
