"""The kernels built on an AMX Xeon use no AMX tiles, so they cannot die of SIGILL where llama.cpp's did.

On the AMX VMs kvserve was measured on, llama.cpp's native build dies of SIGILL: it runs AMX tile
instructions, which Linux only allows a process after an `arch_prctl(ARCH_REQ_XCOMP_PERM)` request.
kvserve's kernels are compiled with `-march=native` (`kvserve.kernels.cpu_ops`); on such a CPU that
enables the AMX instruction sets, but a compiler never emits tile instructions unless the source calls
their intrinsics. This test compiles every kernel source for Sapphire Rapids (AVX-512, VNNI, BF16,
AMX) on any x86 machine, without running it, and checks the object code: VNNI's `vpdpbusd` is there
(the build did target that CPU), no tile instruction is. A kernel that takes up AMX tiles must first
ask for them and fall back to VNNI with a log line when refused; this test fails until it does so
knowingly (then it should check that fallback instead).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kvserve.kernels import cpu_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets"),
    pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump"),
]

AMX_TILE_OPS = re.compile(r"\b(ldtilecfg|sttilecfg|tileloadd\w*|tilestored|tilezero|tilerelease|tdp\w+)\b")
"""AMX's tile configuration, loads, stores and dot products (`tdpbssd`, `tdpbf16ps`, ...)."""


def test_the_kernels_built_for_an_amx_xeon_use_no_amx_tiles(tmp_path: Path) -> None:
    unity = tmp_path / "kernels.cpp"
    unity.write_text("".join(f'#include "{cpu_ops.SOURCE_DIR / source}"\n' for source in cpu_ops.SOURCES))
    flags = [flag for flag in cpu_ops.CFLAGS if flag != "-march=native"] + ["-march=sapphirerapids"]
    includes = [f"-I{path}" for path in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    obj = tmp_path / "kernels.o"
    compiled = subprocess.run(
        ["c++", *flags, "-std=c++17", "-fPIC", *includes, "-c", str(unity), "-o", str(obj)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    disassembly = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert "vpdpbusd" in disassembly  # the quantized tiles' VNNI products: the build is Sapphire Rapids'
    found = sorted(set(AMX_TILE_OPS.findall(disassembly)))
    assert not found, f"AMX tile instructions in the kernels: {found}"
