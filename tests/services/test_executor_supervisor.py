"""The supervisor restarts a dying child with backoff and leaves nothing behind when stopped."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from kvserve.scheduler.server.executor_supervisor import ExecutorSupervisor, executor_command

pytestmark = pytest.mark.timeout(60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[-1].split()[0] != "Z"


def test_executor_command_runs_the_executor_module() -> None:
    assert executor_command(["--executor", "fake"]) == [sys.executable, "-m", "kvserve.executor", "--executor", "fake"]


def test_a_dying_child_is_restarted_with_a_counter() -> None:
    async def scenario():
        supervisor = ExecutorSupervisor([sys.executable, "-c", "raise SystemExit(3)"], backoff_initial_s=0.05)
        await supervisor.start()
        codes = [await asyncio.wait_for(supervisor.exits.get(), 10) for _ in range(3)]
        while supervisor.restarts < 3:
            await asyncio.sleep(0.01)
        await supervisor.stop()
        return codes, supervisor.restarts

    codes, restarts = asyncio.run(scenario())
    assert codes == [3, 3, 3]
    assert restarts >= 3


def test_no_restart_mode_reports_the_exit_once() -> None:
    async def scenario():
        supervisor = ExecutorSupervisor([sys.executable, "-c", "raise SystemExit(5)"], restart=False)
        await supervisor.start()
        code = await asyncio.wait_for(supervisor.exits.get(), 10)
        await asyncio.sleep(0.3)
        await supervisor.stop()
        return code, supervisor.restarts, supervisor.exits.qsize()

    assert asyncio.run(scenario()) == (5, 0, 0)


def test_stop_terminates_the_child_and_its_group() -> None:
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )

    async def scenario():
        supervisor = ExecutorSupervisor([sys.executable, "-c", script], stop_timeout_s=5)
        await supervisor.start()
        pid = supervisor.pid
        await asyncio.sleep(0.5)
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            grandchildren = [int(p) for p in f.read().split()]
        assert os.getpgid(pid) == pid  # its own process group
        await supervisor.stop()
        return pid, grandchildren, supervisor.exits.qsize()

    pid, grandchildren, unexpected_exits = asyncio.run(scenario())
    assert grandchildren
    assert not _alive(pid)
    for child in grandchildren:
        for _ in range(50):
            if not _alive(child):
                break
            asyncio.run(asyncio.sleep(0.05))
        assert not _alive(child)
    assert unexpected_exits == 0


def test_kill_if_current_spares_a_newer_child() -> None:
    async def scenario():
        supervisor = ExecutorSupervisor([sys.executable, "-c", "import time; time.sleep(30)"], backoff_initial_s=0.05)
        await supervisor.start()
        first = supervisor.pid
        supervisor.kill_if_current(first + 100000)  # not ours: nothing happens
        await asyncio.sleep(0.2)
        assert supervisor.pid == first and supervisor.restarts == 0
        supervisor.kill_if_current(first)  # the lost one: killed and replaced
        code = await asyncio.wait_for(supervisor.exits.get(), 10)
        while supervisor.pid in (None, first):
            await asyncio.sleep(0.01)
        second = supervisor.pid
        supervisor.kill_if_current(first)  # a late report about the old child spares the new one
        await asyncio.sleep(0.2)
        alive = supervisor.pid == second
        await supervisor.stop()
        return code, alive, supervisor.restarts

    code, alive, restarts = asyncio.run(scenario())
    assert code == -9 and alive and restarts == 1


PARENT = """
import asyncio, sys
from kvserve.scheduler.server.executor_supervisor import ExecutorSupervisor

async def main():
    supervisor = ExecutorSupervisor([sys.executable, "-c", "import time; time.sleep(60)"])
    await supervisor.start()
    print("CHILD", supervisor.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_the_child_dies_with_a_killed_parent() -> None:
    import subprocess
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("CHILD"):  # unconfigured structlog also prints to stdout
            line = parent.stdout.readline()
        child = int(line.split()[1])
        time.sleep(0.3)  # the trampoline has set its death signal and exec'ed
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
