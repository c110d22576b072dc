"""Scheduler overhead benchmark: the scheduler alone, sampled tokens fed straight back.

Times `schedule()` + `update()` per step once every sequence is decoding, which is the
per-step cost the engine loop pays on top of the executor (goal in docs/benchmarks.md:
≤ 1 ms at 256 running sequences). Building the fake StepResult is the executor's job and is not timed.

`kvserve bench scheduler` (`register`, `run`) prints one line per configuration, or `--json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import SampledToken, StepPlan, StepResult
from kvserve.scheduler.core import Scheduler, SchedulerConfig

SHARED_PREFIX_FRACTION = 0.75
"""With prefix sharing on, this share of each prompt is a common system prompt."""
GOAL_US_AT_256 = 1000.0
"""The goal in docs/benchmarks.md: schedule() + update() at 256 running decodes."""
PREFIX_SHARING = {"both": (False, True), "on": (True,), "off": (False,)}


@dataclass(frozen=True, slots=True)
class SchedulerBenchConfig:
    """`kvserve bench scheduler`'s flags."""

    running: tuple[int, ...] = field(
        default=(64, 256, 1024), metadata=flag("running-sequence counts to measure", nargs="+")
    )
    prompt_len: int = field(default=300, metadata=flag("prompt tokens per request"))
    steps: int = field(default=200, metadata=flag("timed decode steps per configuration"))
    prefix_sharing: str = field(
        default="both",
        metadata=flag(
            "measure with a shared prompt prefix (and the prefix cache), without, or both",
            choices=tuple(PREFIX_SHARING),
        ),
    )
    disk_tier: bool = field(
        default=False,
        metadata=flag(
            "with prefix sharing, as with --kv-disk-dir: every block that fills gets its disk key and a store "
            "(the disk itself is not touched)"
        ),
    )
    json: bool = field(
        default=False,
        metadata=flag("print a JSON list of {running, prefix_sharing, us_per_step, us_per_seq, ...}"),
    )


@dataclass(slots=True)
class SchedulerBenchResult:
    running: int
    prefix_sharing: bool
    steps: int
    us_per_step: float
    us_per_seq: float
    us_per_step_median: float
    """Median step: robust to other processes stealing the CPU during a run."""
    us_schedule: float
    """Mean µs in schedule() per step."""
    us_update: float
    """Mean µs in update() per step."""


class FeedbackExecutor:
    """Stands in for the executor: tracks each sequence's token count and samples a token id."""

    def __init__(self) -> None:
        self._num_tokens: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        num_tokens = self._num_tokens
        for seq_id in plan.drop_seq_ids:
            num_tokens.pop(seq_id, None)
        outputs = []
        for new in plan.new_seqs:
            num_tokens[new.seq_id] = len(new.token_ids)
            if new.num_computed_tokens + new.num_scheduled_tokens == len(new.token_ids):
                outputs.append(SampledToken(new.seq_id, (new.seq_id * 31 + plan.step_id) % 30_000))
        for cached in plan.known_seqs:
            total = num_tokens[cached.seq_id] + len(cached.new_token_ids)
            num_tokens[cached.seq_id] = total
            if cached.num_computed_tokens + cached.num_scheduled_tokens == total:
                outputs.append(SampledToken(cached.seq_id, (cached.seq_id * 31 + plan.step_id) % 30_000))
        return StepResult(plan.step_id, outputs)


