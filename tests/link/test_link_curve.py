"""CURVE on the link: only an executor holding an allowed key, talking to the right
scheduler key, can register; a plain-text executor is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq.auth

from kvserve.link.curve import load_keys
from kvserve.scheduler.server.executor_link.connection import ExecutorLink
from kvserve.testing.ports import free_port
from tests.link.test_link_process import decode, run

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (public .key file, .key_secret file) for a scheduler and two executors."""
    made = {}
    for name in ("scheduler", "executor", "intruder", "impostor"):
        public, secret = zmq.auth.create_certificates(str(tmp_path), name)
        made[name] = (public, secret)
    return made


@pytest.fixture
def tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def curve_link(endpoint: str, keys: dict, allowed: list[str]) -> ExecutorLink:
    scheduler_keys = load_keys(keys["scheduler"][1], [keys[name][0] for name in allowed])
    return ExecutorLink(endpoint, curve_keys=scheduler_keys)


def curve_flags(keys: dict, own: str, server: str) -> list[str]:
    return ["--curve-secret-key", keys[own][1], "--curve-server-key", keys[server][0]]


def test_allowed_executor_registers_and_steps(tcp_endpoint, keys, executors) -> None:
    async def scenario():
        link = curve_link(tcp_endpoint, keys, ["executor"])
        await link.start()
        executors.start(tcp_endpoint, *curve_flags(keys, "executor", "scheduler"))
        try:
            await link.wait_for_executor(timeout_s=30)
            return await decode(link, 3)
        finally:
            await link.close()

    assert len(run(scenario())) == 3


@pytest.mark.parametrize("who", ["unlisted_key", "wrong_server_key", "plain_text"])
def test_unauthenticated_peers_are_refused(tcp_endpoint, keys, executors, who) -> None:
    flags = {
        "unlisted_key": curve_flags(keys, "intruder", "scheduler"),
        # The executor expects another scheduler's key: it refuses to talk to this one.
        "wrong_server_key": curve_flags(keys, "executor", "impostor"),
        "plain_text": [],
    }[who]

    async def scenario():
        link = curve_link(tcp_endpoint, keys, ["executor"])
        await link.start()
        proc = executors.start(tcp_endpoint, "--connect-timeout-s", "3", *flags)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await link.wait_for_executor(timeout_s=4)
            assert link.generation == 0
        finally:
            await link.close()
        return proc

    proc = run(scenario())
    assert proc.wait(timeout=15) == 4, executors.log_of(proc)
