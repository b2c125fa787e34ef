#!/usr/bin/env bash
# The GPU check's plumbing, without a GPU: scripts/gpu_check.sh's stage bookkeeping, results.json,
# the bundle, and benchmarks/compare.py's tables, verdicts and plots, on benchmark results kept in
# tests/fixtures/gpu_check/ (ours and PyTorch's GPT-2 and kernel results from the programs' CPU
# modes, an attention pair from an H200 run, and a planner result with one run over its budget) and
# variants of them; the time boxes, fallbacks and settings on stand-in programs; planner_cuda.sh's
# verdict and cpu_vs_torch.sh's folders; and, where a Python here has torch, that PyTorch's
# benchmarks keep what they measured past a failure.
# These run for real only on a borrowed GPU, once in a while: a slip here would cost that run.
#
#   tests/scripts/gpu_check_tools.sh        (CTest runs it as gpu_check_tools)
#
# Exit status 0 when every check holds, 1 otherwise, 77 (reported as skipped) without python3.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FIXTURES="$ROOT/tests/fixtures/gpu_check"
if ! command -v python3 >/dev/null 2>&1; then
  echo "gpu_check_tools: skipped: no python3 (scripts/setup.sh installs it)"
  exit 77
fi
# The interpreter itself, not a version manager's shim in front of it: a shim costs most of a second
# a call, and this calls Python a hundred times.
PY="$(python3 -c 'import sys; print(sys.executable)')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
FAILURES=0
check() {  # description, then a command that must succeed
  local what="$1"
  shift
  if "$@"; then
    echo "ok: $what"
  else
    echo "FAILED: $what"
    FAILURES=$((FAILURES + 1))
  fi
}
json() {  # file, Python expression over j that must be true
  "$PY" - "$1" "$2" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
sys.exit(0 if eval(sys.argv[2], {"j": j}) else 1)
EOF
}
svgs_parse() {  # folder, names...: each NAME.svg there is well-formed XML with an <svg> root
  local dir="$1"
  shift
  "$PY" - "$dir" "$@" <<'EOF'
import sys, xml.dom.minidom
dir, names = sys.argv[1], sys.argv[2:]
for n in names:
    doc = xml.dom.minidom.parse(f"{dir}/{n}.svg")
    assert doc.documentElement.tagName == "svg", n
EOF
}

