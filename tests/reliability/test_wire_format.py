"""No pickle anywhere near the wire: the services and their shared code never import a
pickle-like serializer nor use pyzmq's pickling helpers (send_pyobj / recv_pyobj)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler_svc", "executor_svc", "protos", "clients", "kernels", "kvserve")
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
            found.append(f".{node.attr}")
    return [f"{path}: {v}" for v in found]


def test_no_pickle_in_any_service_module() -> None:
    files = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    assert len(files) > 30  # the scan really covers the code base
    violations = [v for path in files for v in _violations(path)]
    assert violations == []


def test_the_scan_catches_what_it_forbids(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import pickle\nfrom dill import dumps\nsock.send_pyobj(x)\nimport json\n")
    assert len(_violations(sample)) == 3
