#!/usr/bin/env bash
# The CPU side by side with PyTorch: the README's character-level GPT (vocab 65, block 64, 4
# layers, 4 heads, 128 wide; 0.8M parameters), trained in f32 with AdamW and clipping at 1.0 from
# the same initial weights on the same tokens, by bench_gpt2_cuda --device cpu and by
# benchmarks/torch_gpt2.py --device cpu, then set side by side by benchmarks/compare.py: the step
# time (median over the timed steps, after the warm-up ones), tokens per second, every step's loss
# and the growth of each process's resident memory over the run (PyTorch keeps no allocator
# statistics on the CPU, so both processes are measured alike), with the loss curves, step times
# and memory drawn as SVG files.
#
# Then, where Open MPI's mpirun is found, the same training data-parallel over
# MB_CPU_BENCH_PROCESSES processes (2; 0 skips it), each with threads / processes threads, both
# sides started by mpirun: bench_gpt2_cuda summing its gradients over MPI, torch_gpt2.py with
# DistributedDataParallel over gloo. The batch stays the step's whole batch (each rank takes its
# share of the rows), so the losses are the one-process run's to rounding. Into OUTDIR/processesN,
# compared there the same way.
#
# Last, the Fashion-MNIST MLP and CNN in one process (MB_CPU_BENCH_IMAGE_MODELS, "mlp cnn"; empty
# skips them), f32, at batches MB_CPU_BENCH_IMAGE_BATCH ("64,256"), on the dataset's first images in
# order (MB_CPU_BENCH_IMAGE_DATA: its folder, /usr/share/datasets/fashion-mnist, or "synthetic"):
# bench_image_cuda against benchmarks/torch_image.py, from the same weights on the same images, into
# OUTDIR/images, compared there. Each comparison that misses a check makes the script's exit status
# 1, and the ones after it still run.
#
#   bash benchmarks/cpu_vs_torch.sh BUILD_DIR OUTDIR
#
# BUILD_DIR holds bench_gpt2_cuda and bench_image_cuda (a CUDA-enabled build configured with
# -DMB_BUILD_BENCHMARKS=ON; their CPU mode needs no GPU). Environment: MB_CPU_BENCH_BATCH (32), MB_CPU_BENCH_STEPS (30),
# MB_CPU_BENCH_WARMUP (3), MB_CPU_BENCH_THREADS (every core), MB_CPU_BENCH_PROCESSES (2),
# MB_TORCH_PYTHON (/usr/bin/python3, where Debian's python3-torch lives).
#
# A fair comparison (REFERENCE.md, "Fair CPU comparisons with PyTorch"): Debian's PyTorch calls the
# system's libblas.so.3, so this refuses to run unless that is OpenBLAS, sets OpenBLAS's core type
# from the CPU's instruction sets (its detection misreads these machines), and gives both sides the
# same number of threads. All of it is recorded in OUTDIR/setup.json.
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: bash benchmarks/cpu_vs_torch.sh BUILD_DIR OUTDIR" >&2
  exit 2
fi
# Both folders relative to where the script was started, before it moves to the repository root.
build=$(realpath "$1")
mkdir -p "$2"
out=$(realpath "$2")
cd "$(dirname "$0")/.."
bench="$build/bench_gpt2_cuda"
bench_image="$build/bench_image_cuda"
image_models="${MB_CPU_BENCH_IMAGE_MODELS-mlp cnn}"
for program in "$bench" ${image_models:+"$bench_image"}; do
  if [[ ! -x "$program" ]]; then
    echo "cpu_vs_torch: $program is missing: configure a CUDA-enabled build with" \
         "-DMB_BUILD_BENCHMARKS=ON and build it" >&2
    exit 2
  fi
done
for model in $image_models; do
  if [[ "$model" != mlp && "$model" != cnn ]]; then
    echo "cpu_vs_torch: MB_CPU_BENCH_IMAGE_MODELS names '$model'; the models are mlp and cnn" >&2
    exit 2
  fi
done
py="${MB_TORCH_PYTHON:-/usr/bin/python3}"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "cpu_vs_torch: $py cannot import torch (Debian: apt-get install python3-torch)" >&2
  exit 2
fi
# The library the loader gives for libblas.so.3 (Debian's alternatives pick it), followed to its file.
blas=$(ldconfig -p | awk '$1 == "libblas.so.3" && !found {print $NF; found = 1}')
blas=$(readlink -f "$blas" 2>/dev/null || true)
if [[ "$blas" != *openblas* ]]; then
  echo "cpu_vs_torch: libblas.so.3 is '${blas:-missing}', not OpenBLAS: PyTorch would run on the" \
       "reference BLAS, several times slower than it can (apt-get install libopenblas0-pthread)" >&2
  exit 2
fi
if grep -qw avx512f /proc/cpuinfo; then
  coretype=SkylakeX
elif grep -qw avx2 /proc/cpuinfo; then
  coretype=Haswell
else
  coretype=""
fi
threads="${MB_CPU_BENCH_THREADS:-$(nproc)}"
batch="${MB_CPU_BENCH_BATCH:-32}"
steps="${MB_CPU_BENCH_STEPS:-30}"
warmup="${MB_CPU_BENCH_WARMUP:-3}"
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"
if [[ -n "$coretype" ]]; then export OPENBLAS_CORETYPE="$coretype"; fi

