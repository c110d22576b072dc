"""Every module has one name, the same in a checkout and an installed wheel, and shadows nothing.

Each top-level folder holds its part of the `kvserve` package under its import path
(`scheduler_svc/kvserve/scheduler/...`), so none of the folders is a package by its bare name: a
Python started in the checkout's root still imports installed packages such as Hugging Face's
`kernels` (which transformers imports), with no `-P` or `sys.path` edits anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import kvserve.kernels
import kvserve.scheduler.core.step_builder

REPO_ROOT = Path(__file__).resolve().parents[2]
PORTIONS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"][
    "dev-mode-dirs"
]


def test_a_module_file_sits_at_its_import_path() -> None:
    module = kvserve.scheduler.core.step_builder
    assert Path(module.__file__ or "").resolve() == REPO_ROOT / "scheduler_svc/kvserve/scheduler/core/step_builder.py"
    assert Path(kvserve.kernels.__file__ or "").resolve() == REPO_ROOT / "kernels/kvserve/kernels/__init__.py"


def test_no_top_level_folder_is_a_package_by_its_bare_name() -> None:
    folders = [REPO_ROOT / name for name in PORTIONS if name != "."]
    assert folders and all(folder.is_dir() for folder in folders)
    assert [f.name for f in folders if (f / "__init__.py").exists()] == []
    assert not (REPO_ROOT / "kvserve" / "__init__.py").exists(), "kvserve is a namespace of the folders' portions"


def test_a_python_started_in_the_checkout_root_is_not_shadowed_by_its_folders() -> None:
    """`python -c` puts the working directory first on sys.path; no folder there may win an import."""
    probe = (
        "import importlib.util as u\n"
        "for name in ('kernels', 'protos', 'clients', 'scheduler_svc', 'executor_svc'):\n"
        "    s = u.find_spec(name)\n"
        "    print(name, s.origin if s and s.origin else '-')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    origins = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert len(origins) == 5
    for name, origin in origins.items():
        assert origin == "-" or not Path(origin).resolve().is_relative_to(REPO_ROOT / name), (name, origin)
    assert origins["kernels"].endswith("site-packages/kernels/__init__.py")  # Hugging Face's, from transformers


def test_the_tree_tracks_no_symlinks() -> None:
    done = subprocess.run(["git", "ls-files", "-s"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return  # not a git checkout (an sdist): nothing tracked
    links = [line.split("\t", 1)[1] for line in done.stdout.splitlines() if line.startswith("120000 ")]
    assert links == []
