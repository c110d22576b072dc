"""The load driver against an in-memory stand-in for AsyncClient (no server)."""

import asyncio
from dataclasses import dataclass

import pytest

from kvserve.bench import workloads as wl
from kvserve.bench.load_driver import run_workload


@dataclass
class _Usage:
    cached_tokens: int
    queue_time_s: float = 0.01


@dataclass
class _Chunk:
    token_ids: list
    finish_reason: str | None = None
    usage: _Usage | None = None


class FakeClient:
    """Streams `max_tokens` tokens one per chunk, 1 ms apart; remembers every prompt."""

    def __init__(self):
        self.prompts: list[tuple[str, list[int]]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.preemptions = 0

    async def server_stats(self):
        return {
            "requests_running": self.in_flight,
            "num_preemptions": self.preemptions,
            "prefix_queried_tokens": 10 * len(self.prompts),
            "prefix_hit_tokens": 4 * len(self.prompts),
        }

    async def stream(self, *, token_ids, request_id, cache_salt, max_tokens, ignore_eos, temperature):
        assert ignore_eos and temperature == 0.0
        self.prompts.append((request_id, list(token_ids)))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.03)  # "prefill"
            for i in range(max_tokens):
                last = i == max_tokens - 1
                yield _Chunk([7000 + i], "length" if last else None, _Usage(len(token_ids) // 2) if last else None)
                await asyncio.sleep(0.001)
            self.preemptions += 1
        finally:
            self.in_flight -= 1


def test_records_timings_and_respects_concurrency():
    client = FakeClient()
    workload = wl.mixed(8, 49152, seed=0, max_tokens_cap=5)
    result = asyncio.run(
        run_workload(
            client, workload, configuration="kvserve", concurrency=3, request_rate=None, seed=0, progress=False
        )
    )
    assert len(result.records) == 8 and all(r.ok for r in result.records)
    assert client.peak_in_flight == 3
    assert 1 <= result.peak_running <= 3
    assert result.preemptions == 8
    assert result.prefix_queried_tokens == 80 and result.prefix_hit_tokens == 32
    for record in result.records:
        assert record.output_tokens == 5 and record.finish_reason == "length"
        assert record.ttft_s >= 0.03
        assert len(record.itl_s) == 4
        assert record.e2e_s >= record.ttft_s
        assert record.cached_tokens == record.prompt_tokens // 2
        assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 4)


def test_multi_turn_resends_the_conversation_with_the_real_replies():
    client = FakeClient()
    session = wl.Session("chat", [wl.Turn([1, 2, 3], 2), wl.Turn([4, 5], 3), wl.Turn([6], 1)])
    workload = wl.Workload("multi-turn", [session])
    result = asyncio.run(
        run_workload(
            client, workload, configuration="kvserve", concurrency=None, request_rate=None, seed=0, progress=False
        )
    )
    prompts = [p for _, p in client.prompts]
    assert prompts == [[1, 2, 3], [1, 2, 3, 7000, 7001, 4, 5], [1, 2, 3, 7000, 7001, 4, 5, 7000, 7001, 7002, 6]]
    assert [r.turn for r in result.records] == [0, 1, 2]
    assert len({rid for rid, _ in client.prompts}) == 3


def test_warmup_sessions_are_sent_but_not_recorded():
    client = FakeClient()
    _cold, warm = wl.cold_warm(2, 49152, seed=0, max_tokens_cap=2)
    result = asyncio.run(
        run_workload(client, warm, configuration="kvserve", concurrency=2, request_rate=None, seed=0, progress=False)
    )
    assert len(client.prompts) == 3 and len(result.records) == 2
    assert result.workload == "cold-warm/warm"
    assert result.preemptions == 2  # the primer's is not counted


def test_errors_are_recorded_not_raised():
    class Failing(FakeClient):
        async def stream(self, **kwargs):
            raise RuntimeError("boom")
            yield  # pragma: no cover

    result = asyncio.run(
        run_workload(
            Failing(),
            wl.mixed(2, 49152, 0),
            configuration="kvserve",
            concurrency=2,
            request_rate=None,
            seed=0,
            progress=False,
        )
    )
    assert [r.ok for r in result.records] == [False, False]
    assert "boom" in result.records[0].error


def test_poisson_arrivals_spread_the_sessions():
    client = FakeClient()
    workload = wl.mixed(5, 49152, seed=0, max_tokens_cap=1)
    result = asyncio.run(
        run_workload(
            client, workload, configuration="kvserve", concurrency=None, request_rate=20.0, seed=3, progress=False
        )
    )
    assert len(result.records) == 5
    assert result.duration_s > 0.05  # five arrivals at 20/s take ~0.2 s, not one burst
