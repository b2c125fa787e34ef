#!/usr/bin/python3
"""Writes tests/fixtures/interop.safetensors: tensors made by PyTorch, laid out by hand with
struct and json (no `safetensors` package), so that microbatch's reader is checked against a file
it did not write. tests/core/test_safetensors.cpp knows the values below.

Run with Debian's torch: /usr/bin/python3 scripts/make_safetensors_fixture.py
"""
import json
import os
import struct
import zlib

import torch

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}


def raw_bytes(t):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the same 16 bits as int16
        t = t.view(torch.int16)
    return t.numpy().tobytes()  # little-endian on the machines this runs on


def main():
    tensors = {
        "a_f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b_f64": torch.arange(4, dtype=torch.float64) * 0.5,
        "c_f16": torch.tensor([1.0, -2.0, 0.5, 65504.0], dtype=torch.float16),
        "d_bf16": torch.tensor([1.0, -3.0, 0.25], dtype=torch.bfloat16),
        "e_i64": torch.arange(-3, 3, dtype=torch.int64),
        "f_i32": torch.tensor([[1, -2], [2**31 - 1, -2**31]], dtype=torch.int32),
        "g_u8": torch.arange(250, 256, dtype=torch.uint8),
        "h_bool": torch.tensor([True, False, True]),
        "i_scalar": torch.tensor(7.5, dtype=torch.float32),
        "j_empty": torch.zeros(0, 3, dtype=torch.float32),
        # A transposed view: its file bytes are the row-major order of the transpose.
        "k_transposed": torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),
    }
    # Name order, not the reference writer's descending alignment: readers must not depend on it.
    header = {"__metadata__": {"format": "pt", "source": "make_safetensors_fixture.py"}}
    data = b""
    for name, t in tensors.items():
        blob = raw_bytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    # Checksums from zlib, to check that our CRC-32 is the same function.
    for name, t in tensors.items():
        header["__metadata__"]["microbatch.crc32." + name] = "%08x" % zlib.crc32(raw_bytes(t))
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                       "interop.safetensors")
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    print(out, 8 + len(text) + len(data), "bytes")


if __name__ == "__main__":
    main()
