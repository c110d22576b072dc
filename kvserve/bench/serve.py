"""One `bench serve` run: every configuration on the same requests, then the report.

Configurations, one after another so they never compete for the CPU:
1. `kvserve` — the server under test, prefix caching on;
2. the server baselines (`SERVER_BASELINES`), each a kvserve server of its own:
   `kvserve-no-cache`, started with `--no-prefix-caching` (or an already running one given by
   `no_cache_target`), and `kvserve-prealloc`, the contiguous-preallocation tier run for real
   (`--kv-reservation max-model-len --no-prefix-caching`, one server per workload with
   `--max-model-len` = that workload's longest request, the setting the estimate assumes);
3. every `--target NAME=URL`: another OpenAI-compatible server (llama.cpp's llama-server,
   vLLM), driven over HTTP with the same requests (`openai_driver.py`), every workload but
   `cold-warm` (the OpenAI API has no cache namespace to make a cold half with);
4. `hf-generate` — Hugging Face `generate`, static batches, in this process, on `mixed`;
5. the contiguous-preallocation estimate, computed from kvserve's trace and KV budget (beside
   the `kvserve-prealloc` run as its cross-check).

`sweep` (`--sweep FLAG=V1,V2,...`, sweep.py) replaces all of this with one `kvserve` run per
value, each on a fresh server started with `--FLAG V`; baselines and targets do not run.

`api` picks how the kvserve configurations are driven: `grpc` (the async client) or `openai`
(kvserve's own HTTP API: the fair side of a comparison with an HTTP target). Either way the
server's counters (peak running, preemptions, prefix hits) come from gRPC `server_stats()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import logging
import math
import shlex
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from kvserve.bench import workloads as wl
from kvserve.bench.copy_workload import ModelTextEncoder
from kvserve.bench.load_driver import RunResult, SendTurn, run_workload, warm_up
from kvserve.bench.openai_driver import HttpTarget, OpenAIDriver, WorkloadTokenizer
from kvserve.bench.report import (
    HF_GENERATE,
    KVSERVE,
    KVSERVE_NO_CACHE,
    KVSERVE_PREALLOC,
    BenchReport,
    compute_ratios,
    summarize_run,
)
from kvserve.bench.report_output import ReportOutput, write_outputs
from kvserve.bench.run_meta import run_meta
from kvserve.bench.sweep import SweepSpec, sweep_points
from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.testing.server_launcher import DEFAULT_STARTUP_TIMEOUT_S, ServeProcess, serving

log = structlog.get_logger(__name__)

BASELINES = ("hf", "no-cache", "prealloc")
APIS = ("grpc", "openai")
NO_PREFIX_CACHING_FLAG = "--no-prefix-caching"
PREALLOC_RESERVATION = ("--kv-reservation", "max-model-len")
"""The scheduler reserves each sequence's whole max_model_len of blocks at admission."""
RESERVED_NAMES = (KVSERVE, KVSERVE_NO_CACHE, KVSERVE_PREALLOC, HF_GENERATE)


@dataclass(frozen=True, slots=True)
class ServerBaseline:
    """A `--baselines` value that runs on a kvserve server of its own: its name in the report, its flags."""

    baseline: str
    configuration: str
    flags: tuple[str, ...]
    fit_to_workload: bool = False
    """One server per workload, `--max-model-len` its longest request (prompt + max_tokens)."""


SERVER_BASELINES = (
    ServerBaseline("no-cache", KVSERVE_NO_CACHE, (NO_PREFIX_CACHING_FLAG,)),
    ServerBaseline("prealloc", KVSERVE_PREALLOC, (*PREALLOC_RESERVATION, NO_PREFIX_CACHING_FLAG), fit_to_workload=True),
)


