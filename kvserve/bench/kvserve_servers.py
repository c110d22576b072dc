"""The kvserve servers a `bench serve` run drives, started here or already running.

The server under test runs once per variant (one, or one per `--sweep` value); each server
baseline (`SERVER_BASELINES`) is a kvserve server of its own with the flags that make it that
baseline. A server started here is a `kvserve serve` child on a free port, stopped, process group
and all, before the next one starts, so configurations never compete for the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvserve.bench import workloads as wl
from kvserve.bench.configuration_runs import run_on_kvserve
from kvserve.bench.copy_workload import ModelTextEncoder
from kvserve.bench.load_driver import RunResult
from kvserve.bench.report import KVSERVE_NO_CACHE, KVSERVE_PREALLOC
from kvserve.bench.serve_config import BenchConfig
from kvserve.testing.server_launcher import ServeProcess, serving

log = structlog.get_logger(__name__)

NO_PREFIX_CACHING_FLAG = "--no-prefix-caching"
PREALLOC_RESERVATION = ("--kv-reservation", "max-model-len")
"""The scheduler reserves each sequence's whole max_model_len of blocks at admission."""


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


async def run_server_under_test(
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
            runs += await run_on_kvserve(target, name, loads, config, _http_url(server, config))
    return runs, info, loads


async def run_server_baseline(
    baseline: ServerBaseline, loads: list[wl.Workload], config: BenchConfig
) -> list[RunResult]:
    """One server baseline on `loads`: on the running `no_cache_target`, else on servers started here."""
    if baseline.configuration == KVSERVE_NO_CACHE and config.no_cache_target:
        if config.api == "openai":
            log.warning("no-cache baseline skipped: --no-cache-target is a gRPC address; use --start-server")
            return []
        return await run_on_kvserve(config.no_cache_target, KVSERVE_NO_CACHE, loads, config)
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
            runs += await run_on_kvserve(
                server.address, baseline.configuration, group, config, _http_url(server, config)
            )
    return runs


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


async def _model_info(target: str, timeout_s: float) -> dict:
    from kvserve.clients.async_client import AsyncClient

    async with AsyncClient(target) as client:
        await client.wait_until_serving(timeout_s)
        return await client.model_info()


def _text_encoder(config: BenchConfig) -> ModelTextEncoder:
    """The chat template and tokenizer the `copy` workload renders its requests with, loaded only when needed."""

    def model_dir() -> Path:
        from kvserve.executor.weights.model_store import ensure_model_dir

        return ensure_model_dir(config.model)

    return ModelTextEncoder(model_dir)
