#!/usr/bin/python3
"""Writes tests/fixtures/ops.json: PyTorch's forward values for every op in core/ops.h and for the
tensor views, on fixed small inputs, for tests/core/test_fixtures.cpp to check our ops against.

Run with Debian's torch (1.13), which lives under /usr/bin/python3:
    /usr/bin/python3 scripts/make_fixtures.py

Each case is {name, op, params, inputs: [{shape, dtype, data}], output: {shape, dtype, data}},
with data flat in row-major order; non-finite values are the strings "inf", "-inf", "nan".
Inputs are drawn in f64 from a fixed seed and rounded to the case's dtype before torch sees them,
so the C++ side rebuilds exactly the same input values.

16-bit cases (f16, bf16): torch 1.13 has no CPU kernels for many ops in half precision, and our
contract is "compute in f32, round once", so their reference is torch's op on the inputs widened
to f32, rounded to the 16-bit dtype at the end. Casts use torch's own conversions (exact).

Not covered: dropout (random by design; its own test checks its statistics and determinism).
scaled_dot_product_attention does not exist in torch 1.13; its reference is the formula
softmax(q k^T * scale + causal mask) v computed with torch ops.
"""
import json
import math
import pathlib

import numpy as np
import torch
import torch.nn.functional as F

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ops.json"

DTYPES = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "bool": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
HALF = (torch.float16, torch.bfloat16)

rng = np.random.default_rng(20240611)
cases = []


# ---- inputs and encoding ------------------------------------------------------------------------

def rand(shape, lo=-1.0, hi=1.0, dtype="f64"):
    """Uniform values drawn in f64, then rounded to dtype."""
    values = rng.uniform(lo, hi, size=shape)
    return torch.tensor(values, dtype=torch.float64).to(DTYPES[dtype])


def ints(shape, lo, hi, dtype="i64"):
    return torch.tensor(rng.integers(lo, hi, size=shape), dtype=DTYPES[dtype])


def tensor(values, dtype="f64"):
    return torch.tensor(values, dtype=torch.float64).to(DTYPES[dtype])


