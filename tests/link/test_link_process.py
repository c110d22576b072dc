"""The real link: `kvserve executor --executor fake` in a child process, ExecutorLink here.

Every test is bounded (pytest timeout plus asyncio timeouts), uses an ipc socket in a
private temp dir, and the `executors` fixture kills every child it started.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import time

import pytest
from structlog.testing import capture_logs

from kvserve.config import defaults
from kvserve.executor.fake.executor import FakeExecutor, FakeExecutorConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import KnownSequence, NewSequence, StepPlan
from kvserve.scheduler.server.executor_link.connection import ExecutorLink
from kvserve.scheduler.server.executor_link.link_errors import ExecutorLost, ExecutorStepError
from kvserve.scheduler.server.executor_link.link_socket import LinkSocketError
from kvserve.testing.waiting import wait_until_async

pytestmark = pytest.mark.timeout(90)

GREEDY = SamplingParams(temperature=0.0)
DEAD_AFTER_S = 2.0
DETECTION_PROMISE_S = 2.0
"""The reliability promise: a dead or hung executor is detected within 2 s (default dead_after_s: 1.5 s).
The tests check the mechanism that keeps it (the configured liveness timeout, and which event ended the
link), not the wall clock: on a loaded machine the event loop may run late, and that is not a defect."""
EVENT_TIMEOUT_S = 30.0
"""Bounds only a stuck link; every wait returns as soon as its event happens."""
SILENCE = re.compile(r"no message from the executor \(pid (\d+)\) for ([\d.]+)s")


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def first_plan(seq_id: int = 1, step_id: int = 1) -> StepPlan:
    return StepPlan(step_id, new_seqs=[NewSequence(seq_id, [11, 12, 13, 14, 15], 5, 0, 5, [0], GREEDY, 0)])


async def decode(link: ExecutorLink, steps: int, seq_id: int = 1) -> list[int]:
    """Prefill a 5-token prompt into block 0, then decode; returns the sampled tokens."""
    result = await link.step(first_plan(seq_id))
    tokens = [result.outputs[0].token_id]
    for i in range(steps - 1):
        computed = 5 + i
        new_blocks = [computed // 16] if computed % 16 == 0 else []
        result = await link.step(
            StepPlan(2 + i, known_seqs=[KnownSequence(seq_id, [tokens[-1]], computed, 1, new_blocks)])
        )
        tokens.append(result.outputs[0].token_id)
    return tokens


def expected_tokens(tokenizer_dir: str, steps: int) -> list[int]:
    """The same plans through an in-process FakeExecutor."""
    fake = FakeExecutor(FakeExecutorConfig(num_blocks=64, tokenizer_path=tokenizer_dir))
    tokens = [fake.execute(first_plan()).outputs[0].token_id]
    for i in range(steps - 1):
        computed = 5 + i
        plan = StepPlan(
            2 + i,
            known_seqs=[KnownSequence(1, [tokens[-1]], computed, 1, [computed // 16] if computed % 16 == 0 else [])],
        )
        tokens.append(fake.execute(plan).outputs[0].token_id)
    return tokens


def test_handshake_steps_and_clean_shutdown(link_endpoint, executors, default_model_dir) -> None:
    async def scenario():
        changes = []
        link = ExecutorLink(link_endpoint, dead_after_s=DEAD_AFTER_S, on_change=changes.append)
        await link.start()
        proc = executors.start(link_endpoint)
        try:
            info = await link.wait_for_executor(timeout_s=30)
            assert info.executor_kind == "fake" and info.num_blocks == 64 and info.block_size == 16
            assert link.connected and link.generation == 1 and link.executor_pid == proc.pid
            tokens = await decode(link, 20)  # crosses a block boundary at position 16
            await link.close(shutdown_executor=True)
        finally:
            await link.close()
        return proc, tokens, changes

    proc, tokens, changes = run(scenario())
    assert tokens == expected_tokens(str(default_model_dir), 20)
    assert changes == [True]
    assert proc.wait(timeout=10) == 0, executors.log_of(proc)


def test_step_error_is_reported_and_the_executor_survives(link_endpoint, executors) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint)
        await link.start()
        executors.start(link_endpoint)
        try:
            await link.wait_for_executor(timeout_s=30)
            with pytest.raises(ExecutorStepError, match="unknown to the executor") as caught:
                await link.step(StepPlan(5, known_seqs=[KnownSequence(99, [1], 0, 1)]))
            assert caught.value.step_id == 5 and caught.value.error_type == "PlanError"
            assert link.connected
            assert len(await decode(link, 3)) == 3
            # reset_executor: the executor forgets seq 1, so continuing it is an error.
            await link.reset_executor()
            with pytest.raises(ExecutorStepError, match="unknown"):
                await link.step(StepPlan(50, known_seqs=[KnownSequence(1, [1], 7, 1)]))
        finally:
            await link.close()

    run(scenario())


def test_the_link_outlives_failed_polls_of_its_socket(link_endpoint, executors) -> None:
    """A poll that fails (three times, before any executor came) is logged once and the link receives
    on: the handshake is taken and a dead executor is still noticed. A receive loop that ended
    instead would leave the link deaf, and every later step would wait for a lost executor."""

    async def scenario():
        link = ExecutorLink(link_endpoint, dead_after_s=DEAD_AFTER_S)
        poll = link._socket.poll
        failures = []

        async def failing_poll(timeout_ms: int) -> bool:
            if len(failures) < 3:
                failures.append(timeout_ms)
                raise LinkSocketError(errno.EINTR, "Interrupted system call")
            return await poll(timeout_ms)

        link._socket.poll = failing_poll  # type: ignore[method-assign]
        with capture_logs() as logs:
            await link.start()
            proc = executors.start(link_endpoint)
            try:
                await link.wait_for_executor(timeout_s=EVENT_TIMEOUT_S)
                assert len(await decode(link, 2)) == 2
                proc.kill()
                await wait_until_async(lambda: not link.connected, EVENT_TIMEOUT_S, "the link to lose the executor")
            finally:
                await link.close()
        return failures, logs

    failures, logs = run(scenario())
    assert len(failures) == 3
    errors = [e for e in logs if e["event"].startswith("executor link receive failed")]
    assert len(errors) == 1 and "Interrupted" in errors[0]["error"], errors
    assert not [e for e in logs if e["event"] == "executor link task ended before close"]


def test_two_steps_in_flight_complete_in_order(link_endpoint, executors) -> None:
    """Overlap: the scheduler may send step N+1 before step N's result is back."""

    async def scenario():
        link = ExecutorLink(link_endpoint)
        await link.start()
        executors.start(link_endpoint, "--step-latency-ms", "100")
        try:
            await link.wait_for_executor(timeout_s=30)
            second_plan = StepPlan(2, new_seqs=[NewSequence(2, [21, 22, 23], 3, 0, 3, [1], GREEDY, 0)])
            done_order = []

            async def tracked(plan):
                result = await link.step(plan)
                done_order.append(result.step_id)
                return result

            first, second = await asyncio.gather(tracked(first_plan()), tracked(second_plan))
            third = asyncio.create_task(
                link.step(StepPlan(3, new_seqs=[NewSequence(3, [31, 32], 2, 0, 2, [2], GREEDY, 0)]))
            )
            await asyncio.sleep(0)  # the third step is now in flight
            with pytest.raises(ValueError, match="already in flight"):
                await link.step(StepPlan(3))
            assert [o.seq_id for o in (await third).outputs] == [3]
        finally:
            await link.close()
        return first, second, done_order

    first, second, done_order = run(scenario())
    assert [o.seq_id for o in first.outputs] == [1] and [o.seq_id for o in second.outputs] == [2]
    assert done_order == [1, 2]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_dead_or_hung_executor_is_detected_mid_step(link_endpoint, executors, fault) -> None:
    async def scenario():
        changes = []
        link = ExecutorLink(link_endpoint, on_change=changes.append)  # default liveness settings
        await link.start()
        proc = executors.start(link_endpoint, "--step-latency-ms", "20000")
        try:
            await link.wait_for_executor(timeout_s=30)
            step = asyncio.create_task(link.step(first_plan()))
            await asyncio.sleep(0.3)  # the step is now running in the executor
            assert not step.done()
            os.kill(proc.pid, fault)
            await wait_until_async(step.done, EVENT_TIMEOUT_S, "the link to declare the executor lost")
            with pytest.raises(ExecutorLost) as lost:
                await step
            assert not link.connected and link.info is None
            with pytest.raises(ExecutorLost):
                await link.step(first_plan(step_id=2))  # fails at once, no waiting
        finally:
            await link.close()
        return link.dead_after_s, str(lost.value), proc.pid, changes

    dead_after_s, reason, pid, changes = run(scenario())
    # The configured liveness timeout keeps the promise, and it is what the link runs with by default.
    assert dead_after_s == defaults.EXECUTOR_DEAD_AFTER_S < DETECTION_PROMISE_S
    assert dead_after_s > defaults.LINK_HEARTBEAT_INTERVAL_S
    silence = SILENCE.fullmatch(reason)
    if fault == signal.SIGSTOP:
        # A hung process keeps its socket open: only the liveness timeout can find it.
        assert silence is not None, reason
    else:
        # A killed one is found by its closed connection, or by the same timeout if that comes first.
        assert reason == f"the executor's connection closed (pid {pid})" or silence is not None, reason
    if silence is not None:
        assert int(silence.group(1)) == pid and float(silence.group(2)) >= dead_after_s, reason
    assert changes == [True, False]