@dataclass(slots=True)
class BenchConfig:
    """One `bench serve` run; each field but `command_line` is a `kvserve bench serve` flag."""

    workloads: tuple[str, ...] = field(
        default=("mixed",),
        metadata=flag(
            "mixed: 64-512 prompt, 32-256 output; shared-prefix: 1,500-token system prompt + 50-300-token "
            "questions; multi-turn: chats up to 10 turns; cold-warm: the shared-prefix requests on an empty "
            "then a primed cache; multi-prefix: 8 distinct 1,000-token system prompts at random (for replicas "
            "behind a router: --target ROUTER, or bench scale-out); copy: real editing requests whose answers copy "
            "their prompts (repeat, rewrite, fix spelling, fix a bug; for --speculative); all: every one",
            name="--workload",
            nargs="+",
            choices=(*wl.WORKLOAD_NAMES, "all"),
        ),
    )
    num_requests: int = field(default=32, metadata=flag("requests per workload"))
    concurrency: int | None = field(default=16, metadata=flag("most requests in flight (0: no limit)"))
    request_rate: float | None = field(
        default=None, metadata=flag("Poisson arrival rate in requests/s (unset or inf: all arrive at once)")
    )
    seed: int = field(default=0, metadata=flag("seed of the workloads and the arrivals"))
    max_tokens_cap: int | None = field(
        default=None,
        metadata=flag("cap every request's max_tokens (unset or 0: the workload's own lengths); for short CPU runs"),
    )
    start_server: bool = field(
        default=False, metadata=flag("start kvserve serve (and the no-cache server) as subprocesses on free ports")
    )
    executor: str = field(default="torch", metadata=flag("executor of the started servers", choices=("torch", "fake")))
    host: str = field(default=defaults.GRPC_HOST, metadata=flag("server host (started servers listen here too)"))
    port: int = field(default=defaults.GRPC_PORT, metadata=flag("port of an already running server"))
    server_args: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "extra argument passed to every started server, e.g. --server-arg=--num-blocks=512 (repeatable)",
            name="--server-arg",
            metavar="ARG",
        ),
    )
    no_cache_target: str | None = field(
        default=None,
        metadata=flag(
            "an already running server with --no-prefix-caching; when unset, one is started with "
            "--start-server, else that baseline is skipped",
            metavar="HOST:PORT",
        ),
    )
    baselines: tuple[str, ...] = field(
        default=BASELINES,
        metadata=flag(
            "baselines to run in the same run; prealloc: the contiguous-preallocation estimate, and with "
            "--start-server a server run for real with --kv-reservation max-model-len --no-prefix-caching "
            "(--max-model-len = each workload's longest request), shown as three tiers with the two paged ones",
            nargs="*",
            choices=BASELINES,
        ),
    )
    model: str = field(
        default=defaults.DEFAULT_MODEL,
        metadata=flag("model the hf baseline loads; its tokenizer also decodes text prompts for --target"),
    )
    hf_batch_size: int = field(default=8, metadata=flag("static batch size of the hf baseline"))
    progress: bool = field(default=True, metadata=flag("show a progress bar"))
    startup_timeout_s: float = field(
        default=DEFAULT_STARTUP_TIMEOUT_S, metadata=flag("seconds to wait for SERVING", name="--startup-timeout")
    )
    api: str = field(
        default="grpc",
        metadata=flag(
            "how kvserve is driven: grpc (the async client) or openai (streaming /v1/completions on its HTTP API, "
            "the fair side of a comparison with --target); server counters come from gRPC either way",
            choices=APIS,
        ),
    )
    http_port: int = field(
        default=defaults.HTTP_PORT,
        metadata=flag("with --api openai and no --start-server: the HTTP port of the already running server on --host"),
    )
    targets: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "another OpenAI-compatible server measured in the same run with the same requests, after kvserve's "
            "servers have stopped (repeatable), e.g. llama-server=http://127.0.0.1:8080 (see "
            "scripts/llama_server.sh). Prompts go as token ids, or as text decoded with the model's tokenizer; "
            "default: probe on the warm-up request. Every workload but cold-warm",
            name="--target",
            metavar="NAME=URL[,tokens|,text]",
        ),
    )
    sweep: str | None = field(
        default=None,
        metadata=flag(
            "run the workload once per value of one kvserve serve flag, each on a fresh server started with "
            "--FLAG V (after every --server-arg), e.g. block-size=8,16,32; prints one table of output tok/s, "
            "TTFT p50/p99, ITL p99, KV partial-block waste and peak running against the value (--json, --plot "
            "too). Starts its servers itself; baselines and --target do not run",
            metavar="FLAG=V1,V2,...",
        ),
    )
    command_line: str = ""
    """How the run was invoked, recorded in the report's meta (not a flag)."""

    def __post_init__(self) -> None:
        # One spelling per meaning in the report's meta: "all" is every workload, 0 or inf is no limit.
        if "all" in self.workloads:
            self.workloads = tuple(wl.WORKLOAD_NAMES)
        if self.concurrency == 0:
            self.concurrency = None
        if self.request_rate is not None and math.isinf(self.request_rate):
            self.request_rate = None
        if self.max_tokens_cap == 0:
            self.max_tokens_cap = None


