"""What `kvserve bench executor` prints: a line per figure and a summary, or (`--json`) one JSON object.

The summary names the roofline and what it was measured on, the project's decode goal, the
decode step's physical limit and the executor's resident memory after the run (rank 0's, in a
tensor-parallel group).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from kvserve.bench.executor import BenchResult
from kvserve.bench.physical_limit import MemoryLimit, limit_tokens_per_s

if TYPE_CHECKING:
    from kvserve.executor.model_runner import ModelRunner

GOAL_DECODE64_ROOFLINE = 0.5
"""The project's CPU goal: decode at batch 64 reaches at least half the fp32 GEMM roofline."""


def json_report(runner: ModelRunner, ranks: int, gemm: float, limit: MemoryLimit, results: list[BenchResult]) -> str:
    """The `--json` object: rank 0's runner, the roofline, the memory limit, RSS and every figure."""
    from kvserve.executor.process_memory import MIB, resident_bytes

    report = {
        "dtype": runner.dtype_name,
        "weights": runner.weights_mode,
        "device": runner.device,
        "attention_backend": runner.backend_name,
        "batch_invariant": runner.invariant,
        "tensor_parallel_size": ranks,
        "gemm_flops": gemm,
        **asdict(limit),
        "rss_mib": resident_bytes() / MIB,
        "results": [asdict(r) for r in results],
    }
    return json.dumps(report)


def text_report(runner: ModelRunner, ranks: int, gemm: float, limit: MemoryLimit, results: list[BenchResult]) -> str:
    """A line per figure, then the roofline, the physical limit and resident memory, one line each."""
    from kvserve.executor.process_memory import MIB, resident_bytes

    lines = [_result_line(r) for r in results]
    lines.append(
        f"GEMM roofline: {gemm / 1e9:.1f} GFLOP/s ({f'{ranks} ranks, ' if ranks > 1 else ''}"
        f"{runner.dtype_name}, {runner.device}, attention {runner.backend_name}, "
        f"batch-invariant {'on' if runner.invariant else 'off'}); "
        f"model {runner.model_config.num_params / 1e6:.1f} M params; "
        f"goal: decode batch 64 >= {100 * GOAL_DECODE64_ROOFLINE:.0f}% of the roofline"
    )
    ceiling = limit_tokens_per_s(limit.copy_bandwidth, limit.weight_bytes, limit.kv_bytes_per_seq, 1)
    lines.append(
        f"physical limit: {limit.weight_bytes / 1e6:.1f} MB of weights and {limit.kv_bytes_per_seq / 1e6:.2f} "
        f"MB of KV per sequence read per step, copy bandwidth {limit.copy_bandwidth / 1e9:.1f} GB/s: at most "
        f"{ceiling:.0f} tokens/s at batch 1"
    )
    rank0 = " (rank 0)" if ranks > 1 else ""
    lines.append(f"executor resident memory after the run{rank0}: {resident_bytes() / MIB:.0f} MiB")
    return "\n".join(lines)


def _result_line(r: BenchResult) -> str:
    line = (
        f"{r.phase:7s} batch {r.batch:3d}  {r.tokens_per_s:9.1f} tokens/s  {1e3 * r.step_s:8.2f} ms/step  "
        f"{100 * r.roofline_fraction:5.1f}% of GEMM roofline"
    )
    if r.limit_fraction is not None:
        line += f"  {100 * r.limit_fraction:5.1f}% of the memory limit"
    if r.plan_bytes is None or r.broadcast_s is None or r.decode_plan_s is None:
        return line
    return (
        f"{line} | plan {_size(r.plan_bytes)}: broadcast {1e3 * r.broadcast_s:.2f} ms, "
        f"decode {1e3 * r.decode_plan_s:.2f} ms"
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes} B" if num_bytes < 1000 else f"{num_bytes / 1e3:.1f} kB"
