"""`python -m kvserve.protos.generate --check` guards the committed generated code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.protos import generate

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS = REPO_ROOT / "protos"


def test_committed_generated_code_is_fresh() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.protos.generate", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_proto_is_covered() -> None:
    protos = {str(p) for p in generate.proto_files()}
    assert {
        "kvserve/protos/kvserve/v1/api.proto",
        "kvserve/protos/kvserve/v1/executor_link.proto",
        "kvserve/protos/grpc/reflection/v1/reflection.proto",
    } <= protos
    for proto in generate.proto_files():
        for generated in generate.generated_names(proto):
            assert (PROTOS / generated).is_file(), f"{generated} is missing"


@pytest.fixture
def repo_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the package's .proto tree that the generator treats as its include root."""
    shutil.copytree(PROTOS / "kvserve", tmp_path / "kvserve", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(generate, "INCLUDE_ROOT", tmp_path)
    return tmp_path / "kvserve" / "protos"


def test_check_detects_a_stale_and_a_missing_file(repo_copy: Path) -> None:
    assert generate.stale_files() == []
    v1 = repo_copy / "kvserve" / "v1"
    (v1 / "executor_link.proto").write_text(
        (v1 / "executor_link.proto").read_text() + "\nmessage AddedLater { int64 x = 1; }\n"
    )
    (v1 / "executor_link_pb2_grpc.py").unlink()
    stale = {p.name for p in generate.stale_files()}
    assert stale == {"executor_link_pb2.py", "executor_link_pb2.pyi", "executor_link_pb2_grpc.py"}
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0
    assert generate.stale_files() == []


@pytest.mark.parametrize("folder", ["kvserve/v1", "grpc/other/v2"])
def test_a_new_proto_file_is_picked_up(repo_copy: Path, folder: str) -> None:
    """Anywhere in the package: a new file beside ours, or a new tree like kvserve/protos/grpc/."""
    where = repo_copy / folder
    where.mkdir(parents=True, exist_ok=True)
    package = folder.replace("/", ".")
    (where / "extra.proto").write_text(f'syntax = "proto3";\npackage {package};\nmessage Extra {{ string a = 1; }}\n')
    assert {p.name for p in generate.stale_files()} == {"extra_pb2.py", "extra_pb2.pyi", "extra_pb2_grpc.py"}
    generate.main([])
    assert (where / "extra_pb2.py").is_file() and generate.stale_files() == []


def test_version_stamps_alone_are_not_stale(repo_copy: Path) -> None:
    """A newer grpcio-tools on a fresh clone changes only version numbers: not stale."""
    grpc_file = repo_copy / "kvserve" / "v1" / "executor_link_pb2_grpc.py"
    pb2_file = repo_copy / "kvserve" / "v1" / "executor_link_pb2.py"
    text = grpc_file.read_text()
    assert "GRPC_GENERATED_VERSION = '" in text
    grpc_file.write_text(text.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9", 1))
    pb2_file.write_text(pb2_file.read_text().replace("# Protobuf Python Version: ", "# Protobuf Python Version: 9", 1))
    assert generate.stale_files() == []
    grpc_file.write_text(grpc_file.read_text() + "\n# hand edit\n")
    assert [p.name for p in generate.stale_files()] == ["executor_link_pb2_grpc.py"]