async def _run_loads(
    configuration: str,
    loads: list[wl.Workload],
    config: BenchConfig,
    *,
    warm: Callable[[list[int]], Awaitable[None]],
    stats_client: Any,
    send_turn: SendTurn | None = None,
) -> list[RunResult]:
    """The untimed warm-up, then every workload on one configuration."""
    await warm(loads[0].sessions[0].turns[0].new_token_ids)
    runs = []
    for workload in loads:
        runs.append(
            await run_workload(
                stats_client,
                workload,
                configuration=configuration,
                concurrency=config.concurrency,
                request_rate=config.request_rate,
                seed=config.seed,
                progress=config.progress,
                send_turn=send_turn,
            )
        )
    return runs


async def _run_against(
    target: str, configuration: str, loads: list[wl.Workload], config: BenchConfig, http_url: str | None = None
) -> list[RunResult]:
    """A kvserve server at gRPC `target`; driven over its HTTP API at `http_url` when `config.api` is openai."""
    from kvserve.clients.async_client import AsyncClient

    async with AsyncClient(target) as client:
        await client.wait_until_serving(config.startup_timeout_s)
        block_size = int((await client.model_info()).get("block_size") or 0)
        if config.api != "openai":

            async def grpc_warm(token_ids: list[int]) -> None:
                await warm_up(client, token_ids)

            runs = await _run_loads(configuration, loads, config, warm=grpc_warm, stats_client=client)
        elif http_url is None:
            raise ValueError(f"{configuration}: api openai needs the server's HTTP URL")
        else:
            async with OpenAIDriver(http_url, name=configuration, tokenizer=_tokenizer(config)) as http:
                await http.wait_ready(config.startup_timeout_s)
                runs = await _run_loads(
                    configuration, loads, config, warm=http.warm_up, stats_client=client, send_turn=http.send_turn
                )
    for run in runs:  # each run's partial-block waste is counted at its own server's block size
        run.block_size = block_size
    return runs


async def _run_http_target(
    target: HttpTarget, loads: list[wl.Workload], config: BenchConfig, meta: dict[str, Any]
) -> list[RunResult]:
    """A foreign OpenAI-compatible server (no kvserve counters, so no stats client); `meta` records
    its model, the prompt mode used, or why it could not be measured, without losing the other runs."""
    meta.update(url=target.url, prompt_mode=target.prompt_mode)
    driver = OpenAIDriver(target.url, name=target.name, prompt_mode=target.prompt_mode, tokenizer=_tokenizer(config))
    try:
        async with driver as http:
            meta["model"] = await http.wait_ready(config.startup_timeout_s)
            log.info("target ready", target=target.name, url=target.url, model=meta["model"])
            runs = await _run_loads(
                target.name, loads, config, warm=http.warm_up, stats_client=None, send_turn=http.send_turn
            )
            meta["prompt_mode"] = http.prompt_mode
            return runs
    except Exception as exc:
        log.error("target not measured", target=target.name, url=target.url, error=str(exc))
        meta["error"] = f"{type(exc).__name__}: {exc}"
        return []


def _tokenizer(config: BenchConfig) -> WorkloadTokenizer:
    """The tokenizer of the model the servers run (kvserve's converted model dir), loaded only when needed."""

    def model_dir() -> Path:
        from kvserve.executor.weights.model_store import ensure_model_dir

        return ensure_model_dir(config.model)

    return WorkloadTokenizer(model_dir)


def _text_encoder(config: BenchConfig) -> ModelTextEncoder:
    """The chat template and tokenizer the `copy` workload renders its requests with, loaded only when needed."""

    def model_dir() -> Path:
        from kvserve.executor.weights.model_store import ensure_model_dir

        return ensure_model_dir(config.model)

    return ModelTextEncoder(model_dir)


