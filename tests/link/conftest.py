"""Fixtures for the executor-link tests: short ipc paths and fake-executor subprocesses
that are always killed, even when a test fails half-way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def link_endpoint() -> Iterator[str]:
    """A fresh ipc endpoint in a private directory (unix socket paths must stay short)."""
    directory = tempfile.mkdtemp(prefix="kvl-")
    try:
        yield f"ipc://{directory}/link.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class ExecutorProcesses:
    """Starts `kvserve executor` children (fake by default) and reaps every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, endpoint: str, *extra: str, kind: str = "fake", num_blocks: int = 64) -> subprocess.Popen:
        argv = [sys.executable, "-m", "kvserve", "executor", "--executor", kind, "--link", endpoint, *extra]
        if kind == "fake":
            argv += ["--num-blocks", str(num_blocks)]
        with open(self.log_dir / f"executor-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KVSERVE_LOG_LEVEL": "DEBUG"},
            )
        self.procs.append(proc)
        return proc

    def log_of(self, proc: subprocess.Popen) -> str:
        return (self.log_dir / f"executor-{self.procs.index(proc)}.log").read_text(errors="replace")

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.kill()  # SIGKILL also ends a SIGSTOPped child
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)


@pytest.fixture
def executors(tmp_path: Path) -> Iterator[ExecutorProcesses]:
    procs = ExecutorProcesses(tmp_path)
    try:
        yield procs
    finally:
        procs.cleanup()
