"""A stage that overruns its budget is killed with the servers it started, and its checks say why.

Real processes stand in for a hung stage and for a server it started in a session of its own.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from kvserve.gpu_check.stage import _finish, _missing, _pgids
from kvserve.gpu_check.stages import CHECKS
from kvserve.testing.server_launcher import pid_alive


def test_an_overrunning_stage_and_its_servers_are_killed(tmp_path: Path) -> None:
    stage = subprocess.Popen(["sleep", "60"], start_new_session=True)
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    _pgids(tmp_path, "serve").write_text(f"{server.pid}\n")
    started = time.monotonic()
    name, why = _finish("serve", stage, time.time() + 0.5, tmp_path)
    assert name == "serve" and "ran past its budget and was killed" in why
    assert time.monotonic() - started < 10
    assert stage.poll() is not None and server.wait(timeout=10) is not None and not pid_alive(server.pid)
    check = next(c for c in CHECKS if c.stage == "serve")
    result = _missing(check, why, tmp_path)
    assert result.status == "FAIL" and result.error == why and result.time_limit_s > 0
    assert (tmp_path / "results" / f"{check.name}.json").is_file()


def test_a_stage_that_exits_early_leaves_its_checks_failed_with_the_exit_code(tmp_path: Path) -> None:
    stage = subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    assert _finish("measure", stage, time.time() + 30, tmp_path)[1] == (
        "no result: stage measure exited with 3 before this check reported"
    )