async def _model_info(target: str, timeout_s: float) -> dict:
    from kvserve.clients.async_client import AsyncClient

    async with AsyncClient(target) as client:
        await client.wait_until_serving(timeout_s)
        return await client.model_info()


@contextlib.contextmanager
def _server(config: BenchConfig, name: str, extra: Sequence[str] = ()) -> Iterator[ServeProcess]:
    """A `kvserve serve` child for one configuration; its whole process group goes when the block ends."""
    log.info("starting server", name=name, executor=config.executor, args=[*config.server_args, *extra])
    with serving(
        ["--executor", config.executor, *config.server_args, *extra],
        host=config.host,
        name=name,
        timeout_s=config.startup_timeout_s,
        http=config.api == "openai",  # the HTTP API only where it is driven
    ) as server:
        log.info("server ready", name=name, target=server.address, log=str(server.log_path))
        yield server


def _http_url(server: ServeProcess | None, config: BenchConfig) -> str | None:
    """kvserve's HTTP API, when the kvserve configurations are driven over it."""
    if config.api != "openai":
        return None
    return server.http_url if server is not None else f"http://{config.host}:{config.http_port}"


async def _kvserve_runs(
    config: BenchConfig, variants: list[tuple[str, list[str]]], *, start: bool
) -> tuple[list[RunResult], dict, list[wl.Workload]]:
    """The server under test, every workload once per variant (configuration, extra server flags):
    one variant unless `--sweep`; each on a fresh server when `start`, else the one at host:port.
    Also the first server's ModelInfo and the workloads built for its vocabulary."""
    runs: list[RunResult] = []
    info: dict = {}
    loads: list[wl.Workload] = []
    for name, extra in variants:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(_server(config, name, extra)) if start else None
            target = server.address if server is not None else f"{config.host}:{config.port}"
            if not loads:
                info = await _model_info(target, config.startup_timeout_s)
                loads = [
                    w
                    for workload in config.workloads
                    for w in wl.build(
                        workload,
                        config.num_requests,
                        int(info["vocab_size"]),
                        config.seed,
                        config.max_tokens_cap,
                        _text_encoder(config),
                    )
                ]
            runs += await _run_against(target, name, loads, config, _http_url(server, config))
    return runs, info, loads


async def _run_server_baseline(
    baseline: ServerBaseline, loads: list[wl.Workload], config: BenchConfig
) -> list[RunResult]:
    """One server baseline on `loads`: on the running `no_cache_target`, else on servers started here."""
    if baseline.configuration == KVSERVE_NO_CACHE and config.no_cache_target:
        if config.api == "openai":
            log.warning("no-cache baseline skipped: --no-cache-target is a gRPC address; use --start-server")
            return []
        return await _run_against(config.no_cache_target, KVSERVE_NO_CACHE, loads, config)
    if not config.start_server:
        hint = "give --no-cache-target or --start-server" if baseline.baseline == "no-cache" else "give --start-server"
        log.warning(f"{baseline.baseline} baseline run skipped: {hint}")
        return []
    runs: list[RunResult] = []
    for group in [[w] for w in loads] if baseline.fit_to_workload else [loads]:
        extra = list(baseline.flags)
        if baseline.fit_to_workload:
            extra += ["--max-model-len", str(max(w.max_request_len() for w in group))]
        with _server(config, baseline.configuration, extra) as server:  # after the last one has stopped
            runs += await _run_against(server.address, baseline.configuration, group, config, _http_url(server, config))
    return runs


