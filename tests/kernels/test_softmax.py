"""softmax and log_softmax in one fixed order per row (`kernels/cpu/softmax.cpp`).

Close to torch's at the default model's vocabulary and at ragged widths, exact zeros and -infs for
masked entries, log(sum) rounded to float as a correctly rounded log would be, and a row's bits the
same alone and in any batch, at one thread and at two. The same bits in every build of the kernels:
tests/kernels/test_scalar_build.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.sampling import row_softmax
from kvserve.kernels import cpu_ops

VOCAB = 49152
"""The default model's vocabulary."""
WIDTHS = (1, 7, 8, 13, 31, 32, 33, 100, VOCAB)
"""One entry, short rows, whole and ragged chunks of 8 and 32, the full vocabulary."""
OPS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "softmax": (cpu_ops.softmax, lambda x: x.softmax(-1)),
    "log_softmax": (cpu_ops.log_softmax, lambda x: x.log_softmax(-1)),
}


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


@pytest.fixture
def kernel_threads() -> Iterator[None]:
    """The kernels' thread count is restored after the test."""
    before = cpu_ops.num_threads()
    yield
    cpu_ops.set_num_threads(before)


def _rows(rows: int, width: int, scale: float, seed: int) -> torch.Tensor:
    """Logit-like rows, some entries masked to -inf (never a whole row)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * scale
    if width > 1:
        masked = torch.rand(rows, width, generator=gen) < 0.3
        masked[:, 0] = False
        x[masked] = float("-inf")
    return x


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("scale", [1.0, 5.0, 30.0])
def test_matches_torch(width: int, scale: float) -> None:
    x = _rows(6, width, scale, seed=width)
    reference_p = x.double().softmax(-1)
    p = cpu_ops.softmax(x)
    # Within a few ulps of each probability (exp to about an ulp, the sum's float rounding), as torch's are.
    torch.testing.assert_close(p.double(), reference_p, rtol=3e-5, atol=1e-12)
    torch.testing.assert_close(p, x.softmax(-1), rtol=3e-5, atol=1e-12)
    assert torch.allclose(p.double().sum(-1), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-5)
    log_p = cpu_ops.log_softmax(x)
    torch.testing.assert_close(log_p.double(), x.double().log_softmax(-1), rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(log_p, x.log_softmax(-1), rtol=2e-6, atol=2e-5)


def test_masked_entries_give_exact_zeros_and_minus_infinity() -> None:
    x = _rows(4, 100, 3.0, seed=1)
    x[1, 1:] = float("-inf")  # one finite entry: probability 1, logprob 0
    x[2, 50] = x[2, 0] - 200  # below exp's range: 0, and a finite logprob
    p, log_p = cpu_ops.softmax(x), cpu_ops.log_softmax(x)
    masked = x == float("-inf")
    assert (p[masked] == 0).all() and (log_p[masked] == float("-inf")).all()
    assert (p[[0, 3]][~masked[[0, 3]]] > 0).all()
    assert p[1, 0].item() == 1.0 and log_p[1, 0].item() == 0.0
    assert p[2, 50].item() == 0.0 and math.isfinite(log_p[2, 50].item())
    assert abs(log_p[2, 50].item() - x[2].double().log_softmax(-1)[50].item()) < 1e-4


def test_rows_without_a_finite_maximum_are_nan_as_torchs_are() -> None:
    x = torch.randn(4, 20)
    x[0] = float("-inf")
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    for ours, torchs in OPS.values():
        out = ours(x)
        assert out[:3].isnan().all() and torchs(x)[:3].isnan().all()
        assert out[3].isfinite().all()


@pytest.mark.parametrize("count", [*range(1, 70), 100, 1000, 4095, 4097, 49152])
def test_log_of_the_sum_is_rounded_as_a_correct_log(count: int) -> None:
    """`count` zeros and the rest -inf: the sum is exactly `count`, so the zeros' logprob is -log(count)
    rounded once to float, and their probability is 1 / count rounded once."""
    width = max(count, 64)
    x = torch.full((1, width), float("-inf"))
    x[0, torch.randperm(width, generator=torch.Generator().manual_seed(count))[:count]] = 0.0
    zeros = x == 0
    expected_log = torch.tensor(-math.log(count), dtype=torch.float32)
    assert (cpu_ops.log_softmax(x)[zeros] == expected_log).all()
    expected_p = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(count), dtype=torch.float32)
    assert (cpu_ops.softmax(x)[zeros] == expected_p).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("width", [13, 100, VOCAB])
@pytest.mark.usefixtures("kernel_threads")
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(op: str, width: int) -> None:
    ours, _ = OPS[op]
    rows = {13: 3000, 100: 400, VOCAB: 9}[width]  # over a thread's chunk (16384 entries): two threads split them
    x = _rows(rows, width, 4.0, seed=width + 7)
    cpu_ops.set_num_threads(1)
    alone = [ours(x[i : i + 1].clone()) for i in range(rows)]
    shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(3)).tolist()
    batches = [list(range(rows)), shuffled, shuffled[: rows // 2 + 1], [rows - 1, 0]]
    for count in (1, 2):
        cpu_ops.set_num_threads(count)
        for batch in batches:
            out = ours(x[batch].contiguous())
            for j, i in enumerate(batch):
                assert torch.equal(_bits(out[j : j + 1]), _bits(alone[i])), (count, batch, i)


@pytest.mark.parametrize("op", OPS)
def test_bad_input_is_refused_naming_the_argument(op: str) -> None:
    ours, _ = OPS[op]
    x = torch.randn(3, 16)
    for bad, why in [
        (x.double(), "float32"),
        (x.bfloat16(), "float32"),
        (x[0], r"\[rows, n\]"),
        (x[None], r"\[rows, n\]"),
        (x.t(), "contiguous"),
        (x[:, :0], "at least one column"),
    ]:
        with pytest.raises(RuntimeError, match=rf"{op}: x must .*{why}"):
            ours(bad)


def test_the_samplers_helper_takes_the_kernels_for_float32_on_the_cpu_and_torch_otherwise() -> None:
    x = _rows(3, 100, 3.0, seed=5)
    assert torch.equal(_bits(row_softmax.softmax(x)), _bits(cpu_ops.softmax(x)))
    assert torch.equal(_bits(row_softmax.log_softmax(x)), _bits(cpu_ops.log_softmax(x)))
    # Any shape over its last dim, strided included.
    stacked = torch.stack([x, x.flip(0)]).transpose(0, 1)
    assert torch.equal(row_softmax.log_softmax(stacked)[:, 0], cpu_ops.log_softmax(x))
    half = x.bfloat16()
    assert torch.equal(row_softmax.softmax(half), half.softmax(-1))
    assert torch.equal(row_softmax.log_softmax(x.double()), x.double().log_softmax(-1))
