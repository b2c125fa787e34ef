#!/usr/bin/python3
"""PyTorch reference runs for the parity tests (tests/train/test_parity.cpp).

Run with Debian's torch (/usr/bin/python3 scripts/make_parity_fixtures.py). For an MLP and a
2-layer GPT with the architecture and parameter names of nn/models.h, it writes
tests/fixtures/parity_<model>.safetensors holding the initial weights ("init.<name>"), the
batches ("batch.<step>.inputs" / ".labels"), and the accumulated gradients of the first window
("grad1.<name>"), plus tests/fixtures/parity_<model>.json with the loss of every micro-batch over
20 AdamW steps. Each window is 2 micro-batches of different sizes, weighted exactly by their share
of the window's loss-bearing items (samples, or tokens != -100).
"""
import json
import math
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures")
STEPS = 20
SPLIT = (5, 3)  # micro-batch sizes of every window


def save_safetensors(path, tensors):
    """The safetensors format by hand: u64 header length, JSON header, raw little-endian data."""
    names = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text.encode())
        for b in blobs:
            f.write(b)


class MLP(nn.Module):
    """Flatten -> Linear -> ReLU -> Linear -> ReLU -> Linear, named as nn::MLP ("net.<i>.")."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16),
                                 nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(c, 3 * c)
        self.attn.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def attention(self, x):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.attn.c_attn(x).split(c, dim=2)
        q, k, v = [z.view(b, t, self.heads, d).transpose(1, 2) for z in (q, k, v)]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.attn.c_proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 as nn::GPT: wte, wpe, h.<i>, ln_f; the head is tied to wte."""

    def __init__(self, vocab, block, layers, heads, c):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(block, c)
        self.h = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(c)

    def forward(self, idx, y):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)


def items(labels):
    return int((labels != -100).sum()) if labels.dim() > 1 else labels.shape[0]


def run(name, model, batches):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    tensors = {f"init.{n}": p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step, (x, y) in enumerate(batches):
        tensors[f"batch.{step}.inputs"] = x
        tensors[f"batch.{step}.labels"] = y
        opt.zero_grad()
        total = items(y)
        start = 0
        for n in SPLIT:
            xs, ys = x[start:start + n], y[start:start + n]
            loss = model(xs, ys)
            (loss * (items(ys) / total)).backward()
            losses.append(loss.item())
            start += n
        if step == 0:
            for n, p in model.named_parameters():
                tensors[f"grad1.{n}"] = p.grad.detach().clone()
        opt.step()
    for n, p in model.named_parameters():
        tensors[f"final.{n}"] = p.detach().clone()
    save_safetensors(os.path.join(OUT, f"parity_{name}.safetensors"), tensors)
    with open(os.path.join(OUT, f"parity_{name}.json"), "w") as f:
        json.dump({"model": name, "steps": STEPS, "split": list(SPLIT), "lr": 1e-2,
                   "weight_decay": 0.1, "losses": losses,
                   "torch_version": torch.__version__}, f, indent=1)
    print(f"{name}: {len(losses)} micro-batch losses, first {losses[0]:.6f}, last {losses[-1]:.6f}")


def main():
    torch.manual_seed(0)
    mlp = MLP()
    batches = [(torch.randn(8, 20), torch.randint(0, 5, (8,))) for _ in range(STEPS)]
    run("mlp", mlp, batches)

    torch.manual_seed(1)
    gpt = GPT(vocab=17, block=8, layers=2, heads=2, c=16)
    batches = []
    for _ in range(STEPS):
        x = torch.randint(0, 17, (8, 8))
        y = torch.randint(0, 17, (8, 8))
        keep = torch.randint(1, 9, (8,))  # real tokens per row; the rest is padding
        y[torch.arange(8)[None, :] >= keep[:, None]] = -100
        batches.append((x, y))
    run("gpt", gpt, batches)


if __name__ == "__main__":
    main()