def build_scheduler(
    running: int,
    prefix_sharing: bool,
    prompt_len: int,
    steps: int,
    block_size: int = defaults.BLOCK_SIZE,
    seed: int = 0,
    disk_tier: bool = False,
) -> Scheduler:
    """A scheduler holding `running` requests that will decode for at least `steps` more steps."""
    max_tokens = steps + prompt_len  # room for the warm-up's decode steps too
    blocks_per_seq = -(-(prompt_len + max_tokens) // block_size) + 1
    config = SchedulerConfig(
        num_blocks=running * blocks_per_seq + 16,
        block_size=block_size,
        max_model_len=prompt_len + max_tokens + 1,
        max_num_batched_tokens=max(defaults.MAX_NUM_BATCHED_TOKENS, running),
        max_num_seqs=running,
        enable_prefix_caching=prefix_sharing,
    )
    scheduler = Scheduler(config)
    if disk_tier:
        scheduler.set_disk_tier("kvserve bench scheduler", [])
    rng = random.Random(seed)
    shared = [rng.randrange(30_000) for _ in range(int(prompt_len * SHARED_PREFIX_FRACTION))] if prefix_sharing else []
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(running):
        tail = [rng.randrange(30_000) for _ in range(prompt_len - len(shared))]
        scheduler.add_request(f"bench-{index}", shared + tail, sampling)
    return scheduler


def warm_up(scheduler: Scheduler, executor: FeedbackExecutor, running: int, max_steps: int = 10_000) -> None:
    """Step until every request is admitted and decoding one token per step."""
    for _ in range(max_steps):
        plan = scheduler.schedule()
        scheduler.update(executor.execute(plan))
        if (
            not plan.new_seqs
            and len(plan.known_seqs) == running
            and all(s.num_scheduled_tokens == 1 for s in plan.known_seqs)
        ):
            return
    raise RuntimeError("warm-up did not reach steady decode")


def run_scheduler_bench(
    running: int,
    prefix_sharing: bool,
    prompt_len: int = 300,
    steps: int = 200,
    seed: int = 0,
    disk_tier: bool = False,
) -> SchedulerBenchResult:
    """Mean and median cost of schedule() + update() over `steps` steady decode steps."""
    scheduler = build_scheduler(running, prefix_sharing, prompt_len, steps, seed=seed, disk_tier=disk_tier)
    executor = FeedbackExecutor()
    warm_up(scheduler, executor, running)
    gc.collect()  # start the timed region without garbage left over from the warm-up
    clock = time.perf_counter
    schedule_times, update_times = [], []
    for _ in range(steps):
        t0 = clock()
        plan = scheduler.schedule()
        t1 = clock()
        result = executor.execute(plan)
        t2 = clock()
        scheduler.update(result)
        t3 = clock()
        schedule_times.append(t1 - t0)
        update_times.append(t3 - t2)
    totals = [a + b for a, b in zip(schedule_times, update_times)]
    per_step = statistics.fmean(totals) * 1e6
    return SchedulerBenchResult(
        running,
        prefix_sharing,
        steps,
        per_step,
        per_step / running,
        statistics.median(totals) * 1e6,
        statistics.fmean(schedule_times) * 1e6,
        statistics.fmean(update_times) * 1e6,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scheduler",
        help="time schedule() + update() per step at many running sequences",
        description="Runs the scheduler alone, feeding sampled tokens straight back, once every\n"
        "sequence decodes. Prefix sharing on: 75% of each prompt is shared and the prefix\n"
        "cache is on; off: unique prompts, prefix cache off.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, SchedulerBenchConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(SchedulerBenchConfig, args)
    results = []
    for running in config.running:
        for prefix_sharing in PREFIX_SHARING[config.prefix_sharing]:
            disk = config.disk_tier and prefix_sharing
            result = run_scheduler_bench(running, prefix_sharing, config.prompt_len, config.steps, disk_tier=disk)
            results.append(result)
            if not config.json:
                print(
                    f"running {running:5d}  prefix sharing {'on ' if prefix_sharing else 'off'}"
                    f"{' + disk tier' if disk else ''}  "
                    f"{result.us_per_step:8.1f} us/step (median {result.us_per_step_median:7.1f})  "
                    f"{result.us_per_seq:6.2f} us/seq  "
                    f"[schedule {result.us_schedule:.0f} us, update {result.us_update:.0f} us]",
                    flush=True,
                )
    if config.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        print(f"goal: <= {GOAL_US_AT_256:.0f} us/step at 256 running sequences")
    return 0
