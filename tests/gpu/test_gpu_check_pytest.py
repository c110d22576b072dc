"""The pytest_cuda check's judgement: a skipped single-GPU test fails it, a skipped multi-GPU one does not;
runner_vs_hf_tiny judges test_tiny_models.py's cases of the same junit XML alone.

A tiny suite is run by pytest itself with the check's plugin, and its junit XML read as the check reads it.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

from kvserve.gpu_check.pytest_check import junit_outcomes, tiny_models_result
from kvserve.gpu_check.sizes import GPU

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


def test_the_tiny_model_check_reads_only_test_tiny_models_cases(tmp_path: Path) -> None:
    cases = {
        "tests.executor.test_tiny_models": [("test_logits[cuda-triton]", ""), ("test_logits[cuda-torch]", "")],
        "tests.kernels.test_kernels_cuda": [("test_decode", "<failure message='x'/>")],
    }
    rows = "".join(
        f"<testcase classname='{module}' name='{name}'>{body}</testcase>"
        for module, tests in cases.items()
        for name, body in tests
    )
    (tmp_path / "pytest_cuda.xml").write_text(f"<testsuites><testsuite>{rows}</testsuite></testsuites>")
    ctx = SimpleNamespace(out_dir=tmp_path, sizes=GPU)
    outcome = tiny_models_result(ctx)  # type: ignore[arg-type]
    assert outcome.passed and outcome.figures["passed"] == 2 and outcome.figures["failed"] == 0
    (tmp_path / "pytest_cuda.xml").write_text(
        f"<testsuites><testsuite>{rows}</testsuite></testsuites>".replace(
            "name='test_logits[cuda-torch]'></testcase>", "name='test_logits[cuda-torch]'><skipped/></testcase>"
        )
    )
    skipped = tiny_models_result(ctx)  # type: ignore[arg-type]
    assert not skipped.passed and skipped.error == "tests.executor.test_tiny_models::test_logits[cuda-torch]"
    (tmp_path / "pytest_cuda.xml").unlink()
    assert not tiny_models_result(ctx).passed  # type: ignore[arg-type]
