#!/usr/bin/env bash
# bench_image_cuda's logic on the CPU, for both Fashion-MNIST models on seeded synthetic images: the
# training loop, the files it writes for PyTorch, the JSON and the memory figure. Where Debian's
# PyTorch is installed (MB_TORCH_PYTHON, /usr/bin/python3), benchmarks/torch_image.py trains the same
# model from those files and the two runs' losses must agree step for step, as
# benchmarks/compare.py holds them (f32: the first within 1e-4, every one within 1e-3); without it
# that part says SKIPPED. The times say nothing and are not checked.
#
#   tests/scripts/bench_image_on_cpu.sh BENCH_IMAGE OUTDIR
set -euo pipefail
BENCH="$1"
OUT="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${MB_TORCH_PYTHON:-/usr/bin/python3}"
mkdir -p "$OUT"
rm -f "$OUT"/*.json
for model in mlp cnn; do
  "$BENCH" --device cpu --model "$model" --batch 4,8 --steps 4 --warmup 1 --data synthetic \
    --out-dir "$OUT" --json "$OUT/image_$model.json"
done
# Arguments it cannot use: exit status 2 and a message naming them.
for bad in "--model vgg" "--batch 0" "--steps x" "--device tpu" "--unknown 1"; do
  # shellcheck disable=SC2086
  if "$BENCH" $bad > "$OUT/refused.txt" 2>&1; then
    echo "bench_image_cuda accepted '$bad'" >&2
    exit 1
  elif [[ $? -ne 2 ]]; then
    echo "bench_image_cuda '$bad': exit status other than 2" >&2
    exit 1
  fi
done
if "$BENCH" --device cpu --data "$OUT/no-such-folder" --batch 4 --steps 1 --out-dir "$OUT" \
  > "$OUT/refused.txt" 2>&1; then
  echo "bench_image_cuda ran without its dataset" >&2
  exit 1
fi
grep -q "no-such-folder" "$OUT/refused.txt" || { echo "the missing dataset is not named:" >&2; cat "$OUT/refused.txt" >&2; exit 1; }

torch_ok=0
if "$PY" -c "import torch" 2> /dev/null; then
  torch_ok=1
  for model in mlp cnn; do
    "$PY" "$ROOT/benchmarks/torch_image.py" --device cpu --weights "$OUT/image_${model}_init.safetensors" \
      --batches "$OUT/image_${model}_batches.safetensors" --batch 4,8 --steps 4 --warmup 1 \
      --json "$OUT/torch_image_$model.json"
  done
  # Its verdict also weighs step times, which a test does not: only the loss checks are read.
  python3 "$ROOT/benchmarks/compare.py" "$OUT" --json "$OUT/summary.json" --plots "$OUT/plots" || true
else
  echo "SKIPPED: PyTorch's side of the comparison ($PY cannot import torch; Debian: python3-torch)"
fi

python3 - "$OUT" "$torch_ok" <<'PY'
import json, math, os, sys
out, torch_ok = sys.argv[1], sys.argv[2] == "1"
params = {"mlp": 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10,
          "cnn": 32 * 9 + 32 + 64 * 32 * 9 + 64 + 3136 * 128 + 128 + 128 * 10 + 10}
for model, n in params.items():
    j = json.load(open(f"{out}/image_{model}.json"))
    assert j["parameters"] == n, (model, j["parameters"], n)
    assert j["data"] == "synthetic" and j["model"] == model, j
    assert [r["batch"] for r in j["runs"]] == [4, 8], j["runs"]
    for r in j["runs"]:
        assert "error" not in r, r
        assert len(r["losses"]) == 5 and all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert len(r["grad_norms"]) == 5 and all(x > 0 for x in r["grad_norms"]), r["grad_norms"]
        # Random labels on random pixels: the loss starts near ln 10.
        assert abs(r["losses"][0] - math.log(10)) < 0.5, r["losses"][0]
        if "host_rss_growth_bytes" in r:  # the weights, gradients and AdamW's two moments in f32
            assert r["host_rss_growth_bytes"] >= 16 * n, (model, r["host_rss_growth_bytes"], 16 * n)
    if not torch_ok:
        continue
    t = json.load(open(f"{out}/torch_image_{model}.json"))
    assert t["parameters"] == n, (model, t["parameters"])
    s = json.load(open(f"{out}/summary.json"))[f"image_{model}"]
    for r, tr in zip(j["runs"], t["runs"]):
        worst = max(abs(a - b) for a, b in zip(r["losses"], tr["losses"]))
        got = s[str(r["batch"])]
        assert got["losses_agree"] is True, (model, r["batch"], got)
        assert abs(got["max_loss_difference"] - worst) < 1e-12, (got, worst)
        print(f"{model} B={r['batch']}: losses agree with PyTorch's to {worst:.2e} over {len(r['losses'])} steps")
    for plot in ("loss", "step"):
        assert os.path.getsize(f"{out}/plots/image_{model}_{plot}.svg") > 0
PY
echo "bench_image_on_cpu: ok"
