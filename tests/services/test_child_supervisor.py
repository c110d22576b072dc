"""The supervisor restarts a dying child with backoff and leaves nothing behind when stopped."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvserve.scheduler.server.executor_link.child_supervisor import ChildSupervisor, executor_command
from kvserve.testing.server_launcher import pid_alive
from kvserve.testing.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(60)

EVENT_TIMEOUT_S = 20.0
"""Bounds only a stuck supervisor: every wait returns once its event happens."""


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _events(logs: list[dict], event: str) -> list[dict]:
    return [e for e in logs if e["event"] == event]


def test_executor_command_runs_the_executor_module() -> None:
    assert executor_command(["--executor", "fake"]) == [sys.executable, "-m", "kvserve.executor", "--executor", "fake"]


def test_a_dying_child_is_restarted_with_a_counter() -> None:
    async def scenario():
        supervisor = ChildSupervisor([sys.executable, "-c", "raise SystemExit(3)"], backoff_initial_s=0.05)
        await supervisor.start()
        codes = [await asyncio.wait_for(supervisor.exits.get(), 10) for _ in range(3)]
        await wait_until_async(lambda: supervisor.restarts >= 3, EVENT_TIMEOUT_S, "the third restart")
        await supervisor.stop()
        return codes, supervisor.restarts

    codes, restarts = asyncio.run(scenario())
    assert codes == [3, 3, 3]
    assert restarts >= 3


def test_no_restart_mode_reports_the_exit_once() -> None:
    async def scenario():
        supervisor = ChildSupervisor([sys.executable, "-c", "raise SystemExit(5)"], restart=False)
        with capture_logs() as logs:
            await supervisor.start()
            code = await asyncio.wait_for(supervisor.exits.get(), 10)
            # The watcher logs its decision and returns at once: after this no restart can follow.
            (exited,) = await wait_until_async(
                lambda: _events(logs, "executor_exited"), EVENT_TIMEOUT_S, "the exit to be logged"
            )
            await supervisor.stop()
        return code, exited["will_restart"], supervisor.restarts, supervisor.exits.qsize(), supervisor.pid, logs

    code, will_restart, restarts, more_exits, pid, logs = asyncio.run(scenario())
    assert (code, will_restart, restarts, more_exits, pid) == (5, False, 0, 0, None)
    assert len(_events(logs, "executor_started")) == 1, logs


def test_stop_terminates_the_child_and_its_group() -> None:
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )

    async def scenario():
        supervisor = ChildSupervisor([sys.executable, "-c", script], stop_timeout_s=5)
        await supervisor.start()
        pid = supervisor.pid
        assert pid is not None
        grandchildren = await wait_until_async(lambda: _children(pid), EVENT_TIMEOUT_S, "the child to start its own")
        assert os.getpgid(pid) == pid  # its own process group
        await supervisor.stop()
        return pid, grandchildren, supervisor.exits.qsize()

    pid, grandchildren, unexpected_exits = asyncio.run(scenario())
    assert grandchildren
    assert not pid_alive(pid)
    for child in grandchildren:
        wait_until(lambda child=child: not pid_alive(child), EVENT_TIMEOUT_S, f"grandchild {child} to die")
    assert unexpected_exits == 0


def test_kill_if_current_spares_a_newer_child() -> None:
    async def scenario():
        supervisor = ChildSupervisor([sys.executable, "-c", "import time; time.sleep(30)"], backoff_initial_s=0.05)
        with capture_logs() as logs:
            await supervisor.start()
            first = supervisor.pid
            assert first is not None
            # kill_if_current decides and signals synchronously, logging each kill: what it did not log, it
            # did not send, however late a death would show.
            supervisor.kill_if_current(first + 100000)  # not ours: nothing happens
            assert _events(logs, "executor_kill_lost") == []
            assert supervisor.pid == first and supervisor.restarts == 0 and pid_alive(first)
            supervisor.kill_if_current(first)  # the lost one: killed and replaced
            code = await asyncio.wait_for(supervisor.exits.get(), 10)
            second = await wait_until_async(
                lambda: supervisor.pid not in (None, first) and supervisor.pid, EVENT_TIMEOUT_S, "a new child"
            )
            supervisor.kill_if_current(first)  # a late report about the old child spares the new one
            kills = [e["pid"] for e in _events(logs, "executor_kill_lost")]
            alive = supervisor.pid == second and pid_alive(second)
            await supervisor.stop()
        return code, kills, first, alive, supervisor.restarts, supervisor.exits.qsize()

    code, kills, first, alive, restarts, more_exits = asyncio.run(scenario())
    assert code == -9 and alive and restarts == 1
    assert kills == [first], "only the lost child may be killed"
    assert more_exits == 0, "the new child exited before stop()"


PARENT = """
import asyncio, sys
from kvserve.scheduler.server.executor_link.child_supervisor import ChildSupervisor

async def main():
    supervisor = ChildSupervisor([sys.executable, "-c", "import time; time.sleep(60)"])
    await supervisor.start()
    print("CHILD", supervisor.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _exec_done(pid: int) -> bool:
    """The trampoline set its death signal and exec'ed the real command (the same pid, a new command line)."""
    return "PR_SET_PDEATHSIG" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def test_the_child_dies_with_a_killed_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        line = ""
        while not line.startswith("CHILD"):  # unconfigured structlog also prints to stdout
            line = parent.stdout.readline()
            assert line, "the parent exited before starting its child"
        child = int(line.split()[1])
        wait_until(lambda: _exec_done(child), EVENT_TIMEOUT_S, "the trampoline to exec the child")
        assert pid_alive(child)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not pid_alive(child), EVENT_TIMEOUT_S, "the child to die with its parent")
    finally:
        parent.kill()
