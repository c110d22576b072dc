"""Tensor-parallel sharding, one layer at a time, through the real weight loaders.

Every rank's share is loaded in this one process (`load_weights` / `native_layer_linears` with
that rank's layout), and the collectives are done by hand: column-parallel outputs side by side
in head order, row-parallel partial sums added, vocab-parallel lookups added and logits side by
side. Each must equal the unsharded layer (fp32 allclose). The real collectives run in
test_tensor_parallel_model.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.executor.model_config import ModelConfig, RopeConfig, load_model_config
from kvserve.executor.tensor_parallel.layout import (
    TensorParallelFitError,
    TensorParallelLayout,
    check_fits,
    plan_layout,
)
from kvserve.executor.weights.gguf_q4_1 import GROUP, Q4_1Weight, dequantize, select_columns, select_rows
from kvserve.executor.weights.loader import ModelWeights, load_weights
from kvserve.testing.tiny_checkpoints import SHARDABLE, write_tiny_checkpoint

TINY = {k: v for k, v in SHARDABLE.items() if k != "num_key_value_heads"} | dict(num_hidden_layers=1)
"""One layer is enough to check each layer type."""


def _weights(model_dir, config: ModelConfig, layout: TensorParallelLayout) -> ModelWeights:
    return load_weights(model_dir, config, "cpu", torch.float32, layout=layout)


def _qkv_in_head_order(outputs: list[torch.Tensor], layouts: list[TensorParallelLayout]) -> torch.Tensor:
    """Rank-ordered [q | k | v] blocks regrouped into the unsharded [q | k | v] order (replicated KV heads once)."""
    qs, ks, vs = [], [], []
    seen_kv: set[int] = set()
    for out, lay in zip(outputs, layouts, strict=True):
        q_width, kv_width = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
        qs.append(out[:, :q_width])
        if lay.first_kv_head not in seen_kv:
            seen_kv.add(lay.first_kv_head)
            ks.append(out[:, q_width : q_width + kv_width])
            vs.append(out[:, q_width + kv_width :])
    return torch.cat(qs + ks + vs, dim=1)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("arch,kv_heads", [("llama", 6), ("mistral", 1), ("qwen2", 12)])
@pytest.mark.parametrize("tied", [False, True])
def test_each_parallel_layer_equals_the_unsharded_layer(tmp_path, arch, kv_heads, size, tied) -> None:
    path = write_tiny_checkpoint(tmp_path / arch, arch, num_key_value_heads=kv_heads, tie_word_embeddings=tied, **TINY)
    config = load_model_config(path)
    whole = _weights(path, config, plan_layout(config, 0, 1))
    layouts = [plan_layout(config, rank, size) for rank in range(size)]
    shards = [_weights(path, config, layout) for layout in layouts]
    torch.manual_seed(1)
    x = torch.randn(5, config.hidden_size)
    layer, parts = whole.layers[0], [s.layers[0] for s in shards]

    # Column-parallel: each rank's q/k/v (with Qwen2's bias) and gate/up rows.
    qkv = _qkv_in_head_order([p.qkv(x) for p in parts], layouts)
    torch.testing.assert_close(qkv, layer.qkv(x), rtol=1e-5, atol=1e-5)
    gate_up = [p.gate_up(x).chunk(2, dim=-1) for p in parts]
    gate, up = layer.gate_up(x).chunk(2, dim=-1)
    torch.testing.assert_close(torch.cat([g for g, _ in gate_up], dim=1), gate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([u for _, u in gate_up], dim=1), up, rtol=1e-5, atol=1e-5)

    # Row-parallel: each rank multiplies its columns of the input; the partial sums add up.
    attn = torch.randn(5, config.num_heads * config.head_dim)
    o_parts = [p.o_proj(attn[:, lay.q_rows]) for p, lay in zip(parts, layouts, strict=True)]
    torch.testing.assert_close(sum(o_parts), layer.o_proj(attn), rtol=1e-5, atol=1e-5)
    act = torch.randn(5, config.intermediate_size)
    down_parts = [p.down(act[:, lay.mlp_rows]) for p, lay in zip(parts, layouts, strict=True)]
    torch.testing.assert_close(sum(down_parts), layer.down(act), rtol=1e-5, atol=1e-5)

    # Vocab-parallel: lookups outside a rank's rows are zero, so the sum is the lookup; logits side by side.
    ids = torch.tensor([0, 1, 85, 86, 127, 128, 171, 172, 255])
    torch.testing.assert_close(sum(s.embed(ids) for s in shards), whole.embed(ids), rtol=0, atol=0)
    logits = torch.cat([s.lm_head(x) for s in shards], dim=1)
    assert logits.shape[1] == size * layouts[0].vocab_shard >= config.vocab_size
    torch.testing.assert_close(logits[:, : config.vocab_size], whole.lm_head(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, config.vocab_size :], torch.zeros_like(logits[:, config.vocab_size :]))


def test_replicated_kv_heads_sit_beside_the_query_heads_that_read_them(tmp_path) -> None:
    config = load_model_config(write_tiny_checkpoint(tmp_path / "m", num_key_value_heads=2, **TINY))
    layouts = [plan_layout(config, rank, 4) for rank in range(4)]  # 2 KV heads on 4 ranks: each twice
    assert [lay.first_kv_head for lay in layouts] == [0, 0, 1, 1]
    group = config.num_heads // config.num_kv_heads
    for lay in layouts:
        assert lay.num_kv_heads == 1
        assert {head // group for head in range(lay.first_head, lay.first_head + lay.num_heads)} == {lay.first_kv_head}


def _q4_1(rows: int, columns: int) -> Q4_1Weight:
    g = torch.Generator().manual_seed(rows * columns)
    codes = torch.randint(0, 16, (rows, columns), generator=g, dtype=torch.uint8)
    d = (torch.rand(rows, columns // GROUP, generator=g) / 16).half()
    m = (-torch.rand(rows, columns // GROUP, generator=g)).half()
    return Q4_1Weight(codes, d, m)


@pytest.mark.parametrize("size", [2, 3])
def test_q4_1_shards_are_exact_rows_and_group_aligned_columns(size) -> None:
    weight = _q4_1(48, 6 * GROUP)
    full = dequantize(weight)
    rows, cols = 48 // size, 6 * GROUP // size
    for rank in range(size):
        r, c = slice(rank * rows, (rank + 1) * rows), slice(rank * cols, (rank + 1) * cols)
        assert torch.equal(dequantize(select_rows(weight, r)), full[r])
        assert torch.equal(dequantize(select_columns(weight, c)), full[:, c])
    with pytest.raises(ValueError, match="group boundary"):
        select_columns(weight, slice(16, 48))


@pytest.mark.slow
def test_native_int4_layers_of_the_default_model_shard_at_three(default_model_dir) -> None:
    """The GGUF's own 4-bit layers, split 3 ways (9 heads, 3 KV heads): the shards add up to the whole."""
    from kvserve.executor.attention.cpu_backend import ensure_kernels
    from kvserve.executor.weights import model_store
    from kvserve.executor.weights.gguf_weights import native_layer_linears, read_q4_1_layers

    ensure_kernels()  # the layers call kvserve's CPU kernels; no other test need have loaded them
    source = model_store.resolve_source(None)
    assert source.gguf_file is not None
    gguf = source.path / source.gguf_file
    config = load_model_config(default_model_dir)
    config.num_layers = 1  # the first layer is enough, and reading it is quick
    assert read_q4_1_layers(gguf, config)
    layouts = [plan_layout(config, rank, 3) for rank in range(3)]
    whole = native_layer_linears(gguf, config)[0]
    parts = [native_layer_linears(gguf, config, lay)[0] for lay in layouts]
    torch.manual_seed(2)
    x = torch.randn(4, config.hidden_size)
    # Column-parallel shards compute the same rows as the whole, one rounding each: equal.
    torch.testing.assert_close(_qkv_in_head_order([p["qkv"](x) for p in parts], layouts), whole["qkv"](x))
    # Row-parallel shards split the inputs at group boundaries, so each part rounds its activations to the
    # same 8-bit codes as the whole and sums a subset of the whole's exact group sums in float32: the parts
    # add up to the whole within float32 rounding, far inside the bound (a few 2^-8 roundings).
    attn = torch.randn(4, config.num_heads * config.head_dim)
    _assert_sums_to(
        [p["o_proj"](attn[:, lay.q_rows]) for p, lay in zip(parts, layouts, strict=True)], whole["o_proj"](attn)
    )
    act = torch.randn(4, config.intermediate_size)
    _assert_sums_to(
        [p["down"](act[:, lay.mlp_rows]) for p, lay in zip(parts, layouts, strict=True)], whole["down"](act)
    )


