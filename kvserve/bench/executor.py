"""`kvserve bench executor`'s measurements: runner throughput against the machine's fp32 GEMM roofline.

The roofline is measured in the same run: the FLOP/s of a large square matmul on the
runner's device and dtype. A decode token costs 2 × parameters FLOPs (the embedding matrix
counted as the lm_head, not as its lookup); a prefill token the same less the lm_head, which
only a prompt's last token runs. A phase's roofline fraction is tokens/s × FLOPs per token /
GEMM FLOP/s. Decode runs B sequences whose
`prompt_len`-token prompts were prefilled untimed; prefill runs fresh 512-token prompts.

Each decode batch is also measured against the physical limit of its step (every weight and each
sequence's KV read once, at a copy bandwidth measured in the same run: `kvserve.bench.physical_limit`).

Any `Executor` can be measured; the figures take their device, dtype and model from rank 0's
runner. For a tensor-parallel group the roofline is N × rank 0's (each rank multiplies on its own
share of the cores, or its own device), and each decode step's plan is also priced on its way to
the other ranks: rank 0's encode + broadcast, and (timed apart, after the step) the decode every
other rank runs before its forward.

The command (flags, starting the runner or group) is `executor_command.py`; what it prints,
`executor_report.py`. torch loads inside the functions that use it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.bench.physical_limit import MemoryLimit, limit_tokens_per_s, memory_limit
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.plan_driver import PlanDriver

if TYPE_CHECKING:
    import torch

    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.protocol import Executor


@dataclass(slots=True)
class BenchResult:
    phase: str
    """"decode" or "prefill"."""
    batch: int
    tokens_per_s: float
    roofline_fraction: float
    step_s: float
    """The median timed step."""
    broadcast_s: float | None = None
    """Decode on N > 1 ranks: rank 0's median encode + broadcast of a step's plan (None on one rank)."""
    decode_plan_s: float | None = None
    """Decode on N > 1 ranks: the median decode of that plan's bytes, which every other rank runs
    before its forward (None on one rank)."""
    plan_bytes: int | None = None
    """Decode on N > 1 ranks: the last timed plan's encoded size (None on one rank)."""
    limit_fraction: float | None = None
    """Decode: tokens/s as a fraction of the physical limit, every weight and each sequence's KV read
    once per step at the copy bandwidth measured in the same run (`kvserve.bench.physical_limit`)."""


@dataclass(slots=True)
class PlanCost:
    """A decode step's plan on its way to the other ranks of a group."""

    broadcast_s: float
    decode_s: float
    size_bytes: int


def measure_gemm_flops(device: str, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of a size×size matmul: the roofline every figure is compared with."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def time_decode(
    executor: Executor,
    batch: int,
    prompt_len: int,
    steps: int,
    sampling: SamplingParams,
    seq_base: int = 0,
    runner: ModelRunner | None = None,
) -> tuple[float, PlanCost | None]:
    """(median decode step in seconds, its plan's cost to the other ranks; None on one rank)."""
    from kvserve.executor.tensor_parallel.leader import TensorParallelExecutor

    device = _rank0(executor, runner).device
    group = executor if isinstance(executor, TensorParallelExecutor) else None
    rng = random.Random(batch)
    vocab = executor.info().vocab_size
    driver = PlanDriver(executor)
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        driver.add(seq_base + i, prompt, max_new_tokens=steps + 2, sampling=sampling, seed=i)
    driver.step()  # prefill, untimed
    driver.step()  # first decode warms caches, untimed
    times: list[float] = []
    sends: list[float] = []
    encoded: list[bytes] = []
    for _ in range(steps):
        _sync(device)
        started = time.perf_counter()
        driver.step()
        _sync(device)
        times.append(time.perf_counter() - started)
        if group is not None:  # off the clock
            sends.append(group.last_send_s)
            encoded.append(group.last_plan_bytes)
    driver.run()
    return _robust_time(times), (_plan_cost(sends, encoded) if encoded else None)


def _plan_cost(sends: list[float], encoded: list[bytes]) -> PlanCost:
    """Medians of rank 0's broadcasts and of a follower's decode of the same plans, timed here."""
    from kvserve.bench.plan_broadcast import decode_times

    return PlanCost(_robust_time(sends), _robust_time(decode_times(encoded)), len(encoded[-1]))