# A machine with a GPU, as far as the script can tell: nvidia-smi names one.
mkdir -p "$WORK/bin" "$WORK/out" "$WORK/build"
printf '#!/bin/sh\necho "Test GPU, 1024 MiB, 1.0"\n' >"$WORK/bin/nvidia-smi"
chmod +x "$WORK/bin/nvidia-smi"
cp "$FIXTURES"/*.json "$WORK/out/"

# ---- the compare stage through the check ---------------------------------------------------------
PATH="$WORK/bin:$PATH" BUILD_DIR="$WORK/build" MB_CUDA=ON PYTHON="$PY" MB_GPU_CHECK_STAGES=compare \
  MB_GPU_CHECK_BUNDLE="$WORK/bundle.tar.gz" bash "$ROOT/scripts/gpu_check.sh" "$WORK/out" >"$WORK/check.log" 2>&1
rc=$?
# The fixtures miss targets (the CPU's kernels are no H200's), so the comparison fails, and so the check.
check "the check exits 1 when the comparison fails (got $rc)" test "$rc" -eq 1
R="$WORK/out/results.json"
check "results.json records the compare stage as failed" json "$R" 'j["stages"]["compare"]["status"] == "fail"'
check "results.json carries the comparison's verdict" json "$R" 'j["stages"]["compare"]["figures"] == {"pass": False}'
check "results.json names the GPU" json "$R" 'j["machine"]["gpu"] == "Test GPU, 1024 MiB, 1.0"'
check "only the stage asked for ran" json "$R" 'list(j["stages"]) == ["compare"]'
C="$WORK/out/compare.json"
# Verdicts follow from the fixtures' ratios to the copy bandwidth and the issue's targets.
check "accumulate f32 += f32 at 3.38 of copy passes its 0.90" json "$C" 'j["kernels"]["accumulate_f32_f32"]["result"] == "pass"'
check "grad_norm at 0.23 of copy fails its 0.80" json "$C" 'j["kernels"]["grad_norm"]["result"] == "FAIL"'
check "the GPT-2 runs are compared at both micro-batches" json "$C" 'sorted(j["gpt2"]) == ["2", "4"]'
check "the planner's run over its budget is caught" json "$C" \
  '[b for b, r in j["planner"].items() if not r["fits"]] == ["16GiB"]'
check "attention is summarized" json "$C" '"attention" in j'
check "the plots are written and parse" svgs_parse "$WORK/out/plots" gpt2_loss gpt2_step kernels attention planner
check "the bundle holds the results and the plots" bash -c \
  "tar tzf '$WORK/bundle.tar.gz' | grep -qx './results.json' && tar tzf '$WORK/bundle.tar.gz' | grep -qx './plots/kernels.svg'"
check "the check's console shows the comparison" grep -q "Memory-bound kernels" "$WORK/check.log"

# ---- failed runs and missing figures -------------------------------------------------------------
mkdir -p "$WORK/broken"
cp "$FIXTURES"/*.json "$WORK/broken/"
"$PY" - "$WORK/broken" <<'EOF'
import json, sys
d = sys.argv[1]
g = json.load(open(f"{d}/gpt2.json"))
g["runs"][1] = {"batch": g["runs"][1]["batch"], "error": "[allocator] out of memory <&\">"}
g["runs"][0]["losses"][1] = None  # a NaN loss is written as null
json.dump(g, open(f"{d}/gpt2.json", "w"))
k = json.load(open(f"{d}/kernels.json"))
k["kernels"] = [x for x in k["kernels"] if x["name"] != "adamw"]
k["errors"] = [{"name": "adamw", "error": "[cuda] an illegal memory access"}]
json.dump(k, open(f"{d}/kernels.json", "w"))
EOF
rm "$WORK/broken/torch_attention.json"
"$PY" "$ROOT/benchmarks/compare.py" "$WORK/broken" --json "$WORK/broken/compare.json" \
  --plots "$WORK/broken/plots" >"$WORK/broken.log" 2>&1
rc=$?
check "compare.py fails (not crashes) on a failed run (got $rc)" test "$rc" -eq 1
check "no traceback" bash -c "! grep -q Traceback '$WORK/broken.log'"
check "the failed kernel counts as failed" json "$WORK/broken/compare.json" 'j["kernels"]["adamw"]["result"] == "failed"'
check "the plots are still written" svgs_parse "$WORK/broken/plots" gpt2_loss gpt2_step kernels attention

# ---- compare.py's targets, on variants of the fixtures ------------------------------------------
# variant NAME 'PYTHON': a copy of the fixtures in $WORK/NAME, edited by the Python statements (d is
# the folder, J(name) reads a file, W(name, j) writes one), then compared into $WORK/NAME/compare.json
# (console in $WORK/NAME.log, exit status in $WORK/NAME.rc).
variant() {
  local d="$WORK/$1"
  mkdir -p "$d"
  cp "$FIXTURES"/*.json "$d/"
  "$PY" - "$d" "$2" <<'EOF'
import json, os, sys
d = sys.argv[1]
J = lambda n: json.load(open(os.path.join(d, n)))
W = lambda n, j: json.dump(j, open(os.path.join(d, n), "w"))
rm = lambda *names: [os.remove(os.path.join(d, n)) for n in names]
exec(sys.argv[2])
EOF
  "$PY" "$ROOT/benchmarks/compare.py" "$d" --json "$d/compare.json" --plots "$d/plots" >"$WORK/$1.log" 2>&1
  echo $? >"$WORK/$1.rc"
}
rc_of() { cat "$WORK/$1.rc"; }
no_traceback() { ! grep -q Traceback "$WORK/$1.log"; }
# Ours faster than PyTorch's and no bigger (PyTorch's step 1.5x, its peak 1.5x ours); the planner's
# runs within budget and 5% of their predictions; only the kernels that meet their targets, AdamW
# faster than PyTorch's: every target met.
PASSING='
g, t = J("gpt2.json"), J("torch_gpt2.json")
for r, q in zip(g["runs"], t["runs"]):
    q["step_ms_median"] = r["step_ms_median"] * 1.5
    q["peak_allocated_bytes"] = int(r["peak_allocated_bytes"] * 1.5)
W("torch_gpt2.json", t)
k, tk = J("kernels.json"), J("torch_kernels.json")
k["kernels"] = [x for x in k["kernels"] if x.get("meets_target", True) or x["name"] == "adamw"]
for x in k["kernels"]:
    if x["name"] == "adamw": x.update(meets_target=True, ratio_to_copy=0.9, median_ms=0.5)
W("kernels.json", k)
p = J("planner.json")
p["runs"] = [r for r in p["runs"] if r["budget"] != "16GiB"]
W("planner.json", p)
'
variant passing "$PASSING"
check "every target met: compare.py passes (got $(rc_of passing))" test "$(rc_of passing)" -eq 0
check "every target met: it says so" grep -q "all targets and checks pass" "$WORK/passing.log"
check "GPT-2 no slower and no bigger than PyTorch passes" json "$WORK/passing/compare.json" \
  'all(j["gpt2"][b]["result"] == "pass (not checked: losses)" or j["gpt2"][b]["result"] == "pass" for b in ("2", "4"))'

# GPT-2: ours 3x slower than PyTorch and 1.5x its peak, everything else met.
variant gpt2_slower "$PASSING"'
for r, q in zip(g["runs"], t["runs"]):
    q["step_ms_median"] = r["step_ms_median"] / 3
    q["peak_allocated_bytes"] = int(r["peak_allocated_bytes"] / 1.5)
W("torch_gpt2.json", t)
'
check "GPT-2 slower and bigger than PyTorch fails (got $(rc_of gpt2_slower))" test "$(rc_of gpt2_slower)" -eq 1
check "the GPT-2 rows say why" json "$WORK/gpt2_slower/compare.json" \
  'all(j["gpt2"][b]["result"] == "FAIL (slower than PyTorch, more memory than PyTorch)" for b in ("2", "4"))'
# GPT-2: the first losses agree, the later ones drift apart by more than bf16 explains.
variant gpt2_losses "$PASSING"'
for q in t["runs"]:
    q["losses"] = [x + (0.2 if i >= 3 else 0.0) for i, x in enumerate(q["losses"])]
W("torch_gpt2.json", t)
'
check "GPT-2 losses apart by 0.2 after the first steps fail (got $(rc_of gpt2_losses))" test "$(rc_of gpt2_losses)" -eq 1
check "the GPT-2 rows say the losses differ" json "$WORK/gpt2_losses/compare.json" \
  'all("losses differ by more than 0.05" in j["gpt2"][b]["result"] for b in ("2", "4"))'
variant gpt2_close "$PASSING"'
for q in t["runs"]:
    q["losses"] = [x + (0.03 if i >= 3 else 0.0) for i, x in enumerate(q["losses"])]
W("torch_gpt2.json", t)
'
check "GPT-2 losses within 0.05 pass (got $(rc_of gpt2_close))" test "$(rc_of gpt2_close)" -eq 0
# GPT-2 stopped at its time box after its first micro-batch: the second has no result.
variant gpt2_cut "$PASSING"'
g["runs"] = g["runs"][:1]
W("gpt2.json", g)
'
check "a micro-batch without a result fails (got $(rc_of gpt2_cut))" json "$WORK/gpt2_cut/compare.json" \
  'j["gpt2"]["4"]["result"] == "failed" and not j["pass"]'
# bench_kernels_cuda killed after its first kernels: "complete": false, the rest never measured.
variant kernels_cut "$PASSING"'
k["kernels"] = k["kernels"][:2]; k["complete"] = False
W("kernels.json", k)
'
check "a kernels.json cut short fails (got $(rc_of kernels_cut))" json "$WORK/kernels_cut/compare.json" \
  'j["kernels"]["(run cut short)"]["result"] == "failed" and not j["pass"]'
# AdamW at 0.90 of copy (its 0.85 met) but twice PyTorch's fused AdamW time.
variant adamw_slower "$PASSING"'
for x in tk["kernels"]:
    if x["name"] == "adamw": x["median_ms"] = 0.25
W("torch_kernels.json", tk)
'
check "AdamW slower than PyTorch's fails (got $(rc_of adamw_slower))" test "$(rc_of adamw_slower)" -eq 1
check "AdamW's row says FAIL" json "$WORK/adamw_slower/compare.json" \
  'j["kernels"]["adamw"]["result"] == "FAIL" and j["kernels"]["adamw"]["no_slower_than_torch"] is False'
# The planner within its budget, its prediction 20% under the measured peak.
variant planner_off "$PASSING"'
p["runs"] = [dict(budget="8GiB", budget_bytes=8 << 30, status="ok", micro_batch_size=4, accumulation_steps=4,
                  predicted_peak=5.0 * 2**30, measured_peak=6.0 * 2**30)]
W("planner.json", p)
'
check "a planner prediction 20% off fails (got $(rc_of planner_off))" test "$(rc_of planner_off)" -eq 1
check "the planner's row says so" json "$WORK/planner_off/compare.json" \
  'j["planner"]["8GiB"]["fits"] and j["planner"]["8GiB"]["predicted_within_tolerance"] is False'

# On the CPU (as the fixtures' runs were), PyTorch has no allocator peak: where both sides recorded
# the growth of their resident memory, it is set side by side (no target) and plotted instead.
variant cpu_memory '
g, t = J("gpt2.json"), J("torch_gpt2.json")
for r, q, mine, theirs in zip(g["runs"], t["runs"], (30, 50), (40, 45)):
    r["host_rss_growth_bytes"], q["host_rss_growth_bytes"] = mine << 20, theirs << 20
W("gpt2.json", g); W("torch_gpt2.json", t)
'
check "the CPU's resident memory is set side by side" json "$WORK/cpu_memory/compare.json" \
  '[(j["gpt2"][b]["ours_host_rss_growth"], j["gpt2"][b]["torch_host_rss_growth"], j["gpt2"][b]["host_memory_ratio"]) for b in ("2", "4")] == [(30 << 20, 40 << 20, 0.75), (50 << 20, 45 << 20, 50 / 45)]'
check "it changes no verdict: peak memory stays not checked" json "$WORK/cpu_memory/compare.json" \
  'any("micro-batch 2 peak memory" in n for n in j["not_checked"])'
check "the console shows it" grep -q "resident memory's growth over the run (no target): ours 30.0 MiB, PyTorch 40.0 MiB, ratio 0.750" "$WORK/cpu_memory.log"
check "the step plot draws it in place of the allocator's peak" grep -q "growth of resident memory" "$WORK/cpu_memory/plots/gpt2_step.svg"
variant cpu_memory_ours_only '
g = J("gpt2.json")
for r in g["runs"]:
    r["host_rss_growth_bytes"] = 30 << 20
W("gpt2.json", g)
'
check "with PyTorch's figure missing, no side by side" json "$WORK/cpu_memory_ours_only/compare.json" \
  'j["gpt2"]["2"]["host_memory_ratio"] is None'
check "and the plot says PyTorch's peak is n/a" grep -q "recorded on CUDA only" "$WORK/cpu_memory_ours_only/plots/gpt2_step.svg"

# The tensor-core GPT-2 run failed at every micro-batch; the check's rerun on the f32-math attention
# measured them: both files are compared, the rerun's rows labelled as such.
variant simt "$PASSING"'
W("gpt2_simt.json", dict(g, attention="fused, f32 math (MB_ATTENTION_KERNEL=simt)"))
W("gpt2.json", dict(g, runs=[{"batch": r["batch"], "error": "[cuda] an illegal memory access"} for r in g["runs"]]))
'
check "gpt2_simt.json is compared" json "$WORK/simt/compare.json" \
  'sorted(j["gpt2_simt"]) == ["2", "4"] and all(r["result"].startswith("pass") for r in j["gpt2_simt"].values())'
check "the tensor-core run's failures still count (got $(rc_of simt))" test "$(rc_of simt)" -eq 1
check "the rerun's rows are labelled as the f32-math attention" grep -q "f32-math attention kernel (gpt2_simt.json" "$WORK/simt.log"
check "the GPT-2 plots draw the rerun" grep -q "MB_ATTENTION_KERNEL=simt" "$WORK/simt/plots/gpt2_step.svg"
variant simt_only "$PASSING"'
W("gpt2_simt.json", dict(g, attention="fused, f32 math (MB_ATTENTION_KERNEL=simt)"))
rm("gpt2.json")
'
check "gpt2_simt.json without gpt2.json is compared, and fails (got $(rc_of simt_only))" \
  json "$WORK/simt_only/compare.json" 'sorted(j["gpt2_simt"]) == ["2", "4"] and not j["pass"]'

# Files a killed stage leaves: empty, cut short; entries without their names; PyTorch's NaN.
variant unreadable "$PASSING"'
open(os.path.join(d, "gpt2.json"), "w").close()
s = open(os.path.join(d, "torch_kernels.json")).read()
open(os.path.join(d, "torch_kernels.json"), "w").write(s[:len(s) // 2])
'
check "empty and cut-short files: no traceback" no_traceback unreadable
check "they count as failed (got $(rc_of unreadable))" test "$(rc_of unreadable)" -eq 1
check "they are named as unreadable, and the other sections still run" json "$WORK/unreadable/compare.json" \
  'sorted(j["unreadable"]) == ["gpt2.json", "torch_kernels.json"] and j["kernels"] and j["planner"]'
variant nameless "$PASSING"'
g["runs"].append({"error": "killed"}); W("gpt2.json", g)
k["errors"] = [{"error": "std::bad_alloc"}]; k["kernels"].append({"median_ms": 1.0, "checked": True}); W("kernels.json", k)
for x in tk["kernels"]: x["median_ms"] = float("nan")
W("torch_kernels.json", tk)
'
check "entries without a name or batch: no traceback" no_traceback nameless
check "they count as failed (got $(rc_of nameless))" test "$(rc_of nameless)" -eq 1
check "compare.json is standard JSON (PyTorch's NaN as null)" "$PY" -c '
import json, sys
json.load(open(sys.argv[1]), parse_constant=lambda c: sys.exit(f"non-standard {c}"))' "$WORK/nameless/compare.json"

# ---- the check's bookkeeping, on stand-in programs ------------------------------------------------
# A build folder whose programs print how they were called; microbatch's "train" logs a plan and a
# step as the Trainer does (predicted FAKE_PREDICTED, measured FAKE_MEASURED bytes).
STUB="$WORK/stub/build"
mkdir -p "$STUB"
touch "$STUB/CMakeCache.txt"
for p in bench_gpt2_cuda bench_attention_cuda bench_kernels_cuda tests_core tests_train; do
  printf '#!/bin/bash\necho "%s $* MB_ATTENTION_KERNEL=${MB_ATTENTION_KERNEL:-}"\n' "$p" >"$STUB/$p"
done
cat >"$STUB/microbatch" <<'EOF'
#!/bin/bash
echo "microbatch $*"
while (($#)); do [[ $1 == --output-dir ]] && dir="$2"; shift; done
mkdir -p "$dir"
printf '{"event": "plan", "plan": {"micro_batch_size": 4, "accumulation_steps": 4, "predicted_peak": %s}}\n{"step": 1, "loss": 10.9, "measured_peak": %s}\n' \
  "${FAKE_PREDICTED:-1000}" "${FAKE_MEASURED:-990}" >>"$dir/log.jsonl"
EOF
chmod +x "$STUB"/*
stub_check() {  # NAME, then VAR=value...: the check on the stand-ins, with a GPU, into $WORK/NAME
  local name="$1"
  shift
  env PATH="$WORK/bin:$PATH" BUILD_DIR="$STUB" MB_CUDA=ON PYTHON="$PY" "$@" \
    bash "$ROOT/scripts/gpu_check.sh" "$WORK/$name" >"$WORK/$name.log" 2>&1
  echo $? >"$WORK/$name.rc"
}
stage_status() {  # NAME STAGE STATUS: the stage's status in $WORK/NAME/results.json
  json "$WORK/$1/results.json" "j['stages'].get('$2', {}).get('status') == '$3'"
}

# The tensor-core GPT-2 run hangs: its time box (90 s scaled by 0.05) ends it, the rerun on the
# f32-math attention follows (writing a run without its batch), and so does the profile.
cat >"$STUB/bench_gpt2_cuda" <<'EOF'
#!/bin/bash
echo "bench_gpt2_cuda $* MB_ATTENTION_KERNEL=${MB_ATTENTION_KERNEL:-}"
[[ "${MB_ATTENTION_KERNEL:-}" == simt ]] || exec sleep 60
while (($#)); do [[ $1 == --json ]] && json="$2"; shift; done
echo '{"runs": [{"batch": 8, "step_ms_median": 100.0}, {"error": "killed"}]}' >"$json"
EOF
stub_check hang MB_GPU_CHECK_STAGES="bench_gpt2 profile_gpt2" MB_GPU_CHECK_BOX_SCALE=0.05
check "a GPT-2 run that hangs is stopped at its scaled time box" stage_status hang bench_gpt2 timeout
check "a timed-out GPT-2 run is rerun on the f32-math attention" stage_status hang bench_gpt2_simt pass
check "results.json takes a run without its batch" json "$WORK/hang/results.json" \
  'j["stages"]["bench_gpt2_simt"]["figures"]["batch_8"] == {"step_ms_median": 100.0}'
check "the profile then runs on the f32-math attention" \
  grep -q -- "--profile.*MB_ATTENTION_KERNEL=simt" "$WORK/hang/stages/profile_gpt2.log"

# A stage that hangs late leaves the comparison its 15 s: with 30 s, bench_attention (10 s at the
# least) is not started, and the comparison runs.
printf '#!/bin/bash\nexec sleep 60\n' >"$STUB/bench_attention_cuda"
mkdir -p "$WORK/keep15"
cp "$FIXTURES"/*.json "$WORK/keep15/"
stub_check keep15 MB_GPU_CHECK_STAGES="bench_attention compare" MB_GPU_CHECK_SECONDS=30
check "the GPU stages keep 15 s for the comparison" stage_status keep15 bench_attention skip
check "so the comparison runs" stage_status keep15 compare fail
# memcheck keeps 105 s for the planner and the comparison: with 130 s it is not started (30 s at the
# least), and both run (the planner with its 90 s).
mkdir -p "$WORK/keep105/bin"
printf '#!/bin/bash\nexec sleep 120\n' >"$WORK/keep105/bin/compute-sanitizer"
chmod +x "$WORK/keep105/bin/compute-sanitizer"
stub_check keep105 PATH="$WORK/keep105/bin:$WORK/bin:$PATH" MB_GPU_CHECK_STAGES="sanitizer planner compare" \
  MB_GPU_CHECK_SECONDS=130
check "memcheck keeps the planner's and the comparison's 105 s" stage_status keep105 sanitizer skip
check "so the planner runs" stage_status keep105 planner pass
check "and the comparison" json "$WORK/keep105/results.json" 'j["stages"]["compare"]["status"] in ("pass", "fail")'

# racecheck and synccheck: each tool's summary is read into the stage's figures, and a hazard
# (the tool's exit status 1) fails the stage.
mkdir -p "$WORK/races/bin"
cat >"$WORK/races/bin/compute-sanitizer" <<'EOF'
#!/bin/bash
echo "sanitizer $*" >>"$(dirname "$0")/calls"
case "$2" in
  racecheck) echo "========= RACECHECK SUMMARY: ${RACES:-0} hazards displayed (${RACES:-0} errors, 1 warning)"
             ((${RACES:-0} == 0)) || exit 1 ;;
  synccheck) echo "========= ERROR SUMMARY: 0 errors" ;;
  *) exit 3 ;;
esac
EOF
chmod +x "$WORK/races/bin/compute-sanitizer"
stub_check races PATH="$WORK/races/bin:$WORK/bin:$PATH" MB_GPU_CHECK_STAGES="racecheck"
check "racecheck and synccheck pass without hazards" stage_status races racecheck pass
check "their summaries are the stage's figures" json "$WORK/races/results.json" \
  'j["stages"]["racecheck"]["figures"] == {"racecheck": {"runs": 1, "errors": 0, "warnings": 1}, "synccheck": {"runs": 1, "errors": 0}}'
check "both tools ran the bf16 GPT's step" bash -c \
  "grep -c -- '--bf16 .*--max-steps 1' '$WORK/races/bin/calls' | grep -qx 2 && grep -q -- '--tool synccheck' '$WORK/races/bin/calls'"
rm -f "$WORK/races/bin/calls"
stub_check races2 PATH="$WORK/races/bin:$WORK/bin:$PATH" MB_GPU_CHECK_STAGES="racecheck" RACES=2
check "a hazard fails the stage" stage_status races2 racecheck fail
check "and is counted" json "$WORK/races2/results.json" \
  'j["stages"]["racecheck"]["figures"]["racecheck"]["errors"] == 2'
# Without the time for it, the optional stage is skipped and the check is still complete.
stub_check racetime PATH="$WORK/races/bin:$WORK/bin:$PATH" MB_GPU_CHECK_STAGES="racecheck" MB_GPU_CHECK_SECONDS=30
check "racecheck without the time for it is skipped, saying so" json "$WORK/racetime/results.json" \
  'j["stages"]["racecheck"]["status"] == "skip" and "no time left" in j["stages"]["racecheck"]["message"]'
check "and the check exits 0 (got $(cat "$WORK/racetime.rc"))" test "$(cat "$WORK/racetime.rc")" -eq 0

# The planner: a run within its budget whose prediction is 20% off fails the stage.
MB_PLANNER_SECONDS=20 FAKE_PREDICTED=1000 FAKE_MEASURED=1250 PYTHON="$PY" \
  bash "$ROOT/benchmarks/planner_cuda.sh" "$STUB" "$WORK/planner_off_run" 8GiB >"$WORK/planner_off_run.log" 2>&1
rc=$?
check "planner_cuda.sh fails a prediction 20% off (got $rc)" test "$rc" -eq 1
MB_PLANNER_SECONDS=20 FAKE_PREDICTED=1000 FAKE_MEASURED=990 PYTHON="$PY" \
  bash "$ROOT/benchmarks/planner_cuda.sh" "$STUB" "$WORK/planner_ok_run" 8GiB >"$WORK/planner_ok_run.log" 2>&1
rc=$?
check "planner_cuda.sh passes a prediction 1% off (got $rc)" test "$rc" -eq 0

# A GPU, and a PYTHON that cannot import torch (a venv not named): the PyTorch stages fail, saying
# what to do.
mkdir -p "$WORK/notorch/mods"
echo 'raise ImportError("no torch here")' >"$WORK/notorch/mods/torch.py"
printf '#!/bin/sh\nPYTHONPATH="%s" exec "%s" "$@"\n' "$WORK/notorch/mods" "$PY" >"$WORK/notorch/python"
chmod +x "$WORK/notorch/python"
stub_check torchless MB_GPU_CHECK_STAGES="torch_attention torch_kernels" PYTHON="$WORK/notorch/python"
check "without torch the check fails (got $(cat "$WORK/torchless.rc"))" test "$(cat "$WORK/torchless.rc")" -eq 1
check "the PyTorch stages fail and say to set PYTHON" json "$WORK/torchless/results.json" \
  'all(s["status"] == "fail" and "set PYTHON" in s["message"] for s in j["stages"].values()) and len(j["stages"]) == 2'

# Settings it cannot use stop it at once, before it deletes any earlier result.
mkdir -p "$WORK/settings"
echo '{}' >"$WORK/settings/kernels.json"
for setting in MB_GPU_CHECK_BOX_SCALE=abc MB_GPU_CHECK_BOX_SCALE=0 "MB_GPU_CHECK_STAGES=bench_kernel compare"; do
  stub_check settings "$setting"
  check "$setting: exit status 2 (got $(cat "$WORK/settings.rc"))" test "$(cat "$WORK/settings.rc")" -eq 2
  check "$setting: named in the message" grep -q "${setting%%=*}" "$WORK/settings.log"
done
check "and nothing was deleted" test -f "$WORK/settings/kernels.json"

# A bundle inside the output folder leaves itself out.
mkdir -p "$WORK/inside"
cp "$FIXTURES"/*.json "$WORK/inside/"
stub_check inside MB_GPU_CHECK_STAGES=compare MB_GPU_CHECK_BUNDLE="$WORK/inside/gpu.tar.gz"
check "a bundle inside OUTDIR holds the results" bash -c "tar tzf '$WORK/inside/gpu.tar.gz' | grep -qx './results.json'"
check "and not itself" bash -c "! tar tzf '$WORK/inside/gpu.tar.gz' | grep -q 'gpu.tar.gz'"

# ---- prebuilt programs, on stand-ins ---------------------------------------------------------------
# Archives as scripts/gpu_prebuild.sh packs them (build/prebuilt.manifest and the six programs, here
# stand-ins), each with a root folder of its own; nvcc 13.0 and cuDNN 9.19.0 are stand-ins too. Only
# the build stage is asked for, so an archive that does not fit leaves nothing to build with.
PRE="$WORK/pre"
source "$ROOT/scripts/gpu_build_settings.sh"
mkdir -p "$PRE/pack/build" "$PRE/cuda/bin" "$PRE/cuda/include"
printf '#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.48"\n' >"$PRE/cuda/bin/nvcc"
printf '#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 19\n#define CUDNN_PATCHLEVEL 0\n' \
  >"$PRE/cuda/include/cudnn_version.h"
for p in microbatch bench_gpt2_cuda bench_attention_cuda bench_kernels_cuda tests_train; do
  printf '#!/bin/sh\necho "prebuilt %s"\n' "$p" >"$PRE/pack/build/$p"
done
cat >"$PRE/pack/build/tests_core" <<'EOF'
#!/bin/sh
[ "$1" = --count ] && exit 0
summary() { echo "[doctest] test cases:   2 |   $1 passed | $((2 - $1)) failed | 329 skipped"; }
# As doctest reports them: a failed check, a library's status, a crash (doctest still prints its
# summary), a kill without a word.
case "${PRE_SMOKE:-}" in
  values) echo "ERROR: CHECK( close(y, ref) ) is NOT correct!"; summary 1; exit 1 ;;
  library) echo "[cudnn] cudnnCreate(&h) failed at conv.cu:40: CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH"
           summary 1; exit 1 ;;
  crash) echo "TEST CASE:  cuda conv2d and max_pool2d backward are deterministic"
         echo "CRASHED: SIGSEGV - Segmentation violation signal"; summary 1; exit 139 ;;
  killed) summary 1; exit 137 ;;
esac
summary 2
EOF
chmod +x "$PRE/cuda/bin/nvcc" "$PRE/pack/build"/*
pack() {  # NAME NVCC CUDNN [SED]: $PRE/NAME.tar.xz of $PACK (default $PRE/pack), the manifest's
  # source lines edited by SED
  local from="${PACK:-$PRE/pack}"
  {
    printf 'root %s\nsettings %s\nnvcc %s\ncudnn %s\nbuilt 2026-01-01T00:00:00Z on packer\n' \
      "$PRE/root-$1" "${PRE_SETTINGS:-$(gpu_build_settings_line)}" "$2" "$3"
    (cd "$ROOT" && sha256sum CMakeLists.txt core/tensor.h kernels/cuda/gemm.cu) | sed "s/^/source /; ${4:-}"
  } >"$from/build/prebuilt.manifest"
  tar -C "$from" -cJf "$PRE/$1.tar.xz" build
}
pre_check() {  # NAME, then VAR=value...: the check asked for its build stage, with NAME's archive
  stub_check "$1" PATH="$PRE/cuda/bin:$WORK/bin:$PATH" BUILD_DIR="$WORK/$1-build" \
    MB_GPU_CHECK_STAGES=build MB_GPU_CHECK_PREBUILT="$PRE/$1.tar.xz" "${@:2}"
}
stage_message() {  # NAME STAGE TEXT: the stage's message in $WORK/NAME/results.json holds TEXT
  json "$WORK/$1/results.json" "'$3' in j['stages'].get('$2', {}).get('message', '')"
}
pack fits 13.0 9.19.0
pre_check fits MB_GPU_CHECK_STAGES="build bench_attention"
check "an archive that fits is used" stage_status fits prebuilt pass
check "and the build is skipped for it" stage_message fits build "the prebuilt programs serve"
check "the stages after it run its programs" grep -q "prebuilt bench_attention_cuda" \
  "$WORK/fits/stages/bench_attention.log"
check "its programs lie in its root" test -x "$PRE/root-fits/build/tests_core"
check "beside a link to this checkout" test "$(readlink "$PRE/root-fits/src")" = "$ROOT"
check "the check passes (got $(cat "$WORK/fits.rc"))" test "$(cat "$WORK/fits.rc")" -eq 0
pack changed 13.0 9.19.0 "/core\/tensor.h\$/s/source [0-9a-f]*/source $(printf '0%.0s' {1..64})/"
pre_check changed
check "an archive from other sources is not used" stage_status changed prebuilt skip
check "and the file that changed is named" stage_message changed prebuilt "changed here: core/tensor.h"
check "so the build runs as before (here: not configured)" stage_message changed build "not configured"
pack newer_nvcc 13.1 9.19.0
pre_check newer_nvcc
check "an archive built with a newer nvcc is not used" stage_message newer_nvcc prebuilt \
  "built with nvcc 13.1, this machine has 13.0"