def _assert_sums_to(parts: list[torch.Tensor], whole: torch.Tensor) -> None:
    bound = (len(parts) + 1) * 2**-8 * max(p.abs().max().item() for p in [*parts, whole])
    assert (sum(parts) - whole).abs().max().item() <= bound
    assert (sum(parts) - whole).abs().max().item() < 0.05 * whole.abs().max().item()


def test_a_size_that_does_not_fit_is_refused_with_the_numbers() -> None:
    config = ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True, attention_bias=False, rope=RopeConfig(),
    )  # fmt: skip
    with pytest.raises(TensorParallelFitError) as refused:
        check_fits(config, 2)
    message = str(refused.value)
    assert "num_attention_heads 9 is not divisible by 2" in message
    assert "num_key_value_heads 3 is not divisible by 2" in message
    assert "sizes that fit: 1, 3)" in message  # 9 would split the heads, not the MLP's 1536 columns
    with pytest.raises(TensorParallelFitError, match="num_attention_heads 9 is not divisible by 6"):
        check_fits(config, 6)
    with pytest.raises(TensorParallelFitError, match="intermediate_size 1536 is not divisible by 9"):
        check_fits(config, 9)
    check_fits(config, 3)
    check_fits(dataclasses.replace(config, intermediate_size=1152), 9)  # 3 KV heads, each on 3 ranks
    with pytest.raises(TensorParallelFitError, match="vocab_size 5 leaves the last of 4 ranks no vocabulary rows"):
        check_fits(dataclasses.replace(config, num_heads=8, num_kv_heads=4, intermediate_size=64, vocab_size=5), 4)
    check_fits(config, 3, group_columns=32)  # 192 attention and 512 MLP columns per rank: whole Q4_1 groups
    with pytest.raises(TensorParallelFitError, match=r"attention columns \(80\) are not a multiple of 32"):
        check_fits(dataclasses.replace(config, num_heads=12, num_kv_heads=6, head_dim=40), 6, group_columns=32)
