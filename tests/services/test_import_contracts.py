"""The import contracts can fail: each one, copied verbatim from pyproject.toml, breaks on a fixture
package that violates it and holds on the same fixture without the violation.

The fixture is a miniature `kvserve` tree with just the modules the contracts name; a contract
that stayed KEPT on its violation would be no contract.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = {
    "allowlist": "The scheduling core imports only the standard library (less I/O and concurrency), the contract, "
    "the shared config and structlog",
    "no-tests": "The product never imports the tests",
    "fake-no-torch": "The fake executor never loads torch (a test process runs it in a fraction of a second)",
    "apis-independent": "The HTTP and gRPC APIs stand on the engine, not on each other",
    "core-public-api": "The service reaches the scheduling core only through its public API "
    "(kvserve.scheduler.core.__all__)",
    "server-layers": "The scheduler service's rooms stand in layers: the service on the APIs, the APIs on the engine, "
    "the engine on its parts",
    "security-alone": "Tenancy and security stand alone: no other room of the service, "
    "no I/O beyond grpc's credentials",
    "observability-records": "Observability records what it is given: "
    "it never reaches the engine, the APIs or the link",
}
VIOLATIONS = {
    "allowlist": ("kvserve/scheduler/core/clock.py", "import asyncio\n"),
    "no-tests": ("kvserve/bench/helper.py", "import tests.helpers\n"),
    "fake-no-torch": ("kvserve/executor/fake/executor.py", "from kvserve.executor.model import llama\n"),
    "apis-independent": (
        "kvserve/scheduler/server/http/routes.py",
        "from kvserve.scheduler.server.grpc_api import api_server\n",
    ),
    "core-public-api": (
        "kvserve/scheduler/server/engine.py",
        "from kvserve.scheduler.core.scheduler import Scheduler\n",
    ),
    "server-layers": (
        "kvserve/scheduler/server/intake/request_parsing.py",
        "from kvserve.scheduler.server import engine\n",
    ),
    "security-alone": ("kvserve/scheduler/server/security/auth.py", "import threading\n"),
    "observability-records": (
        "kvserve/scheduler/server/observability/metrics.py",
        "from kvserve.scheduler.server.executor_link import connection\n",
    ),
}
# fmt: off
MODULES = {
    "kvserve/scheduler/core/__init__.py": "from kvserve.scheduler.core.scheduler import Scheduler\n",
    "kvserve/scheduler/core/scheduler.py": (
        "import bisect\nimport structlog\nfrom kvserve.protos import step\nScheduler = 1\n"
    ),
    "kvserve/scheduler/core/clock.py": "import time\n",
    "kvserve/scheduler/server/engine.py": "from kvserve.scheduler.core import Scheduler\n",
    "kvserve/scheduler/server/grpc_api/api_server.py": "from kvserve.scheduler.server import engine\n",
    "kvserve/scheduler/server/http/routes.py": "from kvserve.scheduler.server import engine\n",
    "kvserve/scheduler/server/service.py": "from kvserve.scheduler.server.http import routes\n",
    "kvserve/scheduler/server/engine_view/hub.py": "from kvserve.scheduler.server import serving_model\n",
    "kvserve/scheduler/server/serving_model.py": "from kvserve.scheduler.server import adapter_catalog\n",
    "kvserve/scheduler/server/adapter_catalog.py": "from kvserve.scheduler.server import engine\n",
    "kvserve/scheduler/server/engine_status.py": "import enum\n",
    "kvserve/scheduler/server/queue_admission.py": "",
    "kvserve/scheduler/server/delivery/request_stream.py": (
        "from kvserve.scheduler.server.observability import metrics\n"
    ),
    "kvserve/scheduler/server/executor_link/connection.py": "import zmq\n",
    "kvserve/scheduler/server/observability/metrics.py": (
        "import prometheus_client\nfrom kvserve.config import defaults\n"
    ),
    "kvserve/scheduler/server/server_config.py": "from kvserve.scheduler.server.intake import request_parsing\n",
    "kvserve/scheduler/server/intake/request_parsing.py": "from kvserve.scheduler.server.tools import tool_use\n",
    "kvserve/scheduler/server/tools/tool_use.py": "from kvserve.scheduler.server.structured import spec\n",
    "kvserve/scheduler/server/structured/spec.py": "",
    "kvserve/scheduler/server/security/auth.py": "import hmac\nimport grpc\nfrom kvserve.config import defaults\n",
    "kvserve/protos/step.py": "",
    "kvserve/executor/fake/executor.py": "from kvserve.executor.weights import model_store\n",
    "kvserve/executor/model/llama.py": "import torch\n",
    "kvserve/executor/weights/model_store.py": "def convert():\n    import torch\n    import transformers\n",
    "kvserve/bench/helper.py": "import json\n",
    "kvserve/kernels/cpu_ops.py": "",
    "kvserve/config/defaults.py": "",
    "tests/helpers.py": "",
}
# fmt: on


def _fixture(root: Path, violate: bool) -> None:
    files = dict(MODULES)
    if violate:
        for path, code in VIOLATIONS.values():
            files[path] += code
    for path, code in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)
        for folder in target.relative_to(root).parents:
            if str(folder) != ".":
                (root / folder / "__init__.py").touch(exist_ok=True)
    testing = root / "kvserve" / "testing"
    testing.mkdir(exist_ok=True)
    (testing / "__init__.py").touch()
    (testing / "import_contracts.py").write_text((REPO / "kvserve/testing/import_contracts.py").read_text())
    ours = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    chosen = [c for c in ours["contracts"] if c["name"] in CONTRACTS.values()]
    assert len(chosen) == len(CONTRACTS), "a contract this test names is gone from pyproject.toml"
    lines = [
        "[tool.importlinter]",
        'root_packages = ["kvserve"]',
        "include_external_packages = true",
        f"contract_types = {_toml(ours['contract_types'])}",
    ]
    for contract in chosen:
        lines += [
            "",
            "[[tool.importlinter.contracts]]",
            *(f"{key} = {_toml(value)}" for key, value in contract.items()),
        ]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")


def _toml(value: object) -> str:
    """A TOML value of the kinds the contracts use: strings, booleans and lists of strings."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lint(root: Path) -> str:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return " ".join((out.stdout + out.stderr).split())  # contract names wrap across lines


@pytest.mark.parametrize("violate", [False, True], ids=["clean", "violated"])
def test_each_contract_holds_on_the_clean_fixture_and_breaks_on_its_violation(tmp_path, violate) -> None:
    _fixture(tmp_path, violate)
    report = _lint(tmp_path)
    for key, name in CONTRACTS.items():
        verdict = "BROKEN" if violate else "KEPT"
        assert f"{name} {verdict}" in report, f"{key}: expected {verdict}\n{report[-3000:]}"
