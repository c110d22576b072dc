"""`pip install .` (a wheel, not editable) into a fresh environment works away from the checkout.

The wheel merges the package's portions (kvserve/, protos/kvserve/, scheduler_svc/kvserve/, ...)
into one `kvserve` folder; installed into a new venv whose only view of the repository is that
wheel, `kvserve serve` (the fake executor and the default model), `kvserve generate` and
`scripts/gpu_check.sh OUT --dry-run` must all work, and nothing may import `tests` or a folder by
its own name. Dependencies come from this
environment's site-packages through a .pth line, so nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvserve.testing.ports import free_ports
from kvserve.testing.server_launcher import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
FOLDER_NAMES = ("protos", "scheduler_svc", "executor_svc", "kernels", "clients", "tests")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the kvserve wheel installed (no deps: they are this environment's)."""
    root = tmp_path_factory.mktemp("installed")
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("kvserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvserve/protos/kvserve/v1/api.proto" in names and "kvserve/kernels/cpu/paged_attention.cpp" in names
    assert not [n for n in names if n.split("/")[0] in FOLDER_NAMES], "a folder installed under its own name"
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    return venv


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"KVSERVE_LOG_LEVEL": "WARNING"}


def test_the_wheel_imports_from_its_own_install_and_never_the_checkout(installed, tmp_path) -> None:
    code = (
        "import importlib, pkgutil, sys, kvserve, kvserve.cli\n"
        "for m in pkgutil.walk_packages(kvserve.__path__, 'kvserve.'):\n"
        "    if '.gpu_check' not in m.name and not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        f"print(kvserve.cli.__file__, sorted({{m.split('.')[0] for m in sys.modules}} & set({FOLDER_NAMES!r})))\n"
    )
    out = subprocess.run(
        [str(installed / "bin" / "python"), "-c", code],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    where, folders = out.stdout.split(" ", 1)
    assert where.startswith(str(installed)) and folders.strip() == "[]", out.stdout


@pytest.mark.parametrize("executor", [["--executor", "fake"], []], ids=["fake", "default-model"])
def test_installed_serve_and_generate_answer(installed, tmp_path, executor: list[str]) -> None:
    (port,) = free_ports(1)
    bin_dir = installed / "bin"
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(bin_dir / "kvserve"), "serve", *executor, "--port", str(port), "--http-port", "0"],
            cwd=tmp_path,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServeProcess(process=process, port=port, log_path=log_path, target_host="127.0.0.1", name="installed")
    try:
        server.wait_serving()
        answer = subprocess.run(
            [str(bin_dir / "kvserve"), "generate", "Hello", "--port", str(port), "--max-tokens", "8", "--json"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert answer.returncode == 0, answer.stderr
        assert '"finish_reason"' in answer.stdout
    finally:
        server.stop()
    assert "Traceback" not in server.log_text()


def test_installed_gpu_check_dry_run(installed, tmp_path) -> None:
    """The script from a folder holding only scripts/: the installed package is the only kvserve in reach."""
    scripts = tmp_path / "alone" / "scripts"
    shutil.copytree(REPO / "scripts", scripts)
    out = subprocess.run(
        ["bash", str(scripts / "gpu_check.sh"), str(tmp_path / "out"), "--dry-run"],
        cwd=tmp_path,
        env=_env() | {"PYTHON": str(installed / "bin" / "python")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert (tmp_path / "out" / "report.json").is_file()
