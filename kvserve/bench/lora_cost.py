"""What LoRA adapters cost a decode step: the same rows under adapters and under none, one runner.

    python -m kvserve.bench.lora_cost [--weights W] [--batches 1 32] [--adapters 8] [--rank 16]

One runner loads `--adapters` random rank-`--rank` adapters on all seven projections (PEFT's layout,
`kvserve.testing.lora_adapters`), every one resident (`--max-loras` = `--adapters`). `base` decodes
B sequences under no adapter; `lora` decodes B others spread round-robin over the adapters (B=32
over 8: four rows each; B=1: one adapter). Their steps alternate, in a rotating order, so a busy
moment on a shared machine lands on both alike; each gets its own half of the KV blocks. Reports
the median step of each and what the adapters add. A step with adapter rows also gives up the
native path's fused layers (`NativeLayers`): that is part of what it measures.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import DTYPES, WEIGHTS, RunnerConfig
from kvserve.log_config import configure_logging
from kvserve.testing.lora_adapters import write_lora_adapter
from kvserve.testing.plan_driver import PlanDriver

LORA_SEQ_IDS = 100_000
"""The `lora` variant's sequence ids start here, apart from the `base` variant's."""


@dataclass(frozen=True, slots=True)
class LoraCostConfig:
    """The flags of `python -m kvserve.bench.lora_cost`."""

    model: str | None = field(default=None, metadata=flag("as `kvserve executor --model` (default: the default model)"))
    dtype: str = field(default="auto", metadata=flag("as `kvserve executor --dtype`", choices=("auto", *DTYPES)))
    weights: str = field(default="auto", metadata=flag("as `kvserve executor --weights`", choices=("auto", *WEIGHTS)))
    batches: tuple[int, ...] = field(default=(1, 32), metadata=flag("decode batch sizes", nargs="+"))
    adapters: int = field(default=8, metadata=flag("LoRA adapters loaded; a batch's rows spread over them"))
    rank: int = field(default=16, metadata=flag("each adapter's rank"))
    prompt_len: int = field(default=128, metadata=flag("context of each decoding sequence"))
    steps: int = field(default=24, metadata=flag("timed decode steps per batch and variant"))


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def decode(runner: ModelRunner, names: list[str], batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median decode step of `batch` sequences under no adapter (`base`) and spread over `names` (`lora`)."""
    rng = random.Random(batch)
    info = runner.info()
    prompts = [[rng.randrange(info.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    half = info.num_blocks // 2
    drivers = {"base": PlanDriver(runner, half), "lora": PlanDriver(runner, info.num_blocks, first_block=half)}
    for i, prompt in enumerate(prompts):
        drivers["base"].add(i, prompt, max_new_tokens=steps + 4)
        drivers["lora"].add(LORA_SEQ_IDS + i, prompt, max_new_tokens=steps + 4, lora_name=names[i % len(names)])
    times: dict[str, list[float]] = {name: [] for name in drivers}
    order = list(drivers)
    for step in range(steps + 2):  # the prefill and a first decode, untimed
        for name in order[step % 2 :] + order[: step % 2]:
            started = time.perf_counter()
            drivers[name].step()
            if step >= 2:
                times[name].append(time.perf_counter() - started)
    for driver in drivers.values():
        driver.run()
    return {name: _median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.lora_cost", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    add_flags(parser, LoraCostConfig)
    args = config_from_args(LoraCostConfig, parser.parse_args(argv))
    configure_logging(level="WARNING")
    with tempfile.TemporaryDirectory(prefix="kvserve-lora-") as tmp:
        from kvserve.executor.model_config import load_model_config
        from kvserve.executor.weights.model_store import ensure_model_dir

        model = load_model_config(ensure_model_dir(args.model))
        names = [f"adapter{i}" for i in range(args.adapters)]
        lora = tuple(
            f"{name}={write_lora_adapter(Path(tmp) / name, model, rank=args.rank, seed=i)}"
            for i, name in enumerate(names)
        )
        runner = ModelRunner(
            RunnerConfig(
                model=args.model,
                dtype=args.dtype,
                weights=args.weights,
                kv_cache_gb=0.5,
                lora=lora,
                max_loras=args.adapters,
                max_lora_rank=args.rank,
            )
        )
    print(
        f"{runner.dtype_name}, weights {runner.weights_mode}, {runner.num_threads} threads; {args.adapters} adapters "
        f"of rank {args.rank} on all seven projections; median decode step in ms"
    )
    print("| batch | no LoRA ms | LoRA ms | LoRA / none |")
    print("|---|---|---|---|")
    for batch in args.batches:
        medians = decode(runner, names, batch, args.prompt_len, args.steps)
        base, lora_ms = 1e3 * medians["base"], 1e3 * medians["lora"]
        print(f"| {batch} | {base:.1f} | {lora_ms:.1f} | {lora_ms / base:.2f}× |")
    runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
