"""The pytest_cuda check's judgement: a skipped single-GPU test fails it, a skipped multi-GPU one does not.

A tiny suite is run by pytest itself with the check's plugin, and its junit XML read as the check reads it.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from kvserve.gpu_check.pytest_check import junit_outcomes

SUITE = """
import pytest

@pytest.mark.cuda
def test_runs():
    pass

@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_two_gpus():
    pytest.skip("needs two CUDA GPUs")

@pytest.mark.cuda
def test_one_gpu():
    pytest.skip("needs CUDA")
"""


def test_multi_gpu_skips_are_told_apart_from_single_gpu_skips(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    junit = tmp_path / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "kvserve.gpu_check.pytest_check", f"--junitxml={junit}"]
    done = subprocess.run([*command, "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True)
    assert done.returncode == 0, done.stdout
    found = junit_outcomes(ET.parse(junit).getroot())
    assert [name.split("::")[-1] for name in found["passed"]] == ["test_runs"]
    assert [name.split("::")[-1] for name in found["skipped_multi_gpu"]] == ["test_two_gpus"]
    assert [name.split("::")[-1] for name in found["skipped"]] == ["test_one_gpu"]
    assert found["failed"] == []