def number(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def encode(t):
    t = t.detach().contiguous()
    if t.dtype.is_floating_point:
        data = t.double().flatten().tolist()
    else:
        data = t.long().flatten().tolist()
    return {"shape": list(t.shape), "dtype": NAMES[t.dtype], "data": [number(v) for v in data]}


def widened(fn, inputs):
    """fn on the inputs, with 16-bit floats widened to f32 and the result rounded back once."""
    half = [t.dtype for t in inputs if t.dtype in HALF]
    if not half:
        return fn(*inputs)
    out = fn(*[t.float() if t.dtype in HALF else t for t in inputs])
    return out.to(half[0]) if out.dtype.is_floating_point else out


def case(name, op, inputs, fn, params=None, exact=False, noncontiguous=False, widen=True):
    """Adds a case; `exact` compares without tolerance (casts, views, selections); `widen=False`
    runs fn on the inputs as they are (casts)."""
    out = widened(fn, inputs) if widen else fn(*inputs)
    entry = {"name": name, "op": op, "params": params or {},
             "inputs": [encode(t) for t in inputs], "output": encode(out)}
    if exact:
        entry["exact"] = True
    if noncontiguous:
        entry["noncontiguous"] = True  # the test lays every floating input out with strides
    cases.append(entry)


def all_dims(t, dims):
    return list(range(t.dim())) if not dims else dims


# ---- element-wise -------------------------------------------------------------------------------

def elementwise():
    binary = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
              "maximum": torch.maximum, "minimum": torch.minimum}
    for op, fn in binary.items():
        case(f"{op} same shape", op, [rand([3, 4]), rand([3, 4])], fn)
        case(f"{op} broadcast", op, [rand([2, 1, 4]), rand([3, 1])], fn)
    case("div by small", "div", [rand([5]), rand([5], 0.1, 2)], torch.div)
    case("add scalar-shaped", "add", [rand([2, 3]), rand([])], torch.add)
    case("add f32 non-contiguous", "add", [rand([3, 4], dtype="f32"), rand([3, 4], dtype="f32")],
         torch.add, noncontiguous=True)
    case("maximum ties", "maximum", [tensor([1, 2, 3, 4]), tensor([1, 3, 3, 0])], torch.maximum)
    case("add i64", "add", [ints([2, 3], -5, 5), ints([3], -5, 5)], torch.add, exact=True)
    case("mul i64 * f64 promotes", "mul", [ints([2, 3], -5, 5), rand([2, 3])], torch.mul)
    for dt in ("f32", "f16", "bf16"):
        case(f"add {dt}", "add", [rand([4, 5], dtype=dt), rand([5], dtype=dt)], torch.add)
        case(f"mul {dt}", "mul", [rand([4, 5], dtype=dt), rand([4, 5], dtype=dt)], torch.mul)
        case(f"div {dt}", "div", [rand([4, 5], dtype=dt), rand([4, 5], 0.5, 2, dtype=dt)], torch.div)

    case("pow tensor", "pow", [rand([3, 4], 0.2, 2), rand([3, 4], -2, 2)], torch.pow)
    case("pow tensor broadcast", "pow", [rand([2, 3], 0.2, 2), rand([3], -1, 3)], torch.pow)
    for e in (2.0, 0.5, -1.5, 3.0, 0.0):
        case(f"pow scalar {e}", "pow_scalar", [rand([2, 5], 0.1, 2)], lambda a, e=e: torch.pow(a, e),
             {"exponent": e})
    case("pow scalar 2 negative base", "pow_scalar", [rand([6], -2, 2)], lambda a: torch.pow(a, 2.0),
         {"exponent": 2.0})

    scalar_ops = {"add_scalar": lambda a, s: a + s, "sub_scalar": lambda a, s: a - s,
                  "mul_scalar": lambda a, s: a * s, "div_scalar": lambda a, s: a / s,
                  "rsub_scalar": lambda a, s: s - a, "rdiv_scalar": lambda a, s: s / a}
    for op, fn in scalar_ops.items():
        case(op, op, [rand([2, 3], 0.5, 2)], lambda a, fn=fn: fn(a, 1.75), {"scalar": 1.75})

    unary = {
        "neg": (torch.neg, -2, 2), "exp": (torch.exp, -3, 3), "log": (torch.log, 0.05, 5),
        "sqrt": (torch.sqrt, 0.01, 4), "rsqrt": (torch.rsqrt, 0.05, 4), "abs": (torch.abs, -2, 2),
        "tanh": (torch.tanh, -3, 3), "sigmoid": (torch.sigmoid, -6, 6), "relu": (torch.relu, -2, 2),
        "silu": (F.silu, -4, 4),
    }
    for op, (fn, lo, hi) in unary.items():
        case(op, op, [rand([3, 5], lo, hi)], fn)
        case(f"{op} f32", op, [rand([7], lo, hi, dtype="f32")], fn)
    for approx in ("none", "tanh"):
        gelu = lambda a, approx=approx: F.gelu(a, approximate=approx)
        case(f"gelu {approx}", "gelu", [rand([3, 5], -4, 4)], gelu, {"approximate": approx})
        for dt in ("f32", "f16", "bf16"):
            case(f"gelu {approx} {dt}", "gelu", [rand([12], -4, 4, dtype=dt)], gelu, {"approximate": approx})
    for dt in ("f16", "bf16"):
        case(f"exp {dt}", "exp", [rand([10], -3, 3, dtype=dt)], torch.exp)
        case(f"silu {dt}", "silu", [rand([10], -4, 4, dtype=dt)], F.silu)
        case(f"tanh {dt}", "tanh", [rand([10], -3, 3, dtype=dt)], torch.tanh)
    case("relu non-contiguous", "relu", [rand([4, 3])], torch.relu, noncontiguous=True)
    case("log of zero", "log", [tensor([0.0, 1.0, math.e])], torch.log)
    case("exp overflows f32", "exp", [tensor([100.0, -200.0, 0.0], "f32")], torch.exp)
    case("neg i64", "neg", [ints([5], -9, 9)], torch.neg, exact=True)
    case("abs i64", "abs", [ints([5], -9, 9)], torch.abs, exact=True)

    # Comparisons: small integers in f64 so that ties occur.
    for op in ("eq", "ne", "lt", "le", "gt", "ge"):
        fn = getattr(torch, op)
        a = torch.tensor(rng.integers(0, 3, size=[3, 4]), dtype=torch.float64)
        b = torch.tensor(rng.integers(0, 3, size=[4]), dtype=torch.float64)
        case(op, op, [a, b], fn, exact=True)
        case(f"{op} i64", op, [ints([6], 0, 3), ints([6], 0, 3)], fn, exact=True)

    cond = torch.tensor(rng.integers(0, 2, size=[3, 4]), dtype=torch.bool)
    case("where", "where", [cond, rand([3, 4]), rand([3, 4])], torch.where, exact=True)
    case("where broadcast", "where", [cond[:, :1].contiguous(), rand([4]), rand([3, 1])], torch.where,
         exact=True)
    mask = torch.tensor(rng.integers(0, 2, size=[4]), dtype=torch.bool)
    case("masked_fill", "masked_fill", [rand([3, 4]), mask], lambda a, m: a.masked_fill(m, -2.5),
         {"value": -2.5}, exact=True)
    case("masked_fill -inf", "masked_fill", [rand([2, 4]), mask],
         lambda a, m: a.masked_fill(m, float("-inf")), {"value": "-inf"}, exact=True)
    case("masked_fill bf16", "masked_fill", [rand([2, 4], dtype="bf16"), mask],
         lambda a, m: a.masked_fill(m, 0.1), {"value": 0.1}, exact=True)

    d = rand([3, 4], -2, 2)
    case("accumulate_", "accumulate_", [d, rand([3, 4])], lambda a, b: a + 0.25 * b, {"weight": 0.25})
    case("accumulate_ f32 += f64", "accumulate_", [rand([5], dtype="f32"), rand([5])],
         lambda a, b: a + (-1.5 * b).float(), {"weight": -1.5})


