#!/usr/bin/env bash
# The GPU check, for a bare machine with an NVIDIA GPU (nvcc, CMake, the CUDA libraries and
# PyTorch, but no Debian packages and no network). From the repository root:
#
#   scripts/bundle_deps.sh deps          beforehand, where the Debian -dev packages are installed
#   scripts/gpu_check.sh OUTDIR
#
# Stages, in order (each one time-boxed with `timeout`); the figures that matter most come first,
# so that a stage that hangs costs the less important ones:
#   prebuilt       with MB_GPU_CHECK_PREBUILT, the programs scripts/gpu_prebuild.sh built elsewhere,
#                  in place of configure and build when they fit this checkout and machine (else it
#                  is recorded as skipped, saying why, and the two stages run)
#   configure      a build folder with -DMB_DEPS_DIR=deps -DMB_CUDA=ON -DMB_BUILD_BENCHMARKS=ON
#                  -DMB_NATIVE=OFF (Ninja when it is installed); cuDNN from the CUDA folder, else
#                  from the pip package next to PyTorch (CUDNN_ROOT), else none (the im2col
#                  convolutions serve)
#   build          the library, the command, the benchmarks and both test suites, on every core,
#                  keeping going past a target that fails: each later stage needs only its own
#                  program, built in this run
#   bench_gpt2     benchmarks/gpt2_cuda.cpp             -> OUTDIR/gpt2.json; when it fails or times
#                  out with no run measured, once more as bench_gpt2_simt with MB_ATTENTION_KERNEL=simt
#                  -> OUTDIR/gpt2_simt.json (and the profile then runs with it too)
#   profile_gpt2   benchmarks/gpt2_cuda.cpp --profile: time per op of GPT-2 small steps (B = 8)
#                                                       -> OUTDIR/gpt2_profile.txt (the table), .json
#   bench_attention benchmarks/attention_cuda.cpp: both kernels, and how far apart -> OUTDIR/attention.json
#   bench_kernels  benchmarks/kernels_cuda.cpp          -> OUTDIR/kernels.json
#   torch_gpt2     benchmarks/torch_gpt2.py             -> OUTDIR/torch_gpt2.json
#   torch_attention benchmarks/torch_attention.py       -> OUTDIR/torch_attention.json
#   torch_kernels  benchmarks/torch_kernels.py          -> OUTDIR/torch_kernels.json
#   tests_core     the doctest suites (with a GPU their CUDA cases only, --test-suite=cuda, at
#                  least one of which must pass; doctest's counts are recorded)
#   tests_train
#   sanitizer      compute-sanitizer memcheck on short training runs of tiny GPTs on cuda:0 (f32, bf16)
#   planner        benchmarks/planner_cuda.sh           -> OUTDIR/planner.json
#   racecheck      compute-sanitizer racecheck and synccheck on one training step of the bf16 tiny
#                  GPT (the tensor-core attention's shared tiles and barriers, the row kernels'
#                  block reductions); optional: run only when the time is there after the planner,
#                  else skipped, saying so, without counting as not started
#   compare        benchmarks/compare.py: the table of ratios and the targets -> OUTDIR/compare.json,
#                  and its plots -> OUTDIR/plots/*.svg
#
# It writes OUTDIR/gpu_check.log (everything each stage printed, under a header per stage) and
# OUTDIR/results.json (stage -> status pass | fail | timeout | skip, seconds, figures, message),
# rewritten after every stage (a stage in flight shows as "running"). A failing stage does not
# stop the others. The script stops starting
# stages when its deadline is near, so that it ends within MB_GPU_CHECK_SECONDS (default 480), and
# cuts time boxes short so that the comparison keeps 15 s (the planner and the comparison 105 s while
# the tests and memcheck run). On a machine without a GPU the GPU stages are skipped, saying so.
# Exit status: 1 when a stage failed or timed out; 2 when none did but some were not started for
# lack of time (racecheck, the optional one, aside), or at once for a setting below that it cannot
# use; 0 otherwise.
#
# Environment:
#   MB_GPU_CHECK_SECONDS  the deadline in seconds (default 480)
#   MB_GPU_CHECK_BOX_SCALE  multiplies every stage's time box: a positive number (default 1; a slow
#                         machine, say 6; 0.5 halves them), rounded up to whole seconds
#   MB_GPU_CHECK_STAGES   the stages to run, space-separated, among those above (default: all)
#   BUILD_DIR             the build folder (default build-gpu). It is kept, so a second run only
#                         rebuilds what changed: when the first run's build took most of the time,
#                         run the check again. MB_GPU_CHECK_FRESH=1 deletes it first.
#   MB_GPU_CHECK_PREBUILT an archive from scripts/gpu_prebuild.sh (built where the Debian packages
#                         are, from the same sources): its programs serve if they fit, and the
#                         GPU's minutes go to the benchmarks and tests instead of the compiler
#   MB_DEPS_DIR           the dependency bundle (default deps)
#   MB_CUDA               ON (default); OFF builds without the CUDA backend (to try this script on
#                         a machine without nvcc: the GPU stages are then skipped)
#   PYTHON                the Python that has PyTorch (default python3; a venv's, say venv/bin/python).
#                         Where there is a GPU and it cannot import torch, the PyTorch stages fail.
#   MB_GPU_CHECK_BUNDLE   a .tar.gz path: after every stage, OUTDIR (less any .safetensors, and less
#                         the bundle itself when it lies in OUTDIR) packed into it, so that one file
#                         carries the whole result even when the run is cut short
# OUTDIR holds only small files: the 500 MB of GPT-2 weights the benchmarks exchange stay in the
# build folder.
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Paths given relative to the folder the script is started from.
mkdir -p "$1" "${BUILD_DIR:-$ROOT/build-gpu}"
OUT="$(cd "$1" && pwd)"
BUILD_DIR="$(cd "${BUILD_DIR:-$ROOT/build-gpu}" && pwd)"
DEPS="$(realpath -m "${MB_DEPS_DIR:-$ROOT/deps}")"
cd "$ROOT" || exit 2
# shellcheck source=scripts/gpu_build_settings.sh
source "$ROOT/scripts/gpu_build_settings.sh"
CUDA="${MB_CUDA:-ON}"
PYTHON="${PYTHON:-python3}"
SECONDS_TOTAL="${MB_GPU_CHECK_SECONDS:-480}"
BOX_SCALE="${MB_GPU_CHECK_BOX_SCALE:-1}"
ALL_STAGES="configure build bench_gpt2 profile_gpt2 bench_attention bench_kernels torch_gpt2 torch_attention torch_kernels tests_core tests_train sanitizer planner racecheck compare"
STAGES="${MB_GPU_CHECK_STAGES:-$ALL_STAGES}"
BUNDLE="${MB_GPU_CHECK_BUNDLE:-}"
[[ -n "$BUNDLE" ]] && BUNDLE="$(realpath -m "$BUNDLE")"
# A typo here would scale every time box to nothing or run no stage at all: refused before anything
# runs.
if ! [[ "$BOX_SCALE" =~ ^[0-9]*\.?[0-9]+$ ]] || ! awk -v s="$BOX_SCALE" 'BEGIN { exit !(s > 0) }'; then
  echo "[gpu_check] MB_GPU_CHECK_BOX_SCALE must be a positive number (it multiplies every time box), not '$BOX_SCALE'" >&2
  exit 2
