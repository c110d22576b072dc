"""`kvserve serve` with the 8B-shaped model: 64 concurrent streams, then kill -9 of the executor
under them (it is restarted, every stream completes, no block leaks). Token identity with the
undisturbed run is reported, not required: the recompute prefill is not bit-equal in bf16.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

RESTART_TIMEOUT_S = 180.0
"""How long in-flight requests wait for the restarted executor (the default 30 s is short for 15 GB)."""
STREAM_TIMEOUT_S = 300.0
KILL_AT_FRACTION = 0.25


def serve_server(ctx: StageContext) -> Any:
    """The stage's `kvserve serve --model <big>`, SERVING; stopped, process groups and all, at stage end."""

    def make() -> Any:
        from kvserve.testing.server_launcher import start_serve

        (ctx.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        args = ["--model", str(model_dir(ctx.work_dir, ctx.sizes.big_model))]
        args += ["--executor-restart-timeout", str(RESTART_TIMEOUT_S)]
        server = start_serve(args, ctx.out_dir / "logs", name="serve-big")
        ctx.remember_process_group(server.process.pid)
        started = time.monotonic()
        try:
            server.wait_serving(ctx.sizes.startup_timeout_s)
        except BaseException:
            server.stop()
            raise
        ctx.state["server_start_s"] = time.monotonic() - started
        for pid in server.executor_pids():
            ctx.remember_process_group(pid)
        return server

    return ctx.shared("server", make, close=lambda server: server.stop())


async def run_streams(server: Any, requests: list[Any], kill_at_tokens: int | None = None) -> dict[str, Any]:
    """Every request at once; with `kill_at_tokens`, kill -9 the executor once that many tokens arrived."""
    from kvserve.protos.kvserve.v1 import api_pb2_grpc

    arrived, killed, started = [0], {}, time.monotonic()

    async def consume(stub: Any, request: Any) -> tuple[list[int], int]:
        ids: list[int] = []
        reason = 0
        async for chunk in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
            ids.extend(chunk.token_ids)
            arrived[0] += len(chunk.token_ids)
            reason = chunk.finish_reason or reason
        return ids, reason

    async with server.aio_channel() as channel:
        tasks = [asyncio.create_task(consume(api_pb2_grpc.KVServeStub(channel), r)) for r in requests]
        while kill_at_tokens is not None and arrived[0] < kill_at_tokens and not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)
        if kill_at_tokens is not None:
            killed = {"pid": server.executor_pids()[-1], "tokens_before": arrived[0], "at": time.time()}
            os.kill(killed["pid"], signal.SIGKILL)
            killed["streams_done_before"] = sum(t.done() for t in tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return {"results": results, "seconds": time.monotonic() - started, "killed": killed}


def _streams(ctx: StageContext, kill: bool = False) -> tuple[dict[str, Any], list[str], list[list[int]], Any]:
    """Run the stage's streams; (figures, problems, token ids per stream, stats once idle)."""
    from kvserve.protos.kvserve.v1 import api_pb2
    from kvserve.testing.stream_requests import greedy_request

    server, streams, tokens = serve_server(ctx), ctx.sizes.serve_streams, ctx.sizes.serve_tokens
    kill_at = int(KILL_AT_FRACTION * streams * tokens) if kill else None
    run = asyncio.run(run_streams(server, [greedy_request(i, tokens) for i in range(streams)], kill_at))
    problems, outputs = [], []
    for i, r in enumerate(run["results"]):
        outputs.append([] if isinstance(r, BaseException) else r[0])
        if isinstance(r, BaseException):
            problems.append(f"stream {i}: {type(r).__name__}: {r}"[:300])
        elif len(r[0]) != tokens or r[1] != api_pb2.FINISH_REASON_LENGTH:
            problems.append(f"stream {i}: {len(r[0])} tokens, finish reason {r[1]}")
    s = server.wait_idle(timeout_s=60)
    if s.blocks_referenced or s.requests_running or s.requests_waiting or s.requests_swapped:
        problems.append(
            f"not idle after the streams: {s.blocks_referenced} blocks referenced, {s.requests_running} running"
        )
    if s.blocks_free + s.blocks_cached != s.num_blocks:
        problems.append(f"blocks leak: {s.blocks_free} free + {s.blocks_cached} cached != {s.num_blocks}")
    figures = {"streams": streams, "tokens_each": tokens, "seconds": run["seconds"], **run["killed"]}
    return figures, problems, outputs, s


def _outcome(detail: str, figures: dict[str, Any], problems: list[str]) -> Outcome:
    figures["problems"] = problems[:10]
    complete = figures["streams"] - sum(p.startswith("stream") for p in problems)
    summary = f"{complete}/{figures['streams']} streams of {figures['tokens_each']} tokens complete{detail}"
    summary += f"; {problems[0]}" if problems else ""
    return Outcome(not problems, summary, figures, error="\n".join(problems[:10]) or None)


def check_64_streams(ctx: StageContext) -> Outcome:
    figures, problems, outputs, stats = _streams(ctx)
    ctx.state["undisturbed"] = outputs
    tokens_per_s = figures["streams"] * figures["tokens_each"] / figures["seconds"]
    figures.update(output_tokens_per_s=tokens_per_s, num_blocks=stats.num_blocks)
    figures["server_start_s"] = ctx.state.get("server_start_s")
    return _outcome(f" in {figures['seconds']:.1f}s ({tokens_per_s:,.0f} tok/s)", figures, problems)


def check_kill9(ctx: StageContext) -> Outcome:
    from kvserve.protos.kvserve.v1 import api_pb2
    from kvserve.testing.server_launcher import wait_dead

    server = serve_server(ctx)
    restarts_before = server.stats().executor_restarts
    figures, problems, outputs, stats = _streams(ctx, kill=True)
    if figures["streams_done_before"] == len(outputs):
        problems.append("every stream had finished before the kill: nothing was in flight")
    if stats.executor_restarts != restarts_before + 1:
        problems.append(f"executor restarts went {restarts_before} -> {stats.executor_restarts}, not +1")
    if stats.executor_state != api_pb2.EXECUTOR_STATE_READY:
        problems.append(f"executor state {stats.executor_state} after the restart, not READY")
    if not wait_dead(figures["pid"], 5.0):
        problems.append(f"the killed executor {figures['pid']} is still alive")
    for pid in server.executor_pids():
        ctx.remember_process_group(pid)
    resynced = [t - figures["at"] for t in server.event_times("executor_resynced") if t >= figures["at"]]
    undisturbed = ctx.state.get("undisturbed")
    identical = None if undisturbed is None else sum(a == b for a, b in zip(outputs, undisturbed))
    figures.update(recovery_s=resynced[0] if resynced else None, streams_identical_to_undisturbed=identical)
    recovery = f"{resynced[0]:.1f}s" if resynced else "-"
    detail = f" after a kill -9 at {figures['tokens_before']:,} tokens; restart + re-sync in {recovery}; "
    return _outcome(detail + f"{identical}/{len(outputs)} identical to the undisturbed run", figures, problems)