pack newer_cudnn 13.0 9.20.1
pre_check newer_cudnn
check "an archive built with a newer cuDNN is not used" stage_message newer_cudnn prebuilt \
  "built with cuDNN 9.20.1, this machine has 9.19.0"
pack library 13.0 9.19.0
pre_check library PRE_SMOKE=library
check "an archive whose libraries fail here is not used" stage_message library prebuilt \
  "its CUDA cases cannot run here: [cudnn] cudnnCreate(&h) failed at"
pack crash 13.0 9.19.0
pre_check crash PRE_SMOKE=crash
check "nor one whose smoke run crashes" stage_message crash prebuilt \
  "its CUDA cases cannot run here: CRASHED: SIGSEGV"
pack killed 13.0 9.19.0
pre_check killed PRE_SMOKE=killed
check "nor one whose smoke run is killed" stage_message killed prebuilt \
  "its CUDA cases cannot run here: exit status 137"
PRE_SETTINGS="-DCMAKE_BUILD_TYPE=Debug; targets tests_core" pack settings 13.0 9.19.0
pre_check settings
check "nor one built with other settings" stage_message settings prebuilt \
  "built with other settings (-DCMAKE_BUILD_TYPE=Debug; targets tests_core)"
# A program that finds its library only in the toolkit's lib64: the check puts that folder on
# LD_LIBRARY_PATH, and the stages after it run the program.
if command -v gcc >/dev/null 2>&1; then
  mkdir -p "$PRE/cuda/lib64" "$PRE/pack_lib"
  cp -r "$PRE/pack/build" "$PRE/pack_lib/"
  echo 'int mb_fake(void) { return 0; }' >"$PRE/fake.c"
  echo 'int mb_fake(void); int main(void) { return mb_fake(); }' >"$PRE/main.c"
  gcc -shared -fPIC -o "$PRE/cuda/lib64/libmbfake.so" "$PRE/fake.c" &&
    gcc -o "$PRE/pack_lib/build/bench_attention_cuda" "$PRE/main.c" -L"$PRE/cuda/lib64" -lmbfake
  PACK="$PRE/pack_lib" pack lib 13.0 9.19.0
  pre_check lib MB_GPU_CHECK_STAGES="build bench_attention"
  check "a program whose library lies in the toolkit's lib64 is used" stage_status lib prebuilt pass
  check "the check says where from" grep -q "the CUDA libraries from $PRE/cuda" "$WORK/lib/gpu_check.log"
  check "and the program runs in the later stages" stage_status lib bench_attention pass
