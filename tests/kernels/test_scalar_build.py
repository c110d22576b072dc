"""The quantized kernels' and the LoRA kernel's scalar and AVX2 code give their native build's bits.

`vec8.h` and the format tiles have a plain C++ version for CPUs without AVX2 (ARM, old x86), an AVX2
one, and for the quantized tiles a VNNI one (`interleaved_linear.h`). All promise the same bits:
exact integer sums, the same float32 chain per output. This test builds the two quantized kernels,
the native layer's RMSNorm and `lora_add` for baseline x86-64 (no AVX2) and, on a CPU whose native
build takes the VNNI tiles, for Haswell (AVX2, no VNNI), one child process per build, runs them on
the same operands as the native build loaded here (for the quantized kernels: row counts that fill
and leave ragged tiles and chunks, ragged output widths, both activation dtypes; for the LoRA kernel:
every activation dtype, ragged widths, per-projection columns, several rows per slot), and compares
every output bit for bit.
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
from kvserve.executor.weights.q8_0 import pack
from kvserve.kernels import cpu_ops

pytestmark = pytest.mark.slow

BUILD_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils import cpp_extension
    from kvserve.kernels import cpu_ops

    build, operands, out, march, names = sys.argv[1:]
    cpu_ops._put_ninja_on_path()
    flags = [f for f in cpu_ops.CFLAGS if f != "-march=native"] + [f"-march={march}"]
    sources = [str(cpu_ops.SOURCE_DIR / name) for name in names.split(",")]
    name = "kvserve_" + march.replace("-", "_") + "_check"
    cpp_extension.load(name=name, sources=sources, extra_cflags=flags,
                       extra_ldflags=list(cpu_ops.LDFLAGS), build_directory=build, is_python_module=False)
    results = []
    for op, args in torch.load(operands):
        result = getattr(torch.ops.kvserve_cpu, op)(*args)
        results.append(args[-1] if result is None else result)  # lora_add adds into its last argument
    torch.save(results, out)
    """
)


ROW_COUNTS = (1, 2, 3, 4, 5, 7, 64, 65, 130)
"""Whole and partial tiles of four rows, one chunk of 64 rows and more (interleaved_linear.h)."""
SOURCE_OPS = {"q4_1_linear.cpp": "q4_1_linear", "q8_linear.cpp": "q8_linear", "decoder_layer.cpp": "rms_norm",
              "lora_add.cpp": "lora_add"}  # fmt: skip
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})


def _builds() -> dict[str, tuple[str, ...]]:
    """Each build compared with the native one, by -march, and its sources: baseline x86-64 runs every
    kernel's scalar code; Haswell the quantized kernels' AVX2 tiles, which only a VNNI CPU's native build
    does not run already."""
    builds = {"x86-64": tuple(SOURCE_OPS)}
    if cpu_flags() & VNNI_FLAGS:
        builds["haswell"] = ("q4_1_linear.cpp", "q8_linear.cpp")
    return builds


def _start_build(
    tmp_path: Path, march: str, sources: tuple[str, ...], calls: list[tuple[str, tuple[object, ...]]]
) -> tuple[subprocess.Popen[str], list[tuple[str, tuple[object, ...]]]]:
    """A child that builds `sources` for `march` and saves their ops' outputs on their calls, returned beside it."""
    ops = {SOURCE_OPS[source] for source in sources}
    own = [call for call in calls if call[0] in ops]
    build, operands, out = tmp_path / march, tmp_path / f"{march}-operands.pt", tmp_path / f"{march}.pt"
    build.mkdir()
    torch.save(own, operands)
    command = [sys.executable, "-c", BUILD_CHILD, str(build), str(operands), str(out), march, ",".join(sources)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), own


def _quantized_calls(gen: torch.Generator) -> list[tuple[str, tuple[object, ...]]]:
    calls: list[tuple[str, tuple[object, ...]]] = []
    for n, k in [(101, 96), (200, 1536)]:  # a ragged last block; several groups and 16-bit partial sums
        q4 = make_q4_1_linear(random_q4_1(n, k, gen))
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 included
        q8 = pack(codes, torch.rand(n, k // 32, generator=gen).half().float() * 0.01)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, k, generator=gen) * 3
            x[0, :32] = 0  # a group of zeros
            for activations in (x, x.bfloat16()):
                calls.append(("q4_1_linear", (activations, q4.codes, q4.scales, n)))
                calls.append(("q8_linear", (activations, q8.codes, q8.d, n)))
        calls.append(("rms_norm", (x, torch.randn(k, generator=gen), 1e-5)))
    return calls


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
    """What the native build loaded here computes (`lora_add` into a copy of its last argument)."""
    if op != "lora_add":
        return getattr(cpu_ops, op)(*args)
    out = args[-1].clone()
    cpu_ops.lora_add(*args[:-1], out)
    return out


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="without AVX2 the kernels' build is the scalar one already")
def test_scalar_and_avx2_builds_of_the_kernels_give_the_same_bits(tmp_path: Path) -> None:
    ensure_kernels()
    gen = torch.Generator().manual_seed(0)
    calls = _quantized_calls(gen) + _lora_calls(gen)
    children = {march: _start_build(tmp_path, march, sources, calls) for march, sources in _builds().items()}
    for march, (child, _) in children.items():  # side by side: each is mostly its compiler
        _, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, (march, stderr[-3000:])
    for march, (_, own) in children.items():
        built = torch.load(tmp_path / f"{march}.pt")
        for (op, args), got in zip(own, built, strict=True):
            detail = args[-1] if op != "lora_add" else args[5]
            assert torch.equal(got, _here(op, args)), (march, op, args[0].dtype, args[0].shape[0], detail)