# ---- casts: rounding to nearest even, overflow, truncation toward zero -------------------------

def casts():
    tricky = [0.0, -0.0, 1.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
              1.0 + 2 ** -9, 65504.0, 65519.0, 65520.0, 70000.0, -70000.0, 6e-8, 3e-8, 2.0 ** -25, 1e-5, 3.14159265,
              -2.71828183, 1e30, 1e-40, 0.1, 1.0 / 3.0, float("inf"), float("-inf"), float("nan")]
    src = tensor(tricky, "f32")
    for dt in ("f16", "bf16", "f64"):
        case(f"cast f32 -> {dt}", "cast", [src], lambda a, dt=dt: a.to(DTYPES[dt]), {"dtype": dt}, exact=True)
    x64 = tensor([1.0 + 2 ** -11 + 2 ** -40, 0.1, 1e300, 1e-300, 2.0 ** -149, 1.0 / 3.0])
    case("cast f64 -> f32", "cast", [x64], lambda a: a.float(), {"dtype": "f32"}, exact=True)
    case("cast f16 -> bf16", "cast", [rand([6], -100, 100, dtype="f16")], lambda a: a.bfloat16(),
         {"dtype": "bf16"}, exact=True, widen=False)
    case("cast bf16 -> f32", "cast", [rand([6], -100, 100, dtype="bf16")], lambda a: a.float(),
         {"dtype": "f32"}, exact=True, widen=False)
    fl = tensor([-2.7, -0.5, 0.0, 0.5, 2.7, 100.9], "f32")
    case("cast f32 -> i64 truncates", "cast", [fl], lambda a: a.long(), {"dtype": "i64"}, exact=True)
    case("cast f32 -> bool", "cast", [fl], lambda a: a.bool(), {"dtype": "bool"}, exact=True)
    case("cast i64 -> f32", "cast", [ints([5], -1000, 1000)], lambda a: a.float(), {"dtype": "f32"}, exact=True)
    case("cast bool -> f64", "cast", [torch.tensor([True, False, True])], lambda a: a.double(),
         {"dtype": "f64"}, exact=True)


