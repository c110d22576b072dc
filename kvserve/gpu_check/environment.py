"""The environment check: fail fast, and name why, on what would make every later check fail for a
boring reason (no CUDA, a wheel missing from the list, a grpcio/protobuf older than the generated code
accepts, a glibc older than a wheel needs). Its figures (GPU, driver, versions) head the report.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from kvserve.gpu_check.report import Outcome
from kvserve.gpu_check.wheel_list import check_folder, read_list

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

REQUIRED_IMPORTS = """torch triton transformers tokenizers safetensors numpy grpc grpc_health.v1.health_pb2
grpc_reflection google.protobuf zmq structlog fastapi uvicorn pydantic llguidance prometheus_client jinja2 gguf
tqdm pytest hypothesis openai httpx yaml kvserve.protos.kvserve.v1.api_pb2_grpc kvserve.scheduler.server.service
kvserve.executor.model_runner"""
"""The generated gRPC code checks the grpcio and protobuf it runs on when it is imported."""
MINIMUM_VERSIONS = {"torch": "2.4", "transformers": "4.46", "tokenizers": "0.19", "safetensors": "0.4"}
"""pyproject.toml's lower bounds for what the image, not the wheels, provides."""


def generated_minimums() -> dict[str, str]:
    """The grpcio and protobuf versions kvserve.protos was generated with (their runtimes refuse older)."""
    found = {}
    for module, dist, pattern in (
        ("api_pb2_grpc", "grpcio", r"GRPC_GENERATED_VERSION = '([^']+)'"),
        ("api_pb2", "protobuf", r"Protobuf Python Version: (\S+)"),
    ):
        spec = importlib.util.find_spec(f"kvserve.protos.kvserve.v1.{module}")
        match = re.search(pattern, Path(spec.origin).read_text()) if spec and spec.origin else None
        found.update({dist: match[1]} if match else {})
    return found


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def facts() -> dict[str, Any]:
    """Versions and the device, each looked up on its own so one failure does not hide the rest."""
    found: dict[str, Any] = {"python": platform.python_version(), "glibc": "-".join(platform.libc_ver())}
    found |= {"cpu_count": os.cpu_count()} | {n: _version(n) for n in ["torch", "triton", "transformers", "tokenizers"]}
    found |= {n: _version(n) for n in ("safetensors", "grpcio", "protobuf", "numpy")}
    try:
        import torch

        found.update(cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            found.update(
                device_name=p.name, device_capability=f"{p.major}.{p.minor}", device_count=torch.cuda.device_count()
            )
            found.update(device_memory_gib=round(p.total_memory / 2**30, 1), device_sms=p.multi_processor_count)
    except Exception as exc:
        found["torch_error"] = f"{type(exc).__name__}: {exc}"
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
        found["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip() or None
    except (OSError, subprocess.SubprocessError):
        found["nvidia_smi"] = None
    for module in ("grpc", "google.protobuf", "zmq", "transformers", "torch"):
        try:
            found[f"{module}_from"] = str(Path(importlib.import_module(module).__file__ or "?").parent)
        except Exception as exc:
            found[f"{module}_from"] = f"not importable: {type(exc).__name__}: {exc}"
    return found


def check_environment(ctx: StageContext) -> Outcome:
    figures = facts()
    problems: list[str] = []
    if ctx.sizes.device == "cuda" and not figures.get("cuda_available"):
        problems.append("torch.cuda.is_available() is false")
    for module in REQUIRED_IMPORTS.split():
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {type(exc).__name__}: {str(exc)[:200]}")
    for name, minimum in {**MINIMUM_VERSIONS, **generated_minimums()}.items():
        have = _version(name)
        if have is None or Version(have) < Version(minimum):
            problems.append(f"{name} {have} is older than the {minimum} kvserve needs")
    needed = figures["glibc_needed_by_wheels"] = check_folder(ctx.wheels_dir, read_list()).glibc_needed
    if needed and Version(platform.libc_ver()[1] or "0") < Version(needed):
        problems.append(f"glibc {platform.libc_ver()[1]} is older than the {needed} a carried wheel needs")
    figures["problems"] = problems
    summary = f"{figures.get('device_name') or 'no CUDA device'}, " + ", ".join(
        f"{k} {figures.get(k)}" for k in ("torch", "triton", "transformers", "cuda")
    )
    summary += f"; {len(problems)} problem(s): {problems[0]}" if problems else ""
    return Outcome(not problems, summary, figures, error="\n".join(problems) or None)