else
  echo "skipped: a prebuilt program whose library lies in lib64 (no gcc here)"
fi
# Without the xz program, the check unpacks with Python's tarfile: the same files, modes kept.
mkdir -p "$PRE/untar"
"$PY" "$ROOT/scripts/untar_xz.py" "$PRE/fits.tar.xz" "$PRE/untar" build/prebuilt.manifest
check "untar_xz.py takes one member" bash -c "[[ -f '$PRE/untar/build/prebuilt.manifest' && ! -e '$PRE/untar/build/tests_core' ]]"
"$PY" "$ROOT/scripts/untar_xz.py" "$PRE/fits.tar.xz" "$PRE/untar"
check "and the whole archive, execute bits kept" test -x "$PRE/untar/build/tests_core"
pack values 13.0 9.19.0
pre_check values PRE_SMOKE=values
check "an archive whose smoke cases fail a check of values is used (the bug is the code's)" \
  stage_status values prebuilt pass
check "and says so" stage_message values prebuilt "failed a check of values"

# cpu_vs_torch.sh takes its folders relative to where it is started (it stops at the torch check).
mkdir -p "$WORK/cwd/b"
cp "$STUB/bench_gpt2_cuda" "$WORK/cwd/b/"
cp "$STUB/bench_gpt2_cuda" "$WORK/cwd/b/bench_image_cuda"  # the script checks that both are there
OUT_NAME="cpu_vs_torch_out.$$"
(cd "$WORK/cwd" && MB_TORCH_PYTHON="$WORK/notorch/python" bash "$ROOT/benchmarks/cpu_vs_torch.sh" b "$OUT_NAME") \
  >"$WORK/cwd.log" 2>&1
