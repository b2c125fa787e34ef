#!/usr/bin/env bash
# bench_gpt2_cuda under `mpirun -np 2` (its data-parallel mode, which benchmarks/cpu_vs_torch.sh
# sets against PyTorch's DistributedDataParallel) on the CPU, at the tiny model's size: the two
# ranks' run of B = 4 (2 rows each, gradients summed over MPI) against one process's, step by step.
# The figures say nothing; the losses must be one process's to rounding.
#
#   tests/scripts/bench_data_parallel.sh MPIRUN BENCH_GPT2
set -euo pipefail
MPIRUN="$1"
BENCH="$2"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
args=(--device cpu --tiny --batch 4 --steps 4 --warmup 1)
"$BENCH" "${args[@]}" --out-dir "$WORK/one" --json "$WORK/one.json" > "$WORK/one.out"
timeout 120 "$MPIRUN" -np 2 "$BENCH" "${args[@]}" --out-dir "$WORK/two" --json "$WORK/two.json" \
  > "$WORK/two.out"
# A batch that does not split over the ranks is refused, said once.
set +e
timeout 120 "$MPIRUN" -np 2 "$BENCH" --device cpu --tiny --batch 3 --out-dir "$WORK/odd" \
  > "$WORK/odd.out" 2>&1
status=$?
set -e
if [[ $status -ne 2 || $(grep -c "does not split over the 2 processes" "$WORK/odd.out") -ne 1 ]]; then
  echo "FAIL: --batch 3 over 2 processes exited with $status"; cat "$WORK/odd.out"; exit 1
fi
python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
one, two = (json.load(open(f"{work}/{n}.json")) for n in ("one", "two"))
assert one["processes"] == 1 and two["processes"] == 2, (one["processes"], two["processes"])
a, b = one["runs"][0], two["runs"][0]
assert a["batch"] == b["batch"] == 4 and a["tokens_per_step"] == b["tokens_per_step"], (a, b)
assert len(a["losses"]) == len(b["losses"]) == 5
# The first step's gradient differs by the order of its sums alone (1.2e-6 of its norm, measured);
# AdamW then moves weights whose gradients are near 0 by up to the learning rate either way, and
# the runs drift apart (2.6e-4 of the norm by the fifth step). A sum missing over the ranks, or
# weighed twice, is off by a factor.
x, y = a["grad_norms"][0], b["grad_norms"][0]
assert abs(x - y) < 1e-5 * x, ("first step's norm", x, y)
for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
    assert abs(x - y) < 1e-4 * abs(x), (step, x, y)
for step, (x, y) in enumerate(zip(a["grad_norms"], b["grad_norms"])):
    assert abs(x - y) < 2e-3 * x, (step, x, y)
printed = [l for l in open(f"{work}/two.out") if l.lstrip().startswith("B=4 step")]
assert len(printed) == 5, f"{len(printed)} step lines from 2 ranks: rank 0 alone prints"
print("1 process: ", [round(x, 6) for x in a["losses"]])
print("2 processes:", [round(x, 6) for x in b["losses"]])
PY
echo "bench_data_parallel: ok"
