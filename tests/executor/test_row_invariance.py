"""GEMM rows that do not depend on the batch (`kvserve.executor.weights.row_invariance`).

The probe finds the call sizes a kernel computes alike, `RowFixedLinear` keeps every call within
them, and every GEMM path the runner uses then gives each row the same bits at 1, 7, 16, 64 and
300 rows. The last check is the one that matters: it runs the real kernels on this machine.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.cpu_features import has_native_bf16
from kvserve.executor.weights.gguf_q4_1 import random_q4_1
from kvserve.executor.weights.invariance import GemmShape, Padding, min_rows, random_layer
from kvserve.executor.weights.linear import PACKED, WIDENED, Linear, make_linear
from kvserve.executor.weights.q4_1_linear import make_q4_1_linear
from kvserve.executor.weights.row_invariance import (
    AFFORDABLE_MIN_ROWS,
    MAX_ROWS,
    PROBE_ROWS,
    ProbeCache,
    RowFixedLinear,
    matmul_key,
    probe,
)


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    """The Q4_1 layers call kvserve's CPU kernels, which this module must not rely on another to have loaded."""
    ensure_kernels()


ROWS = [1, 7, 16, 64, 300]


class SizeDependentKernel:
    """A GEMM whose rows come out in other bits when the call has fewer than `switch` rows."""

    kind = "fake"

    def __init__(self, switch: int) -> None:
        self.weight = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))  # wide: few probe calls
        self.switch = switch
        self.calls: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        out = self.exact(x)
        return out if x.shape[0] >= self.switch else out.nextafter(torch.full_like(out, float("inf")))

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        """Row by row: the same bits for a row at any call size."""
        return torch.cat([row[None] @ self.weight.t() for row in x])


@pytest.mark.parametrize("switch", [1, 2, 4, 33, 60])
def test_the_probe_finds_the_smallest_call_size_that_agrees_and_only_probed_sizes(switch):
    min_rows = probe(SizeDependentKernel(switch), 16, torch.float32)
    assert min_rows >= switch and min_rows in (*PROBE_ROWS, MAX_ROWS)
    assert min_rows == min(r for r in PROBE_ROWS if r >= switch)


def test_row_fixed_calls_stay_within_the_probed_sizes_and_return_every_row():
    kernel = SizeDependentKernel(4)
    fixed = RowFixedLinear(kernel, min_rows=4)
    for rows in (1, 3, 4, 200, MAX_ROWS, MAX_ROWS + 1, 3 * MAX_ROWS + 2):
        kernel.calls.clear()
        x = torch.randn(rows, 16)
        out = fixed(x)
        assert out.shape == (rows, 4096)
        assert all(4 <= n <= MAX_ROWS for n in kernel.calls), kernel.calls
        assert torch.equal(out, kernel.exact(x))  # never the small-call bits


def test_a_fixed_order_kernel_gets_long_inputs_in_one_call_and_short_ones_padded():
    kernel = SizeDependentKernel(4)
    fixed = RowFixedLinear(kernel, min_rows=4, max_rows=None)
    for rows in (1, 3 * MAX_ROWS + 2):
        kernel.calls.clear()
        x = torch.randn(rows, 16)
        assert torch.equal(fixed(x), kernel.exact(x))
        assert kernel.calls == [max(rows, 4)]


def test_probe_results_are_cached_on_disk_per_cpu_and_thread_count(tmp_path):
    ProbeCache(tmp_path, "cpu", 2).store({"k": 7})
    assert ProbeCache(tmp_path, "cpu", 2).get("k") == 7
    assert ProbeCache(tmp_path, "another cpu", 2).get("k") is None
    assert ProbeCache(tmp_path, "cpu", 3).get("k") is None


def test_the_child_process_probes_random_layers_of_each_shape_and_caches_them(tmp_path):
    """`min_rows` runs the probe in a child (its oneDNN kernels never stay in the executor) and stores it."""
    cache = ProbeCache(tmp_path, "test", torch.get_num_threads())
    shapes = [
        GemmShape("onednn-packed", "float32", 1536, 576, False, 64),
        GemmShape("q4_1", "float32", 576, 96, False, 64),
    ]
    found = min_rows(shapes, cache)
    assert set(found) == {s.key for s in shapes} and all(1 <= v <= 64 for v in found.values())
    assert found[shapes[0].key] == probe(random_layer(shapes[0]), 1536, torch.float32, 64)  # the same in-process
    assert ProbeCache(tmp_path, "test", torch.get_num_threads()).get(shapes[1].key) == found[shapes[1].key]


def test_the_child_also_measures_matmul_rates_which_price_padding(tmp_path):
    """A padded call costs `min_rows` rows at its dtype's rate: in float32 rows, min_rows × fp32 / bf16."""
    cache = ProbeCache(tmp_path, "test", torch.get_num_threads())
    found = min_rows([], cache, rates=(torch.float32, torch.bfloat16))
    rates = {d: found[matmul_key(d)] for d in (torch.float32, torch.bfloat16)}
    assert all(rate > 0 for rate in rates.values())
    assert (
        ProbeCache(tmp_path, "test", torch.get_num_threads()).get(matmul_key(torch.bfloat16)) == rates[torch.bfloat16]
    )
    # AMX: bf16 products ~6.5x float32's, so 256 rows cost ~39 float32 rows; without it, 256 rows are 256.
    assert Padding(256, "down", 256 / 6.5).affordable and not Padding(256, "down", 256.0).affordable
    assert Padding(2, "down", 2.0).affordable and not Padding(65, "down", AFFORDABLE_MIN_ROWS + 1).affordable


def _paths() -> list[tuple[str, object, int, torch.dtype]]:
    """Every GEMM kernel the CPU runner can build here: (name, layer, in_features, activation dtype)."""
    gen = torch.Generator().manual_seed(1)
    paths = []
    for n_in, n_out in ((1536, 576), (576, 1536)):
        weight = torch.randn(n_out, n_in, generator=gen) * 0.05
        paths.append((f"fp32 {n_in}x{n_out}", make_linear(weight), n_in, torch.float32))
        bf16 = make_linear(weight.bfloat16())
        assert bf16.kind == (PACKED if has_native_bf16() else WIDENED)
        paths.append((f"bf16 {bf16.kind} {n_in}x{n_out}", bf16, n_in, torch.bfloat16))
        widened = Linear(weight=weight.bfloat16(), widen=True)
        paths.append((f"bf16 widened {n_in}x{n_out}", widened, n_in, torch.bfloat16))
        q4 = make_q4_1_linear(random_q4_1(n_out, n_in, gen))
        paths.append((f"q4_1 {n_in}x{n_out}", q4, n_in, torch.float32))
    return paths


@pytest.mark.parametrize("name,layer,n_in,dtype", _paths(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_gemm_path_gives_a_row_the_same_bits_at_every_row_count(tmp_path, name, layer, n_in, dtype):
    """All 300 rows computed in calls of 1, 7, 16, 64 and 300 rows. A bf16 result hides most
    differences in the sums behind its rounding, so every row is compared, not one."""
    fixed = RowFixedLinear(layer, probe(layer, n_in, dtype))
    x = torch.randn(300, n_in, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        results = {rows: torch.cat([fixed(x[s : s + rows]) for s in range(0, 300, rows)]) for rows in ROWS}
    for rows in ROWS:
        assert torch.equal(results[rows], results[300]), f"{name}: {rows}-row calls differ from one 300-row call"