fi
for stage in $STAGES; do
  if [[ " $ALL_STAGES " != *" $stage "* ]]; then
    echo "[gpu_check] MB_GPU_CHECK_STAGES names '$stage', which is no stage; the stages: $ALL_STAGES" >&2
    exit 2
  fi
done
# Output as it happens, so that a stage killed at its time box still shows how far it got.
export PYTHONUNBUFFERED=1
LINEBUF=()
command -v stdbuf >/dev/null 2>&1 && LINEBUF=(stdbuf -oL -eL)
RESERVE=10  # seconds kept for writing the results at the end
START=$(date +%s)
DEADLINE=$((START + SECONDS_TOTAL))
LOG="$OUT/gpu_check.log"
TABLE="$OUT/stages.tsv"  # name, status, seconds, message: one line per stage run
mkdir -p "$OUT/stages"
: >"$LOG"
: >"$TABLE"
# A stage's earlier outputs go when it is to run again (only then: a run of some stages compares
# against the others' results from before).
declare -A OUTPUTS=([bench_gpt2]="gpt2.json gpt2_simt.json" [profile_gpt2]="gpt2_profile.json gpt2_profile.txt"
                    [bench_attention]="attention.json" [bench_kernels]="kernels.json"
                    [torch_gpt2]="torch_gpt2.json" [torch_attention]="torch_attention.json"
                    [torch_kernels]="torch_kernels.json" [planner]="planner.json" [compare]="compare.json")
for stage in $STAGES; do
  rm -f "$OUT/stages/$stage.log"
  for f in ${OUTPUTS[$stage]:-}; do rm -f "$OUT/$f"; done
done

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
tsv_field() { printf '%s' "$1" | tr '\t\n' '  '; }
record() {  # name status seconds message
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(tsv_field "$4")" >>"$TABLE"
  write_results
}
wanted() { [[ " $STAGES " == *" $1 "* ]]; }

# ---- what this machine has ---------------------------------------------------------------------
GPU=""
if command -v nvidia-smi >/dev/null 2>&1; then
  GPU="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
fi
find_nvcc
SANITIZER="$(command -v compute-sanitizer || true)"
[[ -z "$SANITIZER" && -n "$NVCC" && -x "$(dirname "$NVCC")/compute-sanitizer" ]] && SANITIZER="$(dirname "$NVCC")/compute-sanitizer"
TORCH="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
JOBS="$(nproc)"

