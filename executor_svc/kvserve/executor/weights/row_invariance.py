"""Linear layers whose rows do not depend on the batch: every GEMM call gets a shape that computes rows alike.

Why: GEMM libraries pick a micro-kernel, and with it the order of each dot product's sum, by the
shape of the call. On this project's CPUs oneDNN's prepacked fp32 GEMM gives other bits at one row
than at two or more for a 1536-wide reduction, torch's plain fp32 matmul changes between 3 and 4
rows, and on AMX machines bfloat16 products switch kernels at larger row counts. So a token's hidden
state changed with how many tokens shared its step.

How: a `RowFixedLinear` cuts every call into calls of `min_rows` to MAX_ROWS rows: longer inputs
are split, shorter ones padded with zero rows. A row's bits then depend only on the kernel's
behaviour at those call sizes, which `probe` measures: it runs the layer at every size up to 33
rows and at steps up to MAX_ROWS, each on rows taken from different places of a MAX_ROWS-row
reference call (so every row also changes its place in its call), and returns the smallest
`min_rows` from which every probed size gives each row the bits it got in the reference. GEMM
libraries dispatch on shapes, not values, so random inputs and weights of the layer's shape are
enough (`kvserve.executor.weights.invariance` probes random layers, in a child process).

A bfloat16 result hides most differences in the fp32 sums behind its rounding (about one output
element in 30,000 comes out different when two kernels sum in another order), so each size is
checked on PROBE_ELEMENTS output elements, which misses such a pair of kernels with a probability
under 1e-6. Results are cached per machine, torch version, thread count, kernel and shape
(`ProbeCache`): only the first start on a machine pays, a few seconds for the default model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
import torch

log = structlog.get_logger(__name__)

MAX_ROWS = 256
"""Largest GEMM call. Measured on 2048-row prefill calls: splitting into 256-row calls costs ~3%,
128-row calls ~5–10%, 64-row calls 10–20% (more calls, the weight read more often)."""
PROBE_ROWS = (*range(1, 34), 47, 48, 63, 64, 65, 96, 127, 128, 129, 191, 192, 255, MAX_ROWS)
"""Every size a decode step is likely to have, then steps around the sizes where GEMM kernels
change blocking (multiples of 16, 32 and 64, and one row either side)."""
PROBE_ELEMENTS = 1 << 20
"""Output elements compared per probed call size (see the module docstring)."""
AFFORDABLE_MIN_ROWS = 64
"""Padding worth paying at a decode step, in float32 rows: a dtype whose GEMMs need `min_rows` rows
is affordable when `min_rows` × (float32's matmul rate / its own) is at most this. So bfloat16 on
AMX, whose products run ~6× faster than float32's, may pad a call to 256 rows for the price of ~41
float32 rows; a CPU whose bfloat16 is no faster than float32 may pad to 64 at most."""


class RowKernel(Protocol):
    """What a linear layer offers for probing: a call, and the kernel's name."""

    @property
    def kind(self) -> str: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class RowFixedLinear:
    """`inner` called only with `min_rows` to `max_rows` rows (any number from `min_rows` when None)."""

    inner: RowKernel
    min_rows: int
    max_rows: int | None = MAX_ROWS
    """None for a kernel that sums every output in one order whatever the call's size (kvserve's Q4_1
    and Q8_0 kernels): a 1024-token prefill then makes one call per matrix, not four and a
    `torch.cat` of them, which took 5% of its time."""

    @property
    def kind(self) -> str:
        return self.inner.kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, most = x.shape[0], self.max_rows
        if rows >= self.min_rows and (most is None or rows <= most):
            return self.inner(x)
        if rows < self.min_rows:
            padded = x.new_zeros(self.min_rows, x.shape[1])
            padded[:rows] = x
            return self.inner(padded)[:rows]
        assert most is not None
        return torch.cat([self(x[start : start + most]) for start in range(0, rows, most)])


def probe(linear: RowKernel, in_features: int, dtype: torch.dtype, max_rows: int = MAX_ROWS) -> int:
    """The smallest `min_rows` from which every probed call size up to `max_rows` (the most rows the
    layer is ever called with) gives each row the bits it gets in a `max_rows`-row call."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, in_features, generator=generator).to(dtype)
    with torch.inference_mode():
        reference = linear(x)
        out_features = reference.shape[1]
        disagree = 0
        for rows in (r for r in PROBE_ROWS if r < max_rows):
            calls = -(-PROBE_ELEMENTS // (rows * out_features))
            for call in range(calls):
                start = (call * 7 * rows + call) % (max_rows - rows + 1)  # spread over the reference rows
                if not torch.equal(linear(x[start : start + rows]), reference[start : start + rows]):
                    disagree = max(disagree, rows)
                    break
    # Padded calls get a size that was probed: the next one past the last that disagreed.
    return min(r for r in (*PROBE_ROWS, max_rows) if r > disagree)


class ProbeCache:
    """`probe` results on disk, one JSON file per machine, torch version and thread count."""

    def __init__(self, directory: Path, identity: str, threads: int) -> None:
        self.threads = threads
        digest = hashlib.sha256(f"{identity}|torch {torch.__version__}|{threads} threads".encode())
        self.path = directory / f"row-invariance-{digest.hexdigest()[:16]}.json"
        try:
            self._entries: dict[str, int] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._entries = {}

    def get(self, key: str) -> int | None:
        return self._entries.get(key)

    def store(self, results: dict[str, int]) -> None:
        self._entries.update(results)
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".row-invariance-")
        with os.fdopen(fd, "w") as f:
            json.dump(self._entries, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


RATE_MATMUL_SIZE = 2048
"""The matmul whose rate prices a padded row: as large as `bench executor`'s roofline, since at 1024
AMX's bfloat16 reached only 4× float32's rate against 6.5× at 2048 (its tiles stay busy longer)."""


def matmul_gflops(dtype: torch.dtype, size: int = RATE_MATMUL_SIZE, repeats: int = 5) -> int:
    """The best of `repeats` size×size matmuls in `dtype`, in GFLOP/s: what a padded row costs."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return max(1, round(2 * size**3 / best / 1e9))


def matmul_key(dtype: torch.dtype) -> str:
    """The cache key of `matmul_gflops(dtype)`."""
    return f"matmul-gflops:{str(dtype).removeprefix('torch.')}:{RATE_MATMUL_SIZE}"


def probe_key(kind: str, in_features: int, out_features: int, dtype: torch.dtype, max_rows: int) -> str:
    """What a probe result depends on besides the machine: the kernel, the call's dtype and shape."""
    return f"{kind}:{str(dtype).removeprefix('torch.')}:{in_features}x{out_features}:rows<={max_rows}"
