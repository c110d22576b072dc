"""`kvserve bench structured`: the per-step cost of structured output, constrained against free text.

One process runs the whole step path: the real `Scheduler` (which fills each constrained
row's bitmask through llguidance), the plan and result through the wire codec (what
ZeroMQ would carry), the real `ModelRunner` (which unpacks and applies the masks), and
`Scheduler.update` (which advances each matcher). Both runs decode the same chat prompts
at the same batch size; the constrained one follows a grammar long enough that every row
is still decoding in every timed step: a JSON schema (`json_schema`), or the grammar
`tool_choice: "required"` builds from a request's tools (`tools`: the hermes format's calls
to one of three functions, parallel calls allowed, as the HTTP API compiles them). Only
steps in which all `batch` rows decode are timed, so the two runs compare equal work; the
two alternate `repeats` times.

The model, llguidance and the tokenizer load inside the functions that use them, so that
registering the command (`register`) keeps `kvserve --help` free of torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.protos import step_codec
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.sampling import SamplingParams
from kvserve.scheduler.core import MatcherFactory, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.scheduler.server.intake.tokenizer import Tokenizer

GOAL_OVERHEAD = 0.10
"""The project's goal: a step whose rows are all constrained costs at most 10% more than a free one."""
CONSTRAINTS = ("json_schema", "tools")
"""What a constrained run follows: BENCH_SCHEMA, or the forced-call grammar of BENCH_TOOLS."""


@dataclass(frozen=True, slots=True)
class StructuredBenchConfig:
    """`kvserve bench structured`'s flags."""

    model: str = field(
        default=defaults.DEFAULT_MODEL,
        metadata=flag("the default model name, an HF model directory, or a .gguf file"),
    )
    device: str = field(default="auto", metadata=flag("auto, cpu or cuda"))
    batches: tuple[int, ...] = field(default=(1, 32), metadata=flag("decode batch sizes", nargs="+"))
    constraints: tuple[str, ...] = field(
        default=CONSTRAINTS,
        metadata=flag(
            "what the constrained runs follow: a JSON schema, or a required tool call", nargs="+", choices=CONSTRAINTS
        ),
    )
    steps: int = field(default=24, metadata=flag("timed decode steps per run (medians are reported)"))
    repeats: int = field(default=3, metadata=flag("free/constrained run pairs, interleaved; the median counts"))
    kv_cache_gb: float = field(default=0.5, metadata=flag("KV budget of the runner"))
    num_threads: int | None = field(default=None, metadata=flag("torch CPU threads"))
    json: bool = field(default=False, metadata=flag("print the results as JSON"))


BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "scenes": {
            "type": "array",
            "items": {"type": "string", "minLength": 8, "maxLength": 40},
            "minItems": 12,
            "maxItems": 12,
        },
    },
    "required": ["title", "year", "genre", "scenes"],
    "additionalProperties": False,
}
"""At least ~60 tokens of output, so every row decodes through the timed steps."""
BENCH_TOOLS = (
    ("describe_film", "Describe a film.", BENCH_SCHEMA),
    (
        "plan_trip",
        "Plan a trip day by day.",
        {
            "type": "object",
            "properties": {
                "destination": {"type": "string", "maxLength": 40},
                "travellers": {"type": "integer", "minimum": 1, "maximum": 12},
                "days": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"morning": {"type": "string", "minLength": 8, "maxLength": 30}},
                        "required": ["morning"],
                        "additionalProperties": False,
                    },
                    "minItems": 12,
                    "maxItems": 12,
                },
            },
            "required": ["destination", "travellers", "days"],
            "additionalProperties": False,
        },
    ),
    (
        "file_report",
        "File an incident report.",
        {
            "type": "object",
            "properties": {
                "severity": {"enum": ["low", "medium", "high"]},
                "steps": {"type": "array", "items": {"type": "string", "minLength": 8}, "minItems": 12},
            },
            "required": ["severity", "steps"],
        },
    ),
)
"""(name, description, parameters): enums, nested objects, arrays, each call long enough to outlast the timed steps."""
TOPICS = ["a heist", "a lighthouse", "a chess match", "a storm at sea", "a lost dog", "a space station", "a wedding"]


