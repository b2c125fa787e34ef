#!/usr/bin/env python3
"""PyTorch's side of bench_kernels_cuda: the same operations at the same sizes, timed the same way
(median of --reps repetitions after --warmup, each between two torch.cuda.Events), with the same
byte accounting (Note [Bytes moved] in benchmarks/kernels_cuda.cpp), so compare.py can set the
two side by side.

What is compared, exactly:
  copy                   b.copy_(a), 2 GiB of u8                                        2n bytes
  accumulate_f32_f32     dst.add_(src, alpha=w), f32 (256 Mi) += f32                    12 B/element
  accumulate_f32_bf16    dst.add_(src, alpha=w), f32 (256 Mi) += bf16 (type promotion)  10 B/element
  grad_norm              torch.linalg.vector_norm of 2 GiB of f32 (512 Mi elements); a
                         non-finite value shows as a non-finite norm (clip_grad_norm_'s check);
                         the result stays on the device, as microbatch's does   4 B/element
  adamw                  torch.optim.AdamW(fused=True) on ONE f32 parameter of 124,439,808
                         elements with an f32 gradient (lr 6e-4, weight decay 0.1). PyTorch keeps
                         no bf16 working copy (autocast casts at use), so it moves 28 B/element;
                         the figure counts microbatch's 30 so that both are timed against the same
                         work count. One flat tensor is PyTorch's best case (its fused kernel also
                         runs over GPT-2's 148 tensors in a real step).
  cross_entropy_*        F.cross_entropy(bf16 logits (8192, 50257), i64 target, mean,
                         ignore_index -100 on every 97th row) forward, and
                         torch.autograd.grad for dlogits (bf16): PyTorch materializes bf16
                         log-probabilities in the forward
                                                      forward 2 B/logit, backward 4 B/logit (+ 20 B/row)

  python3 benchmarks/torch_kernels.py [--json PATH] [--reps 20] [--warmup 3] [--quick] [--device cuda|cpu]

A kernel whose run throws is recorded under the JSON's "errors" as {"name", "error"} and the others
still run, as in bench_kernels_cuda; the JSON is rewritten after every kernel; the exit status is
then 1.
"""
import argparse
import json
import sys

try:
    import torch
    import torch.nn.functional as F
    from torch_timing import Timer, summarize, sync, time_reps
except ImportError:  # the GPU check reports this as a skipped stage
    print("torch_kernels: PyTorch is not installed for", sys.executable, file=sys.stderr)
    sys.exit(3)

GPT2_ARENA = 124_439_808

FULL = dict(copy_bytes=2 << 30, accumulate_n=256 << 20, norm_n=512 << 20, arena=GPT2_ARENA, ce_rows=8192,
            ce_cols=50257)
QUICK = dict(copy_bytes=64 << 20, accumulate_n=4 << 20, norm_n=4 << 20, arena=768 * 1000 + 1344, ce_rows=64,
             ce_cols=50257)