cat > "$out/setup.json" <<EOF
{"blas": "$blas", "openblas_coretype": "$coretype", "threads": $threads, "batch": $batch,
 "steps": $steps, "warmup": $warmup, "cpu": "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)",
 "torch_python": "$py"}
EOF
echo "cpu_vs_torch: $threads threads, OpenBLAS core type '${coretype:-auto}', $blas"

rm -f "$out/gpt2.json" "$out/torch_gpt2.json"
"$bench" --device cpu --model char --precision f32 --batch "$batch" --steps "$steps" \
  --warmup "$warmup" --out-dir "$out" --json "$out/gpt2.json"
"$py" benchmarks/torch_gpt2.py --device cpu --precision f32 --weights "$out/gpt2_init.safetensors" \
  --tokens "$out/gpt2_tokens.safetensors" --batch "$batch" --steps "$steps" --warmup "$warmup" \
  --json "$out/torch_gpt2.json"
status=0
python3 benchmarks/compare.py "$out" --json "$out/summary.json" --plots "$out/plots" || status=1

# The Fashion-MNIST models in one process (OUTDIR/images), after the data-parallel runs.
image_runs() {
  local images="$out/images" image_batch="${MB_CPU_BENCH_IMAGE_BATCH:-64,256}"
  local data="${MB_CPU_BENCH_IMAGE_DATA:-/usr/share/datasets/fashion-mnist}"
  [[ -n "$image_models" ]] || return 0
  mkdir -p "$images"
  for model in $image_models; do
    rm -f "$images/image_$model.json" "$images/torch_image_$model.json"
    "$bench_image" --device cpu --model "$model" --batch "$image_batch" --steps "$steps" \
      --warmup "$warmup" --data "$data" --out-dir "$images" --json "$images/image_$model.json" || status=1
    "$py" benchmarks/torch_image.py --device cpu --weights "$images/image_${model}_init.safetensors" \
      --batches "$images/image_${model}_batches.safetensors" --batch "$image_batch" --steps "$steps" \
      --warmup "$warmup" --json "$images/torch_image_$model.json" || status=1
  done
  python3 benchmarks/compare.py "$images" --json "$images/summary.json" --plots "$images/plots" || status=1
}

processes="${MB_CPU_BENCH_PROCESSES:-2}"
if [[ "$processes" == 0 ]]; then image_runs; exit "$status"; fi
if ! command -v mpirun > /dev/null || ! mpirun --version 2>&1 | grep -q "Open MPI"; then
  echo "cpu_vs_torch: no Open MPI mpirun here (apt-get install openmpi-bin): the data-parallel" \
       "runs are skipped"
  image_runs
  exit "$status"
fi
if (( batch % processes != 0 )); then
  echo "cpu_vs_torch: the batch of $batch does not split over $processes processes" >&2
  exit 2
fi
rank_threads=$(( threads / processes > 0 ? threads / processes : 1 ))
dp="$out/processes$processes"
mkdir -p "$dp"
rm -f "$dp/gpt2.json" "$dp/torch_gpt2.json"
# A port of its own for gloo's rendezvous, so that two runs on one machine do not meet.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$dp/setup.json" <<JSON
{"blas": "$blas", "openblas_coretype": "$coretype", "processes": $processes,
 "threads_per_process": $rank_threads, "binding": "none", "batch": $batch, "steps": $steps,
 "warmup": $warmup, "launcher": "$(mpirun --version 2>&1 | head -n 1)", "torch_python": "$py"}
JSON
echo "cpu_vs_torch: $processes processes of $rank_threads threads each"
# Open MPI binds each of 2 ranks to one core by default, where a rank's threads would share it:
# --bind-to none leaves them to the system, as one process's are. It wants to be told when it runs
# as root; -x hands the thread settings and the port to every rank.
mpi=(mpirun -np "$processes" --bind-to none -x OMP_NUM_THREADS="$rank_threads"
     -x OPENBLAS_NUM_THREADS="$rank_threads" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port")
if [[ -n "$coretype" ]]; then mpi+=(-x OPENBLAS_CORETYPE); fi
if [[ $EUID -eq 0 ]]; then mpi+=(--allow-run-as-root); fi
"${mpi[@]}" "$bench" --device cpu --model char --precision f32 --batch "$batch" --steps "$steps" \
  --warmup "$warmup" --out-dir "$dp" --json "$dp/gpt2.json"
"${mpi[@]}" "$py" benchmarks/torch_gpt2.py --device cpu --precision f32 \
  --weights "$dp/gpt2_init.safetensors" --tokens "$dp/gpt2_tokens.safetensors" --batch "$batch" \
  --steps "$steps" --warmup "$warmup" --json "$dp/torch_gpt2.json"
# Both sides ran in as many processes (a launcher that started each as a world of one would not).
python3 - "$dp" "$processes" <<'PY'
import json, sys
for name in ("gpt2.json", "torch_gpt2.json"):
    got = json.load(open(f"{sys.argv[1]}/{name}")).get("processes")
    if got != int(sys.argv[2]):
        sys.exit(f"cpu_vs_torch: {name} ran in {got} processes, not {sys.argv[2]}")
PY
python3 benchmarks/compare.py "$dp" --json "$dp/summary.json" --plots "$dp/plots" || status=1
image_runs
exit "$status"
