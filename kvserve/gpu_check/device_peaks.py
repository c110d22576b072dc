"""The device's own peaks, measured in the run whose figures are compared with them: the copy
bandwidth (read + write bytes/s, what an HBM-bound kernel can hope for) and the bf16 matmul peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

COPY_KEY = "copy_bytes_per_s"
GEMM_KEY = "bf16_matmul_flops"


def seconds_per_call(fn: Callable[[int], object], iterations: int, device: str, warmup: int = 3) -> float:
    """Mean seconds of `fn(i)` over back-to-back calls (CUDA events on the GPU: launches overlap)."""
    import torch

    for i in range(warmup):
        fn(i)
    if device != "cuda":
        started = time.perf_counter()
        for i in range(iterations):
            fn(i)
        return (time.perf_counter() - started) / iterations
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iterations):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iterations


def measure_device_peaks(ctx: StageContext) -> Outcome:
    import torch

    from kvserve.bench.executor import measure_gemm_flops

    device, sizes = ctx.sizes.device, ctx.sizes
    src = torch.empty(sizes.copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy = 2 * sizes.copy_bytes / seconds_per_call(lambda _i: dst.copy_(src), 10, device)
    gemm = measure_gemm_flops(device, torch.bfloat16, size=sizes.gemm_size, repeats=10)
    if device == "cuda":
        torch.cuda.empty_cache()
    ctx.state[COPY_KEY], ctx.state[GEMM_KEY] = copy, gemm
    figures = {COPY_KEY: copy, GEMM_KEY: gemm, "copy_bytes": sizes.copy_bytes, "gemm_size": sizes.gemm_size}
    copied = f"{sizes.copy_bytes / 2**30:g} GiB, read + write"
    rows = [("device copy bandwidth", copied, f"{copy / 1e9:,.0f} GB/s", "-", "-")]
    rows.append(("bf16 matmul peak", f"{sizes.gemm_size}^3 matmul", f"{gemm / 1e12:,.0f} TFLOP/s", "-", "-"))
    return Outcome(True, f"copy {copy / 1e9:,.0f} GB/s, bf16 matmul {gemm / 1e12:,.1f} TFLOP/s", figures, rows)