def record(name, operands, nbytes, timing, target=None):
    r = dict(name=name, operands=operands, bytes=float(nbytes), **timing)
    r["gb_per_s"] = nbytes / (timing["median_ms"] * 1e-3) / 1e9 if timing["median_ms"] > 0 else 0.0
    if target is not None:
        r["target"] = target
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default="")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_kernels: no CUDA device here (--device cpu runs the script's logic)", file=sys.stderr)
        return 2
    s = QUICK if a.quick or device.type == "cpu" else FULL
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch_kernels on {name} with torch {torch.__version__}, median of {a.reps} after {a.warmup} warm-up")
    torch.manual_seed(0)
    results, errors = [], []
    out = dict(benchmark="kernels", implementation="pytorch", torch=torch.__version__, device=name,
               sizes="quick" if s is QUICK else "full", reps=a.reps, warmup=a.warmup, copy_gb_per_s=None,
               kernels=results, errors=errors)

    def add(r):  # a kernel's figures, against the copy bandwidth (none when the copy failed)
        copy_gbps = out["copy_gb_per_s"]
        r["ratio_to_copy"] = r["gb_per_s"] / copy_gbps if copy_gbps else None
        results.append(r)

    # Each kernel fails alone, as bench_kernels_cuda's: its exception is recorded under "errors", the
    # others still run, and the JSON is rewritten after each, so that a later failure or the check's
    # time box does not take the earlier figures with it.
    def attempt(name, run):
        try:
            run()
        except Exception as e:  # out of memory, a device fault
            print(f"torch_kernels: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            errors.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)

    def copy():
        n = s["copy_bytes"]
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        r = record("copy", f"{n >> 20} MiB device to device", 2 * n,
                   time_reps(device, a.warmup, a.reps, lambda: dst.copy_(src)))
        out["copy_gb_per_s"] = r["gb_per_s"]
        add(r)

    def accumulate(dt, label, nb):
        n = s["accumulate_n"]
        acc = torch.randn(n, device=device)
        x = torch.randn(n, device=device).to(dt)
        add(record(f"accumulate_f32_{label}", f"f32 ({n}) += 0.25 * {label} ({n})", n * (8 + nb),
                   time_reps(device, a.warmup, a.reps, lambda: acc.add_(x, alpha=0.25)), 0.90))

    def grad_norm():
        n = s["norm_n"]
        g = torch.randn(n, device=device) * 1e-2
        add(record("grad_norm", f"vector_norm of f32 ({n})", 4 * n,
                   time_reps(device, a.warmup, a.reps, lambda: torch.linalg.vector_norm(g)), 0.80))

    def adamw():  # over the GPT-2 small arena
        n = s["arena"]
        param = torch.nn.Parameter(torch.randn(n, device=device) * 0.02)
        param.grad = torch.randn(n, device=device) * 1e-2
        fused = device.type == "cuda"
        try:
            opt = torch.optim.AdamW([param], lr=6e-4, weight_decay=0.1, fused=fused)
        except TypeError:  # an old PyTorch without fused optimizers (CPU smoke runs only)
            fused = False
            opt = torch.optim.AdamW([param], lr=6e-4, weight_decay=0.1)
        add(record("adamw", f"AdamW(fused={fused}) on one f32 parameter ({n}); counted as 30 B/element", 30 * n,
                   time_reps(device, a.warmup, a.reps, opt.step), 0.85))

    def cross_entropy():  # softmax + cross-entropy
        if device.type == "cuda":
            torch.cuda.empty_cache()  # AdamW's arena back before the logits (in here: it may throw)
        rows, cols = s["ce_rows"], s["ce_cols"]
        logits = torch.randn(rows, cols, device=device).to(torch.bfloat16).requires_grad_(True)
        target = torch.randint(0, cols, (rows,), device=device)
        target[::97] = -100
        operands = f"bf16 logits ({rows}, {cols}), i64 target, mean"
        for _ in range(a.warmup):
            torch.autograd.grad(F.cross_entropy(logits, target), logits)
        sync(device)
        timer = Timer(device)
        marks = []
        for _ in range(a.reps):
            m0 = timer.mark()
            loss = F.cross_entropy(logits, target)
            m1 = timer.mark()
            torch.autograd.grad(loss, logits)
            marks.append((m0, m1, timer.mark()))
        fwd = summarize([timer.ms(x, y) for x, y, _ in marks])
        bwd = summarize([timer.ms(y, z) for _, y, z in marks])
        both = summarize([timer.ms(x, z) for x, _, z in marks])
        logit_count = rows * cols
        add(record("cross_entropy_fwd", operands, 2 * logit_count + 20 * rows, fwd))
        add(record("cross_entropy_bwd", operands, 4 * logit_count + 20 * rows, bwd))
        add(record("cross_entropy_fwd_bwd", operands, 6 * logit_count + 40 * rows, both, 0.80))

    attempt("copy", copy)
    for dt, label, nb in ((torch.float32, "f32", 4), (torch.bfloat16, "bf16", 2)):
        attempt(f"accumulate_f32_{label}", lambda: accumulate(dt, label, nb))
    attempt("grad_norm", grad_norm)
    attempt("adamw", adamw)
    attempt("cross_entropy", cross_entropy)

    print(f"\n{'kernel':<24} {'MB moved':>10} {'median ms':>10} {'GB/s':>10} {'vs copy':>8}")
    for r in results:
        ratio = "-" if r["ratio_to_copy"] is None else f"{r['ratio_to_copy']:.3f}"
        print(f"{r['name']:<24} {r['bytes'] / 1e6:>10.1f} {r['median_ms']:>10.4f} {r['gb_per_s']:>10.1f} "
              f"{ratio:>8}")
    for e in errors:
        print(f"{e['name']:<24} failed: {e['error']}")
    if a.json:
        print("wrote", a.json)
    return 1 if errors else 0

if __name__ == "__main__":
    sys.exit(main())
