"""`kvserve bench overload`: how fast a full queue says no.

A `kvserve serve --executor fake` server is filled to its limits (`--max-num-seqs` running, then
`--max-queued-requests` waiting), and `--flood` more requests are sent at once over gRPC. Each must
come back RESOURCE_EXHAUSTED without being queued; the figure is how long each took, from the call
to its status (median, p99, slowest). The tests check only the behaviour
(tests/reliability/test_overload.py): a rejection's latency is a performance figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from kvserve.bench.latency_stats import percentile
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.testing.server_launcher import ServeProcess, serving
from kvserve.testing.stream_requests import greedy_request
from kvserve.testing.waiting import wait_until_async

QUEUE_FULL_WITHIN_S = 60.0
"""Bounds only a stuck server: the wait returns once the queue is full."""


@dataclass(frozen=True, slots=True)
class OverloadBenchConfig:
    """`kvserve bench overload`'s flags."""

    flood: int = field(default=200, metadata=flag("requests sent at once to the full server"))
    max_num_seqs: int = field(default=4, metadata=flag("the server's --max-num-seqs"))
    max_queued_requests: int = field(default=8, metadata=flag("the server's --max-queued-requests"))
    step_latency_ms: float = field(default=20.0, metadata=flag("the fake executor's step time"))
    json: bool = field(default=False, metadata=flag("print one JSON object instead of the table"))


@dataclass(slots=True)
class OverloadResult:
    flood: int
    rejected: int
    """Of the flood, those answered RESOURCE_EXHAUSTED (all, on a correct server)."""
    queued_after: int
    """Requests waiting once the flood was answered: the limit, never more."""
    median_ms: float
    p99_ms: float
    max_ms: float


async def _rejection_ms(call: object) -> float | None:
    """Milliseconds from the call to a RESOURCE_EXHAUSTED status; None for any other outcome."""
    import grpc

    started = time.perf_counter()
    try:
        await call.read()  # type: ignore[attr-defined]
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return 1e3 * (time.perf_counter() - started)
    return None


async def _flood(server: ServeProcess, config: OverloadBenchConfig) -> OverloadResult:
    from kvserve.protos.kvserve.v1 import api_pb2_grpc

    async with server.aio_channel() as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        running = [stub.Generate(greedy_request(i, 4000), timeout=600) for i in range(config.max_num_seqs)]
        for call in running:
            await call.read()
        queued = [stub.Generate(greedy_request(10_000 + i, 10), timeout=600) for i in range(config.max_queued_requests)]
        await wait_until_async(  # the queue is full: what is measured starts after
            lambda: server.stats().requests_waiting >= config.max_queued_requests,
            QUEUE_FULL_WITHIN_S,
            f"{config.max_queued_requests} queued requests",
        )
        calls = [stub.Generate(greedy_request(20_000 + i, 10), timeout=600) for i in range(config.flood)]
        latencies = [ms for ms in await asyncio.gather(*(_rejection_ms(c) for c in calls)) if ms is not None]
        waiting = server.stats().requests_waiting
        for call in running + queued:
            call.cancel()
    return OverloadResult(
        flood=config.flood,
        rejected=len(latencies),
        queued_after=waiting,
        median_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=percentile(latencies, 100),
    )


def run_overload_bench(config: OverloadBenchConfig) -> OverloadResult:
    args = [
        *("--executor", "fake", "--num-blocks", "4096"),
        *("--step-latency-ms", str(config.step_latency_ms), "--max-num-seqs", str(config.max_num_seqs)),
        *("--max-queued-requests", str(config.max_queued_requests)),
    ]
    with serving(args, name="overload") as server:
        return asyncio.run(_flood(server, config))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "overload",
        help="how fast a full queue rejects requests (RESOURCE_EXHAUSTED latency)",
        description="Fills a fake-executor server to its running and queue limits, sends --flood more\n"
        "requests at once, and reports how long each took to be refused.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, OverloadBenchConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(OverloadBenchConfig, args)
    result = run_overload_bench(config)
    if config.json:
        print(json.dumps(asdict(result)))
    else:
        print(
            f"{result.rejected} of {result.flood} rejected (RESOURCE_EXHAUSTED), {result.queued_after} waiting after; "
            f"rejection latency median {result.median_ms:.1f} ms, p99 {result.p99_ms:.1f} ms, "
            f"slowest {result.max_ms:.1f} ms"
        )
    if result.rejected != result.flood or result.queued_after != config.max_queued_requests:
        print("kvserve bench overload: the server did not refuse the whole flood", file=sys.stderr)
        return 1
    return 0