# ---- reductions ---------------------------------------------------------------------------------

def reductions():
    x = rand([2, 3, 4])
    for dims in ([], [0], [1], [-1], [0, 2]):
        for keepdim in (False, True):
            p = {"dims": dims, "keepdim": keepdim}
            case(f"sum {dims} keepdim={keepdim}", "sum", [x],
                 lambda a, dims=dims, k=keepdim: a.sum(dim=all_dims(a, dims), keepdim=k), p)
            case(f"mean {dims} keepdim={keepdim}", "mean", [x],
                 lambda a, dims=dims, k=keepdim: a.mean(dim=all_dims(a, dims), keepdim=k), p)
            case(f"var {dims} keepdim={keepdim}", "var", [x],
                 lambda a, dims=dims, k=keepdim: torch.var(a, dim=all_dims(a, dims), keepdim=k),
                 {**p, "correction": 1})
    case("var correction 0", "var", [x], lambda a: torch.var(a, dim=[1, 2], correction=0),
         {"dims": [1, 2], "keepdim": False, "correction": 0})
    case("sum non-contiguous", "sum", [rand([3, 4])], lambda a: a.sum(dim=[0]), {"dims": [0], "keepdim": False},
         noncontiguous=True)
    case("sum i64", "sum", [ints([3, 4], -9, 9)], lambda a: a.sum(dim=[1]), {"dims": [1], "keepdim": False},
         exact=True)
    for dt in ("f32", "f16", "bf16"):
        y = rand([4, 6], 0, 1, dtype=dt)
        case(f"sum {dt}", "sum", [y], lambda a: a.sum(dim=[1]), {"dims": [1], "keepdim": False})
        case(f"mean {dt}", "mean", [y], lambda a: a.mean(dim=[0]), {"dims": [0], "keepdim": False})
    for dim in (0, 1, -1):
        for keepdim in (False, True):
            p = {"dim": dim, "keepdim": keepdim}
            case(f"max dim={dim} keepdim={keepdim}", "max", [x],
                 lambda a, d=dim, k=keepdim: torch.max(a, d, keepdim=k).values, p, exact=True)
            case(f"argmax dim={dim} keepdim={keepdim}", "argmax", [x],
                 lambda a, d=dim, k=keepdim: torch.argmax(a, d, keepdim=k), p, exact=True)
    ties = tensor([[1, 3, 3, 0], [2, 2, 1, 2]])
    case("argmax ties take the first", "argmax", [ties], lambda a: torch.argmax(a, 1), {"dim": 1, "keepdim": False},
         exact=True)
    case("max of all", "max_all", [x], lambda a: a.max(), exact=True)
    case("max bf16", "max", [rand([3, 5], dtype="bf16")], lambda a: torch.max(a, 1).values,
         {"dim": 1, "keepdim": False}, exact=True)
    case("sum_to", "sum_to", [rand([2, 3, 4])], lambda a: a.sum_to_size(3, 1), {"shape": [3, 1]})
    case("sum_to leading", "sum_to", [rand([2, 3, 4])], lambda a: a.sum_to_size(1, 4), {"shape": [1, 4]})


# ---- linear algebra -----------------------------------------------------------------------------

