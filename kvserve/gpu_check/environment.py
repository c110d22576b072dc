"""The environment check: what the GPU image really is, and whether kvserve can run on it.

It fails fast on what would make every later check fail for a boring reason: no CUDA, an
import that does not resolve (a wheel missing from the list), a grpcio/protobuf older than the
generated code in protos/ accepts, a glibc older than a carried wheel needs. Its figures (GPU,
driver, versions, where grpc and protobuf were imported from) head the report.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.results import Outcome
from kvserve.gpu_check.wheel_list import check_folder, read_list

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

REQUIRED_IMPORTS = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "grpc",
    "grpc_health.v1.health_pb2",
    "grpc_reflection",
    "google.protobuf",
    "zmq",
    "structlog",
    "fastapi",
    "uvicorn",
    "pydantic",
    "llguidance",
    "prometheus_client",
    "jinja2",
    "gguf",
    "tqdm",
    "pytest",
    "hypothesis",
    "openai",
    "httpx",
    "yaml",
    "kvserve.protos.kvserve.v1.api_pb2_grpc",  # the generated code checks the grpcio and protobuf it runs on
    "kvserve.scheduler.server.service",
    "kvserve.executor.model_runner",
)
MINIMUM_VERSIONS = {"torch": "2.4", "transformers": "4.46", "tokenizers": "0.19", "safetensors": "0.4"}
"""pyproject.toml's lower bounds for what the image, not the wheels, provides."""


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+", maxsplit=1)[0])[:3])


def generated_minimums(repo: Path) -> dict[str, str]:
    """The grpcio and protobuf versions protos/ was generated with (their runtimes refuse older)."""
    grpc_src = (repo / "protos/kvserve/v1/api_pb2_grpc.py").read_text()
    pb_src = (repo / "protos/kvserve/v1/api_pb2.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_src)
    pb_version = re.search(r"Protobuf Python Version: (\S+)", pb_src)
    found = {}
    if grpc_version:
        found["grpcio"] = grpc_version.group(1)
    if pb_version:
        found["protobuf"] = pb_version.group(1)
    return found


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or out.stderr.strip() or None


def facts() -> dict[str, Any]:
    """Versions and the device, each looked up on its own so one failure does not hide the rest."""
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "glibc": "-".join(platform.libc_ver()),
        "cpu_count": os.cpu_count(),
    }
    for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "grpcio", "protobuf", "numpy"):
        found[name] = _distribution_version(name)
    try:
        import torch

        found["cuda"] = torch.version.cuda
        found["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            found["device_name"] = props.name
            found["device_capability"] = f"{props.major}.{props.minor}"
            found["device_memory_gib"] = round(props.total_memory / 2**30, 1)
            found["device_sms"] = props.multi_processor_count
    except Exception as exc:
        found["torch_error"] = f"{type(exc).__name__}: {exc}"
    found["nvidia_smi"] = _nvidia_smi()
    for module in ("grpc", "google.protobuf", "zmq", "transformers", "torch"):
        try:
            found[f"{module}_from"] = str(Path(importlib.import_module(module).__file__ or "?").parent)
        except Exception as exc:
            found[f"{module}_from"] = f"not importable: {type(exc).__name__}: {exc}"
    return found


def check_environment(ctx: CheckContext) -> Outcome:
    figures = facts()
    problems: list[str] = []
    if ctx.scale.device == "cuda" and not figures.get("cuda_available"):
        problems.append("torch.cuda.is_available() is false")
    for module in REQUIRED_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {type(exc).__name__}: {str(exc)[:200]}")
    for name, minimum in {**MINIMUM_VERSIONS, **generated_minimums(ctx.repo)}.items():
        have = _distribution_version(name)
        if have is None or version_tuple(have) < version_tuple(minimum):
            problems.append(f"{name} {have} is older than the {minimum} kvserve needs")
    needed = check_folder(ctx.wheels_dir, read_list()).glibc
    have_glibc = version_tuple(platform.libc_ver()[1] or "0")
    figures["glibc_needed_by_wheels"] = None if needed is None else ".".join(map(str, needed))
    if needed is not None and have_glibc < needed:
        problems.append(f"glibc {platform.libc_ver()[1]} is older than the {needed} a carried wheel needs")
    figures["problems"] = problems
    device = figures.get("device_name") or "no CUDA device"
    summary = (
        f"{device}, torch {figures.get('torch')}, triton {figures.get('triton')}, "
        f"transformers {figures.get('transformers')}, CUDA {figures.get('cuda')}"
    )
    if problems:
        summary += f"; {len(problems)} problem(s): {problems[0]}"
    return Outcome(not problems, summary, figures, error="\n".join(problems) or None)