check "cpu_vs_torch.sh finds BUILD_DIR relative to where it was started" grep -q "cannot import torch" "$WORK/cwd.log"
check "and makes OUTDIR there, not in the repository" bash -c "[[ -d '$WORK/cwd/$OUT_NAME' && ! -e '$ROOT/$OUT_NAME' ]]"
[[ -d "$ROOT/$OUT_NAME" ]] && rmdir "$ROOT/$OUT_NAME"

# ---- PyTorch's benchmarks: a run that fails loses nothing else (with a Python that has torch) ------
TORCH_PY=""
for py in "$PY" /usr/bin/python3; do
  "$py" -c 'import torch' 2>/dev/null && TORCH_PY="$py" && break
done
if [[ -z "$TORCH_PY" ]]; then
  echo "skipped: PyTorch's benchmarks (no Python here can import torch)"
else
  # A tiny GPT's initial weights, and tokens for micro-batches 2 and 4 only: the run at 3 fails (no
  # tokens), as one out of memory would.
  mkdir -p "$WORK/torch"
  "$TORCH_PY" - "$WORK/torch" "$ROOT/benchmarks" <<'EOF'
import json, struct, sys
import torch
sys.path.insert(0, sys.argv[2])
from torch_gpt2 import GPT
d = sys.argv[1]
cfg = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)

