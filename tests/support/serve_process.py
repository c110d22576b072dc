"""Run `kvserve serve` as a real subprocess for fault-injection tests, and always clean it up.

Each server gets a free loopback port and its own process group, so teardown can kill
the scheduler *and* its executor even when a test left them in a bad state (SIGSTOP).
Helpers read the executor pids from the supervisor's `executor_started` log lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.kvserve.v1 import api_pb2, api_pb2_grpc

START_TIMEOUT_S = 120.0  # a real-model server converts and loads weights first
FAKE_ARGS = ("--executor", "fake")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class ServeProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    metadata: tuple[tuple[str, str], ...] = ()
    """Sent with the helper calls below (a bearer token when auth is on)."""
    credentials: grpc.ChannelCredentials | None = None
    target_host: str = "127.0.0.1"
    options: list[tuple[str, str]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.target_host}:{self.port}"

    def channel(self) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, options=self.options)
        return grpc.insecure_channel(self.address)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.address, self.credentials, options=self.options)
        return grpc.aio.insecure_channel(self.address)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self, event: str) -> list[dict]:
        found = []
        for line in self.log_text().splitlines():
            if f'"{event}"' in line and "{" in line:
                try:
                    found.append(json.loads(line[line.index("{"):]))
                except json.JSONDecodeError:
                    continue
        return found

    def event_times(self, event: str) -> list[float]:
        """Wall-clock (epoch) times of a log event, from structlog's ISO UTC timestamps."""
        return [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                for e in self.log_events(event) if "timestamp" in e]

    def executor_pids(self) -> list[int]:
        return [e["pid"] for e in self.log_events("executor_started")]

    def health(self, timeout_s: float = 2.0) -> int | None:
        with self.channel() as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=timeout_s).status
            except grpc.RpcError:
                return None

    def stats(self) -> api_pb2.ServerStatsResponse:
        with self.channel() as channel:
            return api_pb2_grpc.KVServeStub(channel).ServerStats(api_pb2.ServerStatsRequest(), timeout=5,
                                                                 metadata=self.metadata)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"kvserve serve exited with {self.process.returncode}:\n{self.log_text()[-4000:]}")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise AssertionError(f"kvserve serve not SERVING after {timeout_s}s:\n{self.log_text()[-4000:]}")

    def wait_idle(self, timeout_s: float = 20.0) -> api_pb2.ServerStatsResponse:
        """Stats once nothing is waiting, running or referenced (or the last stats at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            idle = (stats.requests_running == 0 and stats.requests_waiting == 0 and stats.requests_swapped == 0
                    and stats.blocks_referenced == 0)
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def wait_health(self, status: int, timeout_s: float) -> float:
        """Seconds until health reports `status`; AssertionError after `timeout_s`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.health(timeout_s=0.5) == status:
                return time.monotonic() - started
            time.sleep(0.05)
        raise AssertionError(f"health never became {status} within {timeout_s}s")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (drain), then SIGKILL the whole group; continue a stopped executor so it can die."""
        self._signal_group(signal.SIGCONT)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for pid in self.executor_pids():  # each executor runs in its own session/group
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return self.process.returncode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.executor_pids():
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def start_serve(args: Sequence[str], log_dir: Path, *, host: str = "127.0.0.1") -> ServeProcess:
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    env = {**os.environ, "KVSERVE_LOG_LEVEL": "INFO"}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--host", host, "--port", str(port), *args],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return ServeProcess(process=process, port=port, log_path=log_path)


def greedy_request(key: int, max_tokens: int, *, prompt_len: int = 24, **fields) -> api_pb2.GenerateRequest:
    """A deterministic token-id prompt; greedy with ignore_eos so the length is exact."""
    ids = [(key * 7919 + i * 104729) % 40000 + 100 for i in range(prompt_len)]
    return api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), **fields)


async def collect(stub: api_pb2_grpc.KVServeStub, request: api_pb2.GenerateRequest, *,
                  timeout_s: float = 120.0, metadata: Sequence[tuple[str, str]] = ()) -> tuple[list[int], int]:
    """(token ids, finish reason) of a whole stream."""
    ids: list[int] = []
    reason = 0
    async for chunk in stub.Generate(request, timeout=timeout_s, metadata=tuple(metadata)):
        ids.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return ids, reason
