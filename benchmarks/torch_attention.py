"""PyTorch's SDPA at the shape of benchmarks/attention_cuda.cpp, timed the same way.

    python3 benchmarks/torch_attention.py [--batch 8] [--json torch_attention.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch_timing import time_reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", default="")
    a = p.parse_args()
    shape = (a.batch, 12, 1024, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

    device = torch.device("cuda")
    f = time_reps(device, 3, 20, fwd)["median_ms"]
    fb = time_reps(device, 3, 20, fwd_bwd)["median_ms"]
    flops = 4.0 * a.batch * 12 * 1024 * 1024 * 64 / 2
    out = {"shape": shape, "forward_ms": f, "forward_backward_ms": fb,
           "forward_tflops": flops / (f * 1e-3) / 1e12, "forward_backward_tflops": 3.5 * flops / (fb * 1e-3) / 1e12}
    print(f"torch SDPA {shape} bf16 causal: forward {f:.3f} ms, forward + backward {fb:.3f} ms")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
