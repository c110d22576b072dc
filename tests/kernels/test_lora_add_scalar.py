"""The LoRA kernel's scalar build gives its AVX2 build's bits.

`vec8.h` has a plain C++ version for CPUs without AVX2 (ARM, old x86), and `lora_add.cpp` computes
only through it, so both builds must round every step alike. This test builds the kernel for
baseline x86-64 (no AVX2) in a child process, runs it on the same operands as the AVX2 build loaded
here (every activation dtype, ragged widths, per-projection columns, several rows per slot), and
compares every output bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.cpu_features import cpu_flags
from kvserve.kernels import cpu_ops

pytestmark = pytest.mark.slow

SCALAR_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils import cpp_extension
    from kvserve.kernels import cpu_ops

    build, operands, out = sys.argv[1:]
    cpu_ops._put_ninja_on_path()
    flags = [f for f in cpu_ops.CFLAGS if f != "-march=native"] + ["-march=x86-64"]
    cpp_extension.load(name="kvserve_lora_scalar_check", sources=[str(cpu_ops.SOURCE_DIR / "lora_add.cpp")],
                       extra_cflags=flags, extra_ldflags=list(cpu_ops.LDFLAGS), build_directory=build,
                       is_python_module=False)
    results = []
    for args in torch.load(operands):
        torch.ops.kvserve_cpu.lora_add(*args)
        results.append(args[-1])
    torch.save(results, out)
    """
)


def _calls(gen: torch.Generator) -> list[tuple[object, ...]]:
    calls: list[tuple[object, ...]] = []
    for n_in, outs, ranks in [(576, [576, 192, 192], [[16, 16, 16], [8, 0, 8]]), (100, [21, 43], [[5, 7], [0, 12]])]:
        bounds = [0]
        for width in outs:
            bounds.append(bounds[-1] + width)
        a = torch.randn(2, 48, n_in, generator=gen)
        b = torch.randn(2, 48 * bounds[-1], generator=gen)
        row_slots = torch.tensor([0, 1, -1, 0, 0, 1, 0, 0, 1], dtype=torch.int32)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(9, n_in, generator=gen) * 3).to(dtype)
            out = torch.randn(9, bounds[-1], generator=gen).to(dtype)
            rank_tensor = torch.tensor(ranks, dtype=torch.int32)
            calls.append((x, row_slots, a, b, rank_tensor, bounds, torch.tensor([0.5, 2.0]), out))
    return calls


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="without AVX2 the kernels' build is the scalar one already")
def test_scalar_and_avx2_builds_of_the_lora_kernel_give_the_same_bits(tmp_path: Path) -> None:
    ensure_kernels()
    calls = _calls(torch.Generator().manual_seed(0))
    torch.save(calls, tmp_path / "operands.pt")
    child = subprocess.run(
        [sys.executable, "-c", SCALAR_CHILD, str(tmp_path), str(tmp_path / "operands.pt"), str(tmp_path / "scalar.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    scalar = torch.load(tmp_path / "scalar.pt")
    for args, got in zip(calls, scalar, strict=True):
        x, row_slots, a, b, ranks, bounds, scaling, out = args
        expected = out.clone()
        cpu_ops.lora_add(x, row_slots, a, b, ranks, bounds, scaling, expected)
        assert torch.equal(got, expected), (x.dtype, bounds)
