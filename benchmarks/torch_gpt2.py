#!/usr/bin/env python3
"""PyTorch's side of bench_gpt2_cuda: the same GPT-2 in PyTorch eager, from the same initial weights
and the same tokens (the files bench_gpt2_cuda writes), trained the same way, timed the same way.

The model: token + position embeddings, pre-LayerNorm blocks (LayerNorm eps 1e-5, causal attention
through F.scaled_dot_product_attention(is_causal=True), GELU with the tanh approximation), final
LayerNorm, head tied to the token embedding; no dropout. Parameter names match microbatch's
(wte.weight, h.0.attn.c_attn.weight, h.0.c_fc.weight, ...). Training: f32 parameters and gradients,
bf16 autocast for the forward (PyTorch's mixed precision: matmuls in bf16, the loss in f32),
backward, clip_grad_norm_(1.0), AdamW(fused=True, lr 6e-4, weight decay 0.1 on tensors of two or
more dims, betas (0.9, 0.999), eps 1e-8). Nothing waits for the GPU inside the timed steps: a step's
time is the median over --steps after --warmup, between two torch.cuda.Events, and the losses and
norms are read at the end; memory is torch.cuda.max_memory_allocated / max_memory_reserved since
the model was built.

  python3 benchmarks/torch_gpt2.py --weights DIR/gpt2_init.safetensors --tokens DIR/gpt2_tokens.safetensors \
      [--batch 8,16] [--steps 10] [--warmup 3] [--json PATH] [--device cuda|cpu] [--precision bf16|f32]

--precision f32 trains without autocast (the CPU comparison, benchmarks/cpu_vs_torch.sh). On the
CPU a step's time is host time, the run records torch's thread count and the OpenBLAS settings it
ran with, and there is no allocator peak (PyTorch keeps no allocator statistics for the CPU):
memory is the growth of the process's resident memory instead, its peak over the steps (Linux's
VmHWM, reset once the optimizer is built) less its size before the run's model was built
(host_rss_growth_bytes), as bench_gpt2_cuda measures its own.

A batch size whose run throws (out of memory at B = 16, say) is recorded in the JSON as
{"batch", "error"} and the other batch sizes still run; the JSON is rewritten after every run, so
that figures once measured survive a later failure or a time box (as bench_gpt2_cuda's). The exit
status is then 1.

Under torchrun (`python3 -m torch.distributed.run --nproc_per_node W torch_gpt2.py ...`; Debian's
PyTorch 1.13 launcher fails under Python 3.11 before it starts a process), or under mpirun on one
machine (`mpirun -np W python3 torch_gpt2.py ...`: Open MPI's or MPICH's rank and size are taken
for torch's, and MASTER_ADDR and MASTER_PORT default to 127.0.0.1 and 29500), the W processes
train data-parallel with DistributedDataParallel (gloo on the CPU, NCCL on GPUs, each rank on
cuda:LOCAL_RANK), as bench_gpt2_cuda does under mpirun: B stays the whole batch of a step, rank r
takes the r-th run of B / W rows, and DDP averages the gradients in backward. Rank 0 alone prints
and writes the JSON; the losses are the means over the ranks, the memory figures rank 0's. A
failure on any rank ends every rank, the batch sizes after it not run (rank 0 writes its JSON
first when the failure is its own).

The safetensors files are read by a small reader (torch_timing.py): the GPU machine has no
safetensors package.
"""
import argparse
import gc
import json
import math
import os
import statistics
import sys

try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch_timing import (Timer, memory_fields, read_safetensors, release_free_heap,
                              reset_resident_peak, resident_memory)
except ImportError:
    print("torch_gpt2: PyTorch is not installed for", sys.executable, file=sys.stderr)
    sys.exit(3)

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch 1.x (CPU smoke runs only)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)

    def forward(self, idx, labels):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the head tied to the token embedding
        return F.cross_entropy(logits.float().view(B * T, -1), labels.reshape(B * T))


