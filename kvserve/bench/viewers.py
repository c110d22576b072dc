"""`kvserve bench viewers`: what watching the engine costs serving: step time with N page viewers against none.

One `kvserve serve` (the fake executor by default, so the scheduler's own time is what
moves), one fixed load: `concurrency` chat requests of `max_tokens` tokens each, sent over
the HTTP API. Runs alternate between no viewers and `viewers` readers of `/ui/events`
(each what an open web page holds), `repeats` times, so drift in the machine's speed hits
both alike. Each run reports the engine's time per step (wall time over the server's own
step count), output tokens/s, what the viewers received, and the engine-loop time spent
building their updates (the server's `kvserve:ui_view_build_seconds`, a direct figure that the
run-to-run noise of a 2-core machine does not blur). The median run of each kind counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.testing.server_launcher import ServeProcess, serving


@dataclass(frozen=True, slots=True)
class ViewersBenchConfig:
    """`kvserve bench viewers`' flags."""

    viewers: int = field(default=5, metadata=flag("engine-view streams open during the watched runs"))
    concurrency: int = field(default=64, metadata=flag("chat requests in flight at once"))
    requests: int = field(default=256, metadata=flag("chat requests per run"))
    max_tokens: int = field(default=64, metadata=flag("tokens each request generates (ignore_eos)"))
    repeats: int = field(default=3, metadata=flag("unwatched/watched run pairs, interleaved; the median counts"))
    serve_args: str = field(
        default="--executor fake --num-blocks 2000 --step-latency-ms 2",
        metadata=flag("`kvserve serve` options of the server under test, shell-quoted"),
    )
    json: bool = field(default=False, metadata=flag("print the results as JSON"))


@dataclass(slots=True)
class ViewersRun:
    viewers: int
    seconds: float
    steps: int
    output_tokens: int
    updates: int
    """Engine-view updates the viewers received, all together."""
    max_update_bytes: int
    build_seconds: float
    """Engine-loop time spent building the updates (the server's own histogram)."""

    @property
    def build_share(self) -> float:
        """The fraction of the run's wall time the loop spent building updates."""
        return self.build_seconds / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


async def _chat(client: httpx.AsyncClient, index: int, max_tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": f"Request {index}: " + "tell me about the sea " * (2 + index % 9)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


async def _build_seconds(client: httpx.AsyncClient) -> float:
    """The server's total engine-view build time so far (`kvserve:ui_view_build_seconds_sum`)."""
    response = await client.get("/metrics")
    response.raise_for_status()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "kvserve:ui_view_build_seconds_sum":
                return float(sample.value)
    raise RuntimeError("the server reports no kvserve:ui_view_build_seconds: is its web page off (--no-ui)?")


async def _watch(client: httpx.AsyncClient, received: list[int], stop: asyncio.Event) -> None:
    """One open page's stream: every update read and sized until the run ends."""
    async with client.stream("GET", "/ui/events") as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                received.append(len(line) - len("data: "))
            if stop.is_set():
                return


async def _run(server: ServeProcess, config: ViewersBenchConfig, viewers: int) -> ViewersRun:
    assert server.http_url is not None
    limits = httpx.Limits(max_connections=config.concurrency + viewers + 4)
    async with httpx.AsyncClient(base_url=server.http_url, timeout=600, limits=limits) as client:
        received: list[int] = []
        stop = asyncio.Event()
        watchers = [asyncio.create_task(_watch(client, received, stop)) for _ in range(viewers)]
        while viewers and len(received) < viewers:  # every page is connected before the clock starts
            await asyncio.sleep(0.01)
        pending = iter(range(config.requests))
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            for index in pending:
                got = await _chat(client, index, config.max_tokens)  # `tokens += await ...` would read tokens first
                tokens += got

        # Read off the loop: the viewers' streams keep being read while the gRPC call waits.
        steps_before, build_before = (await asyncio.to_thread(server.stats)).steps, await _build_seconds(client)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        seconds = time.perf_counter() - started
        steps = (await asyncio.to_thread(server.stats)).steps - steps_before
        build_seconds = await _build_seconds(client) - build_before
        updates = len(received) - viewers
        stop.set()
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    return ViewersRun(viewers, seconds, steps, tokens, updates, max(received, default=0), build_seconds)


def run_viewers_bench(
    config: ViewersBenchConfig, progress: Callable[[str], None] = print
) -> dict[int, list[ViewersRun]]:
    runs: dict[int, list[ViewersRun]] = {0: [], config.viewers: []}
    with serving(
        shlex.split(config.serve_args), Path(tempfile.gettempdir()), name="bench-viewers", http=True
    ) as server:
        asyncio.run(_run(server, config, 0))  # warm-up: first-request costs stay out of the figures
        for repeat in range(config.repeats):
            for viewers in (0, config.viewers):
                result = asyncio.run(_run(server, config, viewers))
                runs[viewers].append(result)
                progress(
                    f"run {repeat + 1}/{config.repeats}, {viewers} viewers: {result.ms_per_step:.3f} ms/step, "
                    f"{result.tokens_per_s:.0f} tok/s, {result.updates} updates (largest {result.max_update_bytes} B), "
                    f"building them {1e3 * result.build_seconds:.1f} ms ({100 * result.build_share:.2f}% of the run)"
                )
    return runs


def _median(runs: list[ViewersRun]) -> ViewersRun:
    return sorted(runs, key=lambda r: r.ms_per_step)[len(runs) // 2]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "viewers",
        help="step time and tokens/s with N web-page viewers attached, against none",
        description="Starts one kvserve serve and drives a fixed chat load over its HTTP API, alternating\n"
        "runs with no engine-view streams open and with --viewers of them, and reports the\n"
        "engine's time per step and output tokens/s of each (the median run).",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, ViewersBenchConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(ViewersBenchConfig, args)
    runs = run_viewers_bench(config, progress=(lambda _l: None) if config.json else print)
    alone, watched = _median(runs[0]), _median(runs[config.viewers])
    overhead = watched.ms_per_step / alone.ms_per_step - 1
    if config.json:
        print(json.dumps({"runs": {k: [asdict(r) for r in v] for k, v in runs.items()}, "overhead": overhead}))
        return 0
    print(f"{'viewers':>7}  {'ms/step':>8}  {'tok/s':>8}  {'updates':>7}  {'largest':>8}  loop time building them")
    for r in (alone, watched):
        print(
            f"{r.viewers:7d}  {r.ms_per_step:8.3f}  {r.tokens_per_s:8.0f}  {r.updates:7d}  {r.max_update_bytes:6d} B  "
            f"{1e3 * r.build_seconds:.1f} ms ({100 * r.build_share:.2f}%)"
        )
    spread = statistics.pstdev(r.ms_per_step for r in runs[0]) if len(runs[0]) > 1 else 0.0
    print(
        f"step time with {config.viewers} viewers: {100 * overhead:+.1f}% (spread of unwatched runs ±{spread:.3f} ms)"
    )
    return 0
