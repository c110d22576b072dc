"""The engine loop in-process: a real Scheduler driving the fake executor through a stand-in link.

The stand-in link lets tests kill and replace the executor between or during steps
without processes, so these run in well under a second each.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvserve.executor.fake.executor import FakeExecutor, FakeExecutorConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import ExecutorInfo, StepPlan, StepResult
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.server.delivery.request_stream import FailureKind, RequestFailed
from kvserve.scheduler.server.engine import Engine
from kvserve.scheduler.server.engine_status import ExecutorState
from kvserve.scheduler.server.executor_link.link_errors import ExecutorLost
from kvserve.scheduler.server.intake.request_parsing import ValidatedRequest
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.scheduler.server.server_config import ServerConfig
from kvserve.scheduler.server.service import build_scheduler

pytestmark = pytest.mark.timeout(60)


class InProcessLink:
    """Just enough of ExecutorLink: step() runs the fake executor; `kill()`/`revive()` simulate faults."""

    def __init__(self, num_blocks: int = 256, copy_period: int = 0) -> None:
        self._executor_config = FakeExecutorConfig(num_blocks=num_blocks, step_latency_ms=0.0, copy_period=copy_period)
        self.executor = FakeExecutor(self._executor_config)
        self.generation = 1
        self._connected = asyncio.Event()
        self._connected.set()
        self.kill_after_steps: int | None = None
        self.steps = 0

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def info(self) -> ExecutorInfo | None:
        return self.executor.info() if self.connected else None

    def kill(self) -> None:
        self._connected.clear()

    def revive(self) -> None:
        self.executor = FakeExecutor(self._executor_config)  # a fresh process of the same model
        self.generation += 1
        self._connected.set()

    async def step(self, plan: StepPlan) -> StepResult:
        if not self.connected:
            raise ExecutorLost("no executor is connected")
        await asyncio.sleep(0)
        self.steps += 1
        if self.kill_after_steps is not None and self.steps >= self.kill_after_steps:
            self.kill_after_steps = None
            self.kill()
            raise ExecutorLost("killed by the test")
        return self.executor.execute(plan)

    async def wait_for_executor(self, timeout_s: float | None = None) -> ExecutorInfo:
        await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.executor.info()

    async def reset_executor(self) -> None:
        self.executor.reset()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _engine(tokenizer: Tokenizer, link: InProcessLink, **config) -> Engine:
    server_config = ServerConfig(**config)
    scheduler = build_scheduler(server_config, link.executor.info())
    return Engine(scheduler, link, tokenizer, server_config)


def _request(request_id: str, prompt: list[int], max_tokens: int = 24, **sampling) -> ValidatedRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return ValidatedRequest(
        request_id=request_id, prompt_token_ids=tuple(prompt), sampling=params, priority=0, cache_salt=""
    )


async def _drain(stream) -> tuple[dict[int, str], dict[int, list[int]], dict[int, FinishReason]]:
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, FinishReason] = {}
    async for chunk in stream:
        text[chunk.index] = text.get(chunk.index, "") + chunk.text
        ids.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            reasons[chunk.index] = chunk.finish_reason
    return text, ids, reasons


async def _run(engine: Engine, coro):
    loop_task = asyncio.create_task(engine.run())
    try:
        return await coro
    finally:
        engine.stop()
        await loop_task


PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 198, 1000, 1001, 1002]


def test_stop_string_finishes_the_sequence_and_is_trimmed(tokenizer: Tokenizer) -> None:
    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link)

        async def body():
            full_text, full_ids, _ = await _drain(engine.submit(_request("a", PROMPT), "ns"))
            text = full_text[0]
            stop = text[len(text) // 2 : len(text) // 2 + 4]
            first = text.index(stop)
            stopped_text, stopped_ids, reasons = await _drain(engine.submit(_request("b", PROMPT, stop=(stop,)), "ns"))
            return text, stop, first, stopped_text[0], stopped_ids[0], full_ids[0], reasons[0], engine.stats()

        return await _run(engine, body())

    text, _stop, first, stopped_text, stopped_ids, full_ids, reason, stats = asyncio.run(scenario())
    assert stopped_text == text[:first]
    assert reason is FinishReason.STOP
    assert len(stopped_ids) < len(full_ids) and full_ids[: len(stopped_ids)] == stopped_ids
    assert stats.scheduler.blocks_referenced == 0


def test_stop_string_finish_reaches_the_scheduler_at_the_next_boundary(tokenizer: Tokenizer) -> None:
    """The token sampled while the stop string was matched is neither streamed nor counted, and the
    id is free again as soon as the stream has ended (the scheduler let go of it first)."""

    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link)

        async def body():
            full_text, full_ids, _ = await _drain(engine.submit(_request("a", PROMPT), "ns"))
            text = full_text[0]
            stop = text[len(text) // 2 : len(text) // 2 + 4]
            chunks = [c async for c in engine.submit(_request("b", PROMPT, stop=(stop,)), "ns")]
            again = await _drain(engine.submit(_request("b", PROMPT, stop=(stop,)), "ns"))
            return full_ids[0], chunks, again, engine.stats()

        return await _run(engine, body())

    full_ids, chunks, again, stats = asyncio.run(scenario())
    final = chunks[-1]
    streamed = [t for c in chunks for t in c.token_ids]
    assert final.finish_reason is FinishReason.STOP and final.usage is not None
    assert final.usage.completion_tokens == len(streamed) and streamed == full_ids[: len(streamed)]
    assert again[1][0] == streamed and again[2][0] is FinishReason.STOP
    assert stats.scheduler.blocks_referenced == 0 and stats.active_requests == 0


def test_n_completions_each_finish_with_usage(tokenizer: Tokenizer) -> None:
    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link)
        chunks = []

        async def body():
            sampling = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=5, ignore_eos=True)
            async for chunk in engine.submit(ValidatedRequest("n3", tuple(PROMPT), sampling, 0, ""), "ns"):
                chunks.append(chunk)
            return chunks

        return await _run(engine, body())

    chunks = asyncio.run(scenario())
    finals = [c for c in chunks if c.finish_reason is not None]
    assert sorted(c.index for c in finals) == [0, 1, 2]
    for final in finals:
        assert final.usage is not None and final.usage.completion_tokens == 5
        assert final.usage.prompt_tokens == len(PROMPT)
        assert sum(len(c.token_ids) for c in chunks if c.index == final.index) == 5


def test_executor_lost_mid_stream_recovers_with_identical_output(tokenizer: Tokenizer) -> None:
    prompts = [[100 + i, 200, 300, 400 + i, 17] for i in range(6)]

    async def collect(kill_after: int | None):
        link = InProcessLink()
        engine = _engine(tokenizer, link, executor_restart_timeout_s=5.0)
        link.kill_after_steps = kill_after

        async def body():
            streams = [engine.submit(_request(f"r{i}", p, max_tokens=30), "ns") for i, p in enumerate(prompts)]
            tasks = [asyncio.create_task(_drain(s)) for s in streams]
            if kill_after is not None:
                while engine.state is not ExecutorState.LOST:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.05)
                link.revive()
            results = await asyncio.gather(*tasks)
            return [r[1][0] for r in results], engine.stats()

        return await _run(engine, body())

    baseline, _ = asyncio.run(collect(None))
    recovered, stats = asyncio.run(collect(10))
    assert recovered == baseline
    assert all(len(ids) == 30 for ids in recovered)
    assert stats.executor_state is ExecutorState.READY
    assert stats.scheduler.blocks_referenced == 0


def test_executor_that_never_returns_fails_requests_unavailable(tokenizer: Tokenizer) -> None:
    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link, executor_restart_timeout_s=0.3)
        link.kill_after_steps = 3

        async def body():
            streams = [engine.submit(_request(f"r{i}", PROMPT + [i], max_tokens=100), "ns") for i in range(4)]
            outcomes = []
            for stream in streams:
                try:
                    await _drain(stream)
                    outcomes.append("completed")
                except RequestFailed as exc:
                    outcomes.append(exc.kind)
            with pytest.raises(RequestFailed) as refused:
                engine.submit(_request("late", PROMPT), "ns")
            link.revive()
            await asyncio.sleep(0.2)
            late = await _drain(engine.submit(_request("after", PROMPT, max_tokens=3), "ns"))
            return outcomes, refused.value, late, engine.stats()

        return await _run(engine, body())

    outcomes, refused, late, stats = asyncio.run(scenario())
    assert outcomes == [FailureKind.UNAVAILABLE] * 4
    assert refused.kind is FailureKind.UNAVAILABLE and "did not come back" in refused.message
    assert len(late[1][0]) == 3  # an executor came back: service resumes
    assert stats.scheduler.blocks_referenced == 0


def test_replacement_between_steps_is_resynced(tokenizer: Tokenizer) -> None:
    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link)

        async def body():
            first = await _drain(engine.submit(_request("a", PROMPT, max_tokens=8), "ns"))
            link.revive()  # a new executor (empty KV) registered while the engine was idle
            second = await _drain(engine.submit(_request("b", PROMPT, max_tokens=8), "ns"))
            return first, second

        return await _run(engine, body())

    first, second = asyncio.run(scenario())
    assert first[1][0] == second[1][0]


def test_queue_limit_is_resource_exhausted_at_once(tokenizer: Tokenizer) -> None:
    async def scenario():
        link = InProcessLink()
        link.kill()  # nothing runs: everything stays queued
        engine = _engine(tokenizer, link, max_queued_requests=3, max_queued_prompt_tokens=10_000)
        for i in range(3):
            engine.submit(_request(f"q{i}", PROMPT), "ns")
        with pytest.raises(RequestFailed) as too_many:
            engine.submit(_request("q3", PROMPT), "ns")
        engine2 = _engine(tokenizer, link, max_queued_requests=100, max_queued_prompt_tokens=len(PROMPT) * 2)
        engine2.submit(_request("t0", PROMPT), "ns")
        engine2.submit(_request("t1", PROMPT), "ns")
        with pytest.raises(RequestFailed) as too_long:
            engine2.submit(_request("t2", PROMPT), "ns")
        return too_many.value, too_long.value

    too_many, too_long = asyncio.run(scenario())
    assert too_many.kind is FailureKind.RESOURCE_EXHAUSTED and too_long.kind is FailureKind.RESOURCE_EXHAUSTED


def test_abort_of_a_queued_request_ends_its_stream(tokenizer: Tokenizer) -> None:
    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link)

        async def body():
            stream = engine.submit(_request("queued", PROMPT, max_tokens=1000), "ns")
            assert engine.abort("queued")
            _, ids, reasons = await _drain(stream)
            return ids, reasons, engine.abort("queued"), engine.stats()

        return await _run(engine, body())

    ids, reasons, again, stats = asyncio.run(scenario())
    assert reasons.get(0, FinishReason.ABORT) is FinishReason.ABORT
    assert sum(len(v) for v in ids.values()) < 1000
    assert not again
    assert stats.scheduler.blocks_referenced == 0 and stats.active_requests == 0


def test_metrics_follow_the_requests(tokenizer: Tokenizer) -> None:
    from kvserve.scheduler.server.observability.metrics import ServerMetrics

    async def scenario():
        link = InProcessLink()
        server_config = ServerConfig()
        metrics = ServerMetrics()
        engine = Engine(
            build_scheduler(server_config, link.executor.info()), link, tokenizer, server_config, metrics=metrics
        )
        prompt = list(range(1000, 1100))

        async def body():
            await _drain(engine.submit(_request("m1", prompt, max_tokens=4), "ns"))
            await _drain(engine.submit(_request("m2", prompt, max_tokens=4), "ns"))

        await _run(engine, body())
        return metrics

    metrics = asyncio.run(scenario())
    value = metrics.registry.get_sample_value
    assert value("kvserve:generation_tokens_total") == 8
    assert value("kvserve:prompt_tokens_total") >= 100
    assert value("kvserve:prefix_cache_hits_total") >= 96
    assert value("kvserve:request_success_total", {"finished_reason": "length"}) == 2
    assert value("kvserve:time_to_first_token_seconds_count") == 2
    assert value("kvserve:inter_token_latency_seconds_count") == 6
    assert value("kvserve:executor_up") == 1


def test_verified_drafts_count_as_decode_rows_not_prompt_tokens(tokenizer: Tokenizer) -> None:
    """Under speculation a decoding sequence schedules its token and its drafts: several rows,
    but none of them prompt. The prompt-token counter and the step history's prefill must hold
    the prompt alone, and the verified rows go to decode."""
    from kvserve.scheduler.server.observability.metrics import ServerMetrics

    async def scenario():
        link = InProcessLink(copy_period=6)  # a fake model that copies: drafts are accepted
        speculating = dataclasses.replace(ServerConfig().scheduling, speculative="ngram", ngram_min=1)
        server_config = ServerConfig(scheduling=speculating)
        metrics = ServerMetrics()
        scheduler = build_scheduler(server_config, link.executor.info())
        engine = Engine(scheduler, link, tokenizer, server_config, metrics=metrics)
        await _run(engine, _drain(engine.submit(_request("s1", list(range(1000, 1100)), max_tokens=40), "ns")))
        return metrics, engine

    metrics, engine = asyncio.run(scenario())
    value = metrics.registry.get_sample_value
    assert value("kvserve:spec_decode_num_accepted_tokens_total") > 0
    assert value("kvserve:prompt_tokens_total") == 100
    assert sum(step.prefill_tokens for step in engine.history.steps) == 100
    verified_rows = value("kvserve:spec_decode_num_draft_tokens_total") + value(
        "kvserve:spec_decode_num_bonus_tokens_total"
    )
    assert sum(step.decode_rows for step in engine.history.steps) >= verified_rows


def test_a_request_that_can_never_fit_is_rejected_naming_a_field(tokenizer: Tokenizer) -> None:
    from kvserve.scheduler.core.request import RequestRejected

    async def scenario():
        link = InProcessLink(num_blocks=4)  # 64 token slots in all
        engine = _engine(tokenizer, link)
        with pytest.raises(RequestRejected) as info:
            engine.submit(_request("huge", list(range(100, 150)), max_tokens=100), "ns")
        return info.value, engine.num_active

    rejected, active = asyncio.run(scenario())
    assert rejected.field == "max_tokens" and "KV blocks" in str(rejected)
    assert active == 0


def test_request_finished_block_counts_are_final_on_every_ending(tokenizer: Tokenizer) -> None:
    """A stop string (the scheduler lets go only at the next boundary), n > 1 forks, an abort and a
    re-sync after a lost executor: each request_finished line has every reference given back."""
    from structlog.testing import capture_logs

    async def scenario():
        link = InProcessLink()
        engine = _engine(tokenizer, link, executor_restart_timeout_s=5.0)

        async def body():
            full_text, _, _ = await _drain(engine.submit(_request("plain", PROMPT), "ns"))
            text = full_text[0]
            stop = text[len(text) // 2 : len(text) // 2 + 4]
            await _drain(engine.submit(_request("stopped", PROMPT, stop=(stop,)), "ns"))
            sampling = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=5, ignore_eos=True)
            await _drain(engine.submit(ValidatedRequest("forked", tuple(PROMPT), sampling, 0, ""), "ns"))
            async for _chunk in engine.submit(_request("aborted", [5, 6, 7, 8] * 8, max_tokens=1000), "ns"):
                engine.abort("aborted")  # after its first tokens; later chunks may still arrive
            link.kill_after_steps = link.steps + 3
            task = asyncio.create_task(_drain(engine.submit(_request("resynced", PROMPT, max_tokens=30), "ns")))
            while engine.state is not ExecutorState.LOST:
                await asyncio.sleep(0.001)
            link.revive()
            await task
            return engine.stats()

        return await _run(engine, body())

    with capture_logs() as logs:
        stats = asyncio.run(scenario())
    lines = {e["request_id"]: e for e in logs if e["event"] == "request_finished"}
    assert set(lines) == {"plain", "stopped", "forked", "aborted", "resynced"}
    for request_id, line in lines.items():
        allocated, hit, copied, freed = (line[f"blocks_{k}"] for k in ("allocated", "hit", "copied", "freed"))
        assert allocated >= 1 and allocated + hit - copied == freed, (request_id, line)
    assert lines["stopped"]["finish_reason"] == "stop" and lines["stopped"]["blocks_hit"] >= 1
    assert lines["forked"]["blocks_copied"] >= 2  # completions 1 and 2 copy the last prompt token's block
    assert lines["aborted"]["finish_reason"] == "abort"
    assert lines["resynced"]["blocks_allocated"] > lines["plain"]["blocks_allocated"]  # recomputed after the loss
    assert stats.scheduler.blocks_referenced == 0