def world():
    """(rank, size) of the data-parallel run, (0, 1) for one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_batch(B, a, cfg, weights, tokens, device, autocast):
    """Trains the model at micro-batch B from the initial weights: one entry of the JSON's "runs"."""
    T = cfg["block_size"]
    rank, size = world()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    gc.collect()  # the last batch size's model and optimizer
    release_free_heap()
    rss_before, _ = resident_memory()  # the CPU runs' baseline, as bench_gpt2_cuda's
    model = GPT(**cfg).to(device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise SystemExit(f"torch_gpt2: weights do not match the model: missing {missing}, unexpected {unexpected}")
    params = list(model.parameters())
    if size > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    decay = [t for t in params if t.dim() >= 2]
    no_decay = [t for t in params if t.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda"
    try:
        opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.999), eps=1e-8, fused=fused)
    except TypeError:  # an old PyTorch without fused optimizers (CPU smoke runs only)
        fused = False
        opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.999), eps=1e-8)
    rows = B // size  # this rank's rows of the step's B (all of them in one process)
    batch = tokens[f"tokens_b{B}"][rank * rows:(rank + 1) * rows].to(device)
    timer = Timer(device)
    inputs, labels = batch[:, :T].contiguous(), batch[:, 1:].contiguous()

    # No host synchronisation inside the timed steps (as bench_gpt2_cuda): events around each
    # step, losses and norms read at the end.
    marks, losses, norms = [], [], []
    # The peak counts from here, as bench_gpt2_cuda's: the model is built; the gradients and the
    # optimizer's state are allocated by the first step.
    rss_peak_reset = device.type == "cpu" and reset_resident_peak()
    for i in range(a.warmup + a.steps):
        m0 = timer.mark()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(inputs, labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        marks.append((m0, timer.mark()))
        losses.append(loss.detach())
    times = [timer.ms(x, y) for x, y in marks]
    rss_peak = resident_memory()[1] if rss_peak_reset else None
    if size > 1:  # the mean of the ranks' means (their rows hold as many tokens)
        losses = torch.stack(losses).to(torch.float64)
        dist.all_reduce(losses)
        losses = losses / size
    losses = [float(x) for x in losses]
    norms = [float(x) for x in norms]
    for i, ms in enumerate(times):
        if rank == 0:
            print(f"  B={B} step {i:2d}: loss {losses[i]:.4f}, grad norm {norms[i]:.3f}, {ms:.1f} ms"
                  + (" (warm-up)" if i < a.warmup else ""))
    span = timer.ms(marks[a.warmup][0], marks[-1][1]) / a.steps
    times = times[a.warmup:]
    med = statistics.median(times)
    run = dict(batch=B, seq_len=T, tokens_per_step=B * T, step_ms_median=med, step_ms_min=min(times),
               step_ms_max=max(times), steps_timed=len(times), step_ms_mean_span=span,
               tokens_per_s=B * T / (med * 1e-3),
               losses=losses, grad_norms=norms, fused_adamw=fused)
    run.update(memory_fields(device, rss_before, rss_peak))
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--batch", default="8,16")
    p.add_argument("--steps", type=int, default=10)  # >= 1
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=["bf16", "f32"])
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_gpt2: no CUDA device here (--device cpu runs the script's logic)", file=sys.stderr)
        return 2
    env = os.environ
    # mpirun's names for torch's: Open MPI's, then MPICH's Hydra (as bench_gpt2_cuda reads them).
    for size_name, rank_name, local_name in (
            ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID")):
        if "WORLD_SIZE" not in env and size_name in env:
            env["WORLD_SIZE"] = env[size_name]
            env["RANK"] = env.get(rank_name, "0")
            env["LOCAL_RANK"] = env.get(local_name, env["RANK"])
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", "29500")
    size = int(env.get("WORLD_SIZE", "1"))
    if size > 1:  # started by torchrun or mpirun: data-parallel
        batches = [int(b) for b in a.batch.split(",")]
        if any(b % size for b in batches):
            print(f"torch_gpt2: --batch {a.batch} does not split over the {size} processes",
                  file=sys.stderr)
            return 2
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, size = world()
    weights, meta = read_safetensors(a.weights)
    tokens, _ = read_safetensors(a.tokens)
    cfg = {k: int(meta[k]) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model_name = meta.get("model") or ("gpt2_small" if cfg["n_layer"] == 12 and cfg["n_embd"] == 768 else "tiny")
    autocast = a.precision == "bf16"
    if rank == 0:
        print(f"torch_gpt2 on {name} with torch {torch.__version__}, {a.precision}: {cfg}"
              + (f"; {size} processes" if size > 1 else ""))
    attention = "SDPA" if hasattr(F, "scaled_dot_product_attention") else "composed (no SDPA in this torch)"
    # load_state_dict (in run_batch) checks that the file's tensors are the model's parameters.
    out = dict(benchmark="gpt2", implementation="pytorch", torch=torch.__version__, device=name,
               model=model_name, parameters=sum(t.numel() for t in weights.values()),
               precision=("f32 parameters and gradients, bf16 autocast, " if autocast
                          else "f32 parameters, activations and gradients, ") + attention,
               optimizer="AdamW(fused) lr 6e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on matrices; clip 1.0",
               warmup=a.warmup, processes=size, runs=[])
    if device.type == "cpu":
        out["threads"] = torch.get_num_threads()
        out["openblas_coretype"] = os.environ.get("OPENBLAS_CORETYPE", "")
        out["openblas_num_threads"] = os.environ.get("OPENBLAS_NUM_THREADS", "")

    # Each batch size fails alone, and the JSON is rewritten after each: a later failure or the
    # check's time box does not take the earlier figures with it.
    runs = out["runs"]
    for B in [int(b) for b in a.batch.split(",")]:
        try:
            runs.append(run_batch(B, a, cfg, weights, tokens, device, autocast))
        except Exception as e:  # out of memory, a device fault: this batch size's error
            print(f"torch_gpt2: B={B} failed: {type(e).__name__}: {e}", file=sys.stderr)
            runs.append(dict(batch=B, error=f"{type(e).__name__}: {e}"))
        if a.json and rank == 0:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
        if size > 1 and runs[-1].get("error"):
            # The other ranks wait in a collective this one left: the launcher ends them all.
            sys.stdout.flush()
            os._exit(1)

    if size > 1:
        dist.destroy_process_group()
    if rank != 0:
        return 1 if any(r.get("error") for r in runs) else 0
    print(f"\n{'batch':>6} {'step ms':>12} {'tokens/s':>12} {'peak alloc MiB':>15} {'RSS growth MiB':>15} "
          f"{'last loss':>10}")
    for r in runs:
        if r.get("error"):
            print(f"{r['batch']:>6}  failed: {r['error']}")
            continue
        peak, rss = (r.get(k) for k in ("peak_allocated_bytes", "host_rss_growth_bytes"))
        peak = "-" if peak is None else f"{peak / 2**20:.1f}"  # on CUDA only
        rss = "-" if rss is None else f"{rss / 2**20:.1f}"  # on the CPU only
        print(f"{r['batch']:>6} {r['step_ms_median']:>12.1f} {r['tokens_per_s']:>12.0f} "
              f"{peak:>15} {rss:>15} {r['losses'][-1]:>10.4f}")
    if a.json:
        print("wrote", a.json)
    return 1 if any(r.get("error") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
