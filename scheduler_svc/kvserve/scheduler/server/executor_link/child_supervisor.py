"""Run a child process and restart it, with a bounded back-off, when it dies.

`kvserve serve` is the scheduler process plus this supervisor of its executor, and
`kvserve serve --data-parallel-size N` supervises N whole replicas and the router with it
(`kvserve.replicas.replica_set`). The executor is started
with `python -m kvserve.executor ...` (never imported: the scheduler stays torch-free),
in its own process group so a terminal's Ctrl-C reaches only the scheduler, which then
stops it in order. The child learns our pid (`kvserve.config.defaults.EXECUTOR_PARENT_PID_ENV`) and
exits within a fraction of a second once its parent pid changes; on Linux it also gets PR_SET_PDEATHSIG. So even a
kill -9 of the scheduler leaves no orphan (and the executor's own scheduler-timeout covers the rest).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence

import structlog

from kvserve.child_python import python_module
from kvserve.config import defaults

log = structlog.get_logger(__name__)

_STABLE_AFTER_S = 30.0
"""A child that ran this long resets the restart backoff."""


def executor_command(args: Sequence[str]) -> list[str]:
    """The argv that starts an executor with the given `kvserve executor` options.

    `python -m kvserve.executor` parses exactly those flags without loading the kvserve CLI."""
    return python_module("kvserve.executor", *args)


class ChildSupervisor:
    """Start, watch, restart (with exponential backoff) and finally stop one child process.

    `name` prefixes its log events (`executor_started`, `replica_exited`, ...)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        restart: bool = True,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        stop_timeout_s: float = 10.0,
        env: dict[str, str] | None = None,
        name: str = "executor",
        log_fields: dict[str, object] | None = None,
    ) -> None:
        self.name = name
        self._log_fields = log_fields or {}
        self._argv = list(argv)
        self._restart = restart
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._stop_timeout_s = stop_timeout_s
        self._env = env
        self._process: asyncio.subprocess.Process | None = None
        self._watch_task: asyncio.Task | None = None
        self._stopping = False
        self.restarts = 0
        self.exits: asyncio.Queue[int] = asyncio.Queue()
        """Exit codes of every unexpected exit, for callers that care (start-up failure detection)."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.returncode is None else None

    async def start(self) -> None:
        await self._launch()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def _launch(self) -> None:
        env = {**(os.environ if self._env is None else self._env), defaults.EXECUTOR_PARENT_PID_ENV: str(os.getpid())}
        self._process = await asyncio.create_subprocess_exec(
            *with_parent_death_signal(self._argv), start_new_session=True, env=env
        )
        log.info(f"{self.name}_started", pid=self._process.pid, restarts=self.restarts, **self._log_fields)

    async def _watch(self) -> None:
        backoff = self._backoff_initial_s
        while not self._stopping:
            assert self._process is not None
            started = time.monotonic()
            code = await self._process.wait()
            if self._stopping:
                return
            self.exits.put_nowait(code)
            log.warning(
                f"{self.name}_exited", code=code, restarts=self.restarts, will_restart=self._restart, **self._log_fields
            )
            if not self._restart:
                return
            if time.monotonic() - started > _STABLE_AFTER_S:
                backoff = self._backoff_initial_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)
            if self._stopping:
                return
            self.restarts += 1
            await self._launch()

    def kill_if_current(self, pid: int | None) -> None:
        """SIGKILL child `pid` if it is still the running one (the link declared it lost, but it
        may be alive and hung); the watcher then restarts it. A child started since is spared."""
        process = self._process
        if (
            pid is not None
            and process is not None
            and process.pid == pid
            and process.returncode is None
            and not self._stopping
        ):
            log.warning(f"{self.name}_kill_lost", pid=pid, **self._log_fields)
            _signal_group(pid, signal.SIGKILL)

    async def stop(self) -> None:
        """SIGTERM the executor's process group, SIGKILL it after `stop_timeout_s`."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self._stop_timeout_s)
            except TimeoutError:
                log.warning(f"{self.name}_kill", pid=process.pid, **self._log_fields)
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except asyncio.CancelledError:
                pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; kept across execv\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the parent died before prctl took effect\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
"""Runs as the child itself, then execs the real command (same pid). A `preexec_fn` would do
the same in fewer steps, but running Python between fork and exec in a process with gRPC
threads can abort the child (gRPC's fork handlers), so the child sets its own death signal."""


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv` wrapped so that on Linux the child gets SIGTERM when this process dies."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
