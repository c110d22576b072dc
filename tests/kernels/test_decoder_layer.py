"""The native path's fused decoder layer and its RMSNorm (`kernels/cpu/decoder_layer.cpp`).

The fused op must equal its own steps run one by one through the separate kernels, bit for bit, also
with LoRA deltas inside it, and a token's result must not depend on what shares the call."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.model.llama import apply_rope, rms_norm
from kvserve.kernels import cpu_ops
from tests.kernels.paged_steps import step_metadata

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK = 64, 4, 2, 16, 96, 16
EPS = 1e-5
MAX_POSITIONS = 64


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


def _q4_1(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random codes and scales in `q4_1_linear`'s layout of eight interleaved rows."""
    blocks, groups = (out_features + 7) // 8, in_features // 32
    codes = torch.randint(0, 256, (blocks, in_features * 4), generator=gen, dtype=torch.uint8)
    d = torch.rand(blocks, groups, 1, 8, generator=gen) * 0.02
    m = -torch.rand(blocks, groups, 1, 8, generator=gen) * 0.1
    return codes, torch.cat([d, m], dim=2).half().float().contiguous(), out_features


def _layer(gen: torch.Generator):
    """Norm weights, the four matrices (qkv, o_proj, gate_up, down) and rotary tables."""
    norms = (1 + 0.1 * torch.randn(HIDDEN, generator=gen), 1 + 0.1 * torch.randn(HIDDEN, generator=gen))
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTERMEDIATE, HIDDEN),
              (HIDDEN, INTERMEDIATE)]  # fmt: skip
    matrices = [_q4_1(out, inp, gen) for out, inp in shapes]
    angles = torch.outer(torch.arange(MAX_POSITIONS, dtype=torch.float32), torch.rand(HEAD_DIM // 2, generator=gen))
    angles = torch.cat([angles, angles], dim=-1)
    half = HEAD_DIM // 2
    sin_signed = torch.cat([-angles[:, :half].sin(), angles[:, half:].sin()], dim=-1)
    return norms, matrices, angles.cos().contiguous(), sin_signed.contiguous()


def _batch(cached: list[int], new: list[int]):
    """Positions, slot mapping, block tables (disjoint, in order), query starts and lengths."""
    tables, next_block = [], 0
    for before, count in zip(cached, new, strict=True):
        blocks = -(-(before + count) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    return step_metadata(cached, new, tables, BLOCK)


def _caches(gen: torch.Generator, blocks: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-major caches with random contents standing for earlier tokens."""
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    return cpu_ops.head_major(k, v)


def _fused(x, layer, batch, caches, lora: cpu_ops.LayerLora | None = None) -> None:
    norms, matrices, cos, sin_signed = layer
    positions, slots, tables, starts, lens = batch
    codes, scales, outs = (list(column) for column in zip(*matrices, strict=True))
    cpu_ops.decoder_layer(
        x, norms, EPS, (codes, scales, outs), (positions, cos, sin_signed), (HEADS, KV_HEADS), caches,
        (slots, tables, starts, lens, HEAD_DIM**-0.5), lora,
    )  # fmt: skip


def _step_by_step(x, layer, batch, caches, lora: cpu_ops.LayerLora | None = None) -> None:
    """The same layer through the separate kernels and `apply_rope`, as the unfused forward runs it,
    with `lora`'s deltas added after each product (`LayerLora.add`: `lora_add` per source)."""
    norms, (qkv_w, o_w, gate_up_w, down_w), cos, sin_signed = layer
    positions, slots, tables, starts, lens = batch
    tokens, qk_width = x.shape[0], (HEADS + KV_HEADS) * HEAD_DIM

    def product(index: int, inputs: torch.Tensor, weights) -> torch.Tensor:
        out = cpu_ops.q4_1_linear(inputs, *weights)
        if lora is not None:
            lora.add(cpu_ops.LayerLora.PRODUCTS[index], inputs, out)
        return out

    h = cpu_ops.rms_norm(x, norms[0], EPS)
    qkv = product(0, h, qkv_w)
    rotary = cos[positions][:, None], sin_signed[positions][:, None]
    qk = apply_rope(qkv[:, :qk_width].view(tokens, -1, HEAD_DIM), *rotary)
    q, k = qk[:, :HEADS].contiguous(), qk[:, HEADS:]
    v = qkv[:, qk_width:].view(tokens, KV_HEADS, HEAD_DIM)
    cpu_ops.store_kv(k, v, caches[0], caches[1], slots)
    attn = cpu_ops.paged_attention(q, caches[0], caches[1], tables, starts, lens, HEAD_DIM**-0.5)
    x.add_(product(1, attn.reshape(tokens, -1), o_w))
    h = cpu_ops.rms_norm(x, norms[1], EPS)
    x.add_(product(3, cpu_ops.silu_mul(product(2, h, gate_up_w)), down_w))


def _lora(slotted: list[int], own: list[int], gen: torch.Generator) -> cpu_ops.LayerLora:
    """Two sources: three slots with per-projection ranks (qkv, o_proj and gate_up; none for down), and
    one adapter of its own with one dense block per product; `slotted` and `own` are their row slots."""
    ins = [HIDDEN, HEADS * HEAD_DIM, HIDDEN, INTERMEDIATE]
    outs = [[HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], [HIDDEN], [INTERMEDIATE] * 2, [HIDDEN]]
    slot_ranks = [[[8, 0, 8], [4, 4, 4], [16, 16, 0]], [[8], [0], [4]], [[4, 8], [8, 4], [0, 16]], None]
    a, b, ranks, columns = [], [], [], []
    none = torch.empty(0)
    for n_in, widths, per_slot in zip(ins, outs, slot_ranks, strict=True):
        bounds = [0, *torch.tensor(widths).cumsum(0).tolist()]
        if per_slot is None:
            a.append(none), b.append(none), ranks.append(none), columns.append(none.long())
        else:
            floats = max(sum(r * w for r, w in zip(rs, widths, strict=True)) for rs in per_slot)
            a.append(torch.randn(3, max(sum(rs) for rs in per_slot), n_in, generator=gen) / n_in**0.5)
            b.append(torch.randn(3, floats, generator=gen) * 0.1)
            ranks.append(torch.tensor(per_slot, dtype=torch.int32))
            columns.append(torch.tensor(bounds))
        a.append(torch.randn(1, 8, n_in, generator=gen) / n_in**0.5)
        b.append(torch.randn(1, 8 * sum(widths), generator=gen) * 0.1)
        ranks.append(none)
        columns.append(none.long())
    scaling = [torch.tensor([0.5, 2.0, 1.0]), torch.tensor([0.25])]
    row_slots = [torch.tensor(slotted, dtype=torch.int32), torch.tensor(own, dtype=torch.int32)]
    return cpu_ops.LayerLora(row_slots, scaling, a, b, ranks, columns)


def test_rms_norm_matches_torch_and_a_row_gives_the_same_bits_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(37, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    got = cpu_ops.rms_norm(x, weight, EPS)
    torch.testing.assert_close(got, rms_norm(x, weight, EPS), rtol=2e-6, atol=2e-6)
    for rows in (1, 3, 16):
        assert torch.equal(torch.cat([cpu_ops.rms_norm(x[i : i + rows], weight, EPS) for i in range(0, 37, rows)]), got)


def test_the_fused_layer_equals_its_steps_bit_for_bit() -> None:
    """Two sequences: one with 19 cached tokens and 3 new (its blocks cross a boundary), one prefilling 21."""
    gen = torch.Generator().manual_seed(2)
    layer, batch = _layer(gen), _batch(cached=[19, 0], new=[3, 21])
    x = torch.randn(24, HIDDEN, generator=gen)
    caches = _caches(gen)
    fused_x, fused_caches = x.clone(), tuple(c.clone() for c in caches)
    _fused(fused_x, layer, batch, fused_caches)
    _step_by_step(x, layer, batch, caches)
    assert torch.equal(fused_x, x)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches, strict=True))
    assert not torch.equal(fused_x, torch.zeros_like(x))


def test_lora_deltas_inside_the_fused_layer_equal_lora_add_after_each_step() -> None:
    """A step with rows under adapters keeps the fused layer: its rows get the bits of the op-by-op
    layer with `lora_add` after each product, and the base model's rows the bits they get without LoRA."""
    gen = torch.Generator().manual_seed(5)
    layer, batch = _layer(gen), _batch(cached=[19, 0, 5, 2], new=[3, 21, 4, 2])
    x, caches = torch.randn(30, HIDDEN, generator=gen), _caches(gen, blocks=12)
    # A sequence under slot 1, one under no adapter, one under the adapter of its own, one under slot 2.
    lora = _lora([1] * 3 + [-1] * 21 + [-1] * 4 + [2] * 2, [-1] * 24 + [0] * 4 + [-1] * 2, gen)
    runs = {}
    for name, run, deltas in [("fused", _fused, lora), ("steps", _step_by_step, lora), ("base", _fused, None)]:
        runs[name] = x.clone(), tuple(c.clone() for c in caches)
        run(runs[name][0], layer, batch, runs[name][1], deltas)
    assert torch.equal(runs["fused"][0], runs["steps"][0])
    assert all(torch.equal(a, b) for a, b in zip(runs["fused"][1], runs["steps"][1], strict=True))
    base_rows = (lora.row_slots[0] < 0) & (lora.row_slots[1] < 0)
    assert torch.equal(runs["fused"][0][base_rows], runs["base"][0][base_rows])
    assert not torch.equal(runs["fused"][0][~base_rows], runs["base"][0][~base_rows])


def test_a_tokens_layer_output_is_the_same_alone_and_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    layer = _layer(gen)
    x = torch.randn(24, HIDDEN, generator=gen)
    caches = _caches(gen)
    together, together_caches = x.clone(), tuple(c.clone() for c in caches)
    _fused(together, layer, _batch(cached=[19, 0], new=[3, 21]), together_caches)
    alone, alone_caches = x[:3].clone(), tuple(c.clone() for c in caches)
    _fused(alone, layer, _batch(cached=[19], new=[3]), alone_caches)
    assert torch.equal(alone, together[:3])


def test_bad_arguments_are_refused_by_name() -> None:
    gen = torch.Generator().manual_seed(4)
    norms, matrices, cos, sin_signed = layer = _layer(gen)
    x, caches = torch.randn(3, HIDDEN, generator=gen), _caches(gen)
    positions, *rest = _batch(cached=[19], new=[3])
    with pytest.raises(RuntimeError, match="past the rotary tables"):
        _fused(x, layer, (positions + MAX_POSITIONS, *rest), caches)
    with pytest.raises(RuntimeError, match="qkv's out_features"):
        _fused(x, (norms, [matrices[1], *matrices[1:]], cos, sin_signed), (positions, *rest), caches)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.rms_norm(x.double(), norms[0], EPS)
    lora = _lora([0, 1, -1], [-1, -1, 0], gen)
    with pytest.raises(RuntimeError, match="the LoRA lists take"):
        _fused(x, layer, (positions, *rest), caches, cpu_ops.LayerLora(**{**asdict(lora), "a": lora.a[:-1]}))
    with pytest.raises(RuntimeError, match="columns must be contiguous int64"):
        columns = [c.int() for c in lora.columns]
        _fused(x, layer, (positions, *rest), caches, cpu_ops.LayerLora(**{**asdict(lora), "columns": columns}))