@dataclass(slots=True)
class StepTimes:
    schedule_ms: float
    """Plan building, including the constrained rows' bitmasks."""
    wire_ms: float
    """Plan and result through the protobuf codec, both ways."""
    execute_ms: float
    """Forward pass, mask application, sampling."""
    update_ms: float
    """Results applied, including each matcher advancing."""

    @property
    def total_ms(self) -> float:
        return self.schedule_ms + self.wire_ms + self.execute_ms + self.update_ms


@dataclass(slots=True)
class StructuredBenchResult:
    constraint: str
    batch: int
    free: StepTimes
    constrained: StepTimes
    timed_steps: int

    @property
    def overhead(self) -> float:
        """How much longer a constrained step takes: constrained / free - 1."""
        return self.constrained.total_ms / self.free.total_ms - 1.0


def bench_factory(constraint: str, tokenizer: Tokenizer, runner: ModelRunner) -> MatcherFactory:
    """The matcher factory a request with `constraint` would get: the schema, or the tools' forced-call grammar."""
    from kvserve.scheduler.server.structured.llguidance_backend import LlguidanceBackend
    from kvserve.scheduler.server.structured.spec import StructuredSpec
    from kvserve.scheduler.server.tools.tool_formats import FORMATS
    from kvserve.scheduler.server.tools.tool_use import ToolFunction, ToolUse

    info = runner.info()
    backend = LlguidanceBackend(tokenizer.to_json(), info.vocab_size, info.eos_token_ids)
    if constraint == "json_schema":
        return backend.compile(StructuredSpec("json_schema", "bench", text=json.dumps(BENCH_SCHEMA)))
    if constraint != "tools":
        raise ValueError(f"unknown constraint {constraint!r}: one of {', '.join(CONSTRAINTS)}")
    tools = tuple(ToolFunction(name, description, parameters) for name, description, parameters in BENCH_TOOLS)
    use = ToolUse(tools, mode="required", function=None, parallel=True, format=defaults.TOOL_CALL_FORMAT)
    return backend.compile(StructuredSpec("grammar", "bench", text=FORMATS[use.format].forced_grammar(use)))


def run_structured_bench(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    batches: Sequence[int],
    steps: int,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda _line: None,
    constraints: Sequence[str] = CONSTRAINTS,
) -> list[StructuredBenchResult]:
    from kvserve.scheduler.server.intake.tokenizer import ChatMessage

    prompts = [
        tokenizer.encode_chat([ChatMessage("user", f"Describe a film about {TOPICS[i % len(TOPICS)]} as JSON.")])
        for i in range(max(batches))
    ]
    results = []
    for constraint in constraints:
        factory = bench_factory(constraint, tokenizer, runner)
        for batch in batches:
            runs: dict[bool, list[StepTimes]] = {False: [], True: []}
            for repeat in range(repeats):  # interleaved, so drift in the machine's speed hits both alike
                for constrained in (False, True):
                    times = _decode_steps(runner, prompts[:batch], factory if constrained else None, steps)
                    runs[constrained].append(times)
                    kind = constraint if constrained else "free text"
                    progress(f"batch {batch} run {repeat + 1}/{repeats} {kind}: {times.total_ms:.2f} ms/step")
            results.append(StructuredBenchResult(constraint, batch, _median(runs[False]), _median(runs[True]), steps))
    return results