def bench_prefill(
    executor: Executor,
    batch: int,
    prompt_len: int,
    repeats: int,
    seq_base: int = 0,
    runner: ModelRunner | None = None,
) -> float:
    """Prefill tokens/s: `batch` fresh prompts of `prompt_len` tokens in one step."""
    device = _rank0(executor, runner).device
    rng = random.Random(prompt_len + batch)
    vocab = executor.info().vocab_size
    times = []
    for r in range(repeats + 1):
        driver = PlanDriver(executor)
        for i in range(batch):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            driver.add(seq_base + r * batch + i, prompt, max_new_tokens=1)
        _sync(device)
        started = time.perf_counter()
        driver.step()
        _sync(device)
        if r:  # the first is warm-up
            times.append(time.perf_counter() - started)
        driver.run()
    return batch * prompt_len / _robust_time(times)


def run_executor_bench(
    executor: Executor,
    decode_batches: Sequence[int],
    prefill_batches: Sequence[int],
    prompt_len: int,
    prefill_len: int,
    steps: int,
    greedy: bool = True,
    progress: Callable[[tuple[str, int, float]], None] | None = None,
    runner: ModelRunner | None = None,
) -> tuple[float, MemoryLimit, list[BenchResult]]:
    """Returns (GEMM FLOP/s, the decode step's memory limit, results). `progress((phase, batch,
    tokens_per_s))` is called as each lands. `runner`: rank 0's, when `executor` is not a ModelRunner
    itself (a tensor-parallel group)."""
    runner = _rank0(executor, runner)
    cfg = runner.model_config
    # A decode token runs every matrix once, lm_head included; a prefill token skips lm_head, which
    # only the prompt's last token runs (the embedding is a lookup, not FLOPs, either way).
    lm_head = cfg.vocab_size * cfg.hidden_size
    flops_per_token = {"decode": 2 * cfg.num_params, "prefill": 2 * (cfg.num_params - lm_head * (1 - 1 / prefill_len))}
    if not cfg.tie_word_embeddings:
        flops_per_token = {phase: f - 2 * lm_head for phase, f in flops_per_token.items()}  # the embedding's share
    gemm_before = measure_gemm_flops(runner.device, runner.dtype)
    sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.8, top_p=0.95)
    results: list[BenchResult] = []
    for i, batch in enumerate(decode_batches):
        step_s, cost = time_decode(executor, batch, prompt_len, steps, sampling, seq_base=i * 10_000, runner=runner)
        results.append(_decode_result(batch, step_s, cost))
        if progress:
            progress(("decode", batch, results[-1].tokens_per_s))
    for i, batch in enumerate(prefill_batches):
        tokens_per_s = bench_prefill(executor, batch, prefill_len, repeats=2, seq_base=(50 + i) * 10_000, runner=runner)
        results.append(BenchResult("prefill", batch, tokens_per_s, 0.0, batch * prefill_len / tokens_per_s))
        if progress:
            progress(("prefill", batch, tokens_per_s))
    # The higher of two roofline measurements (before and after), so a busy moment cannot flatter us;
    # a group multiplies on every rank at once, each on its share of the cores (or its own device).
    gemm = runner.layout.size * max(gemm_before, measure_gemm_flops(runner.device, runner.dtype))
    limit = memory_limit(runner, prompt_len)
    for r in results:
        r.roofline_fraction = r.tokens_per_s * flops_per_token[r.phase] / gemm
        if r.phase == "decode":
            ceiling = limit_tokens_per_s(limit.copy_bandwidth, limit.weight_bytes, limit.kv_bytes_per_seq, r.batch)
            r.limit_fraction = r.tokens_per_s / ceiling
    return gemm, limit, results


def _decode_result(batch: int, step_s: float, cost: PlanCost | None) -> BenchResult:
    """A decode figure; its roofline fraction is filled in once the second roofline is measured."""
    result = BenchResult("decode", batch, batch / step_s, 0.0, step_s)
    if cost is not None:
        result.broadcast_s, result.decode_plan_s, result.plan_bytes = cost.broadcast_s, cost.decode_s, cost.size_bytes
    return result


def _rank0(executor: Executor, runner: ModelRunner | None) -> ModelRunner:
    """The runner whose device, dtype and model the figures use: `runner`, or `executor` itself."""
    from kvserve.executor.model_runner import ModelRunner

    if runner is not None:
        return runner
    if not isinstance(executor, ModelRunner):
        raise TypeError(f"{type(executor).__name__} is not a ModelRunner: pass rank 0's runner as well")
    return executor


def _robust_time(times: list[float]) -> float:
    """The median step. llama.cpp's `llama-batched-bench`, the CPU baseline, reports a mean over
    all its steps; the median is as close to that on a quiet machine, resists a neighbour's burst,
    and does not flatter kvserve the way the fastest step would."""
    ordered = sorted(times)
    return ordered[len(ordered) // 2]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
