"""What batch invariance costs: the batch-invariant runner against `--no-batch-invariant`, one process.

    python -m kvserve.bench.invariance_cost [--dtype D] [--weights W] [--batches 1 8 32 64]

Both runners (and, with `--split`, a third: invariant GEMMs and activation but torch's attention)
load the same model and run the same plans; their steps alternate, in a rotating order, so a busy
moment on a shared machine lands on every variant alike. This VM's run-to-run spread (±15-20%)
is larger than the differences measured, which separate runs of `kvserve bench executor` cannot
resolve. Reports the median step of each variant per phase and the invariant one's speed relative
to each other (> 1: faster).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import DTYPES, WEIGHTS, RunnerConfig
from kvserve.log_config import configure_logging
from kvserve.testing.plan_driver import PlanDriver

VARIANTS: dict[str, dict[str, Any]] = {
    "invariant": {},
    "batch-variant": {"batch_invariant": False},
    "invariant GEMMs, torch attention": {"attention_backend": "torch"},
}


@dataclass(frozen=True, slots=True)
class InvarianceCostConfig:
    """The flags of `python -m kvserve.bench.invariance_cost`."""

    model: str | None = field(default=None, metadata=flag("as `kvserve executor --model` (default: the default model)"))
    dtype: str = field(default="auto", metadata=flag("as `kvserve executor --dtype`", choices=("auto", *DTYPES)))
    weights: str = field(default="auto", metadata=flag("as `kvserve executor --weights`", choices=("auto", *WEIGHTS)))
    batches: tuple[int, ...] = field(default=(1, 8, 32, 64), metadata=flag("decode batch sizes", nargs="+"))
    prompt_len: int = field(default=128, metadata=flag("context of each decoding sequence"))
    steps: int = field(default=24, metadata=flag("timed decode steps per batch and variant"))
    prefill_len: int = field(default=128, metadata=flag("tokens per prefill prompt"))
    prefill_batch: int = field(default=8, metadata=flag("prompts in the prefill step"))
    repeats: int = field(default=5, metadata=flag("timed prefill steps per variant"))
    split: bool = field(default=False, metadata=flag("also run invariant GEMMs with torch's attention"))


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def _drivers(runners: dict[str, ModelRunner], prompts: list[list[int]], new_tokens: int) -> dict[str, PlanDriver]:
    drivers = {}
    for name, runner in runners.items():
        driver = PlanDriver(runner)
        for i, prompt in enumerate(prompts):
            driver.add(i, prompt, max_new_tokens=new_tokens)
        drivers[name] = driver
    return drivers


def _alternate(drivers: dict[str, PlanDriver], steps: int) -> dict[str, list[float]]:
    """`steps` steps of every driver, interleaved, each round starting with the next variant."""
    names = list(drivers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            started = time.perf_counter()
            drivers[name].step()
            times[name].append(time.perf_counter() - started)
    return times


def decode(runners: dict[str, ModelRunner], batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median decode step of each variant: `batch` sequences past a `prompt_len`-token prefill."""
    rng = random.Random(batch)
    vocab = next(iter(runners.values())).info().vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    drivers = _drivers(runners, prompts, steps + 4)
    _alternate(drivers, 2)  # the prefill and a first decode, untimed
    times = _alternate(drivers, steps)
    for driver in drivers.values():
        driver.run()
    return {name: _median(t) for name, t in times.items()}


def prefill(runners: dict[str, ModelRunner], batch: int, prompt_len: int, repeats: int) -> dict[str, float]:
    """Median step of each variant prefilling `batch` fresh `prompt_len`-token prompts."""
    rng = random.Random(prompt_len + batch)
    vocab = next(iter(runners.values())).info().vocab_size
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(repeats + 1):
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
        drivers = _drivers(runners, prompts, 1)
        step = _alternate(drivers, 1)
        for driver in drivers.values():
            driver.run()
        if r:  # the first is warm-up
            for name, t in step.items():
                times[name] += t
    return {name: _median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.invariance_cost",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    add_flags(parser, InvarianceCostConfig)
    args = config_from_args(InvarianceCostConfig, parser.parse_args(argv))
    configure_logging(level="WARNING")
    names = list(VARIANTS) if args.split else list(VARIANTS)[:2]
    runners = {
        name: ModelRunner(
            RunnerConfig(model=args.model, dtype=args.dtype, weights=args.weights, kv_cache_gb=0.5, **VARIANTS[name])
        )
        for name in names
    }
    first = runners["invariant"]
    print(
        f"{first.dtype_name}, weights {first.weights_mode}, {first.num_threads} threads; "
        f"median step in ms, and the invariant runner's speed relative to each (> 1: faster)"
    )
    rows = [(f"decode B={b}", b, decode(runners, b, args.prompt_len, args.steps)) for b in args.batches]
    rows.append(
        (
            f"prefill {args.prefill_batch}x{args.prefill_len}",
            args.prefill_batch * args.prefill_len,
            prefill(runners, args.prefill_batch, args.prefill_len, args.repeats),
        )
    )
    print(
        "| phase | "
        + " | ".join(f"{n} ms (tok/s)" for n in names)
        + " | "
        + " | ".join(f"vs {n}" for n in names[1:])
        + " |"
    )
    print("|---" * (2 * len(names)) + "|")
    for label, tokens, medians in rows:
        cells = [f"{1e3 * medians[n]:.1f} ({tokens / medians[n]:.0f})" for n in names]
        ratios = [f"{medians[n] / medians['invariant']:.2f}×" for n in names[1:]]
        print(f"| {label} | " + " | ".join(cells + ratios) + " |")
    for runner in runners.values():
        runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