def test_heartbeats_keep_a_long_step_alive(link_endpoint, executors) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint, heartbeat_interval_s=0.2, dead_after_s=1.0)
        await link.start()
        executors.start(link_endpoint, "--step-latency-ms", "2500", "--heartbeat-interval-s", "0.2")
        try:
            await link.wait_for_executor(timeout_s=30)
            result = await link.step(first_plan())  # 2.5x longer than dead_after_s
            assert result.execute_time_s >= 2.5 and link.connected
        finally:
            await link.close()

    run(scenario())


def test_restarted_executor_registers_as_a_new_generation(link_endpoint, executors, default_model_dir) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint, dead_after_s=DEAD_AFTER_S)
        await link.start()
        first = executors.start(link_endpoint)
        try:
            await link.wait_for_executor(timeout_s=30)
            before = await decode(link, 4)
            first.kill()
            with pytest.raises(ExecutorLost):
                # Either the send fails (connection gone) or liveness catches it.
                for _ in range(100):
                    await link.step(StepPlan(100, known_seqs=[KnownSequence(1, [before[-1]], 8, 1)]))
                    await asyncio.sleep(0.05)
            second = executors.start(link_endpoint)
            await link.wait_for_executor(timeout_s=30)
            assert link.generation == 2 and link.executor_pid == second.pid
            after = await decode(link, 4)  # re-sync: the sequence is sent as new again
        finally:
            await link.close()
        return before, after

    before, after = run(scenario())
    assert before == after == expected_tokens(str(default_model_dir), 4)


