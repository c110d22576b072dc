"""The quantized kernels' and the LoRA kernel's scalar code gives their AVX2 code's bits.

`vec8.h` and the format tiles have a plain C++ version for CPUs without AVX2 (ARM, old x86). Both
versions promise the same bits: exact integer sums, the same float32 chain per output. This test
builds the two quantized kernels, the native layer's RMSNorm and `lora_add` for baseline x86-64 (no
AVX2) in one child process, runs them on the same operands as the AVX2 build loaded here (for the
LoRA kernel: every activation dtype, ragged widths, per-projection columns, several rows per slot),
and compares every output bit for bit.
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
from kvserve.executor.weights.gguf_q4_1 import random_q4_1
from kvserve.executor.weights.q4_1_linear import make_q4_1_linear
from kvserve.executor.weights.q8_0 import quantize
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
    names = ("q4_1_linear.cpp", "q8_linear.cpp", "decoder_layer.cpp", "lora_add.cpp")
    sources = [str(cpu_ops.SOURCE_DIR / name) for name in names]
    cpp_extension.load(name="kvserve_scalar_check", sources=sources, extra_cflags=flags,
                       extra_ldflags=list(cpu_ops.LDFLAGS), build_directory=build, is_python_module=False)
    results = []
    for op, args in torch.load(operands):
        result = getattr(torch.ops.kvserve_cpu, op)(*args)
        results.append(args[-1] if result is None else result)  # lora_add adds into its last argument
    torch.save(results, out)
    """
)


def _lora_calls(gen: torch.Generator) -> list[tuple[str, tuple[object, ...]]]:
    calls: list[tuple[str, tuple[object, ...]]] = []
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
            calls.append(("lora_add", (x, row_slots, a, b, rank_tensor, bounds, torch.tensor([0.5, 2.0]), out)))
    return calls


def _here(op: str, args: tuple) -> torch.Tensor:
    """What the AVX2 build loaded here computes (`lora_add` into a copy of its last argument)."""
    if op != "lora_add":
        return getattr(cpu_ops, op)(*args)
    out = args[-1].clone()
    cpu_ops.lora_add(*args[:-1], out)
    return out


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="without AVX2 the kernels' build is the scalar one already")
def test_scalar_and_avx2_builds_of_the_kernels_give_the_same_bits(tmp_path: Path) -> None:
    ensure_kernels()
    gen = torch.Generator().manual_seed(0)
    calls = []
    for n, k in [(101, 96), (200, 1536)]:  # a ragged last block; several groups and 16-bit partial sums
        q4 = make_q4_1_linear(random_q4_1(n, k, gen))
        q8 = quantize(torch.randn(n, k, generator=gen))
        x = torch.randn(6, k, generator=gen) * 3
        x[1, :32] = 0  # a group of zeros
        for activations in (x, x.bfloat16()):
            calls.append(("q4_1_linear", (activations, q4.codes, q4.scales, n)))
            calls.append(("q8_linear", (activations, q8.codes, q8.d, n)))
        calls.append(("rms_norm", (x, torch.randn(k, generator=gen), 1e-5)))
    calls += _lora_calls(gen)
    torch.save(calls, tmp_path / "operands.pt")
    child = subprocess.run(
        [sys.executable, "-c", SCALAR_CHILD, str(tmp_path), str(tmp_path / "operands.pt"), str(tmp_path / "scalar.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    scalar = torch.load(tmp_path / "scalar.pt")
    for (op, args), got in zip(calls, scalar, strict=True):
        assert torch.equal(got, _here(op, args)), (op, args[0].dtype, args[-1] if op != "lora_add" else args[5])
