#!/usr/bin/env bash
# `mpirun -np 2 microbatch train ...` against one process with the same effective batch: the same
# losses step by step (to rounding), rank 0 alone printing and writing the log, and an error on
# the ranks ending the whole run with the message rather than hanging; and `microbatch eval` in 2
# processes against one.
#
#   tests/scripts/data_parallel_cli.sh MPIRUN MICROBATCH
set -euo pipefail
MPIRUN="$1"
CLI="$2"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# 88 sequences in windows of 16: five whole windows and one of 8 (4 a rank), then a second epoch.
common=(train --model gpt --dataset synthetic --synthetic-size 88 --vocab-size 32 --block-size 16
        --n-layer 1 --n-head 2 --n-embd 32 --max-steps 8 --logging-steps 1 --use-cpu --json
        --gradient-accumulation-steps 2 --learning-rate 3e-3)

# Runs `common` in PROCESSES processes of MICRO a rank and in one of PROCESSES x MICRO, and
# compares their logs step by step; SAMPLES_AT_5 and SAMPLES_AT_6 are the samples counted after
# steps 5 and 6, around the epoch's short last window.
compare_with_one_process() {
  local processes="$1" micro="$2" samples_at_5="$3" samples_at_6="$4"
  "$MPIRUN" -np "$processes" "$CLI" "${common[@]}" --per-device-train-batch-size "$micro" \
    --output-dir "$WORK/many$processes" > "$WORK/many$processes.out"
  "$CLI" "${common[@]}" --per-device-train-batch-size $((processes * micro)) \
    --output-dir "$WORK/one$processes" > "$WORK/one$processes.out"
  python3 - "$WORK" "$processes" "$samples_at_5" "$samples_at_6" <<'PY'
import json, sys
work, processes, at5, at6 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def steps(path):
    return [j for j in map(json.loads, open(path)) if "loss" in j and "event" not in j]
many, one = steps(f"{work}/many{processes}/log.jsonl"), steps(f"{work}/one{processes}/log.jsonl")
printed = [l for l in open(f"{work}/many{processes}.out")
           if l.startswith("{") and '"loss"' in l and '"event"' not in l]
assert len(many) == len(one) == 8, (len(many), len(one))
assert len(printed) == 8, f"{len(printed)} step lines printed by {processes} ranks: rank 0 alone prints"
assert many[4]["samples"] == at5 and many[5]["samples"] == at6, (many[4], many[5])
for a, b in zip(many, one):
    assert a["samples"] == b["samples"] and a["tokens"] == b["tokens"], (a, b)
    assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(b["loss"])), (a["step"], a["loss"], b["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, b["grad_norm"]), (a, b)
print(f"{processes} processes:", [round(s["loss"], 6) for s in many])
print("1 process:  ", [round(s["loss"], 6) for s in one])
PY
}

# Windows of 16: the epoch's sixth window holds the last 8 sequences, 4 a rank.
compare_with_one_process 2 4 80 88
# Three processes, windows of 18 (3 x 2 a rank): the epoch's last window of 16 is shared 6, 5, 5.
compare_with_one_process 3 3 88 106

# A bad argument fails on every rank, and the run ends with its message rather than hanging.
set +e
timeout 120 "$MPIRUN" -np 2 "$CLI" "${common[@]}" --per-device-train-batch-size 5 \
  --gradient-accumulation-steps 3 --train-batch-size 15 --output-dir "$WORK/bad" \
  > "$WORK/bad.out" 2>&1
status=$?
set -e
if [[ $status -eq 0 || $status -eq 124 ]]; then
  echo "FAIL: an effective batch of 15 over 2 processes exited with $status"; cat "$WORK/bad.out"; exit 1
fi
grep -q "train_batch_size 15 is not divisible by the 2 processes" "$WORK/bad.out" || {
  echo "FAIL: the error was not reported"; cat "$WORK/bad.out"; exit 1; }
# An error on rank 0 alone (its log cannot be written: a folder holds the name) ends every rank
# together (Note [Failing together] in train/distributed.h): the message once, status 2 from each
# rank, and no rank aborted.
mkdir -p "$WORK/one_rank/log.jsonl"
set +e
timeout 120 "$MPIRUN" -np 2 "$CLI" "${common[@]}" --per-device-train-batch-size 4 \
  --output-dir "$WORK/one_rank" > "$WORK/one_rank.out" 2>&1
status=$?
set -e
if [[ $status -ne 2 ]]; then
  echo "FAIL: an unwritable log on rank 0 exited with $status"; cat "$WORK/one_rank.out"; exit 1
fi
if [[ $(grep -c "^error: .*cannot write .*log.jsonl" "$WORK/one_rank.out") -ne 1 ]] ||
   grep -q "MPI_ABORT" "$WORK/one_rank.out"; then
  echo "FAIL: the error was not reported once by rank 0, or a rank was aborted"
  cat "$WORK/one_rank.out"; exit 1
fi
# Stopping at the loss-scale floor (fp16, a learning rate that overflows every step): every rank
# stops, and the last good state rank 0 saves is whole when the run ends, every time. The model is
# larger here so that writing its checkpoint takes a while: without the ranks waiting for it, the
# others' stop ended the run mid-write in 5 runs of 5.
for attempt in 1 2 3 4 5; do
  set +e
  timeout 120 "$MPIRUN" -np 2 "$CLI" "${common[@]}" --n-layer 2 --n-embd 256 \
    --per-device-train-batch-size 4 --fp16 \
    --learning-rate 1e6 --loss-scale-floor 32768 --max-overflows-at-floor 1 \
    --output-dir "$WORK/floor$attempt" > "$WORK/floor.out" 2>&1
  status=$?
  set -e
  saved="$(sed -n 's/.*the last good state is saved in \([^ ]*\)$/\1/p' "$WORK/floor.out" | head -n 1)"
  if [[ $status -eq 0 || $status -eq 124 || -z "$saved" || ! -f "$saved/COMPLETE" ]]; then
    echo "FAIL: the floor stop (attempt $attempt) exited with $status, saved '$saved'"
    ls -la "$WORK/floor$attempt" || true; cat "$WORK/floor.out"; exit 1
  fi
  if compgen -G "$WORK/floor$attempt/.checkpoint-*" > /dev/null; then
    echo "FAIL: a checkpoint was left half-written"; ls -la "$WORK/floor$attempt"; exit 1
  fi
  # The scaler's warning on reaching the floor: every rank reaches it, rank 0 alone prints it.
  if [[ $(grep -c "loss scale reached its floor" "$WORK/floor.out") -ne 1 ]]; then
    echo "FAIL: the floor warning was not printed once"; cat "$WORK/floor.out"; exit 1
  fi
done

# `eval` in 2 processes: each rank evaluates its share of the validation split and the sums are
# shared, so the loss is one process's to rounding, printed once.
python3 -c 'import random; r = random.Random(7); print("".join(r.choice("abcdefgh ") for _ in range(3000)))' \
  > "$WORK/text.txt"
text_model=(--model gpt --data "$WORK/text.txt" --block-size 16 --n-layer 1 --n-head 2 --n-embd 32
            --use-cpu --per-device-eval-batch-size 8 --output-dir "$WORK/text")
"$CLI" train "${text_model[@]}" --max-steps 3 --eval-strategy no > "$WORK/text_train.out"
"$CLI" eval "${text_model[@]}" --json > "$WORK/eval_one.out"
"$MPIRUN" -np 2 "$CLI" eval "${text_model[@]}" --json > "$WORK/eval_two.out"
python3 - "$WORK/eval_one.out" "$WORK/eval_two.out" <<'PY'
import json, sys
one = [json.loads(l) for l in open(sys.argv[1])]
two = [json.loads(l) for l in open(sys.argv[2])]
assert len(one) == 1 and len(two) == 1, f"{len(two)} lines printed by 2 ranks: rank 0 alone prints"
a, b = one[0]["eval_loss"], two[0]["eval_loss"]
assert one[0]["eval_examples"] == two[0]["eval_examples"] > 16, (one, two)
assert abs(a - b) < 1e-6 * abs(a), (a, b)
print(f"eval_loss: 1 process {a}, 2 processes {b}")
PY

echo "data_parallel_cli: ok"