async def run_serve_benchmark(config: BenchConfig) -> BenchReport:
    """Run every configuration (or every value of the sweep) and return the filled report."""
    started = dt.datetime.now(dt.UTC)
    if config.api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {config.api!r}")
    http_targets = [HttpTarget.parse(spec) for spec in config.targets]
    names = [t.name for t in http_targets]
    if len(set(names)) != len(names) or set(names) & set(RESERVED_NAMES):
        raise ValueError(f"--target names must be unique and none of {', '.join(RESERVED_NAMES)}")
    spec = SweepSpec.parse(config.sweep) if config.sweep else None
    variants = spec.variants() if spec is not None else [(KVSERVE, [])]
    runs, info, loads = await _kvserve_runs(config, variants, start=config.start_server or spec is not None)
    vocab_size = int(info["vocab_size"])

    baseline_loads = [w for w in loads if w.name != "cold-warm"]
    target_meta: dict[str, dict[str, Any]] = {t.name: {} for t in http_targets}
    hf_extra: dict = {}
    if spec is None:
        for baseline in SERVER_BASELINES:  # one server at a time: they never share the CPU
            if baseline.baseline in config.baselines and baseline_loads:
                runs += await _run_server_baseline(baseline, baseline_loads, config)
        for http_target in http_targets:  # after kvserve's servers have stopped
            if baseline_loads:
                runs += await _run_http_target(http_target, baseline_loads, config, target_meta[http_target.name])
        mixed = next((w for w in loads if w.name == "mixed"), None)
        if "hf" in config.baselines:
            if mixed is None:
                log.warning("hf baseline skipped: it runs on the mixed workload")
            else:
                hf = _run_hf(config, mixed, vocab_size)
                if hf is not None:
                    runs.append(hf[0])
                    hf_extra = {"hf_batch_size": config.hf_batch_size, "hf_generated_tokens": hf[1]}

    report = BenchReport(meta=run_meta(config, started, info, targets=target_meta, **hf_extra))
    report.results = [summarize_run(r) for r in runs]
    block_size = int(info.get("block_size") or defaults.BLOCK_SIZE)
    num_blocks = int(info.get("num_blocks") or 0) if "prealloc" in config.baselines and spec is None else 0
    max_len: dict[str, int] = {}
    for w in loads:
        max_len[w.name] = max(max_len.get(w.name, 0), w.max_request_len())
    compute_ratios(
        report,
        runs,
        num_blocks=num_blocks,
        block_size=block_size,
        max_request_len_by_workload=max_len,
        targets=names,
    )
    if spec is not None:
        report.sweep = sweep_points(spec, report, runs)
    return report


def _run_hf(config: BenchConfig, mixed: wl.Workload, vocab_size: int) -> tuple[RunResult, int] | None:
    from kvserve.bench.baseline_hf import load_model, requests_from_workload, run_hf_baseline
    from kvserve.executor.weights.model_store import ensure_model_dir

    model = load_model(ensure_model_dir(config.model))
    if model.config.vocab_size < vocab_size:
        log.warning(
            "hf baseline skipped: its model's vocabulary is smaller than the server's; "
            "give --model the model the server runs",
            hf_vocab=model.config.vocab_size,
            server_vocab=vocab_size,
        )
        return None
    return run_hf_baseline(
        model, requests_from_workload(mixed), batch_size=config.hf_batch_size, progress=config.progress
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serving benchmark: latency, throughput, cache reuse, ratios vs baselines",
        description="Drive a kvserve server (or start one) with seeded workloads, through the gRPC async "
        "client or (--api openai) its OpenAI-compatible HTTP API, then compare, in the same run, kvserve "
        "with prefix caching off, any other OpenAI-compatible server (--target, e.g. llama.cpp's "
        "llama-server), Hugging Face generate (static batching) and contiguous preallocation (run for real "
        "with --start-server, and estimated). Prints a table and the goal ratios of docs/benchmarks.md; "
        "--json and --plot write them for machines and people. --sweep FLAG=V1,V2,... instead runs the "
        "workload once per value of a kvserve serve flag, each on a fresh server.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, BenchConfig, exclude=("command_line",))
    add_flags(parser, ReportOutput, overrides={"json": {"help": ReportOutput.JSON_HELP + ", table to stderr"}})
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.log_config import configure_logging

    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the HTTP driver
    config = config_from_args(BenchConfig, args, command_line=shlex.join(["kvserve", *sys.argv[1:]]))
    try:
        for spec in config.targets:
            HttpTarget.parse(spec)
        if config.sweep is not None:
            SweepSpec.parse(config.sweep).check()  # before any server starts
    except ValueError as exc:
        print(f"kvserve bench serve: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_serve_benchmark(config))
    status = write_outputs(report, config_from_args(ReportOutput, args), stream=sys.stdout)
    unmeasured = [name for name, meta in report.meta.get("targets", {}).items() if meta.get("error")]
    for name in unmeasured:
        print(
            f"kvserve bench serve: --target {name} not measured: {report.meta['targets'][name]['error']}",
            file=sys.stderr,
        )
    return 1 if unmeasured else status
