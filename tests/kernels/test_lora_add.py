"""The LoRA kernel (`cpu_ops.lora_add`) against its torch reference, and its batch invariance.

Correctness: every activation dtype, projections of several ranks (one not targeted, a slot of no
rows), ragged input and output widths, one block or per-projection columns, against
`lora_add_reference` (float64); the rows and columns it must not touch keep their bits.

Invariance, bit for bit: a row's result is the same alone and in batches of 2 to 256 rows under
mixed adapters, in any order, at one thread and at two, and a zero-padded tail computes like the
vector body.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.kernels import cpu_ops
from kvserve.kernels.reference import lora_add_reference

SLOTS = 5


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


@pytest.fixture
def threads() -> Iterator[None]:
    """Put torch's and the kernels' thread counts back after a test that changes them."""
    torch_threads, kernel_threads = torch.get_num_threads(), cpu_ops.set_num_threads(0)
    yield
    torch.set_num_threads(torch_threads)
    cpu_ops.set_num_threads(kernel_threads)


def _bounds(widths: list[int]) -> list[int]:
    bounds = [0]
    for width in widths:
        bounds.append(bounds[-1] + width)
    return bounds


def _stack(n_in: int, outs: list[int], ranks: list[list[int]], gen: torch.Generator):
    """Slot tensors as `AdapterSlots` fills them on the CPU: each slot's A rows stacked, its B blocks
    packed projection by projection, stale values past a slot's own (which the kernel must not read)."""
    bounds, widest = _bounds(outs), max(sum(r) for r in ranks)
    floats = max(sum(rank * width for rank, width in zip(r, outs, strict=True)) for r in ranks)
    a = torch.randn(SLOTS, widest, n_in, generator=gen) / n_in**0.5
    b = torch.randn(SLOTS, floats, generator=gen) * 0.1
    return a, b, torch.tensor(ranks, dtype=torch.int32), bounds


RANKS = [[16, 16, 16], [8, 0, 8], [4, 4, 4], [0, 0, 0], [16, 8, 0]]
"""Per slot, rows per projection: all targeted, one projection not, a small rank, none, mixed."""


@pytest.mark.parametrize(
    "x_dtype,out_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.bfloat16, torch.float32)],
)  # fmt: skip
@pytest.mark.parametrize("n_in,outs", [(576, [576, 192, 192]), (100, [21, 40, 43]), (13, [3, 2, 5])])
def test_lora_add_matches_the_reference_and_leaves_the_rest_alone(x_dtype, out_dtype, n_in, outs) -> None:
    gen = torch.Generator().manual_seed(n_in)
    a, b, ranks, bounds = _stack(n_in, outs, RANKS, gen)
    scaling = torch.tensor([2.0, 0.5, 1.0, 3.0, 0.25])
    row_slots = torch.randint(-1, SLOTS, (40,), generator=gen)
    x = torch.randn(40, n_in, generator=gen).to(x_dtype)
    out = torch.randn(40, bounds[-1], generator=gen).to(out_dtype)
    out[:, ::7] = -0.0  # a sign the untouched columns must keep
    expected, got = out.clone(), out.clone()
    lora_add_reference(x, row_slots, a, b, ranks, bounds, scaling, expected)
    cpu_ops.lora_add(x, row_slots, a, b, ranks, bounds, scaling, got)
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # one rounding to 8 or 11 bits, each side: at most one step of the dtype apart
        step = torch.finfo(out_dtype).eps
        assert ((got.float() - expected.float()).abs() <= step * expected.float().abs() + 1e-6).all()
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    for t, slot in enumerate(row_slots.tolist()):
        kept = [c for p, rank in enumerate(RANKS[slot]) for c in range(bounds[p], bounds[p + 1]) if rank == 0]
        if slot < 0:
            kept = list(range(bounds[-1]))
        assert torch.equal(got[t, kept].view(bits), out[t, kept].view(bits)), t