def linalg():
    mm = [("2-d", [3, 4], [4, 5]), ("batched", [2, 3, 4], [2, 4, 5]), ("broadcast batch", [2, 1, 3, 4], [3, 4, 2]),
          ("(..., K) @ (K, N)", [2, 3, 4], [4, 2]), ("1-d @ 2-d", [4], [4, 3]), ("2-d @ 1-d", [3, 4], [4]),
          ("1-d @ 1-d", [4], [4]), ("1-d @ batched", [4], [2, 4, 3]), ("batched @ 1-d", [2, 3, 4], [4])]
    for name, sa, sb in mm:
        case(f"matmul {name}", "matmul", [rand(sa), rand(sb)], torch.matmul)
    case("matmul non-contiguous", "matmul", [rand([3, 4]), rand([4, 5])], torch.matmul, noncontiguous=True)
    for dt in ("f32", "f16", "bf16"):
        case(f"matmul {dt}", "matmul", [rand([2, 5, 16], dtype=dt), rand([16, 3], dtype=dt)], torch.matmul)
    case("linear", "linear", [rand([2, 3, 4]), rand([5, 4]), rand([5])], F.linear)
    case("linear no bias", "linear", [rand([3, 4]), rand([2, 4])], F.linear)
    case("linear 1-d input", "linear", [rand([4]), rand([2, 4]), rand([2])], F.linear)
    for dt in ("f32", "bf16"):
        case(f"linear {dt}", "linear", [rand([4, 8], dtype=dt), rand([3, 8], dtype=dt), rand([3], dtype=dt)], F.linear)


# ---- shape and indexing -------------------------------------------------------------------------

def shape_and_index():
    case("cat dim 0", "cat", [rand([2, 3]), rand([1, 3]), rand([3, 3])], lambda *t: torch.cat(t, 0), {"dim": 0},
         exact=True)
    case("cat dim -1", "cat", [rand([2, 3]), rand([2, 1])], lambda *t: torch.cat(t, -1), {"dim": -1}, exact=True)
    case("cat 3-d dim 1", "cat", [rand([2, 2, 3]), rand([2, 4, 3])], lambda *t: torch.cat(t, 1), {"dim": 1},
         exact=True, noncontiguous=True)
    case("stack dim 0", "stack", [rand([2, 3]), rand([2, 3])], lambda *t: torch.stack(t, 0), {"dim": 0}, exact=True)
    case("stack dim -1", "stack", [rand([2, 3]), rand([2, 3]), rand([2, 3])], lambda *t: torch.stack(t, -1),
         {"dim": -1}, exact=True)
    case("stack dim 1", "stack", [rand([4]), rand([4])], lambda *t: torch.stack(t, 1), {"dim": 1}, exact=True)

    w = rand([6, 3])
    case("embedding", "embedding", [w, ints([2, 4], 0, 6)], lambda w, i: F.embedding(i, w), exact=True)
    case("embedding 1-d", "embedding", [w, ints([5], 0, 6)], lambda w, i: F.embedding(i, w), exact=True)
    case("embedding bf16", "embedding", [rand([6, 3], dtype="bf16"), ints([3], 0, 6)],
         lambda w, i: F.embedding(i, w), exact=True)
    a = rand([3, 4])
    case("gather dim 0", "gather", [a, ints([2, 4], 0, 3)], lambda a, i: torch.gather(a, 0, i), {"dim": 0}, exact=True)
    case("gather dim 1", "gather", [a, ints([3, 2], 0, 4)], lambda a, i: torch.gather(a, 1, i), {"dim": 1}, exact=True)
    case("gather dim -1 3-d", "gather", [rand([2, 3, 4]), ints([2, 3, 1], 0, 4)],
         lambda a, i: torch.gather(a, -1, i), {"dim": -1}, exact=True)
    case("index_select dim 0", "index_select", [a, tensor([2, 0, 2]).long()],
         lambda a, i: torch.index_select(a, 0, i), {"dim": 0}, exact=True)
    case("index_select dim 1", "index_select", [a, tensor([3, 1]).long()],
         lambda a, i: torch.index_select(a, 1, i), {"dim": 1}, exact=True)
    case("index_select non-contiguous", "index_select", [rand([4, 3]), tensor([1, 3]).long()],
         lambda a, i: torch.index_select(a, 0, i), {"dim": 0}, exact=True, noncontiguous=True)


# ---- views (Tensor methods) ---------------------------------------------------------------------

