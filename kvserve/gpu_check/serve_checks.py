"""`kvserve serve` on CUDA with the 8B-shaped model: 64 concurrent streams, then kill -9 under them.

One server for the serve stage (kvserve.testing.server_launcher, as the fault-injection suite
starts them), with a restart timeout long enough for a new executor to reload 15 GB of weights.

The kill check is tests/reliability/test_executor_faults.py's, on the real model: the executor
is killed once a quarter of the streams' tokens have arrived; the supervisor restarts it, the
scheduler re-syncs, and every stream must complete with all its tokens, finish LENGTH, and
leave no block referenced. Whether the resumed streams repeat the undisturbed run token for
token is reported but not required: the new executor recomputes the KV of prompt + output in
one prefill, and in bf16 that is not bit-equal to the decode steps it replaces; with random
weights a near-tie then flips a greedy token (the fake executor of the CPU test is exact).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import structlog

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.results import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

log = structlog.get_logger(__name__)

RESTART_TIMEOUT_S = 180.0
"""How long in-flight requests wait for the restarted executor (the default 30 s is short for 15 GB)."""
STREAM_TIMEOUT_S = 300.0
KILL_AT_FRACTION = 0.25


def serve_server(ctx: CheckContext) -> Any:
    """The stage's `kvserve serve --model <big>`, SERVING; stopped (process groups and all) at stage end."""

    def make() -> Any:
        from kvserve.testing.server_launcher import start_serve

        log_dir = ctx.out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        args = ["--model", str(model_dir(ctx.work_dir, ctx.scale.big_model))]
        args += ["--executor-restart-timeout", str(RESTART_TIMEOUT_S)]
        server = start_serve(args, log_dir, name="serve-big")
        ctx.remember_process_group(server.process.pid)
        try:
            started = time.monotonic()
            server.wait_serving(ctx.scale.startup_timeout_s)
            ctx.state["server_start_s"] = time.monotonic() - started
        except BaseException:
            server.stop()
            raise
        for pid in server.executor_pids():
            ctx.remember_process_group(pid)
        return server

    return ctx.resource("server", make, close=lambda server: server.stop())


