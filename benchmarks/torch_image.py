#!/usr/bin/env python3
"""PyTorch's side of bench_image_cuda: the same Fashion-MNIST model in PyTorch eager, from the same
initial weights and the same batches (the files bench_image_cuda writes), trained and timed the same
way.

The models, with microbatch's parameter names (nn/models.h): the MLP Flatten -> Linear(784, 256) ->
ReLU -> Linear(256, 128) -> ReLU -> Linear(128, 10) ("net.1.", "net.3.", "net.5."); the CNN
Conv2d(1, 32, 3, padding 1) -> ReLU -> MaxPool2d(2) -> Conv2d(32, 64, 3, padding 1) -> ReLU ->
MaxPool2d(2) -> Flatten -> Linear(3136, 128) -> ReLU -> Linear(128, 10) ("net.0.", "net.3.",
"net.7.", "net.9."); cross-entropy loss. Training: f32, backward, clip_grad_norm_(1.0),
AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on tensors of two or more dims),
optimizer step i on the rows [i * B, (i + 1) * B) of the batch size's images. A step's time is the
median over --steps after --warmup (host time on the CPU, torch.cuda.Events on a GPU), the losses
and norms read at the end; memory is torch.cuda.max_memory_allocated on a GPU and, on the CPU, the
growth of the process's resident memory over the steps (host_rss_growth_bytes), as bench_image_cuda
measures its own.

  python3 benchmarks/torch_image.py --weights DIR/image_mlp_init.safetensors \\
      --batches DIR/image_mlp_batches.safetensors [--batch 64,256] [--steps 30] [--warmup 3] \\
      [--json PATH] [--device cpu|cuda]

A batch size whose run throws is recorded as {"batch", "error"} and the others still run; the JSON
is rewritten after every run; the exit status is then 1.
"""
import argparse
import gc
import json
import os
import statistics
import sys

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch_timing import (Timer, memory_fields, read_safetensors, release_free_heap,
                              reset_resident_peak, resident_memory)
except ImportError:
    print("torch_image: PyTorch is not installed for", sys.executable, file=sys.stderr)
    sys.exit(3)


def make_model(name):
    """The model named in the weights' metadata, laid out as microbatch's (net.<i>.)."""
    if name == "mlp":
        layers = [nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                  nn.Linear(128, 10)]
    elif name == "cnn":
        layers = [nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                  nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                  nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10)]
    else:
        raise SystemExit(f"torch_image: the weights name model '{name}', not mlp or cnn")
    model = nn.Module()
    model.net = nn.Sequential(*layers)
    return model


def run_batch(B, a, name, weights, batches, device):
    """Trains the model at batch B from the initial weights: one entry of the JSON's "runs"."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    gc.collect()  # the last batch size's model and optimizer
    release_free_heap()
    rss_before, _ = resident_memory()
    model = make_model(name).to(device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise SystemExit(f"torch_image: weights do not match the model: missing {missing}, unexpected {unexpected}")
    params = list(model.parameters())
    groups = [{"params": [t for t in params if t.dim() >= 2], "weight_decay": 0.01},
              {"params": [t for t in params if t.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    inputs = batches[f"inputs_b{B}"].to(device)
    labels = batches[f"labels_b{B}"].to(device)
    if name == "cnn":
        inputs = inputs.unsqueeze(1)  # (N, 28, 28) -> (N, 1, 28, 28), as nn::CNN does
    timer = Timer(device)
    marks, losses, norms = [], [], []
    rss_peak_reset = device.type == "cpu" and reset_resident_peak()
    for i in range(a.warmup + a.steps):
        m0 = timer.mark()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model.net(inputs[i * B:(i + 1) * B]), labels[i * B:(i + 1) * B])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        marks.append((m0, timer.mark()))
        losses.append(loss.detach())
    times = [timer.ms(x, y) for x, y in marks]
    rss_peak = resident_memory()[1] if rss_peak_reset else None
    losses = [float(x) for x in losses]
    norms = [float(x) for x in norms]
    for i, ms in enumerate(times):
        print(f"  B={B} step {i:2d}: loss {losses[i]:.4f}, grad norm {norms[i]:.3f}, {ms:.2f} ms"
              + (" (warm-up)" if i < a.warmup else ""))
    times = times[a.warmup:]
    med = statistics.median(times)
    run = dict(batch=B, step_ms_median=med, step_ms_min=min(times), step_ms_max=max(times),
               steps_timed=len(times), samples_per_s=B / (med * 1e-3), losses=losses, grad_norms=norms)
    run.update(memory_fields(device, rss_before, rss_peak))
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--batch", default="64,256")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0:
        print("torch_image: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_image: no CUDA device here (--device cpu runs on the CPU)", file=sys.stderr)
        return 2
    weights, meta = read_safetensors(a.weights)
    batches, _ = read_safetensors(a.batches)
    name = meta.get("model", "")
    sizes = [int(b) for b in a.batch.split(",")]
    for B in sizes:
        rows = batches.get(f"inputs_b{B}")
        if rows is None or rows.shape[0] < B * (a.warmup + a.steps):
            print(f"torch_image: {a.batches} holds no {a.warmup + a.steps} steps of {B} images",
                  file=sys.stderr)
            return 2
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch_image on {device_name} with torch {torch.__version__}: {name}")
    out = dict(benchmark="image", implementation="pytorch", torch=torch.__version__, device=device_name,
               model=name, parameters=sum(t.numel() for t in weights.values()),
               precision="f32 parameters, activations and gradients",
               optimizer="AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on tensors of 2+ dims; clip 1.0",
               batches=sizes, warmup=a.warmup, runs=[])
    if device.type == "cpu":
        out["threads"] = torch.get_num_threads()
        out["openblas_coretype"] = os.environ.get("OPENBLAS_CORETYPE", "")
        out["openblas_num_threads"] = os.environ.get("OPENBLAS_NUM_THREADS", "")
    for B in sizes:
        try:
            out["runs"].append(run_batch(B, a, name, weights, batches, device))
        except Exception as e:  # out of memory, a device fault: this batch size's error
            print(f"torch_image: B={B} failed: {type(e).__name__}: {e}", file=sys.stderr)
            out["runs"].append(dict(batch=B, error=f"{type(e).__name__}: {e}"))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    print(f"\n{'batch':>6} {'step ms':>10} {'samples/s':>12} {'RSS growth MiB':>15} {'last loss':>10}")
    for r in out["runs"]:
        if r.get("error"):
            print(f"{r['batch']:>6}  failed: {r['error']}")
            continue
        rss = r.get("host_rss_growth_bytes")
        rss = "-" if rss is None else f"{rss / 2**20:.1f}"
        print(f"{r['batch']:>6} {r['step_ms_median']:>10.2f} {r['samples_per_s']:>12.0f} {rss:>15} "
              f"{r['losses'][-1]:>10.4f}")
    if a.json:
        print("wrote", a.json)
    return 1 if any(r.get("error") for r in out["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
