"""The device's own peaks, measured in the same run as the figures compared with them.

- copy bandwidth: a device-to-device copy of `copy_bytes`, counted as bytes read + written per
  second (what an HBM-bound kernel can hope for; a spec sheet's number is not reachable);
- bf16 matrix peak: a large square bf16 matmul (`kvserve bench executor`'s GEMM roofline).

Later checks of the stage read them from `ctx.state`, or from this check's result file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.gpu_check.results import Outcome, read_result
from kvserve.gpu_check.timing import seconds_per_call

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

COPY_KEY = "copy_bytes_per_s"
GEMM_KEY = "bf16_matmul_flops"


def measure_copy_bandwidth(device: str, num_bytes: int, iterations: int = 10) -> float:
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = seconds_per_call(lambda _i: dst.copy_(src), iterations, device)
    return 2 * num_bytes / seconds  # the buffers go with this frame


def peak(ctx: CheckContext, key: str) -> float | None:
    """A peak measured earlier in this run (None when device_peaks did not measure it)."""
    if key in ctx.state:
        return ctx.state[key]
    found = read_result(ctx.out_dir, "device_peaks")
    return None if found is None else found.figures.get(key)


def measure_device_peaks(ctx: CheckContext) -> Outcome:
    import torch

    from kvserve.bench.executor import measure_gemm_flops

    device, scale = ctx.scale.device, ctx.scale
    copy = measure_copy_bandwidth(device, scale.copy_bytes)
    gemm = measure_gemm_flops(device, torch.bfloat16, size=scale.gemm_size, repeats=10)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    ctx.state[COPY_KEY], ctx.state[GEMM_KEY] = copy, gemm
    figures = {COPY_KEY: copy, GEMM_KEY: gemm, "copy_bytes": scale.copy_bytes, "gemm_size": scale.gemm_size}
    rows = [
        (
            "device copy bandwidth",
            f"{scale.copy_bytes / 2**30:g} GiB, read + write",
            f"{copy / 1e9:,.0f} GB/s",
            "-",
            "-",
        ),
        ("bf16 matmul peak", f"{scale.gemm_size}^3 matmul", f"{gemm / 1e12:,.0f} TFLOP/s", "-", "-"),
    ]
    return Outcome(True, f"copy {copy / 1e9:,.0f} GB/s, bf16 matmul {gemm / 1e12:,.1f} TFLOP/s", figures, rows)
