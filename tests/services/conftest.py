"""Start `kvserve serve` as a real subprocess on free loopback ports, and always clean it up."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.kvserve.v1 import api_pb2, api_pb2_grpc

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServeProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, timeout_s: float = 2.0) -> int | None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=timeout_s).status
            except grpc.RpcError:
                return None

    def stats(self) -> api_pb2.ServerStatsResponse:
        with grpc.insecure_channel(self.address) as channel:
            return api_pb2_grpc.KVServeStub(channel).ServerStats(api_pb2.ServerStatsRequest(), timeout=5)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"kvserve serve exited with {self.process.returncode}:\n{self.log_text()[-4000:]}")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
        raise AssertionError(f"kvserve serve not SERVING after {timeout_s}s:\n{self.log_text()[-4000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain), then SIGKILL the whole process group if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def start_serve(args: list[str], tmp_dir: Path) -> ServeProcess:
    port = free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    env = {**os.environ, "KVSERVE_LOG_LEVEL": os.environ.get("KVSERVE_LOG_LEVEL", "INFO")}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return ServeProcess(process=process, port=port, log_path=log_path)


@pytest.fixture
def serve_factory() -> Iterator:
    """Start servers with given args; every one is stopped (and its group killed) at teardown."""
    started: list[ServeProcess] = []
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-test-"))

    def start(args: list[str], *, wait: bool = True) -> ServeProcess:
        server = start_serve(args, tmp_dir)
        started.append(server)
        if wait:
            server.wait_serving()
        return server

    yield start
    for server in started:
        _stop_group(server)
    shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ServeProcess]:
    """One fake-executor server shared by a module's tests (fast: no model)."""
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-test-"))
    server = start_serve(["--executor", "fake", "--num-blocks", "4096", "--step-latency-ms", "2"], tmp_dir)
    try:
        server.wait_serving()
        yield server
    finally:
        _stop_group(server)
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _stop_group(server: ServeProcess) -> None:
    """Drain-stop the server, then SIGKILL its process group. The executor runs in a group of its
    own but dies with its parent (PR_SET_PDEATHSIG), so nothing is left either way."""
    server.stop()
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
