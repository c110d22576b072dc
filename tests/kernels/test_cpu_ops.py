"""kvserve's CPU kernels (`kernels/cpu/`) against their torch references, and their batch invariance.

Correctness: paged attention against `paged_attention_reference` over shuffled block tables,
every block size, GQA ratios 1/3/4, head_dim 64/128, fp32/bf16/fp16 activations and a KV cache
of another dtype; the store against `store_kv_reference`; silu_mul against torch; q8_linear
against `q8_linear_reference`; q4_1_linear against `q4_1_linear_reference`.

Invariance, bit for bit: a token's attention output is the same alone or beside other
sequences, as a decode or inside a prefill, whole or chunked, from any physical blocks, and the
activation and the Q8_0 and Q4_1 products are the same at every row count.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.config.defaults import BLOCK_SIZES
from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.kernels import cpu_ops
from kvserve.kernels.reference import (
    paged_attention_reference,
    q4_1_linear_reference,
    q8_linear_reference,
    store_kv_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Of the output's own scale: the one rounding of the result to its dtype, plus fp32 sums."""


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


def _paged_case(seq_lens, kv_heads, head_dim, block_size, gen, dtype=torch.float32):
    """Random slot-major caches and shuffled disjoint block tables (padded with block 0)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, tables, padded


def _attend(query, k, v, padded, q_lens, seq_lens):
    kh, vh = cpu_ops.head_major(k, v)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = query.shape[-1] ** -0.5
    return cpu_ops.paged_attention(query, kh, vh, padded, starts, torch.tensor(seq_lens, dtype=torch.int32), scale)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128)])
def test_paged_attention_matches_the_reference(block_size, heads, kv_heads, head_dim):
    """Decodes (q_len 1), prefills (no context) and extends (context + several tokens) in one batch,
    with lengths that are, and are not, multiples of the block size."""
    gen = torch.Generator().manual_seed(block_size + head_dim)
    q_lens = [1, 37, 5, 1, 20]
    seq_lens = [1, 37, 2 * block_size + 5, 3 * block_size, 61]
    k, v, tables, padded = _paged_case(seq_lens, kv_heads, head_dim, block_size, gen)
    query = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    expected = paged_attention_reference(query, k, v, starts, seq_lens, tables, head_dim**-0.5)
    got = _attend(query, k, v, padded, q_lens, seq_lens)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_paged_attention_in_every_dtype_and_a_cache_of_another(dtype, kv_dtype):
    gen = torch.Generator().manual_seed(3)
    q_lens, seq_lens = [1, 9, 1], [40, 30, 17]
    k, v, tables, padded = _paged_case(seq_lens, 3, 64, 16, gen, kv_dtype)
    query = torch.randn(sum(q_lens), 6, 64, generator=gen).to(dtype)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    expected = paged_attention_reference(query.float(), k.float(), v.float(), starts, seq_lens, tables, 0.125)
    got = _attend(query, k, v, padded, q_lens, seq_lens)
    assert got.dtype == dtype
    tolerance = max(TOLERANCE[dtype], TOLERANCE[kv_dtype])
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_unwritten_slots_past_a_sequence_never_reach_its_output():
    """Slots of a block past the sequence's length may hold anything, NaN included."""
    gen = torch.Generator().manual_seed(4)
    k, v, tables, padded = _paged_case([21], 2, 64, 16, gen)
    query = torch.randn(1, 4, 64, generator=gen)
    clean = _attend(query, k, v, padded, [1], [21])
    last = tables[0][1]
    k[last, 5:], v[last, 5:] = float("nan"), float("nan")
    assert torch.equal(_attend(query, k, v, padded, [1], [21]), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_a_tokens_attention_is_bit_identical_however_it_arrives(dtype, block_size):
    """Sequence A (70 tokens) computed: whole; in chunks of 13; token by token (decodes); beside
    other sequences of other lengths; and from other physical blocks. Every one of its rows must
    come out with the same bits each way."""
    gen = torch.Generator().manual_seed(block_size)
    heads, kv_heads, head_dim, length = 9, 3, 64, 70
    others = [5, 150, 33]
    k, v, _, padded = _paged_case([length, *others], kv_heads, head_dim, block_size, gen, dtype)
    query = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    whole = _attend(query, k, v, padded[:1], [length], [length])

    chunked = torch.cat(
        [
            _attend(query[start : start + 13], k, v, padded[:1], [min(13, length - start)], [min(start + 13, length)])
            for start in range(0, length, 13)
        ]
    )
    assert torch.equal(chunked, whole)
    decodes = torch.cat([_attend(query[p : p + 1], k, v, padded[:1], [1], [p + 1]) for p in range(length)])
    assert torch.equal(decodes, whole)

    # Beside others: A's last 7 tokens as an extend, between two decodes and a prefill.
    other_q = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in (1, 33, 1)]
    batch_q = torch.cat([other_q[0], query[-7:], other_q[1], other_q[2]])
    order = [1, 0, 3, 2]  # A is row 1 of the table
    rows = padded[torch.tensor(order)]
    out = _attend(batch_q, k, v, rows, [1, 7, 33, 1], [others[0], length, others[2], others[1]])
    assert torch.equal(out[1:8], whole[-7:])

    # Other physical blocks holding the same K/V (a prefix-cache copy, a swap-in, a recompute).
    moved = torch.randperm(k.shape[0], generator=gen)
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    k2[moved], v2[moved] = k, v
    assert torch.equal(_attend(query, k2, v2, moved[padded[:1].long()].int(), [length], [length]), whole)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_the_head_major_layout(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim = 96 // block_size + 1, 3, 64
    slots = torch.tensor([17, 3, -1, 95, 40, 0], dtype=torch.int64)
    fused = torch.randn(len(slots), 2 * kv_heads * head_dim + 8, generator=gen)  # strided views, like qkv
    key = fused[:, : kv_heads * head_dim].view(-1, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(-1, kv_heads, head_dim)
    expected_k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    expected_v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = cpu_ops.head_major(expected_k, expected_v)
    store_kv_reference(key.to(dtype), value.to(dtype), expected_k, expected_v, slots)
    cpu_ops.store_kv(key, value, k_cache, v_cache, slots)  # fp32 rows, converted to the cache's dtype
    want_k, want_v = cpu_ops.head_major(expected_k, expected_v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    gen = torch.Generator().manual_seed(5)
    k, v, _, padded = _paged_case([20], 2, 64, 16, gen)
    kh, vh = cpu_ops.head_major(k, v)
    query = torch.randn(1, 4, 64)
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block table too narrow"):
        cpu_ops.paged_attention(query, kh, vh, padded, one, torch.tensor([200], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.paged_attention(query, kh, vh, padded + 100, one, torch.tensor([20], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.store_kv(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kh, vh, torch.tensor([10_000]))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        odd = torch.randn(4, 2, 12, 16)
        cpu_ops.paged_attention(torch.randn(1, 4, 12), odd, odd.transpose(2, 3).contiguous(), padded, one,
                                torch.tensor([5], dtype=torch.int32), 0.1)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch_and_every_row_count_gives_the_same_bits(dtype):
    gen = torch.Generator().manual_seed(6)
    width = 100  # not a multiple of 8: the zero-padded last chunk
    gate_up = (torch.randn(300, 2 * width, generator=gen) * 4).to(dtype)
    expected = F.silu(gate_up[:, :width].float()) * gate_up[:, width:].float()
    got = cpu_ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (300, width)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tolerance * 10, rtol=tolerance)
    for rows in (1, 7, 64):
        pieces = torch.cat([cpu_ops.silu_mul(gate_up[start : start + rows]) for start in range(0, 300, rows)])
        assert torch.equal(pieces, got)
    strided = torch.randn(5, 2 * width + 6, generator=gen).to(dtype)[:, : 2 * width]  # a view, like a chunk
    assert torch.equal(cpu_ops.silu_mul(strided), cpu_ops.silu_mul(strided.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rounds_alike_in_its_vector_body_and_its_tail(dtype):
    """Column 8 is in the 8-wide vector body of a 16-wide row and in the scalar tail of a 9-wide one:
    the same inputs there give the same bits, specials included."""
    values = torch.tensor([0.5, -3.0, 1e-3, 7.25, float("nan"), float("inf"), -float("inf"), 60000.0, 1e-40])
    for g in values:
        for u in values:
            rows = []
            for width in (9, 16):
                gate_up = torch.zeros(1, 2 * width)
                gate_up[0, 8], gate_up[0, width + 8] = g, u
                rows.append(
                    cpu_ops.silu_mul(gate_up.to(dtype))[0, 8].view(
                        torch.int16 if dtype != torch.float32 else torch.int32
                    )
                )
            assert torch.equal(rows[0], rows[1]), (g, u)


def _q8_case(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales in the kernel's layout of eight interleaved rows, the last block padded."""
    blocks = (out_features + 7) // 8
    codes = torch.randint(-127, 128, (blocks, in_features * 8), generator=gen, dtype=torch.int8)
    scales = (torch.rand(blocks, in_features // 32, 8, generator=gen) * 0.01).half().float()
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_linear_matches_the_reference_and_every_row_count_gives_the_same_bits(dtype):
    """101 outputs: whole blocks of eight and a ragged last block; tiles of one to four rows; 130
    rows cross the kernel's 64-row passes."""
    gen = torch.Generator().manual_seed(7)
    codes, scales = _q8_case(101, 96, gen)
    codes[0, :8] = -127  # the extreme products: 2 · 127 · 127 in one 16-bit pair sum
    x = torch.randn(130, 96, generator=gen).to(dtype)
    x[0, :4] = -1.0
    x[5, 32:64] = 0  # a group of zeros: scale 0, codes 0
    got = cpu_ops.q8_linear(x, codes, scales, 101)
    assert got.dtype == torch.float32 and got.shape == (130, 101)
    torch.testing.assert_close(got, q8_linear_reference(x, codes, scales, 101), rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 3, 4, 7, 64):
        pieces = [cpu_ops.q8_linear(x[start : start + rows], codes, scales, 101) for start in range(0, 130, rows)]
        assert torch.equal(torch.cat(pieces), got), rows


def test_q8_linear_refuses_what_it_cannot_multiply():
    gen = torch.Generator().manual_seed(8)
    codes, scales = _q8_case(16, 64, gen)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_ops.q8_linear(torch.randn(2, 32), codes, scales, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.q8_linear(torch.randn(2, 40), codes[:, :320].contiguous(), scales[:, :1].contiguous(), 16)
    with pytest.raises(RuntimeError, match="scales"):
        cpu_ops.q8_linear(torch.randn(2, 64), codes, scales.half(), 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.q8_linear(torch.randn(2, 64).half(), codes, scales, 16)
    with pytest.raises(RuntimeError, match="blocks of eight rows"):
        cpu_ops.q8_linear(torch.randn(2, 64), codes, scales, 8)


def _q4_1_case(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales in the kernel's layout of eight interleaved rows, the last block padded."""
    blocks, groups = (out_features + 7) // 8, in_features // 32
    codes = torch.randint(0, 256, (blocks, in_features * 4), generator=gen, dtype=torch.uint8)
    d = torch.rand(blocks, groups, 1, 8, generator=gen) * 0.01
    m = -torch.rand(blocks, groups, 1, 8, generator=gen) * 0.05
    return codes, torch.cat([d, m], dim=2).half().float().contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_1_linear_matches_the_reference_and_every_row_count_gives_the_same_bits(dtype):
    """101 outputs (a ragged last block of eight); tiles of one to four rows; 130 rows cross the
    kernel's 64-row passes."""
    gen = torch.Generator().manual_seed(9)
    codes, scales = _q4_1_case(101, 96, gen)
    x = torch.randn(130, 96, generator=gen).to(dtype)
    x[3, :32] = 0  # a group of zeros: scale 0, codes 0
    got = cpu_ops.q4_1_linear(x, codes, scales, 101)
    assert got.dtype == torch.float32 and got.shape == (130, 101)
    torch.testing.assert_close(got, q4_1_linear_reference(x, codes, scales, 101), rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 3, 4, 7, 64):
        pieces = [cpu_ops.q4_1_linear(x[start : start + rows], codes, scales, 101) for start in range(0, 130, rows)]
        assert torch.equal(torch.cat(pieces), got), rows


def test_q4_1_linear_gives_the_same_bits_on_one_thread_and_on_two():
    gen = torch.Generator().manual_seed(10)
    codes, scales = _q4_1_case(1000, 64, gen)
    x = torch.randn(5, 64, generator=gen)
    before = cpu_ops.set_num_threads(1)
    try:
        one = cpu_ops.q4_1_linear(x, codes, scales, 1000)
        cpu_ops.set_num_threads(2)
        assert torch.equal(cpu_ops.q4_1_linear(x, codes, scales, 1000), one)
    finally:
        cpu_ops.set_num_threads(before)


def test_q4_1_linear_refuses_what_it_cannot_multiply():
    gen = torch.Generator().manual_seed(11)
    codes, scales = _q4_1_case(16, 64, gen)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_ops.q4_1_linear(torch.randn(2, 32), codes, scales, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.q4_1_linear(torch.randn(2, 40), codes[:, :160].contiguous(), scales[:, :1].contiguous(), 16)
    with pytest.raises(RuntimeError, match="scales"):
        cpu_ops.q4_1_linear(torch.randn(2, 64), codes, scales[:, :, 0].contiguous(), 16)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_ops.q4_1_linear(torch.randn(2, 64), codes.to(torch.int8), scales, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.q4_1_linear(torch.randn(2, 64).half(), codes, scales, 16)
    with pytest.raises(RuntimeError, match="blocks of eight rows"):
        cpu_ops.q4_1_linear(torch.randn(2, 64), codes, scales, 17)


def test_a_build_killed_mid_way_does_not_stop_the_next_start(tmp_path) -> None:
    """torch's builder marks a build directory with a lock file it removes when done; a build killed
    meanwhile (an executor stopped during its first start) leaves it, and torch then waits for it forever.
    `load` holds an OS lock instead and clears the stale file: a fresh process loads the build."""
    built = ensure_kernels()
    root = tmp_path / "kernels"
    shutil.copytree(built, root / built.name)
    (root / built.name / cpu_ops.TORCH_BATON).touch()  # what a killed build leaves
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from pathlib import Path; from kvserve.kernels import cpu_ops; print(cpu_ops.load(Path({str(root)!r})))",
        ],
        capture_output=True,
        text=True,
        timeout=120,  # a stale file made it wait forever
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == str(root / built.name)
    assert not (root / built.name / cpu_ops.TORCH_BATON).exists()
