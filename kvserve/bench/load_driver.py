"""Drive a kvserve server with a workload through the async client and time every token.

Sessions start at Poisson arrival times (`request_rate` per second, seeded) or all at
once; at most `concurrency` sessions are in flight. Turns of one session are sent one after
the other, each resending the conversation so far. While the workload runs, a sampler
polls `server_stats()` for the peak number of running sequences and the preemption and
prefix-cache counters.

Client-side timing (`TokenClock`, shared with the HTTP driver in `openai_driver.py`): TTFT
is send → first chunk with tokens; ITL is the gap between consecutive token-carrying
chunks; TPOT is (e2e − TTFT) / (output tokens − 1); e2e is send → last chunk.

This module sends each turn through the gRPC `AsyncClient`; another transport passes its
own `send_turn` (same signature as `grpc_send_turn`) and reuses the sessions, arrivals,
concurrency gate, stats sampler and records unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from tqdm import tqdm

from kvserve.bench.sessions import Session, Workload

log = structlog.get_logger(__name__)

STATS_POLL_INTERVAL_S = 0.02


@dataclass(slots=True)
class RequestRecord:
    """What one request measured, client side, plus the server's usage figures."""

    session_id: str
    turn: int
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    queue_time_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    output_text: str = ""
    """The reply's text, kept by the HTTP driver (bench speculative compares it across configurations)."""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def sequence_len(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(slots=True)
class ServerCounters:
    """The server_stats() fields the benchmark reads, as a snapshot."""

    running: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> ServerCounters:
        return cls(
            running=int(stats.get("requests_running", 0) or 0),
            preemptions=int(stats.get("num_preemptions", 0) or 0),
            prefix_queried_tokens=int(stats.get("prefix_queried_tokens", 0) or 0),
            prefix_hit_tokens=int(stats.get("prefix_hit_tokens", 0) or 0),
        )


@dataclass(slots=True)
class RunResult:
    """One workload against one server configuration."""

    configuration: str
    workload: str
    records: list[RequestRecord]
    duration_s: float
    peak_running: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    block_size: int = 0
    """The KV block size of the server that ran it (ModelInfo); 0: unknown (a foreign server)."""


def arrival_offsets(num_sessions: int, request_rate: float | None, seed: int) -> list[float]:
    """Start times in seconds: Poisson process at `request_rate`/s, or all 0 when None/inf."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * num_sessions
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    rng = random.Random(f"arrivals:{seed}")
    offsets, t = [], 0.0
    for _ in range(num_sessions):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


class _StatsSampler:
    """Polls server_stats() in the background; keeps the peak running count."""

    def __init__(self, client: Any | None) -> None:
        self._client = client  # None: a server without kvserve's stats (a foreign baseline)
        self.peak_running = 0
        self.last: ServerCounters | None = None
        self._task: asyncio.Task | None = None

    async def snapshot(self) -> ServerCounters | None:
        if self._client is None:
            return None
        try:
            counters = ServerCounters.from_stats(await self._client.server_stats())
        except Exception as exc:  # stats are best effort; the latency figures do not need them
            log.debug("server_stats failed", error=str(exc))
            return None
        self.peak_running = max(self.peak_running, counters.running)
        self.last = counters
        return counters

    async def _loop(self) -> None:
        while True:
            await self.snapshot()
            await asyncio.sleep(STATS_POLL_INTERVAL_S)

    def start(self) -> None:
        if self._client is not None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> ServerCounters | None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return await self.snapshot()


class TokenClock:
    """The client-side timing of one request, written into its record as chunks arrive."""

    __slots__ = ("_last", "_record", "_start")

    def __init__(self, record: RequestRecord) -> None:
        self._record = record
        self._start = time.perf_counter()
        self._last: float | None = None

    def tokens_arrived(self) -> None:
        """A chunk carrying tokens arrived now: the first sets TTFT, each later one adds an ITL gap."""
        now = time.perf_counter()
        if self._last is None:
            self._record.ttft_s = now - self._start
        else:
            self._record.itl_s.append(now - self._last)
        self._last = now

    def finish(self, error: BaseException | None = None) -> None:
        """The stream ended (or failed): e2e, and the error if any."""
        self._record.e2e_s = time.perf_counter() - self._start
        if error is not None:
            self._record.error = f"{type(error).__name__}: {error}"


SendTurn = Callable[[Session, int, list[int], int, str], Awaitable[tuple[RequestRecord, list[int]]]]
"""(session, turn index, prompt ids, max_tokens, request id) -> (record, the reply's token ids)."""


async def grpc_send_turn(
    client: Any, session: Session, turn_index: int, prompt: list[int], max_tokens: int, request_id: str
) -> tuple[RequestRecord, list[int]]:
    """One turn through the gRPC AsyncClient: greedy, ignore_eos, token-id prompt."""
    record = RequestRecord(session.session_id, turn_index, len(prompt), max_tokens)
    output: list[int] = []
    clock = TokenClock(record)
    try:
        async for chunk in client.stream(
            token_ids=prompt,
            request_id=request_id,
            cache_salt=session.cache_salt,
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0,
        ):
            if chunk.token_ids:
                clock.tokens_arrived()
                output.extend(chunk.token_ids)
            if chunk.finish_reason:
                record.finish_reason = chunk.finish_reason
            if chunk.usage is not None:
                record.cached_tokens = chunk.usage.cached_tokens
                record.queue_time_s = chunk.usage.queue_time_s
        clock.finish()
    except Exception as exc:
        clock.finish(exc)
    record.output_tokens = len(output)
    return record, output


async def _run_session(send_turn: SendTurn, session: Session, prefix: str) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    history: list[int] = []
    for i, turn in enumerate(session.turns):
        prompt = history + turn.new_token_ids
        record, output = await send_turn(session, i, prompt, turn.max_tokens, f"{prefix}-{session.session_id}-t{i}")
        records.append(record)
        if not record.ok:
            break
        history = prompt + output
    return records


async def warm_up(client: Any, token_ids: list[int]) -> None:
    """One short untimed request in its own cache namespace: start-up costs stay out of the figures."""
    async for _ in client.stream(
        token_ids=token_ids[:16], cache_salt="bench-warmup", max_tokens=2, ignore_eos=True, temperature=0.0
    ):
        pass


async def run_workload(
    client: Any,
    workload: Workload,
    *,
    configuration: str,
    concurrency: int | None,
    request_rate: float | None,
    seed: int,
    progress: bool = True,
    send_turn: SendTurn | None = None,
) -> RunResult:
    """Send every session of `workload` and collect per-request records and server counters.

    `client` is the gRPC AsyncClient: it sends the turns unless `send_turn` is given, and its
    `server_stats()` is sampled; None (with a `send_turn`) for a server without kvserve's stats.
    """
    send: SendTurn = send_turn or functools.partial(grpc_send_turn, client)
    run_prefix = f"bench-{configuration}-{workload.name}{'-' + workload.phase if workload.phase else ''}-{seed}"
    for session in workload.warmup:
        await _run_session(send, session, run_prefix + "-warmup")

    sampler = _StatsSampler(client)
    before = await sampler.snapshot()
    sampler.peak_running = 0
    sampler.start()
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    offsets = arrival_offsets(len(workload.sessions), request_rate, seed)
    label = workload.name + (f"/{workload.phase}" if workload.phase else "")
    bar = tqdm(
        total=workload.num_requests, desc=f"{configuration} {label}", file=sys.stderr, disable=not progress, leave=False
    )
    start = time.perf_counter()

    async def one(session: Session, offset: float) -> list[RequestRecord]:
        delay = offset - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            records = await _run_session(send, session, run_prefix)
        else:
            async with gate:
                records = await _run_session(send, session, run_prefix)
        bar.update(len(session.turns))
        return records

    try:
        per_session = await asyncio.gather(*(one(s, o) for s, o in zip(workload.sessions, offsets)))
    finally:
        duration = time.perf_counter() - start
        after = await sampler.stop()
        bar.close()
    result = RunResult(
        configuration=configuration,
        workload=label,
        records=[r for rs in per_session for r in rs],
        duration_s=duration,
        peak_running=sampler.peak_running,
    )
    if before is not None and after is not None:
        result.preemptions = after.preemptions - before.preemptions
        result.prefix_queried_tokens = after.prefix_queried_tokens - before.prefix_queried_tokens
        result.prefix_hit_tokens = after.prefix_hit_tokens - before.prefix_hit_tokens
    return result