def _median(runs: list[StepTimes]) -> StepTimes:
    """The run with the median total: one consistent split, not medians of parts from different runs."""
    return sorted(runs, key=lambda t: t.total_ms)[len(runs) // 2]


def _decode_steps(
    runner: ModelRunner, prompts: list[list[int]], factory: MatcherFactory | None, steps: int
) -> StepTimes:
    """Median times of `steps` decode steps in which every row decodes (prefill and one warm-up untimed)."""
    info = runner.info()
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            eos_token_ids=tuple(info.eos_token_ids),
            enable_prefix_caching=False,
        )
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=factory is None)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(f"r{i}", prompt, sampling, constraint=factory)
    timed: list[StepTimes] = []
    warmed = False
    while scheduler.has_unfinished() and len(timed) < steps:
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        sent = step_codec.decode_plan(pb.StepPlan.FromString(step_codec.encode_plan(plan).SerializeToString()))
        t2 = time.perf_counter()
        result = runner.execute(sent)
        t3 = time.perf_counter()
        got = step_codec.decode_result(pb.StepResult.FromString(step_codec.encode_result(result).SerializeToString()))
        t4 = time.perf_counter()
        outputs = scheduler.update(got)
        t5 = time.perf_counter()
        decoding = plan.num_scheduled_tokens == len(prompts) and not plan.new_seqs
        if decoding and warmed:
            timed.append(StepTimes(1e3 * (t1 - t0), 1e3 * (t2 - t1 + t4 - t3), 1e3 * (t3 - t2), 1e3 * (t5 - t4)))
        warmed = warmed or decoding
        if any(o.finish_reason is not None for o in outputs) and len(timed) < steps:
            raise RuntimeError("a row finished before the timed steps ended: lengthen its grammar or lower --steps")
    for request_id in [f"r{i}" for i in range(len(prompts))]:
        scheduler.abort(request_id)
    runner.reset()
    return StepTimes(
        statistics.median(t.schedule_ms for t in timed),
        statistics.median(t.wire_ms for t in timed),
        statistics.median(t.execute_ms for t in timed),
        statistics.median(t.update_ms for t in timed),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "structured",
        help="decode step time with every row under a JSON schema, against free text",
        description="Runs the scheduler (llguidance bitmasks), the wire codec and the model runner\n"
        "in one process, decoding the same chat prompts twice at each batch size: free\n"
        "text, then every row under a JSON schema. Prints the median step time of each,\n"
        "split into scheduling, wire, execution and update, and the overhead ratio.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, StructuredBenchConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.log_config import configure_logging
    from kvserve.scheduler.server.intake.tokenizer import Tokenizer

    config = config_from_args(StructuredBenchConfig, args)
    configure_logging(level="WARNING" if config.json else None)
    runner = ModelRunner(
        RunnerConfig(
            model=config.model, device=config.device, kv_cache_gb=config.kv_cache_gb, num_threads=config.num_threads
        )
    )
    tokenizer = Tokenizer.from_dir(runner.info().tokenizer_path)
    results = run_structured_bench(
        runner,
        tokenizer,
        config.batches,
        config.steps,
        config.repeats,
        progress=(lambda _l: None) if config.json else print,
        constraints=config.constraints,
    )
    if config.json:
        print(json.dumps([{**asdict(r), "overhead": r.overhead} for r in results]))
        return 0
    print(
        f"{'constraint':>11}  {'batch':>5}  {'free ms/step':>12}  {'constrained':>11}  {'overhead':>8}"
        "   constrained split (ms)"
    )
    for r in results:
        c = r.constrained
        print(
            f"{r.constraint:>11}  {r.batch:5d}  {r.free.total_ms:12.2f}  {c.total_ms:11.2f}  "
            f"{100 * r.overhead:7.1f}%   "
            f"schedule {c.schedule_ms:.2f} (free {r.free.schedule_ms:.2f}), wire {c.wire_ms:.2f}, "
            f"execute {c.execute_ms:.2f} (free {r.free.execute_ms:.2f}), update {c.update_ms:.2f}"
        )
        print(
            f"{'':20}tokens/s: free {1e3 * r.batch / r.free.total_ms:.1f}, constrained {1e3 * r.batch / c.total_ms:.1f}"
        )
    print(f"goal: constrained steps cost at most {100 * GOAL_OVERHEAD:.0f}% more")
    runner.close()
    return 0
