"""Rank 0 starts the other ranks of a one-host group, watches them, and ends the group when one dies.

Each rank is `python -m kvserve.executor` with the same model flags and its place in the environment
(`kvserve.executor.tensor_parallel.config`). A rank that exits while the group runs ends the whole group
at once: rank 0 kills the others and exits with `ExitReason.RANK_LOST`, and the supervisor above it
(`kvserve serve`) restarts the group, which the scheduler re-syncs like any new executor. The ranks
know rank 0's pid and exit within a fraction of a second once it is gone (the parent-pid contract of
`kvserve.config.defaults.EXECUTOR_PARENT_PID_ENV`), so none outlives the group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence

import structlog

from kvserve.child_python import python_module
from kvserve.config import defaults
from kvserve.config.flags import config_to_argv
from kvserve.executor.link_worker import ExitReason
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.tensor_parallel.config import SPAWNED_ENV, RankPlace, TensorParallelConfig

log = structlog.get_logger(__name__)

WATCH_INTERVAL_S = 0.1
STOP_TIMEOUT_S = 5.0
"""How long the ranks get to leave after the end-of-group message before they are killed."""


def local_leader_place(size: int) -> RankPlace:
    """Rank 0 of a group on this host, its rendezvous on a free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return RankPlace(0, size, 0, size, "127.0.0.1", port, launched_by_leader=False)


class LocalRanks:
    """Ranks 1 … N−1 of a group whose rank 0 is this process."""

    def __init__(self, leader: RankPlace, argv: Sequence[str], broadcast_timeout_s: float) -> None:
        self.leader = leader
        self.argv = python_module("kvserve.executor", *argv)
        self.processes: dict[int, subprocess.Popen] = {}
        self.broadcast_timeout_s = broadcast_timeout_s
        self.sending_since: float | None = None
        """When rank 0 began the broadcast in progress (monotonic), None between broadcasts. gloo's root
        waits for every rank to take the message, and the control group's timeout is long (followers idle
        on it), so a rank that hung between steps would hold rank 0 there: this watch bounds it instead."""
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True)

    def start(self) -> None:
        for rank in range(1, self.leader.world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.leader.world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.leader.world_size),
                "MASTER_ADDR": self.leader.master_addr,
                "MASTER_PORT": str(self.leader.master_port),
                SPAWNED_ENV: "1",
                defaults.EXECUTOR_PARENT_PID_ENV: str(os.getpid()),
            }
            # Its own session: a signal to rank 0's process group (Ctrl-C, the supervisor's SIGTERM) reaches
            # rank 0 alone, which then ends the group in order; the ranks follow rank 0 by its pid.
            process = subprocess.Popen(self.argv, env=env, start_new_session=True)
            self.processes[rank] = process
            log.info("tensor-parallel rank started", rank=rank, pid=process.pid)
        self._watcher.start()

    def expect_exit(self) -> None:
        """The ranks are about to be told to leave: their exits no longer end the group."""
        self._stopping = True

    def stop(self) -> None:
        """After the end-of-group message: wait for the ranks to leave, kill the ones that do not."""
        self._stopping = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for rank, process in self.processes.items():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank did not leave; killing it", rank=rank, pid=process.pid)
                process.kill()
                process.wait()

    def kill_all(self) -> None:
        self._stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)

    def end_group(self, reason: str, **details: object) -> None:
        """A rank is gone or stuck: kill every other rank and end this process (the supervisor restarts us)."""
        log.error("tensor-parallel group lost; ending it for a restart", reason=reason, **details)
        self.kill_all()
        os._exit(int(ExitReason.RANK_LOST))

    def _watch(self) -> None:
        """Until every rank is gone once the group ends: a rank's exit ends a running group, and a
        broadcast no rank takes ends it too (or, at the end of the group, gets its ranks killed)."""
        while True:
            if self._stopping:
                if all(process.poll() is not None for process in self.processes.values()):
                    return
            else:
                for rank, process in self.processes.items():
                    code = process.poll()
                    if code is not None and not self._stopping:
                        self.end_group("a rank exited", rank=rank, pid=process.pid, code=code)
            since = self.sending_since
            if since is not None and time.monotonic() - since > self.broadcast_timeout_s:
                if self._stopping:  # the end-of-group message: killing the ranks fails it, and close() goes on
                    log.warning("a rank did not take the end-of-group message; killing the ranks")
                    self.kill_all()
                else:
                    waited = round(time.monotonic() - since, 2)
                    self.end_group("a rank did not take the plan broadcast", waited_s=waited)
            time.sleep(WATCH_INTERVAL_S)


def follower_argv(runner: RunnerConfig, parallel: TensorParallelConfig) -> list[str]:
    """The command line of ranks 1 … N−1: the same model flags; their place comes in the environment."""
    return ["--executor", "torch", *config_to_argv(runner), *config_to_argv(parallel)]