def test_a_second_executor_replaces_the_first(link_endpoint, executors) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint, dead_after_s=DEAD_AFTER_S)
        await link.start()
        first = executors.start(link_endpoint, "--step-latency-ms", "20000", "--scheduler-timeout-s", "1.5")
        try:
            await link.wait_for_executor(timeout_s=30)
            step = asyncio.create_task(link.step(first_plan()))
            second = executors.start(link_endpoint)
            with pytest.raises(ExecutorLost, match="replaced"):
                await step
            await link.wait_for_executor(timeout_s=30)
            assert link.generation == 2 and link.executor_pid == second.pid
            assert len(await decode(link, 2)) == 2
        finally:
            await link.close()
        return first

    first = run(scenario())
    # The replaced executor hears nothing more from us and exits by itself.
    assert first.wait(timeout=15) == 3, executors.log_of(first)


def test_executor_exits_when_the_scheduler_vanishes(link_endpoint, executors) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint)
        await link.start()
        proc = executors.start(link_endpoint, "--scheduler-timeout-s", "1.5")
        await link.wait_for_executor(timeout_s=30)
        # A round trip proves the executor heard us; closing right after the handshake could drop
        # the ack, and an executor never acknowledged waits out --connect-timeout-s instead.
        await link.reset_executor()
        await link.close(shutdown_executor=False)  # as if the scheduler was killed
        return proc, time.monotonic()

    proc, closed_at = run(scenario())
    assert proc.wait(timeout=15) == 3, executors.log_of(proc)
    assert time.monotonic() - closed_at < 1.5 + 3.0


