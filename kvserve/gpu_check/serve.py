"""The serve stage: `kvserve serve` with the 8B-shaped model under `bench serve`, 64 streams, and kill -9."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from typing import Any

from kvserve.bench import workloads as wl
from kvserve.bench.baseline_hf import requests_from_workload, run_hf_baseline
from kvserve.bench.report import GOALS, compute_ratios, render_table, summarize_run
from kvserve.bench.serve import BenchConfig, run_serve_benchmark
from kvserve.gpu_check.models import model_dir, with_hf_model
from kvserve.gpu_check.report import Outcome, StageContext, judged
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import start_serve, wait_dead
from kvserve.testing.stream_requests import greedy_request

RESTART_TIMEOUT_S = 180.0  # in-flight requests wait this long for the restarted executor (30 s is short for 15 GB)
STREAM_TIMEOUT_S, KILL_AT_FRACTION = 300.0, 0.25  # the executor is killed once a quarter of the tokens arrived
WORKLOAD, SEED = "mixed", 0


def serve_server(ctx: StageContext) -> Any:
    """The stage's `kvserve serve --model <big>`, SERVING; stopped, process groups and all, at stage end."""

    def make() -> Any:
        (ctx.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        model = str(model_dir(ctx.work_dir, ctx.sizes.big_model))
        args = ["--model", model, "--executor-restart-timeout", str(RESTART_TIMEOUT_S)]
        server = start_serve(args, ctx.out_dir / "logs", name="serve-big")
        ctx.closing.callback(server.stop)
        ctx.remember_process_groups(server.process.pid)
        started = time.monotonic()
        server.wait_serving(ctx.sizes.startup_timeout_s)
        ctx.state["server_start_s"] = time.monotonic() - started
        ctx.remember_process_groups(*server.executor_pids())
        return server

    return ctx.shared("server", make, close=None)


def measure_bench_serve(ctx: StageContext) -> Outcome:
    """`bench serve` mixed vs HF `generate` static batches (goal >= 6x); HF first, before the server claims the GPU."""
    sizes, errors = ctx.sizes, []
    vocab = json.loads((model_dir(ctx.work_dir, sizes.big_model) / "config.json").read_text())["vocab_size"]
    (mixed,) = wl.build(WORKLOAD, sizes.bench_requests, vocab, SEED, sizes.bench_max_tokens)
    hf_args: dict[str, Any] = dict(requests=requests_from_workload(mixed), batch_size=sizes.hf_batch_size)
    try:  # (HF's run, the tokens it generated)
        run_hf = functools.partial(run_hf_baseline, progress=False, device=sizes.device, **hf_args)
        hf = with_hf_model(ctx, "bfloat16" if sizes.device == "cuda" else "float32", run_hf)
    except Exception as exc:
        hf = None
        errors.append(f"hf-generate: {type(exc).__name__}: {exc}"[:400])
    server = serve_server(ctx)
    config: dict[str, Any] = dict(workloads=(WORKLOAD,), seed=SEED, host=server.target_host, port=server.port)
    config.update(num_requests=sizes.bench_requests, concurrency=sizes.bench_concurrency, baselines=(), progress=False)
    config.update(max_tokens_cap=sizes.bench_max_tokens, startup_timeout_s=60.0)
    config["command_line"] = f"kvserve gpu_check bench_serve_vs_hf ({sizes.name})"
    report = asyncio.run(run_serve_benchmark(BenchConfig(**config)))
    if hf is not None:
        report.results.append(summarize_run(hf[0]))
        report.meta.update(hf_batch_size=sizes.hf_batch_size, hf_generated_tokens=hf[1], hf_device=sizes.device)
        compute_ratios(report, [], num_blocks=0, block_size=0, max_request_len_by_workload={})
    report_path = ctx.out_dir / "bench_serve_mixed.json"
    report_path.write_text(report.to_json() + "\n")
    report_path.with_suffix(".txt").write_text(render_table(report) + "\n")
    ours, theirs = report.find("kvserve", WORKLOAD), report.find("hf-generate", WORKLOAD)
    ratio, goal = report.ratios.get("vs_hf_throughput"), GOALS["vs_hf_throughput"][1]
    if ours is None or ours["num_failed"]:
        errors.append(f"kvserve: {ours['num_failed'] if ours else 'no'} failed requests {ours and ours['errors']}")
    kv_tps, hf_tps = (r["output_throughput"] if r else 0.0 for r in (ours, theirs))
    figures = {"workload": WORKLOAD, "requests": sizes.bench_requests, "concurrency": sizes.bench_concurrency}
    figures.update(max_tokens_cap=sizes.bench_max_tokens, hf_batch_size=sizes.hf_batch_size, goal=goal, errors=errors)
    figures.update(kvserve_output_tokens_per_s=kv_tps, hf_output_tokens_per_s=hf_tps, vs_hf_throughput=ratio)
    figures.update(kvserve_ttft_mean_s=ours and ours["ttft"]["mean"], report=str(report_path))
    shown, met = ("-", "-") if ratio is None else (f"{ratio:.2f}x", "met" if ratio >= goal else "not met")
    setting = f"{sizes.bench_requests} requests, concurrency {sizes.bench_concurrency}, "
    setting += f"max_tokens <= {sizes.bench_max_tokens}, HF batch {sizes.hf_batch_size}"
    value = f"{kv_tps:,.0f} vs {hf_tps:,.0f} output tok/s"
    row = ("bench serve mixed: kvserve vs HF generate", setting, value, shown, f">= {goal:g}x: {met}")
    summary = f"vs_hf_throughput {shown} (goal >= {goal:g}): kvserve {kv_tps:,.0f}, HF {hf_tps:,.0f} tok/s"
    summary += f"; {errors[0]}" if errors else ""
    return Outcome(not errors and ratio is not None, summary, figures, [row], error="\n".join(errors) or None)


def _streams(ctx: StageContext, kill: bool = False) -> tuple[dict[str, Any], list[str], list[list[int]], Any]:
    """All streams at once (with `kill`, kill -9 of the executor a quarter in): figures, problems, token ids, stats."""
    server, streams, tokens = serve_server(ctx), ctx.sizes.serve_streams, ctx.sizes.serve_tokens
    figures: dict[str, Any] = {"streams": streams, "tokens_each": tokens}
    arrived, started = [0], time.monotonic()

    async def consume(stub: Any, request: Any) -> tuple[list[int], int]:
        ids, reason = [], 0
        async for chunk in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
            ids.extend(chunk.token_ids)
            arrived[0] += len(chunk.token_ids)
            reason = chunk.finish_reason or reason
        return ids, reason

    async def run() -> list[Any]:
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            tasks = [asyncio.create_task(consume(stub, greedy_request(i, tokens))) for i in range(streams)]
            while kill and arrived[0] < int(KILL_AT_FRACTION * streams * tokens) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            if kill:
                figures.update(pid=server.executor_pids()[-1], tokens_before=arrived[0], at=time.time())
                os.kill(figures["pid"], signal.SIGKILL)
                figures["streams_done_before"] = sum(t.done() for t in tasks)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    figures["seconds"] = time.monotonic() - started
    problems, outputs = [], []
    for i, r in enumerate(results):
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
    return figures, problems, outputs, s


def _outcome(detail: str, figures: dict[str, Any], problems: list[str]) -> Outcome:
    figures["problems"] = problems[:10]
    complete = figures["streams"] - sum(p.startswith("stream") for p in problems)
    summary = f"{complete}/{figures['streams']} streams of {figures['tokens_each']} tokens complete{detail}"
    return judged(summary, figures, problems[:10])


def check_64_streams(ctx: StageContext) -> Outcome:
    figures, problems, outputs, stats = _streams(ctx)
    ctx.state["undisturbed"] = outputs
    tps = figures["streams"] * figures["tokens_each"] / figures["seconds"]
    figures.update(output_tokens_per_s=tps, num_blocks=stats.num_blocks, server_start_s=ctx.state.get("server_start_s"))
    return _outcome(f" in {figures['seconds']:.1f}s ({tps:,.0f} tok/s)", figures, problems)


def check_kill9(ctx: StageContext) -> Outcome:
    """Token identity with the undisturbed run is reported, not required: recompute prefill isn't bit-equal in bf16."""
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
    ctx.remember_process_groups(*server.executor_pids())
    resynced = [t - figures["at"] for t in server.event_times("executor_resynced") if t >= figures["at"]]
    undisturbed = ctx.state.get("undisturbed")
    identical = None if undisturbed is None else sum(a == b for a, b in zip(outputs, undisturbed))
    figures.update(recovery_s=resynced[0] if resynced else None, streams_identical_to_undisturbed=identical)
    recovery = f"{resynced[0]:.1f}s" if resynced else "-"
    detail = f" after a kill -9 at {figures['tokens_before']:,} tokens; restart + re-sync in {recovery}; "
    return _outcome(detail + f"{identical}/{len(outputs)} identical to the undisturbed run", figures, problems)
