"""scripts/gpu_wheels.txt is the whole dependency closure the GPU run needs beyond the image.

The closure is walked from pyproject.toml's dependencies and test extra through the installed
distributions' metadata (Python 3.12 on Linux x86_64), stopping at what the image provides.
A new dependency (or a new dependency of a dependency) that is not listed fails here, before
a GPU run discovers it as an import error.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as normalize

from kvserve.gpu_check.wheel_list import glibc_needed, installable, parse_list, read_list

REPO = Path(__file__).resolve().parents[2]
IMAGE_PROVIDES = frozenset(
    {"torch", "triton", "transformers", "tokenizers", "huggingface-hub", "safetensors", "numpy", "pyyaml", "requests"}
)
"""What the GPU image brings (with their own dependencies): never shipped, never shadowed."""
NOT_NEEDED_ON_GPU = frozenset(
    {
        *("matplotlib", "accelerate", "grpcio-tools", "ruff", "mypy", "import-linter", "vulture", "hatchling"),
        *("playwright", "pillow", "vllm-router", "peft"),
    }
)
"""Declared by pyproject.toml but not imported by the GPU run: plots, unused, protoc, lint, the build
backend (the installed-wheel test builds the wheel; it is not `cuda`); peft (the LoRA tests' reference,
not `cuda`); the
browser tests' Playwright and Pillow (imported inside their fixtures and helpers, and those
tests are not `cuda`); vllm-router (a binary the router tests run)."""
GPU_PLATFORM = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def needed_on_gpu() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pending = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]]
    needed: set[str] = set()
    while pending:
        req = pending.pop()
        name = normalize(req.name)
        if name in needed or name in IMAGE_PROVIDES or name in NOT_NEEDED_ON_GPU:
            continue
        if req.marker is not None and not req.marker.evaluate(GPU_PLATFORM):
            continue
        needed.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: listed or not, its own dependencies cannot be walked
        pending += [r for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(GPU_PLATFORM)]
    return needed


def test_the_list_holds_the_whole_closure() -> None:
    listed = {r.name for r in read_list()}
    missing = needed_on_gpu() - listed
    assert not missing, f"add to scripts/gpu_wheels.txt (then run scripts/gpu_wheels.sh): {sorted(missing)}"


def test_nothing_the_image_provides_is_shipped() -> None:
    listed = {r.name for r in read_list()}
    assert not listed & IMAGE_PROVIDES, "shadowing the image's torch/transformers stack breaks its version pins"


def test_every_entry_is_pinned() -> None:
    assert all(r.version for r in read_list())


@pytest.mark.parametrize(
    "text, message",
    [("pyzmq==1\nPyZMQ==2\n", "listed twice"), ("pyzmq>=1\n", "expected NAME==VERSION"), ("# only\n", "no wheels")],
)
def test_malformed_lists_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_list(text)


@pytest.mark.parametrize(
    "filename, expected",
    [
        ("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", True),
        ("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", True),
        ("grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        ("structlog-26.1.0-py3-none-any.whl", True),
        ("grpcio-1.85.3-cp311-cp311-manylinux2014_x86_64.whl", False),
        ("grpcio-1.85.3-cp312-cp312-manylinux2014_aarch64.whl", False),
        ("grpcio-1.85.3-cp312-cp312-win_amd64.whl", False),
        ("grpcio-1.85.3-cp312-cp312-musllinux_1_1_x86_64.whl", False),
    ],
)
def test_wheel_tags_are_judged_for_cpython_312_on_manylinux_x86_64(filename: str, expected: bool) -> None:
    assert installable(filename) is expected


def test_the_glibc_a_wheel_needs_is_its_oldest_tag() -> None:
    assert glibc_needed("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl") == (2, 26)
    assert glibc_needed("grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl") == (2, 17)
    assert glibc_needed("structlog-26.1.0-py3-none-any.whl") is None
