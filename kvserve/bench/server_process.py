"""Start and stop a `kvserve serve` subprocess for `bench serve --start-server`.

The server runs in its own process group on a free loopback port, its output goes to a
log file, and `stop()` (or leaving the `with` block, or an exception) always terminates
the whole group, so a failed benchmark never leaves servers behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
_LOG_TAIL_CHARS = 4000


class ServerStartError(RuntimeError):
    """The server exited or did not report SERVING in time; the message holds its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `kvserve serve` child process; `target` is "host:port" for the clients."""

    def __init__(self, *, executor: str = "fake", host: str = "127.0.0.1", port: int | None = None,
                 extra_args: Sequence[str] = (), name: str = "kvserve") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.name = name
        self.args = [sys.executable, "-m", "kvserve", "serve", "--host", host, "--port", str(self.port),
                     "--executor", executor, *extra_args]
        self.log_path = Path(tempfile.mkstemp(prefix=f"kvserve-bench-{name}-", suffix=".log")[1])
        self._proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def start(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> "ServerProcess":
        """Launch the server and block until its health check says SERVING."""
        from clients.sync_client import Client

        log.info("starting server", name=self.name, command=" ".join(self.args[1:]), log=str(self.log_path))
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            with Client(self.target, timeout_s=5.0) as client:
                while True:
                    if self._proc.poll() is not None:
                        raise ServerStartError(f"{self.name} exited with code {self._proc.returncode}:\n"
                                               f"{self.log_tail()}")
                    try:
                        if client.health() == "SERVING":
                            break
                    except Exception:  # not listening yet
                        pass
                    if time.monotonic() > deadline:
                        raise ServerStartError(f"{self.name} not SERVING after {timeout_s:.0f}s:\n{self.log_tail()}")
                    time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        log.info("server ready", name=self.name, target=self.target)
        return self

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it after a grace period."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:  # the group may outlive its leader (the executor child), so signal it regardless
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            proc.wait()
            return
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
