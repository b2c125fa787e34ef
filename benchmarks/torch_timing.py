"""Timing shared by the PyTorch benchmarks, the same way as benchmarks/bench_util.h: marks are
torch.cuda.Events in the stream (host time on the CPU), a repetition is the time between its two
marks, and figures are medians."""
import statistics
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
