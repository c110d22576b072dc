"""`kvserve bench executor`: runner throughput against the machine's fp32 GEMM roofline.

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


`kvserve bench executor` (`register`, `run`) takes the runner's own flags (those of
`kvserve executor`: RunnerConfig and TensorParallelConfig) and the bench's
(`ExecutorBenchConfig`). torch loads inside the functions that use it, so registering the
command keeps `kvserve --help` free of it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, cast

from kvserve.bench.physical_limit import MemoryLimit, limit_tokens_per_s, memory_limit
from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.tensor_parallel.config import TensorParallelConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.plan_driver import PlanDriver

if TYPE_CHECKING:
    import torch

    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.protocol import Executor

PROG = "kvserve bench executor"
GOAL_DECODE64_ROOFLINE = 0.5
"""The project's CPU goal: decode at batch 64 reaches at least half the fp32 GEMM roofline."""
_RUNNER = "model runner (as kvserve executor)"
_KV_HELP = "KV budget (default: just enough for the largest configuration)"


@dataclass(frozen=True, slots=True)
class ExecutorBenchConfig:
    """`kvserve bench executor`'s own flags, beside the runner's."""

    batches: tuple[int, ...] = field(default=(1, 8, 32, 64), metadata=flag("decode batch sizes", nargs="+"))
    prompt_len: int = field(default=128, metadata=flag("context of each decoding sequence"))
    steps: int = field(default=8, metadata=flag("timed decode steps per batch size (the median counts)"))
    prefill_len: int = field(default=512, metadata=flag("tokens per prefill prompt"))
    prefill_batches: tuple[int, ...] = field(default=(1, 4), metadata=flag("prompts per prefill step", nargs="*"))
    sample: bool = field(default=False, metadata=flag("sample with temperature 0.8, top-p 0.95 instead of greedy"))
    json: bool = field(
        default=False,
        metadata=flag(
            "print one JSON object: dtype, weights, tensor_parallel_size, gemm_flops, copy_bandwidth, "
            "weight_bytes, kv_bytes_per_seq, rss_mib and results [{phase, batch, tokens_per_s, roofline_fraction, "
            "step_s, broadcast_s, decode_plan_s, plan_bytes, limit_fraction}] (broadcast_s, decode_plan_s and "
            "plan_bytes null on one rank, limit_fraction on prefill)"
        ),
    )


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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "executor",
        help="model runner tokens/s for decode and prefill, against the GEMM roofline",
        description="Runs the model runner in-process with synthetic plans. The roofline is a large\n"
        "matmul's FLOP/s measured in the same run; each figure's fraction is\n"
        "tokens/s x FLOPs per token / roofline (2 x parameters for decode; prefill\n"
        "tokens skip the lm_head). --no-batch-invariant measures what batch invariance costs;\n"
        "-tp N shards the model over N ranks, and each decode batch then also reports its\n"
        "plan's size, rank 0's broadcast and the other ranks' decode of it.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, ExecutorBenchConfig)
    add_flags(
        parser,
        RunnerConfig,
        group=_RUNNER,
        overrides={"model": {"default": defaults.DEFAULT_MODEL}, "kv_cache_gb": {"help": _KV_HELP}},
    )
    add_flags(parser, TensorParallelConfig, group=_RUNNER)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.executor.process_memory import MIB, resident_bytes
    from kvserve.executor.tensor_parallel.layout import TensorParallelFitError
    from kvserve.log_config import configure_logging

    bench = config_from_args(ExecutorBenchConfig, args)
    configure_logging(level="WARNING" if bench.json else None)
    try:
        parallel = config_from_args(TensorParallelConfig, args)
        config = config_from_args(RunnerConfig, args)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if config.kv_cache_gb is None and not config.device.startswith("cuda"):
        # Each decoding sequence holds whole blocks: its context rounded up to the block size.
        per_sequence = -(-(bench.prompt_len + bench.steps + 4) // config.block_size) * config.block_size
        tokens = max(max(bench.batches) * per_sequence, max(bench.prefill_batches or [1]) * bench.prefill_len)
        config.kv_cache_gb = _gib_for_tokens(config, tokens + 64 * config.block_size, parallel.tensor_parallel_size)
    if bench.json:  # the other ranks log as quietly as this one
        os.environ.setdefault("KVSERVE_LOG_LEVEL", "WARNING")
    try:
        executor, runner = _start(config, parallel)
    except TensorParallelFitError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2

    def show(measured: tuple[str, int, float]) -> None:
        if not bench.json:
            print(f"measured {measured[0]} batch {measured[1]}: {measured[2]:.1f} tokens/s", flush=True)

    try:
        gemm, limit, results = run_executor_bench(
            executor,
            bench.batches,
            bench.prefill_batches,
            bench.prompt_len,
            bench.prefill_len,
            bench.steps,
            greedy=not bench.sample,
            progress=show,
            runner=runner,
        )
        if bench.json:
            report = {
                "dtype": runner.dtype_name,
                "weights": runner.weights_mode,
                "device": runner.device,
                "attention_backend": runner.backend_name,
                "batch_invariant": runner.invariant,
                "tensor_parallel_size": parallel.tensor_parallel_size,
                "gemm_flops": gemm,
                **asdict(limit),
                "rss_mib": resident_bytes() / MIB,
                "results": [asdict(r) for r in results],
            }
            print(json.dumps(report))
        else:
            for r in results:
                print(_result_line(r))
            ranks = parallel.tensor_parallel_size
            print(
                f"GEMM roofline: {gemm / 1e9:.1f} GFLOP/s ({f'{ranks} ranks, ' if ranks > 1 else ''}"
                f"{runner.dtype_name}, {runner.device}, attention {runner.backend_name}, "
                f"batch-invariant {'on' if runner.invariant else 'off'}); "
                f"model {runner.model_config.num_params / 1e6:.1f} M params; "
                f"goal: decode batch 64 >= {100 * GOAL_DECODE64_ROOFLINE:.0f}% of the roofline"
            )
            ceiling = limit_tokens_per_s(limit.copy_bandwidth, limit.weight_bytes, limit.kv_bytes_per_seq, 1)
            print(
                f"physical limit: {limit.weight_bytes / 1e6:.1f} MB of weights and {limit.kv_bytes_per_seq / 1e6:.2f} "
                f"MB of KV per sequence read per step, copy bandwidth {limit.copy_bandwidth / 1e9:.1f} GB/s: at most "
                f"{ceiling:.0f} tokens/s at batch 1"
            )
            rank0 = " (rank 0)" if ranks > 1 else ""
            print(f"executor resident memory after the run{rank0}: {resident_bytes() / MIB:.0f} MiB")
    finally:
        executor.close()  # a group's other ranks leave with it
    return 0


def _start(config: RunnerConfig, parallel: TensorParallelConfig) -> tuple[Executor, ModelRunner]:
    """(the executor to drive, rank 0's runner): one runner here, or rank 0 of a group whose other
    ranks are this process's children."""
    if parallel.tensor_parallel_size == 1:
        from kvserve.executor.model_runner import ModelRunner

        runner = ModelRunner(config)
        return runner, runner
    from kvserve.executor.process import start_local_group

    group = start_local_group(config, parallel)
    return group, cast("ModelRunner", group.runner)


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


def _gib_for_tokens(config: RunnerConfig, tokens: int, ranks: int = 1) -> float:
    """KV GiB for `tokens` cached tokens of the configured model, in float32, on each of `ranks`
    tensor-parallel ranks (each holds its share of the KV heads). A size the model does not fit
    gets the whole model's figure here; starting the group then refuses it."""
    from kvserve.executor.model_config import load_model_config
    from kvserve.executor.tensor_parallel.layout import TensorParallelFitError, plan_layout
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.protos.kv_geometry import GIB, KvGeometry, bytes_per_token

    cfg = load_model_config(ensure_model_dir(config.model))
    try:
        kv_heads = plan_layout(cfg, 0, ranks).num_kv_heads
    except TensorParallelFitError:
        kv_heads = cfg.num_kv_heads
    return tokens * bytes_per_token(KvGeometry(cfg.num_layers, kv_heads, cfg.head_dim), "float32") / GIB
