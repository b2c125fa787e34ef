#!/usr/bin/env bash
# Trains the default example: an MLP on Fashion-MNIST (Debian's dataset-fashion-mnist), on the CPU.
# Installs what is missing and builds first (scripts/setup.sh). Extra flags go to `microbatch train`,
# e.g. `bash scripts/train.sh --model cnn` or `--gradient-accumulation-steps 4`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR="${BUILD_DIR:-build}"
# The example's 10 epochs and a line every 500 steps, unless a --config file is given: flags win
# over a config file's keys, so passing them would silently override the file's. No
# --per-device-train-batch-size: the command's 64 is a default, so that
# `--gradient-accumulation-steps 4 --train-batch-size 100` gives micro-batches of 25.
example=(--num-train-epochs 10 --logging-steps 500)
for arg in "$@"; do
  if [[ "$arg" == --config || "$arg" == --config=* ]]; then
    example=()
  fi
done
exec "$BUILD_DIR/microbatch" train --model mlp "${example[@]}" "$@"
