"""One `bench serve` configuration on a server already listening: the untimed warm-up, then every workload.

A kvserve server is driven through the gRPC async client or, with `--api openai`, over its own HTTP
API, its counters coming from gRPC either way; a `--target` (another OpenAI-compatible server) only
over HTTP, without counters. Which servers run, and when, is `kvserve_servers.py`'s and `serve.py`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from kvserve.bench import workloads as wl
from kvserve.bench.load_driver import RunResult, SendTurn, run_workload, warm_up
from kvserve.bench.openai_driver import HttpTarget, OpenAIDriver, WorkloadTokenizer
from kvserve.bench.serve_config import BenchConfig

log = structlog.get_logger(__name__)


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


async def run_on_kvserve(
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


async def run_on_http_target(
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