def save(path, tensors, meta):
    header, blobs, at = {"__metadata__": meta}, [], 0
    for name, t in tensors.items():
        b = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))

torch.manual_seed(0)
save(f"{d}/init.safetensors", {k: v.detach() for k, v in GPT(**cfg).state_dict().items()},
     {k: str(v) for k, v in cfg.items()})
save(f"{d}/tokens.safetensors", {f"tokens_b{b}": torch.randint(0, 64, (b, 9)) for b in (2, 4)}, {})
EOF
  "$TORCH_PY" "$ROOT/benchmarks/torch_gpt2.py" --device cpu --precision f32 --weights "$WORK/torch/init.safetensors" \
    --tokens "$WORK/torch/tokens.safetensors" --batch 2,3,4 --steps 2 --warmup 1 --json "$WORK/torch/gpt2.json" \
    >"$WORK/torch_gpt2.log" 2>&1
  rc=$?
  check "torch_gpt2.py: a failed batch size fails the run (got $rc)" test "$rc" -eq 1
  check "torch_gpt2.py: it is recorded, and the others measured" json "$WORK/torch/gpt2.json" \
    '[sorted(r) == ["batch", "error"] for r in j["runs"]] == [False, True, False] and j["runs"][2]["step_ms_median"] > 0'
  check "torch_gpt2.py: on the CPU a measured run records its resident memory's growth" json "$WORK/torch/gpt2.json" \
    'all(r["host_rss_growth_bytes"] == r["host_peak_rss_bytes"] - r["host_rss_before_bytes"] > 0 for r in j["runs"] if "error" not in r)'
  # The cross-entropy throws, as under a device fault: the kernels before it are kept.
  "$TORCH_PY" - "$ROOT/benchmarks" "$WORK/torch/kernels.json" >"$WORK/torch_kernels.log" 2>&1 <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["torch_kernels.py", "--device", "cpu", "--reps", "2", "--warmup", "1", "--json", sys.argv[2]]