# results.json from the stage table and the files the stages wrote.
write_results() {
  "$PYTHON" - "$OUT" "$TABLE" "$START" "$GPU" "$NVCC_VERSION" "$TORCH" "$CUDA" "${CUDNN_NOTE:-}" <<'EOF' ||
import json, os, re, sys, time

out, table, start, gpu, nvcc, torch, cuda, cudnn = sys.argv[1:9]

def load(name):  # None for a file that is missing, unreadable or not a JSON object
    try:
        with open(os.path.join(out, name)) as f:
            j = json.load(f)
        return j if isinstance(j, dict) else None
    except (OSError, ValueError):
        return None

def dicts(xs):  # the entries of a JSON list that are objects
    return [x for x in xs if isinstance(x, dict)] if isinstance(xs, list) else []

def doctest_counts(text):
    fig = {}
    for kind in ("test cases", "assertions"):
        m = re.search(r"\[doctest\] " + kind + r":\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed(?:\s*\|\s*(\d+) skipped)?", text)
        if m:
            key = kind.replace(" ", "_")
            fig[key] = int(m.group(1))
            fig[key + "_passed"] = int(m.group(2))
            fig[key + "_failed"] = int(m.group(3))
            if m.group(4) is not None:
                fig[key + "_skipped"] = int(m.group(4))
    return fig

def figures(name):
    try:
        text = open(os.path.join(out, "stages", name + ".log"), errors="replace").read()
    except OSError:
        text = ""
    if name.startswith("tests_"):
        return doctest_counts(text)
    if name == "sanitizer":
        m = [int(x) for x in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
        return {"runs": len(m), "errors": sum(m)} if m else {}
    if name == "racecheck":
        # racecheck sums up as "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)",
        # synccheck as "ERROR SUMMARY: E errors".
        races = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
        syncs = [int(x) for x in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
        fig = {}
        if races:
            fig["racecheck"] = {"runs": len(races), "errors": sum(int(e) for e, _ in races),
                                "warnings": sum(int(w) for _, w in races)}
        if syncs:
            fig["synccheck"] = {"runs": len(syncs), "errors": sum(syncs)}
        return fig
    if name in ("bench_kernels", "torch_kernels"):
        j = load("kernels.json" if name == "bench_kernels" else "torch_kernels.json")
        if not j:
            return {}
        fig = {"copy_gb_per_s": j.get("copy_gb_per_s")}
        for k in dicts(j.get("kernels")):
            fig[str(k.get("name"))] = {key: k.get(key) for key in ("median_ms", "gb_per_s", "ratio_to_copy", "target",
                                                          "meets_target", "checked") if key in k}
        return fig
    if name in ("bench_gpt2", "bench_gpt2_simt", "torch_gpt2"):
        j = load({"bench_gpt2": "gpt2.json", "bench_gpt2_simt": "gpt2_simt.json"}.get(name, "torch_gpt2.json"))
        if not j:
            return {}
        fig = {f"batch_{r.get('batch')}": {key: r[key] for key in ("step_ms_median", "tokens_per_s",
                                                              "peak_allocated_bytes", "peak_reserved_bytes",
                                                              "error", "profile_error") if key in r}
               for r in dicts(j.get("runs"))}
        if "error" in j:
            fig["error"] = j["error"]
        return fig
    if name == "profile_gpt2":
        runs = (load("gpt2_profile.json") or {}).get("runs", [])
        p = runs[0].get("profile") if runs else None
        if not p:
            return {}
        top = [{key: r.get(key) for key in ("name", "calls", "host_ms", "device_ms")} for r in p.get("rows", [])[:15]]
        fig = {key: p.get(key) for key in ("steps", "span_ms", "host_total_ms", "device_total_ms")}
        fig["top"] = top
        return fig
    if name in ("bench_attention", "torch_attention"):
        j = load("attention.json" if name == "bench_attention" else "torch_attention.json")
        return {key: j[key] for key in ("kernel", "forward_ms", "forward_backward_ms", "forward_tflops",
                                        "forward_backward_tflops", "tensor_vs_simt", "simt", "error")
                if key in j} if j else {}
    if name == "planner":
        j = load("planner.json")
        return {str(r.get("budget")): {key: r.get(key) for key in ("status", "micro_batch_size", "accumulation_steps",
                                                         "predicted_peak", "measured_peak")}
                for r in dicts((j or {}).get("runs"))}
    if name == "compare":
        j = load("compare.json")
        return {"pass": j.get("pass")} if j else {}
    return {}

stages = {}
for line in open(table):  # the last line of a stage wins ("running", then how it ended)
    parts = line.rstrip("\n").split("\t")
    if len(parts) < 4:
        continue
    name, status, seconds, message = parts[:4]
    stages[name] = {"status": status, "seconds": float(seconds),
                    "figures": figures(name) if status in ("pass", "fail", "timeout") else {},
                    "message": message}
result = {"machine": {"gpu": gpu or None, "nvcc": nvcc or None, "torch": torch or None, "cuda_backend": cuda,
                      "cudnn": cudnn or None},
          "seconds": round(time.time() - float(start), 1), "stages": stages}
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(result, f, indent=2)
EOF
    echo "[gpu_check] could not write results.json with $PYTHON" >&2
  if [[ -n "$BUNDLE" ]]; then
    # A bundle inside OUTDIR leaves itself out: else each one would hold the one before and its own
    # partial copy.
    local self=()
    [[ "$BUNDLE" == "$OUT"/* ]] && self=(--no-wildcards --exclude="./${BUNDLE#"$OUT"/}" --exclude="./${BUNDLE#"$OUT"/}.part")
    tar -czf "$BUNDLE.part" -C "$OUT" --exclude='*.safetensors' "${self[@]}" . 2>/dev/null && mv -f "$BUNDLE.part" "$BUNDLE"
  fi
}

# Runs one stage: NAME BOX MIN COMMAND...; BOX is its time box in seconds, MIN the least time worth
# starting it with; KEEP seconds are left for the stages after it. The command sees its time box as
# MB_STAGE_SECONDS. Its output goes to OUTDIR/stages/NAME.log and gpu_check.log.
FAILED=0
UNSTARTED=0
KEEP=0
run_stage() {
  local name="$1" box min="$3"
  box=$(awk -v b="$2" -v s="$BOX_SCALE" 'BEGIN { x = b * s; x = (x == int(x)) ? x : int(x) + 1; print (x < 1 ? 1 : x) }')
  shift 3
  local left=$((DEADLINE - $(date +%s) - RESERVE - KEEP))
  if ((left < min)); then
    say "$name: not started, ${left}s left before the deadline and it needs ${min}s"
    record "$name" skip 0 "not started: ${left}s left before the deadline, it needs ${min}s"
    UNSTARTED=1
    return 1
  fi
  local limit=$((box < left ? box : left))
  say "---- $name (time box ${limit}s): $*"
  record "$name" running 0 "started $(date -u +%T), time box ${limit}s"
  local t0 t1 rc
  t0=$(date +%s.%N)
  MB_STAGE_SECONDS="$limit" timeout --kill-after=10 "$limit" "${LINEBUF[@]}" "$@" >"$OUT/stages/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  cat "$OUT/stages/$name.log" >>"$LOG"
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  local status=pass message="exit status 0"
  if ((rc == 124 || rc == 137)); then
    status=timeout
    message="killed after ${limit}s"
  elif ((rc != 0)); then
    status=fail
    # The first error line says more than the last line (a build's last line is a target that
    # did build); else the last line.
    local why
    why="$(grep -m 1 -E '(^|[^a-z_])(error|Error|ERROR|FAILED)([^a-z_]|$)' "$OUT/stages/$name.log")"
    [[ -z "$why" ]] && why="$(grep -v '^\s*$' "$OUT/stages/$name.log" | tail -n 1)"
    message="exit status $rc: $(cut -c1-300 <<<"$why")"
  fi
  [[ $status != pass ]] && FAILED=1
  say "$name: $status in ${secs}s ($message)"
  if [[ $name == compare ]]; then
    cat "$OUT/stages/$name.log"  # the table is the point of the whole check
  elif [[ $name == profile_gpt2 && -f "$OUT/gpt2_profile.txt" ]]; then
    head -n 45 "$OUT/gpt2_profile.txt"  # where a step's time goes, on the console too
  elif [[ $status != pass ]]; then
    tail -n 25 "$OUT/stages/$name.log" | sed 's/^/    /'
  fi
  record "$name" "$status" "$secs" "$message"
  return $rc
}

skip_stage() {  # name reason
  wanted "$1" || return 0
  say "$1: skipped ($2)"
  record "$1" skip 0 "$2"
}

say "started $(date -u +%FT%TZ) in $ROOT; results in $OUT; deadline ${SECONDS_TOTAL}s"
say "GPU: ${GPU:-none found (no nvidia-smi or no device)}; nvcc ${NVCC_VERSION:-not found}; torch ${TORCH:-not importable by $PYTHON}; $JOBS cores"

# ---- configure --------------------------------------------------------------------------------
# The settings gpu_prebuild.sh builds with too; MB_CUDA last, as the later -D of a name wins.
CONFIG_ARGS=(-S "$ROOT" -B "$BUILD_DIR" -DMB_DEPS_DIR="$DEPS" "${GPU_CMAKE_SETTINGS[@]}" -DMB_CUDA="$CUDA")
CUDNN_NOTE=""
[[ "${MB_GPU_CHECK_FRESH:-0}" == 1 ]] && rm -rf "$BUILD_DIR" && mkdir -p "$BUILD_DIR"
# Ninja where there is one and the folder is new (CMake keeps a folder's generator): it compiles a
# target's objects while the targets it links against are still building, where Make waits for
# them, and that is most of a fresh build's time on many cores.
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]] && command -v ninja >/dev/null 2>&1; then
  CONFIG_ARGS+=(-G Ninja)
fi
if [[ "$CUDA" == ON ]]; then
  [[ -n "$NVCC" ]] && CONFIG_ARGS+=(-DCMAKE_CUDA_COMPILER="$NVCC")
  # cuDNN: the CUDA folder's own, else the pip package beside PyTorch (its library is only
  # libcudnn.so.9, so a small folder gives CMake the libcudnn.so it looks for).
  cuda_root="$(dirname "$(dirname "${NVCC:-/usr/local/cuda/bin/nvcc}")")"
  if [[ -f "$cuda_root/include/cudnn.h" || -f /usr/include/cudnn.h ]]; then
    CUDNN_NOTE="from the CUDA toolkit"
  else
    pip_cudnn="$("$PYTHON" -c 'import nvidia.cudnn, os; print(list(nvidia.cudnn.__path__)[0])' 2>/dev/null || true)"
    pip_name="$("$PYTHON" -c 'import importlib.metadata as m; print(next((d.metadata["Name"] for d in m.distributions() if (d.metadata["Name"] or "").startswith("nvidia-cudnn")), ""))' 2>/dev/null || true)"
    wheel_cuda="$(sed -n 's/.*-cu\([0-9]*\)$/\1/p' <<<"$pip_name")"
    if [[ -n "$pip_cudnn" && -f "$pip_cudnn/include/cudnn.h" ]] && ls "$pip_cudnn"/lib/libcudnn.so* >/dev/null 2>&1; then
      if [[ -n "$wheel_cuda" && "$wheel_cuda" != "${NVCC_VERSION%%.*}" ]]; then
        CUDNN_NOTE="off: pip's $pip_name is built for CUDA $wheel_cuda, nvcc is $NVCC_VERSION"
        CONFIG_ARGS+=(-DMB_CUDNN=OFF)
      else
        shim="$BUILD_DIR/cudnn-root"
        mkdir -p "$shim/lib"
        ln -sfn "$pip_cudnn/include" "$shim/include"
        for lib in "$pip_cudnn"/lib/libcudnn.so*; do break; done
        ln -sf "$lib" "$shim/lib/libcudnn.so"
        export CUDNN_ROOT="$shim"
        export LD_LIBRARY_PATH="$pip_cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        CUDNN_NOTE="from pip ($pip_name, $pip_cudnn)"
      fi
    else
      CUDNN_NOTE="not found: convolutions use the im2col kernels"
    fi
  fi
  say "cuDNN: $CUDNN_NOTE"
fi
# ---- prebuilt programs --------------------------------------------------------------------------
# With MB_GPU_CHECK_PREBUILT=ARCHIVE (scripts/gpu_prebuild.sh), the programs built elsewhere replace
# the configure and build stages when they fit this checkout and this machine: they were built with
# this check's settings (scripts/gpu_build_settings.sh), every source file their manifest lists is
# unchanged here, nvcc and cuDNN here are no older than the ones they were built with, every program
# finds its libraries and starts, and, with a GPU, a cuBLAS case and a cuDNN case run without an
# error from the device or the libraries. They go to the folder they were built in (the manifest's
# root: build/, with src/ a link to this checkout, whose paths the programs hold). Otherwise the
# stage "prebuilt" says why, as skipped, and the check builds as before. Where the programs find
# the CUDA libraries only in the toolkit's folders, those go on LD_LIBRARY_PATH, and the PyTorch
# stages run with the value from before (TORCH_ENV), so that PyTorch keeps its own libraries.
TORCH_ENV=()
version_ge() { [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" == "$2" ]]; }  # A >= B
prebuilt_seconds() { awk -v a="$PREBUILT_T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
prebuilt_refused() {  # why
  say "prebuilt: not used: $1"
  record prebuilt skip "$(prebuilt_seconds)" "not used: $1"
  rm -rf "$PREBUILT_TMP"
  return 1
}
unpack() {  # ARCHIVE DEST [MEMBER]: with xz, else with Python's tarfile
  if command -v xz >/dev/null 2>&1; then
    tar -xJf "$1" -C "$2" ${3:+"$3"}
  else
    "$PYTHON" "$ROOT/scripts/untar_xz.py" "$@"
  fi
}
missing_library() {  # FOLDER: the first program there that is missing or lacks a library, and why
  local p line
  for p in "${PROGRAMS[@]}"; do
    [[ -x "$1/$p" ]] || { echo "$p: not an executable file"; return; }
    line="$(timeout 30 env LD_TRACE_LOADED_OBJECTS=1 "$1/$p" 2>&1 | grep -m 1 'not found')"
    [[ -z "$line" ]] || { echo "$p: $line"; return; }
  done
}
use_prebuilt() {  # archive: true when its programs are in use, in BUILD_DIR
  local archive="$1" tmp manifest root built_settings built_nvcc built_cudnn here_cudnn="" bad line
  PREBUILT_T0=$(date +%s.%N)
  PREBUILT_TMP="$(mktemp -d)"
  tmp="$PREBUILT_TMP"
  manifest="$tmp/build/prebuilt.manifest"
  say "---- prebuilt: $archive"
  [[ -f "$archive" ]] || { prebuilt_refused "$archive is not a file"; return 1; }
  unpack "$archive" "$tmp" build/prebuilt.manifest 2>"$tmp/err" ||
    { prebuilt_refused "cannot read its manifest: $(head -n 1 "$tmp/err")"; return 1; }
  root="$(sed -n 's/^root //p' "$manifest")"
  built_settings="$(sed -n 's/^settings //p' "$manifest")"
  built_nvcc="$(sed -n 's/^nvcc //p' "$manifest")"
  built_cudnn="$(sed -n 's/^cudnn //p' "$manifest")"
  [[ "$root" == /* ]] || { prebuilt_refused "its manifest names no root folder"; return 1; }
  [[ "$built_settings" == "$(gpu_build_settings_line)" ]] ||
    { prebuilt_refused "built with other settings (${built_settings:-none named})"; return 1; }
  sed -n 's/^source //p' "$manifest" >"$tmp/sources.sha256"
  [[ -s "$tmp/sources.sha256" ]] || { prebuilt_refused "its manifest lists no source files"; return 1; }
  if ! (cd "$ROOT" && sha256sum --quiet --strict -c "$tmp/sources.sha256") >"$tmp/sums" 2>&1; then
    # The first three files that differ (or are missing) here, else what sha256sum said.
    bad="$(sed -n 's/: FAILED.*//p' "$tmp/sums" | head -n 3 | paste -sd ' ' -)"
    prebuilt_refused "built from other sources (changed here: ${bad:-$(head -n 1 "$tmp/sums")})"
    return 1
  fi
  [[ -n "$NVCC_VERSION" ]] && version_ge "$NVCC_VERSION" "$built_nvcc" ||
    { prebuilt_refused "built with nvcc $built_nvcc, this machine has ${NVCC_VERSION:-none}"; return 1; }
  if [[ "$built_cudnn" != none ]]; then
    local h cuda_include
    cuda_include="$(dirname "$(dirname "$(realpath "${NVCC:-/usr/local/cuda/bin/nvcc}")")")/include"
    for h in "$cuda_include" /usr/include "${pip_cudnn:-/nonexistent}/include"; do
      [[ -f "$h/cudnn_version.h" ]] && here_cudnn="$(cudnn_version "$h/cudnn_version.h")" && break
    done
    [[ -n "$here_cudnn" ]] && version_ge "$here_cudnn" "$built_cudnn" || {
      prebuilt_refused "built with cuDNN $built_cudnn, this machine has ${here_cudnn:-none found}"
      return 1
    }
  fi
  mkdir -p "$root" 2>/dev/null || { prebuilt_refused "cannot make $root"; return 1; }
  [[ ! -e "$root/src" || -L "$root/src" ]] || { prebuilt_refused "$root/src is there, no link"; return 1; }
  ln -sfn "$ROOT" "$root/src"
  rm -f "$root/shared"
  [[ -d "$ROOT/../shared" ]] && ln -sfn "$(cd "$ROOT/.." && pwd)/shared" "$root/shared"
  rm -rf "$root/build"
  unpack "$archive" "$root" 2>"$tmp/err" ||
    { prebuilt_refused "cannot unpack it: $(head -n 1 "$tmp/err")"; return 1; }
  # The CUDA libraries: where the system finds them, else in the toolkit's folders.
  line="$(missing_library "$root/build")"
  if [[ -n "$line" && -n "$NVCC" && "$line" == *"not found"* ]]; then
    local cuda_root
    cuda_root="$(dirname "$(dirname "$(realpath "$NVCC")")")"
    TORCH_ENV=(env -u LD_LIBRARY_PATH)
    [[ -n "${LD_LIBRARY_PATH+set}" ]] && TORCH_ENV=(env LD_LIBRARY_PATH="$LD_LIBRARY_PATH")
    LD_LIBRARY_PATH="$cuda_root/lib64:$cuda_root/lib:$cuda_root/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
    say "prebuilt: the CUDA libraries from $cuda_root (LD_LIBRARY_PATH; not for the PyTorch stages)"
    line="$(missing_library "$root/build")"
  fi
  [[ -z "$line" ]] || { prebuilt_refused "$line"; return 1; }
  local run
  for line in "microbatch --help" "tests_core --count"; do
    read -ra run <<<"$line"
    timeout --kill-after=5 60 "$root/build/${run[0]}" "${run[@]:1}" >/dev/null 2>"$tmp/err" ||
      { prebuilt_refused "$line: $(head -n 1 "$tmp/err")"; return 1; }
  done
  # With a GPU: a cuBLAS case and a cuDNN case, both passed on an H200 before. An error from the
  # device or the libraries (a CUDA, cuBLAS or cuDNN status, a crash, a hang) refuses the programs;
  # a failed check of values is a bug that a build here would have too, and the tests will show it.
  local note="" rc=0
  if [[ -n "$GPU" ]]; then
    timeout --kill-after=10 120 "$root/build/tests_core" --test-suite=cuda \
      -tc='cuda matmul: 16-bit accumulates*,cuda conv2d and max_pool2d backward*' \
      >"$tmp/smoke" 2>&1 || rc=$?
    if ((rc != 0)); then
      line="$(grep -m 1 -E 'failed at |_STATUS_|error while loading|no kernel image|CRASHED' "$tmp/smoke")"
      ((rc == 124 || rc >= 128)) && [[ -z "$line" ]] && line="exit status $rc (killed or crashed)"
      [[ -z "$line" ]] && ! grep -q '\[doctest\] test cases:' "$tmp/smoke" && line="$(tail -n 1 "$tmp/smoke")"
      [[ -z "$line" ]] || { prebuilt_refused "its CUDA cases cannot run here: $line"; return 1; }
      note="; its smoke cases failed a check of values (see the tests)"
    fi
    grep -qE 'test cases: *2 \|' "$tmp/smoke" || {
      prebuilt_refused "its two CUDA cases did not both run: $(grep -m 1 'test cases' "$tmp/smoke")"
      return 1
    }
  fi
  BUILD_DIR="$root/build"
  local when
  when="$(sed -n 's/^built //p' "$manifest")"
  say "prebuilt: using the programs in $BUILD_DIR (built $when with nvcc $built_nvcc, cuDNN $built_cudnn)"
  record prebuilt pass "$(prebuilt_seconds)" "programs built $when, in $BUILD_DIR$note"
  rm -rf "$tmp"
}
PROGRAMS=("${GPU_PROGRAMS[@]}")
PREBUILT_USED=0
if [[ -n "${MB_GPU_CHECK_PREBUILT:-}" && "$CUDA" == ON ]] && wanted build; then
  use_prebuilt "$(realpath -m "$MB_GPU_CHECK_PREBUILT")" && PREBUILT_USED=1
fi

BUILD_OK=0
if ((PREBUILT_USED)); then
  BUILD_OK=1
  for stage in configure build; do
    wanted "$stage" && record "$stage" skip 0 "the prebuilt programs serve"
  done
elif wanted configure; then
  if [[ ! -f "$DEPS/include/fmt/format.h" ]]; then
    say "configure: no dependency bundle at $DEPS (make it with scripts/bundle_deps.sh deps where the Debian packages are)"
    record configure fail 0 "no dependency bundle at $DEPS"
    FAILED=1
  else
    run_stage configure 90 10 cmake "${CONFIG_ARGS[@]}" && BUILD_OK=1
    # What CMake made of it ("microbatch: cuDNN /path/libcudnn.so" or "... not found ...").
    found="$(grep -o 'microbatch: cuDNN.*' "$OUT/stages/configure.log" | head -n 1)"
    [[ -n "$found" && "$CUDA" == ON ]] && CUDNN_NOTE="$CUDNN_NOTE; CMake: ${found#microbatch: }" && write_results
  fi
else
  [[ -f "$BUILD_DIR/CMakeCache.txt" ]] && BUILD_OK=1
fi

# The command and benchmarks first, the test suites last; -k keeps going past a target that fails,
# so the stages whose programs did build still run. Each program is deleted before the build, so one
# that is there afterwards was built (or found up to date) by this run.
TARGETS=("${GPU_TARGETS[@]}")
[[ "$CUDA" == ON ]] || TARGETS=(microbatch_cli tests_core tests_train)
built() { [[ -x "$BUILD_DIR/$1" ]]; }
if ((PREBUILT_USED)); then
  :
elif ((BUILD_OK)) && wanted build; then
  for p in "${PROGRAMS[@]}"; do rm -f "$BUILD_DIR/$p"; done
  keep_going=(-k)
  grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null && keep_going=(-k 0)
  run_stage build 330 60 cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}" -- "${keep_going[@]}"
elif wanted build; then
  skip_stage build "not configured"
fi
# The stage NAME, when PROGRAM was built: true to run it, else it is recorded as skipped.
ready() {  # name program
  wanted "$1" || return 1
  if ((!BUILD_OK)) || ! built "$2"; then
    skip_stage "$1" "$2 was not built"
    return 1
  fi
}
need_torch() {  # name: for a GPU stage, so there is a GPU and PyTorch's figures are wanted
  [[ -n "$TORCH" ]] && return 0
  local why="PyTorch is not importable by $PYTHON: set PYTHON to the venv's python (PYTHON=venv/bin/python)"
  say "$1: failed: $why"
  record "$1" fail 0 "$why"
  FAILED=1
  return 1
}

# ---- GPU stages, the figures first --------------------------------------------------------------
GPU_STAGES="bench_gpt2 profile_gpt2 bench_attention bench_kernels torch_gpt2 torch_attention torch_kernels sanitizer planner racecheck compare"
GPU_OK=1
if [[ -z "$GPU" || "$CUDA" != ON ]]; then
  reason=$([[ -z "$GPU" ]] && echo "no GPU on this machine" || echo "built without the CUDA backend")
  GPU_OK=0
fi
KEEP=15  # room for the comparison, whatever a benchmark does
gpu_stage() {  # name: true when the GPU stage NAME is to run
  wanted "$1" || return 1
  ((GPU_OK)) && return 0
  skip_stage "$1" "$reason"
  return 1
}
# GPT-2's initial weights and tokens, which bench_gpt2 writes and torch_gpt2 reads (500 MB: kept out
# of OUTDIR).
GPT2_IO="$BUILD_DIR/gpt2_io"
PROFILE_ENV=()  # the profile follows the GPT-2 run: on the f32-math kernels after a fallback
if gpu_stage bench_gpt2 && ready bench_gpt2 bench_gpt2_cuda; then
  mkdir -p "$GPT2_IO"
  run_stage bench_gpt2 90 45 "$BUILD_DIR/bench_gpt2_cuda" --out-dir "$GPT2_IO" --json "$OUT/gpt2.json"
  # No run measured, the run failed or hung (a run that failed alone, out of memory at B = 16 say,
  # leaves the others'): once more on the f32-math attention kernels, so that a fault in the
  # tensor-core ones (the newest) still leaves the rest of the step measured, and profiled.
  if [[ "$(tail -n 1 "$TABLE" | cut -f2)" =~ ^(fail|timeout)$ ]] &&
     ! "$PYTHON" -c 'import json, sys; sys.exit(0 if any("error" not in r for r in json.load(open(sys.argv[1]))["runs"]) else 1)' \
       "$OUT/gpt2.json" 2>/dev/null; then
    PROFILE_ENV=(MB_ATTENTION_KERNEL=simt)
    run_stage bench_gpt2_simt 90 45 env MB_ATTENTION_KERNEL=simt "$BUILD_DIR/bench_gpt2_cuda" \
      --out-dir "$GPT2_IO" --json "$OUT/gpt2_simt.json"
  fi
fi
if gpu_stage profile_gpt2 && ready profile_gpt2 bench_gpt2_cuda; then
  # A few steps after two timed ones, the profiler on; its own folder for the weights.
  run_stage profile_gpt2 60 30 env "${PROFILE_ENV[@]}" "$BUILD_DIR/bench_gpt2_cuda" \
    --out-dir "$BUILD_DIR/profile_run" --batch 8 \
    --warmup 2 --steps 2 --profile --profile-steps 3 --profile-out "$OUT/gpt2_profile.txt" \
    --json "$OUT/gpt2_profile.json"
  rm -rf "$BUILD_DIR/profile_run"
fi
gpu_stage bench_attention && ready bench_attention bench_attention_cuda &&
  run_stage bench_attention 30 10 "$BUILD_DIR/bench_attention_cuda" --json "$OUT/attention.json"
gpu_stage bench_kernels && ready bench_kernels bench_kernels_cuda &&
  run_stage bench_kernels 60 30 "$BUILD_DIR/bench_kernels_cuda" --json "$OUT/kernels.json"
if gpu_stage torch_gpt2 && need_torch torch_gpt2; then
  if [[ ! -f "$GPT2_IO/gpt2_init.safetensors" ]]; then
    skip_stage torch_gpt2 "no initial weights: bench_gpt2 did not write them"
  else
    run_stage torch_gpt2 75 30 "${TORCH_ENV[@]}" "$PYTHON" benchmarks/torch_gpt2.py --weights "$GPT2_IO/gpt2_init.safetensors" \
      --tokens "$GPT2_IO/gpt2_tokens.safetensors" --json "$OUT/torch_gpt2.json"
  fi
fi
rm -rf "$GPT2_IO"
gpu_stage torch_attention && need_torch torch_attention &&
  run_stage torch_attention 40 15 "${TORCH_ENV[@]}" "$PYTHON" benchmarks/torch_attention.py --json "$OUT/torch_attention.json"
gpu_stage torch_kernels && need_torch torch_kernels &&
  run_stage torch_kernels 45 20 "${TORCH_ENV[@]}" "$PYTHON" benchmarks/torch_kernels.py --json "$OUT/torch_kernels.json"

# ---- tests (their CUDA cases run where there is a GPU) ------------------------------------------
KEEP=105  # room for the planner's runs and the comparison, whatever a test suite or memcheck does
for suite in tests_core tests_train; do
  if ready "$suite" "$suite"; then
    # From the build folder, as CTest runs them. With a GPU, the CUDA cases only (doctest's test
    # suite cuda): the CPU cases are the test command's on any machine, and would spend the GPU's
    # time; and none of them passing means the runtime saw no device, which is no pass. Never a
    # rehearsal (Note [Rehearsing the CUDA cases] in tests/core/harness.h).
    run_stage "$suite" 90 15 bash -c '
      cd "$1" || exit 1
      if [[ $3 != 1 ]]; then exec env -u MB_TEST_CUDA_REHEARSAL "./$2"; fi
      env -u MB_TEST_CUDA_REHEARSAL "./$2" --test-suite=cuda 2>&1 | tee "$2.cuda.log"
      rc=${PIPESTATUS[0]}
      if ((rc == 0)) && ! grep -Eq "test cases: *[0-9]+ *\| *[1-9][0-9]* passed" "$2.cuda.log"; then
        echo "gpu_check: no CUDA case of $2 ran: the CUDA runtime sees no device"
        rc=1
      fi
      exit $rc' _ "$BUILD_DIR" "$suite" "$GPU_OK"
  fi
done

# The tiny GPTs the compute-sanitizer stages train on cuda:0: in f32 (head size 16), and in bf16
# with head size 64 (the tensor-core attention, GPT-2's shape), 80 positions (a partial key tile)
# and a vocabulary of 61 (logits on padded rows, the cuBLASLt epilogues).
TINY_GPT_F32="--n-embd 32 --n-head 2 --block-size 32 --vocab-size 64"
TINY_GPT_BF16="--n-embd 128 --n-head 2 --block-size 80 --vocab-size 61 --bf16"
TINY_GPT_TRAIN=(train --model gpt --dataset synthetic --synthetic-size 16 --device cuda --n-layer 1
                --per-device-train-batch-size 4 --logging-steps 1 --eval-strategy no
                --save-strategy no)
if gpu_stage sanitizer && ready sanitizer microbatch; then
  if [[ -z "$SANITIZER" ]]; then
    skip_stage sanitizer "compute-sanitizer not found"
  else
    # Both tiny GPTs for two optimizer steps. MB_ALLOCATOR_BYPASS=1 asks the allocator to return
    # every block to cudaFree, so that memcheck sees each allocation's real bounds.
    run_stage sanitizer 90 30 bash -c '
      sanitizer="$1" dir="$2/sanitizer_run" f32="$3" bf16="$4"
      shift 4  # the command and its training arguments
      for model in "$f32" "$bf16"; do
        echo "== memcheck: $model"
        MB_ALLOCATOR_BYPASS=1 "$sanitizer" --tool memcheck --error-exitcode 1 "$@" $model \
          --max-steps 2 --output-dir "$dir" || exit 1
        rm -rf "$dir"
      done' sanitizer "$SANITIZER" "$BUILD_DIR" "$TINY_GPT_F32" "$TINY_GPT_BF16" \
      "$BUILD_DIR/microbatch" "${TINY_GPT_TRAIN[@]}"
  fi
fi
KEEP=15  # for the comparison
gpu_stage planner && ready planner microbatch &&
  run_stage planner 150 90 env PYTHON="$PYTHON" bash benchmarks/planner_cuda.sh "$BUILD_DIR" "$OUT"
if gpu_stage racecheck && ready racecheck microbatch; then
  if [[ -z "$SANITIZER" ]]; then
    skip_stage racecheck "compute-sanitizer not found"
  elif ((DEADLINE - $(date +%s) - RESERVE - KEEP < 20)); then
    # The one optional stage: no time is kept for it, and a check without it is complete (exit
    # status 0 when all else passed).
    skip_stage racecheck "no time left for it after the planner (it needs 20s)"
  else
    # The bf16 tiny GPT, one step: racecheck finds shared-memory hazards (a tile read before
    # every warp wrote it, or rewritten while one still reads it), synccheck a barrier that not
    # every thread of a block reaches. Last: the slowest tools, the least needed.
    run_stage racecheck 60 20 bash -c '
      sanitizer="$1" dir="$2/racecheck_run" bf16="$3"
      shift 3  # the command and its training arguments
      for tool in racecheck synccheck; do
        echo "== $tool"
        "$sanitizer" --tool "$tool" --error-exitcode 1 "$@" $bf16 --max-steps 1 \
          --output-dir "$dir" || exit 1
        rm -rf "$dir"
      done' racecheck "$SANITIZER" "$BUILD_DIR" "$TINY_GPT_BF16" \
      "$BUILD_DIR/microbatch" "${TINY_GPT_TRAIN[@]}"
  fi
fi
KEEP=0
if gpu_stage compare; then
  if [[ -f "$OUT/kernels.json" || -f "$OUT/gpt2.json" || -f "$OUT/gpt2_simt.json" || -f "$OUT/planner.json" ||
        -f "$OUT/attention.json" ]]; then
    run_stage compare 15 5 "$PYTHON" benchmarks/compare.py "$OUT" --json "$OUT/compare.json" --plots "$OUT/plots"
  else
    skip_stage compare "no benchmark results to compare"
  fi
fi

write_results
say "done in $(($(date +%s) - START))s: $(awk -F'\t' '!($1 in s) { n[++k] = $1 } { s[$1] = $2 } END { for (i = 1; i <= k; ++i) printf "%s:%s ", n[i], s[n[i]] }' "$TABLE" | sed 's/ $//')"
say "results: $OUT/results.json, log: $LOG"
if ((FAILED)); then exit 1; fi
if ((UNSTARTED)); then exit 2; fi
exit 0
