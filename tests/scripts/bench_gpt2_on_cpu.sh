#!/usr/bin/env bash
# bench_gpt2_cuda's logic on the CPU, at the tiny model's size: the training loop, the JSON and the
# CPU runs' memory figure. The times say nothing.
#
#   tests/scripts/bench_gpt2_on_cpu.sh BENCH_GPT2 OUTDIR
set -euo pipefail
BENCH="$1"
OUT="$2"
mkdir -p "$OUT"
"$BENCH" --device cpu --tiny --batch 2,4 --steps 3 --warmup 1 --json "$OUT/gpt2.json" --out-dir "$OUT/gpt2"
python3 - "$OUT/gpt2.json" <<'PY'
import json, math, sys
j = json.load(open(sys.argv[1]))
n = j["parameters"]
assert [r["batch"] for r in j["runs"]] == [2, 4], j["runs"]


def kernel_gives_resident_peak():
    """Whether this kernel keeps VmHWM and lets a process reset it, as the benchmark needs."""
    try:
        with open("/proc/self/status") as f:
            if not any(line.startswith("VmHWM:") for line in f):
                return False
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


measured = kernel_gives_resident_peak()
if not measured:
    print("SKIPPED: the memory figure is not checked: this kernel gives no VmHWM in "
          "/proc/self/status or refuses a write to /proc/self/clear_refs")
for r in j["runs"]:
    assert len(r["losses"]) == 4 and all(math.isfinite(x) for x in r["losses"]), r["losses"]
    if not measured:
        assert "host_rss_growth_bytes" not in r, r
        continue
    # Each run's model is built after the baseline: its f32 weights, gradients and AdamW's two
    # moments (4 arenas of n floats) are resident by the peak. A baseline taken after the model was
    # built would not show them.
    growth, before, peak = (r[k] for k in ("host_rss_growth_bytes", "host_rss_before_bytes", "host_peak_rss_bytes"))
    assert growth == peak - before, r
    assert growth >= 4 * 4 * n, (r["batch"], growth, 4 * 4 * n)
    print(f"B={r['batch']}: resident memory grew {growth / 2**20:.2f} MiB over the run "
          f"(the arenas: {16 * n / 2**20:.2f} MiB)")
PY
echo "bench_gpt2_on_cpu: ok"
