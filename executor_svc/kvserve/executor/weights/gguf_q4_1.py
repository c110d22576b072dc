"""GGUF Q4_1 weights as they ship.

Q4_1 stores each run of 32 weights along a row as an fp16 scale `d`, an fp16 minimum `m`
and 16 bytes of 4-bit codes (byte j holds weight j in its low nibble and weight j + 16 in
its high one): w = d·q + m. kvserve's CPU kernel reads the same codes, repacked in its own
order (`kvserve.executor.weights.q4_1_linear.pack`), so the weights stay 4-bit instead of
being dequantized at load.

Rows are independent (a group never spans two rows), so concatenating q/k/v or gate/up
and permuting rows are exact on the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
BLOCK_BYTES = 20
"""2 (d, fp16) + 2 (m, fp16) + 16 (32 four-bit codes)."""


@dataclass(slots=True)
class Q4_1Weight:
    """One [out, in] weight matrix in Q4_1: codes and per-group scale and minimum."""

    codes: torch.Tensor
    """[out, in] uint8 in 0..15."""
    d: torch.Tensor
    """[out, in / 32] float16."""
    m: torch.Tensor
    """[out, in / 32] float16."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])


def parse_q4_1(raw: np.ndarray) -> Q4_1Weight:
    """A GGUF Q4_1 tensor's bytes, [out, in / 32 × 20] uint8 (as gguf's reader gives them)."""
    rows, row_bytes = raw.shape
    if row_bytes % BLOCK_BYTES:
        raise ValueError(f"a Q4_1 row holds whole {BLOCK_BYTES}-byte blocks, got {row_bytes} bytes")
    blocks = np.ascontiguousarray(raw).reshape(rows, row_bytes // BLOCK_BYTES, BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    packed = blocks[:, :, 4:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Q4_1Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


def random_q4_1(n_out: int, n_in: int, generator: torch.Generator) -> Q4_1Weight:
    """Random codes, scales and minimums of a trained layer's magnitude: for the GEMM probe, which
    depends on shapes, not values, and for benchmarks and tests of the kernels."""
    return Q4_1Weight(
        codes=torch.randint(0, 16, (n_out, n_in), generator=generator, dtype=torch.uint8),
        d=(torch.rand(n_out, n_in // GROUP, generator=generator) * 0.01).half(),
        m=(-torch.rand(n_out, n_in // GROUP, generator=generator) * 0.05).half(),
    )


def dequantize(weight: Q4_1Weight) -> torch.Tensor:
    """[out, in] float32, d·q + m exactly as GGUF defines it (what the dequantized path loads)."""
    d = weight.d.float().repeat_interleave(GROUP, dim=1)
    m = weight.m.float().repeat_interleave(GROUP, dim=1)
    return d * weight.codes.float() + m


def concat_rows(weights: list[Q4_1Weight]) -> Q4_1Weight:
    """Stack matrices with the same input size along their outputs (fused qkv, gate_up)."""
    return Q4_1Weight(
        torch.cat([w.codes for w in weights]), torch.cat([w.d for w in weights]), torch.cat([w.m for w in weights])
    )


def select_rows(weight: Q4_1Weight, rows: slice) -> Q4_1Weight:
    """Output rows `rows` (a column-parallel shard): exact, a group runs along a row."""
    return Q4_1Weight(weight.codes[rows], weight.d[rows], weight.m[rows])


def select_columns(weight: Q4_1Weight, columns: slice) -> Q4_1Weight:
    """Input columns `columns` (a row-parallel shard); exact when they start and end on a group boundary."""
    start, stop = columns.start, columns.stop
    if start % GROUP or stop % GROUP:
        raise ValueError(f"Q4_1 columns {start}:{stop} do not start and end on a {GROUP}-weight group boundary")
    groups = slice(start // GROUP, stop // GROUP)
    return Q4_1Weight(
        weight.codes[:, columns].contiguous(), weight.d[:, groups].contiguous(), weight.m[:, groups].contiguous()
    )