def views():
    x = rand([2, 3, 4])
    case("reshape", "reshape", [x], lambda a: a.reshape(4, 6), {"shape": [4, 6]}, exact=True)
    case("reshape -1", "reshape", [x], lambda a: a.reshape(-1, 2), {"shape": [-1, 2]}, exact=True)
    case("reshape non-contiguous", "reshape", [x], lambda a: a.reshape(6, 4), {"shape": [6, 4]}, exact=True,
         noncontiguous=True)
    case("view", "view", [x], lambda a: a.view(3, 8), {"shape": [3, 8]}, exact=True)
    case("transpose", "transpose", [x], lambda a: a.transpose(0, 2), {"dim0": 0, "dim1": 2}, exact=True)
    case("transpose negative", "transpose", [x], lambda a: a.transpose(-1, -2), {"dim0": -1, "dim1": -2}, exact=True)
    case("t", "t", [rand([3, 5])], lambda a: a.t(), exact=True)
    case("permute", "permute", [x], lambda a: a.permute(1, 2, 0), {"dims": [1, 2, 0]}, exact=True)
    case("slice", "slice", [x], lambda a: a[:, 1:3], {"dim": 1, "start": 1, "end": 3, "step": 1}, exact=True)
    case("slice step", "slice", [rand([7, 2])], lambda a: a[1:7:2], {"dim": 0, "start": 1, "end": 7, "step": 2},
         exact=True)
    case("slice negative", "slice", [x], lambda a: a[..., -3:-1], {"dim": -1, "start": -3, "end": -1, "step": 1},
         exact=True)
    case("slice past the end", "slice", [x], lambda a: a[..., 2:100], {"dim": 2, "start": 2, "end": 100, "step": 1},
         exact=True)
    case("select", "select", [x], lambda a: a.select(1, 2), {"dim": 1, "index": 2}, exact=True)
    case("select negative", "select", [x], lambda a: a.select(-1, -1), {"dim": -1, "index": -1}, exact=True)
    case("expand", "expand", [rand([3, 1])], lambda a: a.expand(2, 3, 4), {"shape": [2, 3, 4]}, exact=True)
    case("expand -1", "expand", [rand([3, 1])], lambda a: a.expand(-1, 5), {"shape": [-1, 5]}, exact=True)
    case("squeeze", "squeeze", [rand([2, 1, 3])], lambda a: a.squeeze(1), {"dim": 1}, exact=True)
    case("squeeze non-1 is a no-op", "squeeze", [rand([2, 3])], lambda a: a.squeeze(0), {"dim": 0}, exact=True)
    case("unsqueeze", "unsqueeze", [rand([2, 3])], lambda a: a.unsqueeze(-1), {"dim": -1}, exact=True)
    case("flatten", "flatten", [x], lambda a: a.flatten(), {"start_dim": 0, "end_dim": -1}, exact=True)
    case("flatten inner", "flatten", [rand([2, 3, 4, 2])], lambda a: a.flatten(1, 2), {"start_dim": 1, "end_dim": 2},
         exact=True)
    case("contiguous of a transpose", "contiguous", [x], lambda a: a.contiguous(), exact=True, noncontiguous=True)


# ---- neural-network functions -------------------------------------------------------------------