async def _consume(stub: Any, request: Any, arrived: list[int]) -> tuple[list[int], int]:
    """A whole stream's (token ids, finish reason); `arrived[0]` counts tokens as they come."""
    ids: list[int] = []
    reason = 0
    async for chunk in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
        ids.extend(chunk.token_ids)
        arrived[0] += len(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return ids, reason


async def run_streams(server: Any, requests: list[Any], *, kill_at_tokens: int | None = None) -> dict[str, Any]:
    """Every request at once; with `kill_at_tokens`, kill -9 the executor once that many have arrived."""
    from kvserve.protos.kvserve.v1 import api_pb2_grpc

    arrived = [0]
    killed: dict[str, Any] = {}
    started = time.monotonic()
    async with server.aio_channel() as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        tasks = [asyncio.create_task(_consume(stub, r, arrived)) for r in requests]
        if kill_at_tokens is not None:
            while arrived[0] < kill_at_tokens and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            killed = {"pid": server.executor_pids()[-1], "tokens_before": arrived[0], "at": time.time()}
            os.kill(killed["pid"], signal.SIGKILL)
            killed["streams_done_before"] = sum(t.done() for t in tasks)
            print(f"[gpu_check] kill -9 executor {killed['pid']} after {arrived[0]} tokens", flush=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    print(f"[gpu_check] {len(requests)} streams ended after {time.monotonic() - started:.1f}s", flush=True)
    return {"results": results, "seconds": time.monotonic() - started, "killed": killed}


def _complete(results: list[Any], tokens: int) -> tuple[list[str], list[list[int]]]:
    """(problems, token ids per stream): every stream must end LENGTH with exactly `tokens` tokens."""
    from kvserve.protos.kvserve.v1 import api_pb2

    problems: list[str] = []
    outputs: list[list[int]] = []
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            problems.append(f"stream {i}: {type(r).__name__}: {r}"[:300])
            outputs.append([])
            continue
        ids, reason = r
        outputs.append(ids)
        if len(ids) != tokens or reason != api_pb2.FINISH_REASON_LENGTH:
            problems.append(f"stream {i}: {len(ids)} tokens, finish reason {reason}")
    return problems, outputs


def _requests(ctx: CheckContext) -> list[Any]:
    from kvserve.testing.stream_requests import greedy_request

    return [greedy_request(i, ctx.scale.serve_tokens) for i in range(ctx.scale.serve_streams)]


def _idle_problems(stats: Any) -> list[str]:
    problems = []
    if stats.blocks_referenced or stats.requests_running or stats.requests_waiting or stats.requests_swapped:
        problems.append(
            f"not idle after the streams: {stats.blocks_referenced} blocks referenced, "
            f"{stats.requests_running} running, {stats.requests_waiting} waiting"
        )
    if stats.blocks_free + stats.blocks_cached != stats.num_blocks:
        problems.append(f"blocks leak: {stats.blocks_free} free + {stats.blocks_cached} cached != {stats.num_blocks}")
    return problems


def check_64_streams(ctx: CheckContext) -> Outcome:
    server = serve_server(ctx)
    streams, tokens = ctx.scale.serve_streams, ctx.scale.serve_tokens
    run = asyncio.run(run_streams(server, _requests(ctx)))
    problems, outputs = _complete(run["results"], tokens)
    stats = server.wait_idle()
    problems += _idle_problems(stats)
    ctx.state["undisturbed"] = outputs
    ctx.state["undisturbed_s"] = run["seconds"]
    figures = {
        "streams": streams,
        "tokens_each": tokens,
        "seconds": run["seconds"],
        "output_tokens_per_s": streams * tokens / run["seconds"],
        "num_blocks": stats.num_blocks,
        "server_start_s": ctx.state.get("server_start_s"),
        "problems": problems[:10],
    }
    summary = (
        f"{streams - sum(1 for p in problems if p.startswith('stream'))}/{streams} streams of {tokens} tokens "
        f"complete in {run['seconds']:.1f}s ({figures['output_tokens_per_s']:,.0f} tok/s)"
    )
    if problems:
        summary += f"; {problems[0]}"
    return Outcome(not problems, summary, figures, error="\n".join(problems[:10]) or None)


def check_kill9(ctx: CheckContext) -> Outcome:
    from kvserve.protos.kvserve.v1 import api_pb2
    from kvserve.testing.server_launcher import wait_dead

    server = serve_server(ctx)
    streams, tokens = ctx.scale.serve_streams, ctx.scale.serve_tokens
    restarts_before = server.stats().executor_restarts
    blocks_before = server.stats().num_blocks
    run = asyncio.run(run_streams(server, _requests(ctx), kill_at_tokens=int(KILL_AT_FRACTION * streams * tokens)))
    killed = run["killed"]
    problems, outputs = _complete(run["results"], tokens)
    if killed["streams_done_before"] == streams:
        problems.append("every stream had finished before the kill: nothing was in flight")
    stats = server.wait_idle(timeout_s=60)
    problems += _idle_problems(stats)
    if stats.executor_restarts != restarts_before + 1:
        problems.append(f"executor restarts went {restarts_before} -> {stats.executor_restarts}, not +1")
    if stats.executor_state != api_pb2.EXECUTOR_STATE_READY:
        problems.append(f"executor state {stats.executor_state} after the restart, not READY")
    if not wait_dead(killed["pid"], 5.0):
        problems.append(f"the killed executor {killed['pid']} is still alive")
    for pid in server.executor_pids():
        ctx.remember_process_group(pid)
    lost = [t for t in server.event_times("executor lost") if t >= killed["at"]]
    resynced = [t for t in server.event_times("executor_resynced") if t >= killed["at"]]
    undisturbed = ctx.state.get("undisturbed")
    identical = None if undisturbed is None else sum(a == b for a, b in zip(outputs, undisturbed))
    figures = {
        "streams": streams,
        "tokens_each": tokens,
        "tokens_before_kill": killed["tokens_before"],
        "streams_done_before_kill": killed["streams_done_before"],
        "detection_s": lost[0] - killed["at"] if lost else None,
        "recovery_s": resynced[0] - killed["at"] if resynced else None,
        "seconds": run["seconds"],
        "num_blocks_before": blocks_before,
        "num_blocks_after": stats.num_blocks,
        "streams_identical_to_undisturbed": identical,
        "problems": problems[:10],
    }
    ok_streams = streams - sum(1 for p in problems if p.startswith("stream"))
    summary = (
        f"kill -9 after {killed['tokens_before']:,}/{streams * tokens:,} tokens: {ok_streams}/{streams} streams "
        f"complete, restart + re-sync in {figures['recovery_s'] or float('nan'):.1f}s, "
        f"{identical if identical is not None else '?'}/{streams} token-identical to the undisturbed run"
    )
    if problems:
        summary += f"; {problems[0]}"
    return Outcome(not problems, summary, figures, error="\n".join(problems[:10]) or None)
