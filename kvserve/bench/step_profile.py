"""Where a decode step goes: the median step, torch.profiler's busiest ops, and what a neighbour costs.

    python -m kvserve.bench.step_profile [--batch 1] [--dtype D] [--weights W] [--kv-cache-dtype KV]
                                         [--num-threads T] [--neighbours N] [--compile]

Runs one runner in-process on `PlanDriver` plans (B sequences decoding past a `--prompt-len`
prefill), as `kvserve bench executor` does, then profiles `--profile-steps` more steps and prints
each op's time per step, the busiest first. `--neighbours N` first times the same steps beside N
busy-looping processes (what a compiler or a second service on the host does to the executor's
threads). `--compile` also times the forward pass of one captured batch under `torch.compile`
(inductor's C++ backend, static shapes, RMSNorm opaque as `--compile on` serves it) and compares its
logits with eager ones. It needs `--weights native`: inductor lowers oneDNN's prepacked linears,
which the dequantized paths run, only for frozen weights.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.attention.base import AttentionBackend
from kvserve.executor.lora.step_deltas import LoraStep
from kvserve.executor.model.input_batch import InputBatch
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.model.opaque_norm import opaque_rms_norm
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import DTYPES, WEIGHTS, RunnerConfig
from kvserve.log_config import configure_logging
from kvserve.testing.plan_driver import PlanDriver


@dataclass(frozen=True, slots=True)
class StepProfileConfig:
    """The flags of `python -m kvserve.bench.step_profile`."""

    model: str | None = field(default=None, metadata=flag("as `kvserve executor --model` (default: the default model)"))
    dtype: str = field(default="auto", metadata=flag("as `kvserve executor --dtype`", choices=("auto", *DTYPES)))
    weights: str = field(default="auto", metadata=flag("as `kvserve executor --weights`", choices=("auto", *WEIGHTS)))
    kv_cache_dtype: str = field(
        default="auto", metadata=flag("as `kvserve executor --kv-cache-dtype`", choices=("auto", *DTYPES))
    )
    num_threads: int | None = field(default=None, metadata=flag("as `kvserve executor --num-threads`"))
    batch: int = field(default=1, metadata=flag("decoding sequences per step"))
    prompt_len: int = field(default=128, metadata=flag("context of each decoding sequence"))
    steps: int = field(default=20, metadata=flag("timed decode steps (the median counts)"))
    profile_steps: int = field(default=5, metadata=flag("profiled decode steps"))
    top: int = field(default=15, metadata=flag("ops shown, the busiest first"))
    neighbours: int = field(default=0, metadata=flag("busy-looping processes to time the steps beside as well"))
    compile: bool = field(default=False, metadata=flag("also time the forward pass under torch.compile"))


def start_driver(runner: ModelRunner, batch: int, prompt_len: int, new_tokens: int) -> PlanDriver:
    """`batch` sequences of random prompts, prefilled and past their first decode (both untimed)."""
    rng = random.Random(batch)
    vocab = runner.info().vocab_size
    driver = PlanDriver(runner)
    for i in range(batch):
        driver.add(i, [rng.randrange(vocab) for _ in range(prompt_len)], max_new_tokens=new_tokens)
    driver.step()
    driver.step()
    return driver


def median_step(driver: PlanDriver, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        driver.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def beside_neighbours(driver: PlanDriver, steps: int, neighbours: int) -> float:
    """The median step while `neighbours` processes spin on the same cores."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(neighbours)]
    try:
        return median_step(driver, steps)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def profile_ops(driver: PlanDriver, steps: int, top: int) -> list[str]:
    """One line per op: its self time and calls per step, the busiest first, then the total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            driver.step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    calls = sum(e.count for e in events) / steps
    lines = [
        f"{e.key[:56]:56s} {e.self_cpu_time_total / steps / 1e3:8.2f} ms {e.count / steps:7.0f} calls"
        for e in events[:top]
    ]
    lines.append(f"{'all ops':56s} {total:8.2f} ms {calls:7.0f} calls")
    return lines


def compare_compiled(runner: ModelRunner, driver: PlanDriver, steps: int) -> list[str]:
    """The forward pass of the driver's next decode batch, eager and under torch.compile."""
    captured: list[InputBatch] = []
    forward = runner.model.forward

    def capture(
        batch: InputBatch, cache: PagedKVCache, backend: AttentionBackend, lora: LoraStep | None = None
    ) -> torch.Tensor | None:
        captured.append(batch)
        return forward(batch, cache, backend, lora)

    runner.model.forward = capture  # type: ignore[method-assign]
    driver.step()
    runner.model.forward = forward  # type: ignore[method-assign]
    batch = captured[-1]

    def eager() -> torch.Tensor | None:
        return forward(batch, runner.cache, runner.backend)

    with torch.inference_mode():
        reference = eager()
        runner.model.norm = opaque_rms_norm  # inductor would reorder a traced RMSNorm's sum by shape
        started = time.perf_counter()
        compiled = torch.compile(eager, dynamic=False)
        logits = compiled()
        compile_s = time.perf_counter() - started
        assert reference is not None and logits is not None
        eager_s = statistics.median(_timed(eager) for _ in range(steps))
        compiled_s = statistics.median(_timed(compiled) for _ in range(steps))
    same = torch.equal(logits, reference)
    return [
        f"torch.compile: {compile_s:.1f} s to compile; forward {1e3 * eager_s:.2f} ms eager, "
        f"{1e3 * compiled_s:.2f} ms compiled; logits {'bit-identical' if same else 'differ'}"
        + ("" if same else f" (max |diff| {(logits - reference).abs().max().item():.3g})")
    ]


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.step_profile", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    add_flags(parser, StepProfileConfig)
    args = config_from_args(StepProfileConfig, parser.parse_args(argv))
    configure_logging(level="WARNING")
    runner = ModelRunner(
        RunnerConfig(
            model=args.model,
            dtype=args.dtype,
            weights=args.weights,
            kv_cache_dtype=args.kv_cache_dtype,
            num_threads=args.num_threads,
            kv_cache_gb=0.5,
        )
    )
    try:
        new_tokens = 3 * args.steps + args.profile_steps + 8
        driver = start_driver(runner, args.batch, args.prompt_len, new_tokens)
        print(
            f"{runner.dtype_name}, KV {runner.kv_dtype_name}, weights {runner.weights_mode}, "
            f"{runner.num_threads} threads, "
            f"batch {args.batch}: median decode step {1e3 * median_step(driver, args.steps):.2f} ms"
        )
        if args.neighbours:
            step = beside_neighbours(driver, args.steps, args.neighbours)
            print(f"beside {args.neighbours} busy process(es): median decode step {1e3 * step:.2f} ms")
        if args.profile_steps:
            print("\n".join(profile_ops(driver, args.profile_steps, args.top)))
        if args.compile:
            print("\n".join(compare_compiled(runner, driver, args.steps)))
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