def nn_functions():
    x = rand([3, 5], -3, 3)
    for dim in (-1, 0):
        case(f"softmax dim={dim}", "softmax", [x], lambda a, d=dim: torch.softmax(a, d), {"dim": dim})
        case(f"log_softmax dim={dim}", "log_softmax", [x], lambda a, d=dim: torch.log_softmax(a, d), {"dim": dim})
    case("softmax 3-d middle", "softmax", [rand([2, 3, 4], -3, 3)], lambda a: torch.softmax(a, 1), {"dim": 1})
    case("softmax large logits", "softmax", [tensor([[1000, 1001, 1002], [-1000, 0, 1000]])],
         lambda a: torch.softmax(a, -1), {"dim": -1})
    case("log_softmax large logits", "log_softmax", [tensor([[1000, 1001, 1002]])],
         lambda a: torch.log_softmax(a, -1), {"dim": -1})
    case("softmax with -inf", "softmax", [tensor([[0, float("-inf"), 1], [2, 2, float("-inf")]])],
         lambda a: torch.softmax(a, -1), {"dim": -1})
    case("softmax non-contiguous", "softmax", [rand([4, 3], -3, 3)], lambda a: torch.softmax(a, -1), {"dim": -1},
         noncontiguous=True)
    for dt in ("f32", "f16", "bf16"):
        case(f"softmax {dt}", "softmax", [rand([3, 8], -4, 4, dtype=dt)], lambda a: torch.softmax(a, -1), {"dim": -1})
        case(f"log_softmax {dt}", "log_softmax", [rand([3, 8], -4, 4, dtype=dt)],
             lambda a: torch.log_softmax(a, -1), {"dim": -1})

    logits = rand([6, 5], -3, 3)
    target = tensor([0, 4, 2, 2, 1, 3]).long()
    ignored = tensor([0, -100, 2, 2, -100, 3]).long()
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.1):
            for tname, t in (("", target), (" ignore_index", ignored)):
                p = {"reduction": reduction, "label_smoothing": smoothing, "ignore_index": -100}
                case(f"cross_entropy {reduction} smoothing={smoothing}{tname}", "cross_entropy", [logits, t],
                     lambda a, b, p=p: F.cross_entropy(a, b, ignore_index=p["ignore_index"], reduction=p["reduction"],
                                                       label_smoothing=p["label_smoothing"]), p)
    p = {"reduction": "mean", "label_smoothing": 0.0, "ignore_index": 1}
    case("cross_entropy ignore_index=1", "cross_entropy", [logits, target],
         lambda a, b: F.cross_entropy(a, b, ignore_index=1), p)
    p = {"reduction": "mean", "label_smoothing": 0.0, "ignore_index": -100}
    for dt in ("f32", "bf16"):
        case(f"cross_entropy {dt}", "cross_entropy", [rand([4, 7], -3, 3, dtype=dt), tensor([1, 6, 0, 3]).long()],
             lambda a, b: F.cross_entropy(a, b), p)

    for shape, norm in (([2, 3, 4], [4]), ([2, 3, 4], [3, 4]), ([5, 6], [6])):
        n = [rand(norm, 0.5, 1.5), rand(norm)]
        for has_w, has_b in ((True, True), (False, False), (True, False)):
            inputs = [rand(shape, -2, 2)] + ([n[0]] if has_w else []) + ([n[1]] if has_b else [])
            p = {"normalized_shape": norm, "eps": 1e-5, "weight": has_w, "bias": has_b}

            def ln(a, *wb, norm=norm, has_w=has_w, has_b=has_b):
                w = wb[0] if has_w else None
                b = wb[-1] if has_b else None
                return F.layer_norm(a, norm, w, b, 1e-5)

            case(f"layer_norm {shape} over {norm} w={has_w} b={has_b}", "layer_norm", inputs, ln, p)
    p = {"normalized_shape": [8], "eps": 1e-3, "weight": True, "bias": True}
    for dt in ("f32", "f16", "bf16"):
        case(f"layer_norm {dt}", "layer_norm", [rand([3, 8], -2, 2, dtype=dt), rand([8], 0.5, 1.5, dtype=dt),
                                                rand([8], dtype=dt)],
             lambda a, w, b: F.layer_norm(a, [8], w, b, 1e-3), p)


def attention_reference(q, k, v, causal, scale):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        t, sk = q.shape[-2], k.shape[-2]
        keep = torch.ones(t, sk, dtype=torch.bool).tril()  # query i sees keys 0..i (top-left)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v)


def attention():
    for causal in (True, False):
        for scale in (None, 0.3):
            q, k, v = rand([2, 2, 4, 3]), rand([2, 2, 4, 3]), rand([2, 2, 4, 3])
            p = {"causal": causal} if scale is None else {"causal": causal, "scale": scale}
            case(f"sdpa causal={causal} scale={scale}", "scaled_dot_product_attention", [q, k, v],
                 lambda q, k, v, c=causal, s=scale: attention_reference(q, k, v, c, s), p)
    case("sdpa causal, more keys than queries", "scaled_dot_product_attention",
         [rand([1, 2, 3, 4]), rand([1, 2, 5, 4]), rand([1, 2, 5, 2])],
         lambda q, k, v: attention_reference(q, k, v, True, None), {"causal": True})
    for dt in ("f32", "bf16"):
        case(f"sdpa {dt}", "scaled_dot_product_attention", [rand([1, 2, 5, 4], dtype=dt) for _ in range(3)],
             lambda q, k, v: attention_reference(q, k, v, True, None), {"causal": True})


