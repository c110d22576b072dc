"""The `meta` of a `bench serve` report: what ran, where, on what, so a figure can be reproduced."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
from dataclasses import asdict
from typing import Any

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The vector and matrix extensions that decide CPU GEMM speed, reported when present."""


def _cpuinfo_field(lines: list[str], name: str) -> str | None:
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == name), None)


def _machine() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    flags = set((_cpuinfo_field(lines, "flags") or "").split())
    return {
        "platform": platform.platform(),
        "cpu": _cpuinfo_field(lines, "model name") or platform.processor(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }  # other work on the machine skews every figure


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("kvserve", "torch", "transformers", "grpcio"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def run_meta(config: Any, started: dt.datetime, info: dict, **extra: Any) -> dict[str, Any]:
    """The report's meta: when, how invoked (`config`, a BenchConfig), machine, versions, and the
    (first) server's model and KV geometry from its ModelInfo `info`."""
    model_keys = (
        "model_id",
        "executor_kind",
        "device",
        "dtype",
        "attention_backend",
        "block_size",
        "num_blocks",
        "vocab_size",
    )
    return {
        "date": started.isoformat(timespec="seconds"),
        "command": config.command_line,
        "machine": _machine(),
        "versions": _versions(),
        "model": {k: info.get(k) for k in model_keys},
        "config": asdict(config),
        "api": config.api,
        **extra,
    }