import torch_kernels

def fault(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

torch_kernels.F.cross_entropy = fault
sys.exit(torch_kernels.main())
EOF
  rc=$?
  check "torch_kernels.py: a failed kernel fails the run (got $rc)" test "$rc" -eq 1
  check "torch_kernels.py: it is recorded, and the others measured" json "$WORK/torch/kernels.json" \
    '[e["name"] for e in j["errors"]] == ["cross_entropy"] and [k["name"] for k in j["kernels"]] == ["copy", "accumulate_f32_f32", "accumulate_f32_bf16", "grad_norm", "adamw"]'
fi

# ---- no GPU: the GPU stages say why they did not run ---------------------------------------------
mkdir -p "$WORK/nogpu/bin"
printf '#!/bin/sh\nexit 9\n' >"$WORK/nogpu/bin/nvidia-smi"  # nvidia-smi there, no device
chmod +x "$WORK/nogpu/bin/nvidia-smi"
PATH="$WORK/nogpu/bin:$PATH" BUILD_DIR="$WORK/build" PYTHON="$PY" \
  MB_GPU_CHECK_STAGES="bench_gpt2 compare" bash "$ROOT/scripts/gpu_check.sh" "$WORK/nogpu/out" >/dev/null 2>&1
check "without a GPU the GPU stages are skipped, saying so" json "$WORK/nogpu/out/results.json" \
  'all(s["status"] == "skip" and s["message"] == "no GPU on this machine" for s in j["stages"].values()) and len(j["stages"]) == 2'

if ((FAILURES > 0)); then
  echo "gpu_check_tools: $FAILURES check(s) failed; the check's log:"
  sed 's/^/    /' "$WORK/check.log" | tail -n 40
  exit 1
fi
echo "gpu_check_tools: all checks hold"