def test_one_block_without_ranks_is_every_row_against_every_column() -> None:
    """ranks None and no columns: a hand-made dense pair (and an int64 slot vector)."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 12, 40, generator=gen), torch.randn(2, 12 * 30, generator=gen)
    x, out = torch.randn(9, 40, generator=gen), torch.randn(9, 30, generator=gen)
    row_slots = torch.tensor([0, 1, -1, 1, 0, 0, -1, 1, 1])
    scaling = torch.tensor([1.5, -0.5])
    expected, got = out.clone(), out.clone()
    lora_add_reference(x, row_slots, a, b, None, [], scaling, expected)
    cpu_ops.lora_add(x, row_slots, a, b, None, [], scaling, got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _run(x, row_slots, operands, out) -> torch.Tensor:
    a, b, ranks, bounds, scaling = operands
    result = out.clone()
    cpu_ops.lora_add(x, row_slots, a, b, ranks, bounds, scaling, result)
    return result


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_in,outs", [(576, [576, 192, 192]), (1536, [576]), (576, [1536, 1536])])
def test_a_rows_result_has_the_same_bits_alone_and_in_any_batch_at_one_and_two_threads(dtype, n_in, outs) -> None:
    """The default model's fused shapes (qkv, down, gate_up) at rank 16: each of 300 rows alone at one
    thread, against batches of 2 to 256 rows from several offsets under mixed adapters, and shuffled,
    at one thread and at two."""
    gen = torch.Generator().manual_seed(n_in + len(outs))
    ranks = [[16] * len(outs), [8] * len(outs), [16] + [0] * (len(outs) - 1), [0] * len(outs), [4] * len(outs)]
    a, b, rank_tensor, bounds = _stack(n_in, outs, ranks, gen)
    operands = (a, b, rank_tensor, bounds, torch.tensor([2.0, 0.5, 1.0, 3.0, 0.25]))
    x = torch.randn(300, n_in, generator=gen).to(dtype)
    out = torch.randn(300, bounds[-1], generator=gen).to(dtype)
    row_slots = torch.randint(-1, SLOTS, (300,), generator=gen, dtype=torch.int32)
    row_slots[:150:3] = 0  # batches from the start hold more rows of slot 0 than one chunk (64)
    row_slots[1:150:3] = 0
    torch.set_num_threads(1)
    alone = torch.cat([_run(x[t : t + 1], row_slots[t : t + 1], operands, out[t : t + 1]) for t in range(300)])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert cpu_ops.num_threads() == threads
        for rows in (*range(2, 34), 64, 65, 128, 255, 256):
            for start in (0, 5, 300 - rows):
                part = slice(start, start + rows)
                got = _run(x[part], row_slots[part], operands, out[part])
                assert torch.equal(got, alone[part]), (threads, rows, start)
        order = torch.randperm(300, generator=gen)
        assert torch.equal(_run(x[order], row_slots[order], operands, out[order]), alone[order]), threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_zero_padded_tails_compute_like_the_vector_body(dtype) -> None:
    """Input 8 and output 8 are in the vector body at 16 wide and in the zero-padded tail at 9 wide:
    the same values give the same bits there."""
    results = []
    for width in (9, 16):
        a = torch.zeros(1, 4, width)
        b = torch.zeros(1, 4, width)
        a[0, :, :9] = torch.randn(4, 9, generator=torch.Generator().manual_seed(3))
        b[0, :, :9] = torch.randn(4, 9, generator=torch.Generator().manual_seed(4))
        x = torch.zeros(3, width, dtype=dtype)
        x[:, :9] = torch.randn(3, 9, generator=torch.Generator().manual_seed(5)).to(dtype)
        out = torch.zeros(3, width, dtype=dtype)
        out[:, :9] = torch.randn(3, 9, generator=torch.Generator().manual_seed(6)).to(dtype)
        operands = (a, b.reshape(1, -1), None, [], torch.tensor([0.75]))
        results.append(_run(x, torch.zeros(3, dtype=torch.int32), operands, out)[:, :9])
    assert torch.equal(results[0], results[1])


def test_lora_add_refuses_what_it_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(7)
    a, b, ranks, bounds = _stack(64, [32, 16, 16], RANKS, gen)
    scaling = torch.ones(SLOTS)
    x, out, slots = torch.randn(3, 64), torch.zeros(3, 64), torch.tensor([0, 1, -1], dtype=torch.int32)

    def call(**changes: object) -> None:
        args = dict(x=x, row_slots=slots, a=a, b=b, ranks=ranks, columns=bounds, scaling=scaling, out=out) | changes
        cpu_ops.lora_add(**args)

    with pytest.raises(RuntimeError, match="names slot 5"):
        call(row_slots=torch.tensor([0, 5, -1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one per row"):
        call(row_slots=slots[:2])
    with pytest.raises(RuntimeError, match="contiguous float32"):
        call(a=a.half())
    with pytest.raises(RuntimeError, match="x has 32 columns but a's rows 64 inputs"):
        call(x=torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="increasing boundaries"):
        call(columns=[0, 32, 48, 60])
    with pytest.raises(RuntimeError, match="column boundaries"):
        call(columns=[])
    with pytest.raises(RuntimeError, match="more than the 48 stacked"):
        call(ranks=torch.full((SLOTS, 3), 17, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="blocks of b take 1024 floats, more than the 1023"):
        call(b=b[:, :1023].contiguous())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        call(out=torch.zeros(3, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        call(out=torch.zeros(64, 3).t())
    with pytest.raises(RuntimeError, match="one per slot"):
        call(scaling=torch.ones(2))
