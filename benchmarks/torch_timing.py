"""What the PyTorch benchmarks share, done the same way as benchmarks/bench_util.h: timing (marks
are torch.cuda.Events in the stream, host time on the CPU; a repetition is the time between its two
marks; figures are medians), the process's resident memory on the CPU, and a small safetensors
reader (the GPU machine has no safetensors package)."""
import ctypes
import json
import statistics
import struct
import time

import torch


class Timer:
    """Marks in a CUDA stream (events) or in host time (CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def ms(self, a, b):
        if self.cuda:
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b])
        return (self.marks[b] - self.marks[a]) * 1e3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(ms):
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), reps=len(ms))


def time_reps(device, warmup, reps, fn):
    """fn run `warmup` times, then `reps` times, each repetition timed alone."""
    for _ in range(warmup):
        fn()
    sync(device)
    timer = Timer(device)
    marks = []
    for _ in range(reps):
        a = timer.mark()
        fn()
        marks.append((a, timer.mark()))
    return summarize([timer.ms(a, b) for a, b in marks])


DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    """Returns ({name: CPU tensor}, metadata) for a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    if n > 100_000_000 or 8 + n > len(data):
        raise ValueError(f"{path}: bad header length {n}")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        shape = info["shape"]
        raw = bytearray(body[begin:end])
        t = torch.frombuffer(raw, dtype=dtype) if len(raw) > 0 else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(shape).clone()
    return tensors, metadata


def resident_memory():
    """(VmRSS, VmHWM) of this process in bytes, from Linux's /proc/self/status; None each where
    missing. The C++ benchmarks read the same lines (benchmarks/bench_util.h, ResidentMemory)."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM") and rest.split():
                    found[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return found.get("VmRSS"), found.get("VmHWM")


def release_free_heap():
    """Hands the C heap's free pages back to the system (glibc's malloc_trim), as the C++
    benchmarks do before their baseline: what an earlier run freed and malloc kept would raise it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_resident_peak():
    """Sets VmHWM to the current resident size (Linux 4.0 and later); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_fields(device, rss_before, rss_peak):
    """A run's memory figures, as the C++ benchmarks write them: the allocator's peaks on a GPU
    (max_memory_allocated / max_memory_reserved), and where both resident sizes were measured (the
    CPU runs) the growth of resident memory over the run."""
    fields = {}
    if device.type == "cuda":
        fields["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        fields["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if rss_before is not None and rss_peak is not None:
        fields.update(host_rss_before_bytes=rss_before, host_peak_rss_bytes=rss_peak,
                      host_rss_growth_bytes=rss_peak - rss_before)
    return fields