# ---- convolution and pooling --------------------------------------------------------------------

def conv_pool():
    configs = [([2, 3, 5, 5], [4, 3, 3, 3], 1, 0, True), ([1, 2, 6, 5], [3, 2, 3, 3], 1, 1, False),
               ([2, 2, 7, 7], [2, 2, 3, 3], 2, 1, True), ([1, 3, 6, 7], [2, 3, 2, 3], 2, 0, True),
               ([1, 1, 4, 4], [2, 1, 5, 5], 1, 2, True), ([2, 4, 5, 5], [3, 4, 1, 1], 2, 0, False)]
    for xs, ws, s, pad, bias in configs:
        inputs = [rand(xs), rand(ws)] + ([rand([ws[0]])] if bias else [])
        case(f"conv2d {xs} * {ws} stride={s} padding={pad} bias={bias}", "conv2d", inputs,
             lambda x, w, *b, s=s, pad=pad: F.conv2d(x, w, b[0] if b else None, stride=s, padding=pad),
             {"stride": s, "padding": pad})
    case("conv2d non-contiguous", "conv2d", [rand([1, 2, 5, 5]), rand([2, 2, 3, 3]), rand([2])],
         lambda x, w, b: F.conv2d(x, w, b, padding=1), {"stride": 1, "padding": 1}, noncontiguous=True)
    for dt in ("f32", "f16", "bf16"):
        case(f"conv2d {dt}", "conv2d", [rand([2, 3, 6, 6], dtype=dt), rand([4, 3, 3, 3], dtype=dt), rand([4], dtype=dt)],
             lambda x, w, b: F.conv2d(x, w, b, stride=1, padding=1), {"stride": 1, "padding": 1})

    for xs, k, s, pad in (([2, 3, 6, 6], 2, 0, 0), ([1, 2, 7, 5], 3, 2, 1), ([2, 1, 5, 5], 3, 1, 1),
                          ([1, 2, 6, 7], 4, 3, 2), ([1, 1, 3, 3], 3, 0, 0)):
        case(f"max_pool2d {xs} k={k} stride={s} padding={pad}", "max_pool2d", [rand(xs)],
             lambda x, k=k, s=s, pad=pad: F.max_pool2d(x, k, stride=s or k, padding=pad),
             {"kernel_size": k, "stride": s, "padding": pad}, exact=True)
    case("max_pool2d negative input with padding", "max_pool2d", [rand([1, 2, 4, 4], -3, -1)],
         lambda x: F.max_pool2d(x, 2, stride=2, padding=1), {"kernel_size": 2, "stride": 2, "padding": 1}, exact=True)
    case("max_pool2d non-contiguous", "max_pool2d", [rand([1, 2, 4, 6])], lambda x: F.max_pool2d(x, 2),
         {"kernel_size": 2, "stride": 0, "padding": 0}, exact=True, noncontiguous=True)
    for dt in ("f16", "bf16"):
        case(f"max_pool2d {dt}", "max_pool2d", [rand([1, 2, 4, 4], dtype=dt)], lambda x: F.max_pool2d(x, 2),
             {"kernel_size": 2, "stride": 0, "padding": 0}, exact=True)


def main():
    torch.manual_seed(0)
    for section in (elementwise, casts, reductions, linalg, shape_and_index, views, nn_functions, attention,
                    conv_pool):
        section()
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    doc = {
        "comment": "PyTorch " + torch.__version__ + " forward values, written by scripts/make_fixtures.py. "
                   "16-bit cases: torch's op in f32 on the widened inputs, rounded once. "
                   "dropout is not covered: it is random by design.",
        "skipped_ops": ["dropout"],
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {len(cases)} cases, {OUT.stat().st_size} bytes, to {OUT}")


if __name__ == "__main__":
    main()