def test_executor_without_a_scheduler_gives_up(link_endpoint, executors) -> None:
    proc = executors.start(link_endpoint, "--connect-timeout-s", "1")
    assert proc.wait(timeout=20) == 4, executors.log_of(proc)


def test_reregister_mode_waits_for_the_next_scheduler(link_endpoint, executors) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint)
        await link.start()
        proc = executors.start(link_endpoint, "--scheduler-timeout-s", "1", "--reregister")
        await link.wait_for_executor(timeout_s=30)
        await decode(link, 2)
        await link.close(shutdown_executor=False)
        await wait_until_async(
            lambda: "scheduler lost; resetting and registering again" in executors.log_of(proc),
            EVENT_TIMEOUT_S,
            lambda: f"the executor to notice the scheduler left and reset:\n{executors.log_of(proc)}",
            interval_s=0.1,
        )
        assert proc.poll() is None
        successor = ExecutorLink(link_endpoint)
        await successor.start()
        try:
            await successor.wait_for_executor(timeout_s=30)
            assert successor.executor_pid == proc.pid
            tokens = await decode(successor, 2)  # seq 1 again: the executor did reset
        finally:
            await successor.close(shutdown_executor=True)
        return proc, tokens

    proc, tokens = run(scenario())
    assert len(tokens) == 2
    assert proc.wait(timeout=10) == 0, executors.log_of(proc)


def test_sigterm_stops_the_executor_cleanly(link_endpoint, executors) -> None:
    async def scenario():
        link = ExecutorLink(link_endpoint, dead_after_s=5.0)  # so only the goodbye can explain a fast loss
        await link.start()
        proc = executors.start(link_endpoint)
        try:
            await link.wait_for_executor(timeout_s=30)
            with capture_logs() as logs:
                proc.send_signal(signal.SIGTERM)
                await wait_until_async(lambda: not link.connected, EVENT_TIMEOUT_S, "the link to see the executor go")
        finally:
            await link.close()
        return proc, [e["reason"] for e in logs if e["event"] == "executor lost"]

    proc, reasons = run(scenario())
    # The executor says goodbye: that, not the (5 s) heartbeat deadline, is what ended the link.
    assert reasons == [f"the executor (pid {proc.pid}) shut down"]
    assert proc.wait(timeout=10) == 0, executors.log_of(proc)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_executor_serves_the_link(link_endpoint, executors) -> None:
    """`--executor torch` through the same link: handshake, greedy steps, reset, same tokens again."""

    async def scenario():
        link = ExecutorLink(link_endpoint, dead_after_s=10.0)
        await link.start()
        proc = executors.start(
            link_endpoint, "--device", "cpu", "--kv-cache-gb", "0.05", "--num-threads", "2", kind="torch"
        )
        try:
            info = await link.wait_for_executor(timeout_s=240)
            assert info.executor_kind == "torch" and info.num_blocks > 0 and info.vocab_size > 1000
            first = await decode(link, 4)
            await link.reset_executor()
            second = await decode(link, 4)
            await link.close(shutdown_executor=True)
        finally:
            await link.close()
        return info, first, second, proc

    info, first, second, proc = run(scenario(), timeout=280)
    assert first == second
    assert all(0 <= t < info.vocab_size for t in first)
    assert proc.wait(timeout=20) == 0, executors.log_of(proc)
