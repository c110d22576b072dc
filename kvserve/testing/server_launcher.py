"""Run `kvserve serve` as a real subprocess, for tests and `bench serve --start-server`, and always clean it up.

Each server gets a free loopback port and its own process group, so teardown can kill
the scheduler *and* its executor even when it was left in a bad state (SIGSTOP) or a
run failed half-way. Its output goes to a log file; helpers read the executor pids and
other events from the JSON log lines.

The OpenAI-compatible HTTP API is off (`--http-port 0`) unless `http=True`, because
tests run many servers at once and its default port (8000) is fixed; with `http=True`
it gets a free port of its own, at `ServeProcess.http_url`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.child_python import python_module
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.ports import free_ports
from kvserve.testing.waiting import wait_until

DEFAULT_STARTUP_TIMEOUT_S = 180.0
"""A real-model server converts and loads weights before it serves."""
_LOG_TAIL_CHARS = 4000


class ServerStartError(RuntimeError):
    """The server exited or did not report SERVING in time; the message holds its log tail."""


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
    """One server process (normally from `start_serve`) and the calls tests make on it."""

    process: subprocess.Popen
    port: int
    log_path: Path
    metadata: tuple[tuple[str, str], ...] = ()
    """Sent with the helper calls below (a bearer token when auth is on)."""
    credentials: grpc.ChannelCredentials | None = None
    target_host: str = "127.0.0.1"
    options: list[tuple[str, str]] = field(default_factory=list)
    name: str = "serve"
    http_port: int | None = None
    """The OpenAI-compatible HTTP API's port; None when it is off (`--http-port 0`)."""

    @property
    def address(self) -> str:
        return f"{self.target_host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        """The HTTP API as `127.0.0.1:PORT`, None when it is off."""
        return None if self.http_port is None else f"{self.target_host}:{self.http_port}"

    @property
    def http_url(self) -> str | None:
        """The HTTP API as `http://127.0.0.1:PORT` (an OpenAI client's base_url adds `/v1`), None when it is off."""
        return None if self.http_address is None else f"http://{self.http_address}"

    def channel(self) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, options=self.options)
        return grpc.insecure_channel(self.address)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.address, self.credentials, options=self.options)
        return grpc.aio.insecure_channel(self.address)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_events(self, event: str) -> list[dict]:
        found = []
        for line in self.log_text().splitlines():
            if f'"{event}"' in line and "{" in line:
                try:
                    found.append(json.loads(line[line.index("{") :]))
                except json.JSONDecodeError:
                    continue
        return found

    def event_times(self, event: str) -> list[float]:
        """Wall-clock (epoch) times of a log event, from structlog's ISO UTC timestamps."""
        return [
            datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            for e in self.log_events(event)
            if "timestamp" in e
        ]

    def executor_pids(self) -> list[int]:
        return [e["pid"] for e in self.log_events("executor_started")]

    def health(self, timeout_s: float = 2.0) -> int | None:
        with self.channel() as channel:
            try:
                return (
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
                )
            except grpc.RpcError:
                return None

    def stats(self) -> api_pb2.ServerStatsResponse:
        with self.channel() as channel:
            return api_pb2_grpc.KVServeStub(channel).ServerStats(
                api_pb2.ServerStatsRequest(), timeout=5, metadata=self.metadata
            )

    def wait_serving(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """Block until health says SERVING; ServerStartError (with the log tail) if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log_text()[-_LOG_TAIL_CHARS:]}"
                )
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise ServerStartError(f"{self.name} not SERVING after {timeout_s:.0f}s:\n{self.log_text()[-_LOG_TAIL_CHARS:]}")

    def wait_idle(self, timeout_s: float = 20.0) -> api_pb2.ServerStatsResponse:
        """Stats once nothing is waiting, running or referenced (or the last stats at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            idle = (
                stats.requests_running == 0
                and stats.requests_waiting == 0
                and stats.requests_swapped == 0
                and stats.blocks_referenced == 0
            )
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def kill_executor(self, timeout_s: float, dead_within_s: float = 30.0) -> None:
        """SIGKILL the current executor (dead within `dead_within_s`), then wait until the next one has
        registered and the scheduler re-synced with it (a restart counted, READY); WaitTimedOut after
        `timeout_s`."""
        restarts = self.stats().executor_restarts
        pid = self.executor_pids()[-1]
        os.kill(pid, signal.SIGKILL)
        if not wait_dead(pid, dead_within_s):
            raise TimeoutError(f"executor pid {pid} still alive {dead_within_s:g} s after SIGKILL")

        def resynced() -> bool:
            stats = self.stats()
            return stats.executor_restarts > restarts and stats.executor_state == api_pb2.EXECUTOR_STATE_READY

        wait_until(resynced, timeout_s, "a new executor, synced")

    def wait_health(self, status: int, timeout_s: float) -> float:
        """Seconds until health reports `status`; TimeoutError after `timeout_s`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.health(timeout_s=0.5) == status:
                return time.monotonic() - started
            time.sleep(0.05)
        raise TimeoutError(f"health never became {status} within {timeout_s}s")

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
        # Each executor runs in its own session, and so does each tensor-parallel rank it starts.
        ranks = [e["pid"] for e in self.log_events("tensor-parallel rank started")]
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        for pid in self.executor_pids():
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


def start_serve(
    args: Sequence[str],
    log_dir: Path | None = None,
    *,
    host: str = "127.0.0.1",
    name: str = "serve",
    http: bool = False,
) -> ServeProcess:
    """Launch `kvserve serve ARGS` on a free port in its own session and return at once
    (then `wait_serving`). The log goes to `log_dir`, or to a temporary file. `http`: serve
    the OpenAI-compatible HTTP API too, on a second free port (else `--http-port 0`)."""
    port, http_port = free_ports(2, host)
    if log_dir is None:
        handle, path = tempfile.mkstemp(prefix=f"kvserve-{name}-", suffix=".log")
        os.close(handle)
        log_path = Path(path)
    else:
        log_path = log_dir / f"{name}-{port}.log"
    env = {**os.environ, "KVSERVE_LOG_LEVEL": "INFO"}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                *python_module("kvserve", "serve", "--host", host, "--port", str(port)),
                *("--http-port", str(http_port if http else 0)),
                *args,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    target_host = "127.0.0.1" if host in ("0.0.0.0", "") else host  # a wildcard bind is reached via loopback
    return ServeProcess(
        process=process,
        port=port,
        log_path=log_path,
        target_host=target_host,
        name=name,
        http_port=http_port if http else None,
    )


@contextlib.contextmanager
def serving(
    args: Sequence[str],
    log_dir: Path | None = None,
    *,
    host: str = "127.0.0.1",
    name: str = "serve",
    timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    http: bool = False,
) -> Iterator[ServeProcess]:
    """A SERVING server for the length of a `with` block, stopped however the block ends (`http`: as in start_serve)."""
    server = start_serve(args, log_dir, host=host, name=name, http=http)
    try:
        server.wait_serving(timeout_s)
        yield server
    finally:
        server.stop()
