"""One `bench serve` run: every configuration on the same requests, then the report.

Configurations, one after another so they never compete for the CPU:
1. `kvserve` — the server under test, prefix caching on;
2. `kvserve-no-cache` — a second server started with `--no-prefix-caching` (or an
   already running one given by `no_cache_target`);
3. `hf-generate` — Hugging Face `generate`, static batches, in this process, on `mixed`;
4. the contiguous-preallocation estimate, computed from kvserve's trace and KV budget.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import structlog

from kvserve.bench import workloads as wl
from kvserve.bench.load_driver import RunResult, run_workload, warm_up
from kvserve.bench.report import KVSERVE, KVSERVE_NO_CACHE, BenchReport, compute_ratios, summarize_run
from kvserve.testing.server_launcher import DEFAULT_STARTUP_TIMEOUT_S, ServeProcess, serving
from protos import defaults

log = structlog.get_logger(__name__)

BASELINES = ("hf", "no-cache", "prealloc")
NO_PREFIX_CACHING_FLAG = "--no-prefix-caching"


@dataclass(slots=True)
class BenchConfig:
    workloads: list[str] = field(default_factory=lambda: ["mixed"])
    num_requests: int = 32
    concurrency: int | None = 16
    request_rate: float | None = None
    seed: int = 0
    max_tokens_cap: int | None = None
    start_server: bool = False
    executor: str = "torch"
    host: str = defaults.GRPC_HOST
    port: int = defaults.GRPC_PORT
    server_args: list[str] = field(default_factory=list)
    no_cache_target: str | None = None
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    model: str = defaults.DEFAULT_MODEL
    hf_batch_size: int = 8
    progress: bool = True
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    command_line: str = ""
    """How the run was invoked, recorded in the report's meta."""


def _machine() -> dict[str, str | int | None]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }  # other work on the machine skews every figure


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("kvserve", "torch", "transformers", "grpcio"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


async def _run_against(
    target: str, configuration: str, loads: list[wl.Workload], config: BenchConfig
) -> list[RunResult]:
    from clients.async_client import AsyncClient

    runs = []
    async with AsyncClient(target) as client:
        await client.wait_until_serving(config.startup_timeout_s)
        await warm_up(client, loads[0].sessions[0].turns[0].new_token_ids)
        for workload in loads:
            runs.append(
                await run_workload(
                    client,
                    workload,
                    configuration=configuration,
                    concurrency=config.concurrency,
                    request_rate=config.request_rate,
                    seed=config.seed,
                    progress=config.progress,
                )
            )
    return runs


async def _model_info(target: str, timeout_s: float) -> dict:
    from clients.async_client import AsyncClient

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
    ) as server:
        log.info("server ready", name=name, target=server.address, log=str(server.log_path))
        yield server


async def run_serve_benchmark(config: BenchConfig) -> BenchReport:
    """Run every configuration and return the filled report."""
    started = dt.datetime.now(dt.UTC)
    runs: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        if config.start_server:
            target = stack.enter_context(_server(config, KVSERVE)).address
        else:
            target = f"{config.host}:{config.port}"
        info = await _model_info(target, config.startup_timeout_s)
        vocab_size = int(info["vocab_size"])
        loads = [
            w
            for name in config.workloads
            for w in wl.build(name, config.num_requests, vocab_size, config.seed, config.max_tokens_cap)
        ]
        runs += await _run_against(target, KVSERVE, loads, config)

    no_cache_loads = [w for w in loads if w.name != "cold-warm"]
    if "no-cache" in config.baselines and no_cache_loads:
        if config.no_cache_target:
            runs += await _run_against(config.no_cache_target, KVSERVE_NO_CACHE, no_cache_loads, config)
        elif config.start_server:
            with _server(config, KVSERVE_NO_CACHE, [NO_PREFIX_CACHING_FLAG]) as server:
                runs += await _run_against(server.address, KVSERVE_NO_CACHE, no_cache_loads, config)
        else:
            log.warning("no-cache baseline skipped: give --no-cache-target or --start-server")

    hf_extra: dict = {}
    mixed = next((w for w in loads if w.name == "mixed"), None)
    if "hf" in config.baselines:
        if mixed is None:
            log.warning("hf baseline skipped: it runs on the mixed workload")
        else:
            hf = _run_hf(config, mixed, vocab_size)
            if hf is not None:
                runs.append(hf[0])
                hf_extra = {"hf_batch_size": config.hf_batch_size, "hf_generated_tokens": hf[1]}

    report = BenchReport(
        meta={
            "date": started.isoformat(timespec="seconds"),
            "command": config.command_line,
            "machine": _machine(),
            "versions": _versions(),
            "model": {
                k: info.get(k)
                for k in (
                    "model_id",
                    "executor_kind",
                    "device",
                    "dtype",
                    "attention_backend",
                    "block_size",
                    "num_blocks",
                    "vocab_size",
                )
            },
            "config": asdict(config),
            **hf_extra,
        }
    )
    report.results = [summarize_run(r) for r in runs]
    block_size = int(info.get("block_size") or defaults.BLOCK_SIZE)
    num_blocks = int(info.get("num_blocks") or 0) if "prealloc" in config.baselines else 0
    max_len: dict[str, int] = {}
    for w in loads:
        max_len[w.name] = max(max_len.get(w.name, 0), w.max_request_len())
    compute_ratios(report, runs, num_blocks=num_blocks, block_size=block_size, max_request_len_by_workload=max_len)
    return report


def _run_hf(config: BenchConfig, mixed: wl.Workload, vocab_size: int) -> tuple[RunResult, int] | None:
    from executor_svc.model_store import ensure_model_dir
    from kvserve.bench.hf_baseline import load_model, requests_from_workload, run_hf_baseline

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
