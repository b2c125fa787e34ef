#!/usr/bin/env bash
# The memory planner on the GPU: trains GPT-2 small (bf16, synthetic tokens, T = 1024) with the
# Trainer on cuda:0 for a few optimizer steps under each memory budget, with the micro-batch left
# to the planner (effective batch fixed), and records the plan it chose, its predicted peak and
# the peak the allocator measured (reserved bytes above the Trainer's baseline, from each step's
# line in log.jsonl) into OUTDIR/planner.json.
#
#   benchmarks/planner_cuda.sh BUILD_DIR OUTDIR [BUDGET...]       (default budgets: 8GiB 16GiB 24GiB)
#
# Environment: MB_PLANNER_STEPS (optimizer steps per budget, default 3), MB_PLANNER_BATCH (effective
# batch in sequences, default 16), MB_PLANNER_SECONDS (time for all the runs, default
# MB_STAGE_SECONDS, which scripts/gpu_check.sh sets, else 300): each run gets an equal share of what
# is left when it starts, and a run that is stopped still reports the steps it logged.
# Each budget's run keeps its output in OUTDIR/planner_<budget>/ (stdout.log, log.jsonl, status).
# Exit status 1 when a run failed, measured more than its budget, or measured a peak more than 5%
# away from the predicted one (the issue's targets).
set -uo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 BUILD_DIR OUTDIR [BUDGET...]" >&2
  exit 2
fi
BUILD="$1"
OUT="$2"
shift 2
BUDGETS=("$@")
[[ ${#BUDGETS[@]} -eq 0 ]] && BUDGETS=(8GiB 16GiB 24GiB)
STEPS="${MB_PLANNER_STEPS:-3}"
BATCH="${MB_PLANNER_BATCH:-16}"
DEADLINE=$(($(date +%s) + ${MB_PLANNER_SECONDS:-${MB_STAGE_SECONDS:-300}} - 10))  # 10 s for the summary
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"

runs_left=${#BUDGETS[@]}
for budget in "${BUDGETS[@]}"; do
  run_seconds=$(((DEADLINE - $(date +%s)) / runs_left))
  runs_left=$((runs_left - 1))
  dir="$OUT/planner_$budget"
  rm -rf "$dir"  # log.jsonl is appended to: start clean
  mkdir -p "$dir"
  echo "planner: GPT-2 small under $budget ($STEPS steps of $BATCH sequences, at most ${run_seconds}s)"
  start=$(date +%s)
  timeout --kill-after=5 "$((run_seconds > 1 ? run_seconds : 1))" "$BUILD/microbatch" train --model gpt2 --dataset synthetic \
    --synthetic-size $((BATCH * STEPS)) --device cuda --bf16 --memory-budget "$budget" \
    --per-device-train-batch-size auto --train-batch-size "$BATCH" --max-steps "$STEPS" \
    --logging-steps 1 --eval-strategy no --save-strategy no --output-dir "$dir" --json \
    >"$dir/stdout.log" 2>&1
  echo "$? $(($(date +%s) - start))" >"$dir/status"
  rm -f "$dir/model.safetensors"  # the final model the Trainer saves: 500 MB nobody reads here
  tail -n 3 "$dir/stdout.log"
done

"$PYTHON" - "$OUT" "${BUDGETS[@]}" <<'EOF'
import json, os, re, sys

out, budgets = sys.argv[1], sys.argv[2:]
TOLERANCE = 0.05  # the predicted peak must be within 5% of the measured one
units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}

def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    return int(float(m.group(1)) * units[m.group(2).upper()]) if m and m.group(2).upper() in units else None

runs, ok = [], True
for budget in budgets:
    d = os.path.join(out, f"planner_{budget}")
    rc, seconds = (int(x) for x in open(os.path.join(d, "status")).read().split())
    run = dict(budget=budget, budget_bytes=parse_bytes(budget), exit_code=rc, seconds=seconds)
    plan, steps = None, []
    log = os.path.join(d, "log.jsonl")
    if os.path.exists(log):
        for line in open(log):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if j.get("event") == "plan":
                plan = j.get("plan")
            elif "measured_peak" in j and "step" in j and "event" not in j:
                steps.append(j)
    if plan:
        run.update({k: plan.get(k) for k in ("micro_batch_size", "accumulation_steps", "gradient_checkpointing",
                                             "predicted_peak", "effective_batch", "device")})
        run["outside_budget"] = plan.get("outside_budget")
    if steps:
        run["measured_peak"] = max(s["measured_peak"] for s in steps)
        run["measured_peaks"] = [s["measured_peak"] for s in steps]
        run["elapsed_seconds"] = [s.get("seconds") for s in steps]
        run["losses"] = [s.get("loss") for s in steps]
    if rc == 0 and steps:
        run["status"] = "ok"
    else:
        tail = open(os.path.join(d, "stdout.log"), errors="replace").read().strip().splitlines()[-3:]
        run["status"] = "timeout" if rc in (124, 137) else "failed"
        run["message"] = " | ".join(tail)
    fits = run.get("measured_peak") is not None and run["budget_bytes"] is not None and \
        run["measured_peak"] <= run["budget_bytes"]
    pred, meas = run.get("predicted_peak"), run.get("measured_peak")
    predicted = bool(pred and meas) and abs(pred - meas) <= TOLERANCE * meas
    ok = ok and run["status"] == "ok" and fits and predicted
    print(f"  {budget:>7}: {run['status']}, micro-batch {run.get('micro_batch_size')} x {run.get('accumulation_steps')}, "
          f"predicted {pred}, measured {meas}" + (f", measured/predicted {meas / pred:.3f}" if pred and meas else "")
          + ("" if fits else ", over budget") + ("" if predicted else f", prediction not within {TOLERANCE:.0%}"))
    runs.append(run)
with open(os.path.join(out, "planner.json"), "w") as f:
    json.dump({"benchmark": "planner", "model": "gpt2_small", "precision": "bf16", "runs": runs, "pass": ok}, f, indent=2)
print("wrote", os.path.join(out, "planner.json"))
sys.exit(0 if ok else 1)
EOF
