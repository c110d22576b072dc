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
        server = start_serve(
            [*args, "--executor-restart-timeout", str(RESTART_TIMEOUT_S)], ctx.out_dir / "logs", name="serve-big"
        )
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
        if kill_at_tokens is not None:
            while arrived[0] < kill_at_tokens and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            killed = {"pid": server.executor_pids()[-1], "tokens_before": arrived[0], "at": time.time()}
            os.kill(killed["pid"], signal.SIGKILL)
            killed["streams_done_before"] = sum(t.done() for t in tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return {"results": results, "seconds": time.monotonic() - started, "killed": killed}


def _streams(
    ctx: StageContext, server: Any, kill: bool = False
) -> tuple[dict[str, Any], list[str], list[list[int]], Any]:
    """Run the stage's streams; (run, problems, token ids per stream, stats once idle)."""
    from kvserve.protos.kvserve.v1 import api_pb2
    from kvserve.testing.stream_requests import greedy_request

    streams, tokens = ctx.sizes.serve_streams, ctx.sizes.serve_tokens
    requests = [greedy_request(i, tokens) for i in range(streams)]
    run = asyncio.run(run_streams(server, requests, int(KILL_AT_FRACTION * streams * tokens) if kill else None))
    problems, outputs = [], []
    for i, r in enumerate(run["results"]):
        ids, reason = ([], None) if isinstance(r, BaseException) else r
        outputs.append(ids)
        if isinstance(r, BaseException):
            problems.append(f"stream {i}: {type(r).__name__}: {r}"[:300])
        elif len(ids) != tokens or reason != api_pb2.FINISH_REASON_LENGTH:
            problems.append(f"stream {i}: {len(ids)} tokens, finish reason {reason}")
    stats = server.wait_idle(timeout_s=60)
    if stats.blocks_referenced or stats.requests_running or stats.requests_waiting or stats.requests_swapped:
        problems.append(
            f"not idle after the streams: {stats.blocks_referenced} blocks referenced, {stats.requests_running} running"
        )
    if stats.blocks_free + stats.blocks_cached != stats.num_blocks:
        problems.append(f"blocks leak: {stats.blocks_free} free + {stats.blocks_cached} cached != {stats.num_blocks}")
    return run, problems, outputs, stats


def _outcome(summary: str, figures: dict[str, Any], problems: list[str]) -> Outcome:
    figures["problems"] = problems[:10]
    complete = figures["streams"] - sum(p.startswith("stream") for p in problems)
    summary = f"{complete}/{figures['streams']} streams of {figures['tokens_each']} tokens complete{summary}"
    return Outcome(
        not problems,
        summary + (f"; {problems[0]}" if problems else ""),
        figures,
        error="\n".join(problems[:10]) or None,
    )


def check_64_streams(ctx: StageContext) -> Outcome:
    server = serve_server(ctx)
    run, problems, outputs, stats = _streams(ctx, server)
    ctx.state["undisturbed"] = outputs
    figures = {"streams": len(outputs), "tokens_each": ctx.sizes.serve_tokens, "seconds": run["seconds"]}
    figures.update(
        output_tokens_per_s=len(outputs) * ctx.sizes.serve_tokens / run["seconds"], num_blocks=stats.num_blocks
    )
    figures["server_start_s"] = ctx.state.get("server_start_s")
    return _outcome(f" in {run['seconds']:.1f}s ({figures['output_tokens_per_s']:,.0f} tok/s)", figures, problems)


def check_kill9(ctx: StageContext) -> Outcome:
    from kvserve.protos.kvserve.v1 import api_pb2
    from kvserve.testing.server_launcher import wait_dead

    server = serve_server(ctx)
    restarts_before = server.stats().executor_restarts
    run, problems, outputs, stats = _streams(ctx, server, kill=True)
    killed = run["killed"]
    if killed["streams_done_before"] == len(outputs):
        problems.append("every stream had finished before the kill: nothing was in flight")
    if stats.executor_restarts != restarts_before + 1:
        problems.append(f"executor restarts went {restarts_before} -> {stats.executor_restarts}, not +1")
    if stats.executor_state != api_pb2.EXECUTOR_STATE_READY:
        problems.append(f"executor state {stats.executor_state} after the restart, not READY")
    if not wait_dead(killed["pid"], 5.0):
        problems.append(f"the killed executor {killed['pid']} is still alive")
    for pid in server.executor_pids():
        ctx.remember_process_group(pid)
    resynced = [t - killed["at"] for t in server.event_times("executor_resynced") if t >= killed["at"]]
    undisturbed = ctx.state.get("undisturbed")
    identical = None if undisturbed is None else sum(a == b for a, b in zip(outputs, undisturbed))
    figures = {"streams": len(outputs), "tokens_each": ctx.sizes.serve_tokens, "seconds": run["seconds"], **killed}
    figures.update(recovery_s=resynced[0] if resynced else None, streams_identical_to_undisturbed=identical)
    recovery = f"{resynced[0]:.1f}s" if resynced else "-"
    detail = f" after a kill -9 at {killed['tokens_before']:,} tokens; restart + re-sync in {recovery}; "
    detail += f"{identical}/{len(outputs)} identical to the undisturbed run"
    return _outcome(detail, figures, problems)
