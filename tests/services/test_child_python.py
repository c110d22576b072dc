"""Python children started from the checkout's root import installed packages, not its folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvserve.child_python import PYTHON, python_module

REPO_ROOT = Path(__file__).resolve().parents[2]
WHERE_KERNELS = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"


def kernels_origin(python: list[str] | tuple[str, ...]) -> str:
    done = subprocess.run([*python, "-c", WHERE_KERNELS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_bare_child_in_the_checkout_root_would_import_its_kernels_folder() -> None:
    """The hazard itself: without -P, `kernels` is the checkout's folder (so the next test can fail)."""
    assert Path(kernels_origin([sys.executable])).resolve() == REPO_ROOT / "kernels" / "__init__.py"


def test_kvserve_children_never_see_the_checkout_root() -> None:
    origin = kernels_origin(PYTHON)
    assert not origin or Path(origin).resolve() != REPO_ROOT / "kernels" / "__init__.py", origin


def test_python_module_runs_the_module_with_the_safe_path_flag() -> None:
    assert python_module("kvserve.executor", "--help") == [sys.executable, "-P", "-m", "kvserve.executor", "--help"]
