"""What the host CPU computes natively, read once from the kernel's CPU flags.

Kernel choices depend on it: a bfloat16 GEMM is fast only with AVX512_BF16 or AMX, and
without them torch falls back to an emulation many times slower than fp32.
"""

from __future__ import annotations

import functools
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of /proc/cpuinfo's first processor; empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16() -> bool:
    return bool(cpu_flags() & BF16_FLAGS)


def has_avx512() -> bool:
    """Whether oneDNN's float32 GEMMs get sixteen lanes to kvserve's CPU kernels' eight (AVX2's)."""
    return "avx512f" in cpu_flags()
