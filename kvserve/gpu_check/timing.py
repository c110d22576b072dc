"""Timing on the device: CUDA events around back-to-back calls on the GPU, perf_counter on CPU.

A loop of calls timed as a whole measures throughput (launches overlap the previous kernel);
`best_of` times calls one at a time with a synchronize each, for steps whose host work (plan
building, sampling) is part of what is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def seconds_per_call(fn: Callable[[int], object], iterations: int, device: str, warmup: int = 3) -> float:
    """Mean seconds of `fn(i)` over `iterations` back-to-back calls, after `warmup` untimed ones."""
    for i in range(warmup):
        fn(i)
    synchronize(device)
    if device.startswith("cuda"):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iterations):
            fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / iterations
    started = time.perf_counter()
    for i in range(iterations):
        fn(i)
    return (time.perf_counter() - started) / iterations


def best_of(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Fastest of `repeats` synchronized calls (the first is a warm-up and not counted)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best
