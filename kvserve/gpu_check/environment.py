"""The env stage: fail fast, naming why, on what would fail all later checks (no CUDA, a missing wheel, too old)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from packaging.version import Version

from kvserve.gpu_check.report import Outcome, StageContext
from kvserve.gpu_check.wheel_list import check_folder, read_list

# the generated gRPC code checks the grpcio and protobuf it runs on when it is imported
REQUIRED_IMPORTS = """torch triton transformers tokenizers safetensors numpy grpc grpc_health.v1.health_pb2
grpc_reflection google.protobuf zmq structlog fastapi uvicorn pydantic llguidance prometheus_client jinja2 gguf
tqdm pytest hypothesis openai httpx yaml kvserve.protos.kvserve.v1.api_pb2_grpc kvserve.scheduler.server.service
kvserve.executor.model_runner"""
IMPORTED_FROM = ("grpc", "google.protobuf", "zmq", "transformers", "torch")
VERSIONS = ("torch", "triton", "transformers", "tokenizers", "safetensors", "grpcio", "protobuf", "numpy")
# pyproject.toml's lower bounds for what the image, not the wheels, provides
MINIMUM_VERSIONS = {"torch": "2.4", "transformers": "4.46", "tokenizers": "0.19", "safetensors": "0.4"}
GENERATED_WITH = {
    "grpcio": ("api_pb2_grpc", r"GRPC_GENERATED_VERSION = '([^']+)'"),
    "protobuf": ("api_pb2", r"Protobuf Python Version: (\S+)"),
}
"""Where kvserve.protos' generated modules name the grpcio and protobuf they were made with (older ones refuse)."""


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_environment(ctx: StageContext) -> Outcome:
    # the versions and the device, each looked up on its own so one failure does not hide the rest
    figures: dict[str, Any] = {"python": platform.python_version(), "glibc": "-".join(platform.libc_ver())}
    figures |= {"cpu_count": os.cpu_count()} | {name: _version(name) for name in VERSIONS}
    try:
        import torch

        figures.update(cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            capability = f"{p.major}.{p.minor}"
            figures.update(device_name=p.name, device_capability=capability, device_sms=p.multi_processor_count)
            figures.update(device_count=torch.cuda.device_count(), device_memory_gib=round(p.total_memory / 2**30, 1))
    except Exception as exc:
        figures["torch_error"] = f"{type(exc).__name__}: {exc}"
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip() or None
    except (OSError, subprocess.SubprocessError):
        figures["nvidia_smi"] = None
    no_cuda = ctx.sizes.device == "cuda" and not figures.get("cuda_available")
    problems = ["torch.cuda.is_available() is false"] if no_cuda else []
    for module in REQUIRED_IMPORTS.split():  # and where the stack the wheels may shadow came from
        try:
            where = str(Path(importlib.import_module(module).__file__ or "?").parent)
        except Exception as exc:
            problems.append(f"import {module}: {type(exc).__name__}: {str(exc)[:200]}")
            where = f"not importable: {type(exc).__name__}: {exc}"
        figures |= {f"{module}_from": where} if module in IMPORTED_FROM else {}
    minimums = dict(MINIMUM_VERSIONS)
    for dist, (module, pattern) in GENERATED_WITH.items():
        spec = importlib.util.find_spec(f"kvserve.protos.kvserve.v1.{module}")
        match = re.search(pattern, Path(spec.origin).read_text()) if spec and spec.origin else None
        minimums |= {dist: match[1]} if match else {}
    for name, minimum in minimums.items():
        if (have := _version(name)) is None or Version(have) < Version(minimum):
            problems.append(f"{name} {have} is older than the {minimum} kvserve needs")
    needed = figures["glibc_needed_by_wheels"] = check_folder(ctx.wheels_dir, read_list()).glibc_needed
    if needed and Version(platform.libc_ver()[1] or "0") < Version(needed):
        problems.append(f"glibc {platform.libc_ver()[1]} is older than the {needed} a carried wheel needs")
    figures["problems"] = problems
    versions = ", ".join(f"{k} {figures.get(k)}" for k in ("torch", "triton", "transformers", "cuda"))
    summary = f"{figures.get('device_name') or 'no CUDA device'}, {versions}"
    summary += f"; {len(problems)} problem(s): {problems[0]}" if problems else ""
    return Outcome(not problems, summary, figures, error="\n".join(problems) or None)
