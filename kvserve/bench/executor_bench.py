"""`kvserve bench executor`: runner throughput against the machine's fp32 GEMM roofline.

The roofline is measured in the same run: the FLOP/s of a large square matmul on the
runner's device and dtype. A decode token costs 2 × parameters FLOPs (the embedding matrix
counted as the lm_head, not as its lookup); a prefill token the same less the lm_head, which
only a prompt's last token runs. A phase's roofline fraction is tokens/s × FLOPs per token /
GEMM FLOP/s. Decode runs B sequences whose
`prompt_len`-token prompts were prefilled untimed; prefill runs fresh 512-token prompts.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from executor_svc.model_runner import ModelRunner
from kvserve.testing.plan_driver import PlanDriver
from protos.sampling import SamplingParams


@dataclass(slots=True)
class BenchResult:
    phase: str
    """"decode" or "prefill"."""
    batch: int
    tokens_per_s: float
    roofline_fraction: float


def measure_gemm_flops(device: str, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of a size×size matmul: the roofline every figure is compared with."""
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


def bench_decode(
    runner: ModelRunner, batch: int, prompt_len: int, steps: int, sampling: SamplingParams, seq_base: int = 0
) -> float:
    """Decode tokens/s for `batch` sequences at context ≈ prompt_len, from the median of `steps` steps."""
    rng = random.Random(batch)
    vocab = runner.info().vocab_size
    driver = PlanDriver(runner)
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        driver.add(seq_base + i, prompt, max_new_tokens=steps + 2, sampling=sampling, seed=i)
    driver.step()  # prefill, untimed
    driver.step()  # first decode warms caches, untimed
    times = []
    for _ in range(steps):
        _sync(runner.device)
        started = time.perf_counter()
        driver.step()
        _sync(runner.device)
        times.append(time.perf_counter() - started)
    driver.run()
    return batch / _robust_time(times)


def bench_prefill(runner: ModelRunner, batch: int, prompt_len: int, repeats: int, seq_base: int = 0) -> float:
    """Prefill tokens/s: `batch` fresh prompts of `prompt_len` tokens in one step."""
    rng = random.Random(prompt_len + batch)
    vocab = runner.info().vocab_size
    times = []
    for r in range(repeats + 1):
        driver = PlanDriver(runner)
        for i in range(batch):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            driver.add(seq_base + r * batch + i, prompt, max_new_tokens=1)
        _sync(runner.device)
        started = time.perf_counter()
        driver.step()
        _sync(runner.device)
        if r:  # the first is warm-up
            times.append(time.perf_counter() - started)
        driver.run()
    return batch * prompt_len / _robust_time(times)


def run_executor_bench(
    runner: ModelRunner,
    decode_batches: list[int],
    prefill_batches: list[int],
    prompt_len: int,
    prefill_len: int,
    steps: int,
    greedy: bool = True,
    progress=None,
) -> tuple[float, list[BenchResult]]:
    """Returns (GEMM FLOP/s, results). `progress((phase, batch, tokens_per_s))` is called as each lands."""
    cfg = runner.model_config
    # A decode token runs every matrix once, lm_head included; a prefill token skips lm_head, which
    # only the prompt's last token runs (the embedding is a lookup, not FLOPs, either way).
    lm_head = cfg.vocab_size * cfg.hidden_size
    flops_per_token = {"decode": 2 * cfg.num_params, "prefill": 2 * (cfg.num_params - lm_head * (1 - 1 / prefill_len))}
    if not cfg.tie_word_embeddings:
        flops_per_token = {phase: f - 2 * lm_head for phase, f in flops_per_token.items()}  # the embedding's share
    gemm_before = measure_gemm_flops(runner.device, runner.dtype)
    sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.8, top_p=0.95)
    measured: list[tuple[str, int, float]] = []
    for i, batch in enumerate(decode_batches):
        measured.append(
            ("decode", batch, bench_decode(runner, batch, prompt_len, steps, sampling, seq_base=i * 10_000))
        )
        if progress:
            progress(measured[-1])
    for i, batch in enumerate(prefill_batches):
        measured.append(
            ("prefill", batch, bench_prefill(runner, batch, prefill_len, repeats=2, seq_base=(50 + i) * 10_000))
        )
        if progress:
            progress(measured[-1])
    # The higher of two roofline measurements (before and after), so a busy moment cannot flatter us.
    gemm = max(gemm_before, measure_gemm_flops(runner.device, runner.dtype))
    results = [BenchResult(phase, batch, tps, tps * flops_per_token[phase] / gemm) for phase, batch, tps in measured]
    return gemm, results


def _robust_time(times: list[float]) -> float:
    """The median step. llama.cpp's `llama-batched-bench`, the CPU baseline, reports a mean over
    all its steps; the median is as close to that on a quiet machine, resists a neighbour's burst,
    and does not flatter kvserve the way the fastest step would."""
    ordered = sorted(times)
    return ordered[len(ordered) // 2]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
