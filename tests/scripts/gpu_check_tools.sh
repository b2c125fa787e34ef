#!/usr/bin/env bash
# The GPU check's plumbing, without a GPU: scripts/gpu_check.sh's stage bookkeeping, results.json,
# the bundle, and benchmarks/compare.py's tables, verdicts and plots, on benchmark results kept in
# tests/fixtures/gpu_check/ (ours and PyTorch's GPT-2 and kernel results from the programs' CPU
# modes, an attention pair from an H200 run, and a planner result with one run over its budget).
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
  python3 - "$1" "$2" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
sys.exit(0 if eval(sys.argv[2], {"j": j}) else 1)
EOF
}
svgs_parse() {  # folder, names...: each NAME.svg there is well-formed XML with an <svg> root
  local dir="$1"
  shift
  python3 - "$dir" "$@" <<'EOF'
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
PATH="$WORK/bin:$PATH" BUILD_DIR="$WORK/build" MB_CUDA=ON PYTHON=python3 MB_GPU_CHECK_STAGES=compare \
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
python3 - "$WORK/broken" <<'EOF'
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
python3 "$ROOT/benchmarks/compare.py" "$WORK/broken" --json "$WORK/broken/compare.json" \
  --plots "$WORK/broken/plots" >"$WORK/broken.log" 2>&1
rc=$?
check "compare.py fails (not crashes) on a failed run (got $rc)" test "$rc" -eq 1
check "no traceback" bash -c "! grep -q Traceback '$WORK/broken.log'"
check "the failed kernel counts as failed" json "$WORK/broken/compare.json" 'j["kernels"]["adamw"]["result"] == "failed"'
check "the plots are still written" svgs_parse "$WORK/broken/plots" gpt2_loss gpt2_step kernels attention

# ---- no GPU: the GPU stages say why they did not run ---------------------------------------------
mkdir -p "$WORK/nogpu/bin"
printf '#!/bin/sh\nexit 9\n' >"$WORK/nogpu/bin/nvidia-smi"  # nvidia-smi there, no device
chmod +x "$WORK/nogpu/bin/nvidia-smi"
PATH="$WORK/nogpu/bin:$PATH" BUILD_DIR="$WORK/build" PYTHON=python3 \
  MB_GPU_CHECK_STAGES="bench_gpt2 compare" bash "$ROOT/scripts/gpu_check.sh" "$WORK/nogpu/out" >/dev/null 2>&1
check "without a GPU the GPU stages are skipped, saying so" json "$WORK/nogpu/out/results.json" \
  'all(s["status"] == "skip" and s["message"] == "no GPU on this machine" for s in j["stages"].values()) and len(j["stages"]) == 2'

if ((FAILURES > 0)); then
  echo "gpu_check_tools: $FAILURES check(s) failed; the check's log:"
  sed 's/^/    /' "$WORK/check.log" | tail -n 40
  exit 1
fi
echo "gpu_check_tools: all checks hold"
