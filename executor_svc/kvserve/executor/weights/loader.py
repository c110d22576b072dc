"""Load HF safetensors weights into the fused layout the forward pass uses.

q/k/v projections are concatenated into one matrix and gate/up into another at load
time, so each layer runs 4 matmuls instead of 7: fewer kernel launches and better
GEMM shapes, which matters most for small-batch decode. Each matrix becomes a `Linear`
(one copy, in the layout its device multiplies fastest; see `kvserve.executor.weights.linear`), or, with
`--weights native`, a `Q4_1Linear` on a GGUF's own 4-bit codes (`kvserve.executor.weights.gguf_weights`)
and a Q8_0 lm_head (`kvserve.executor.weights.q8_0`).

Every tensor kept is copied out of the file, so the file's mapping (and every page of it the
load touched) is released when loading ends; on CPU the token embedding alone stays mapped,
read row by row (`kvserve.executor.weights.token_embedding`).

Under tensor parallelism each rank reads only its own rows or columns of each matrix
(`kvserve.executor.tensor_parallel.layout`) and builds the same fused layers from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from kvserve.executor.model_config import ModelConfig
from kvserve.executor.tensor_parallel.layout import TensorParallelLayout, plan_layout
from kvserve.executor.weights.linear import Linear, make_linear
from kvserve.executor.weights.q4_1_linear import Q4_1Linear
from kvserve.executor.weights.q8_0 import Q8Linear, quantize
from kvserve.executor.weights.row_invariance import RowFixedLinear
from kvserve.executor.weights.token_embedding import TokenEmbedding, mapped_table

log = structlog.get_logger(__name__)


Matrix = Linear | Q4_1Linear | RowFixedLinear
"""A layer matrix: as loaded, or in fixed GEMM call shapes (`kvserve.executor.weights.invariance`)."""


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Matrix
    """hidden -> (num_heads + 2 * num_kv_heads) * head_dim, with the bias for Qwen2."""
    o_proj: Matrix
    post_attention_norm: torch.Tensor
    gate_up: Matrix
    """hidden -> 2 * intermediate: gate outputs first, then up."""
    down: Matrix


@dataclass(slots=True)
class ModelWeights:
    embed: TokenEmbedding
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear | Q8Linear | RowFixedLinear
    """hidden -> vocab; built from the embedding matrix when the model ties them."""


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


_EMBED = "model.embed_tokens.weight"
LINEAR_NAMES = ("qkv", "o_proj", "gate_up", "down")
"""A layer's matrices that `--weights native` replaces (`kvserve.executor.weights.gguf_weights`)."""
_LINEAR_SOURCES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip


def load_weights(
    model_dir: Path,
    config: ModelConfig,
    device: str,
    dtype: torch.dtype,
    layer_linears: list[dict[str, Q4_1Linear]] | None = None,
    layout: TensorParallelLayout | None = None,
    q8_lm_head: bool = False,
) -> ModelWeights:
    """Read each tensor once, when it is needed, fuse per layer, and move to `device` in `dtype`.

    `layer_linears` (per layer, by `LINEAR_NAMES`) replaces those matrices: the file's copies are
    then never read, so they never occupy memory the allocator would keep. `layout`: this rank's
    share under tensor parallelism (default: the whole model). `q8_lm_head`: the lm_head in Q8_0.
    """
    layout = layout or plan_layout(config, 0, 1)
    with ExitStack() as files:
        raw: dict[str, Any] = {}
        paths: dict[str, Path] = {}
        for path in weight_files(model_dir):
            handle = files.enter_context(safe_open(str(path), framework="pt"))
            names = list(handle.keys())  # a safe_open handle is not iterable itself
            raw.update(dict.fromkeys(names, handle))
            paths.update(dict.fromkeys(names, path))
        mapped = mapped_table(paths[_EMBED], _EMBED) if device == "cpu" and _EMBED in paths else None
        head = quantize if q8_lm_head else make_linear
        return _build(raw, model_dir, config, device, dtype, layer_linears, mapped, layout, head)


def _build(
    raw: dict[str, Any],
    model_dir: Path,
    config: ModelConfig,
    device: str,
    dtype: torch.dtype,
    layer_linears: list[dict[str, Q4_1Linear]] | None,
    mapped_embed: torch.Tensor | None,
    layout: TensorParallelLayout,
    head: Callable[[torch.Tensor], Linear | Q8Linear],
) -> ModelWeights:
    """`mapped_embed`: the embedding as a view of the file, which the lookup reads instead of a loaded table.
    `head`: makes the lm_head of its weight (`make_linear`, or Q8_0's `quantize`)."""

    def take(name: str, keep: bool = False, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """`keep`: the tensor is stored as it is. Only then is it copied out of the file's mapping, which it
        would keep alive with every page the load touched; the others become a `Linear` or are concatenated,
        which copies them anyway. `rows` / `cols`: read only that part (a tensor-parallel shard)."""
        if name not in raw:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        handle = raw.pop(name)
        if rows is not None:
            tensor = handle.get_slice(name)[rows]
        elif cols is not None:
            tensor = handle.get_slice(name)[:, cols]
        else:
            tensor = handle.get_tensor(name)
        converted = tensor.to(device=device, dtype=dtype).contiguous()
        return converted.clone() if keep and converted.data_ptr() == tensor.data_ptr() else converted

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        linears: Mapping[str, Linear | Q4_1Linear]
        if layer_linears is None:
            linears = _fused_linears(take, p, config, layout)
        else:
            for name in _LINEAR_SOURCES:
                raw.pop(p + name, None)  # replaced: never read
            linears = layer_linears[i]
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight", keep=True),
                post_attention_norm=take(p + "post_attention_layernorm.weight", keep=True),
                **{name: linears[name] for name in LINEAR_NAMES},
            )
        )
    untied = not config.tie_word_embeddings and "lm_head.weight" in raw
    vocab = layout.vocab_rows if layout.sharded else None
    if mapped_embed is not None and vocab is not None:
        mapped_embed = mapped_embed[vocab]  # still a view of the file
    if untied and mapped_embed is not None:
        raw.pop(_EMBED)  # looked up from the file's mapping: never loaded
        table, lm_head = mapped_embed, head(_pad_rows(take("lm_head.weight", rows=vocab), layout))
    else:
        # A tied lm_head needs the whole matrix; it is kept as the lookup table only when none is mapped.
        embed = take(_EMBED, keep=mapped_embed is None, rows=vocab)
        lm_head = head(_pad_rows(take("lm_head.weight", rows=vocab) if untied else embed, layout))
        table = embed if mapped_embed is None else mapped_embed
    weights = ModelWeights(
        embed=TokenEmbedding(table, dtype, first_row=vocab.start if vocab is not None else None),
        layers=layers,
        final_norm=take("model.norm.weight", keep=True),
        lm_head=lm_head,
    )
    leftovers = [n for n in raw if not n.endswith("rotary_emb.inv_freq") and n != "lm_head.weight"]
    if leftovers:
        log.warning("ignored unexpected weights", count=len(leftovers), first=leftovers[:3])
    return weights


def _fused_linears(
    take: Callable[..., torch.Tensor], p: str, config: ModelConfig, layout: TensorParallelLayout
) -> dict[str, Linear]:
    """One layer's matrices from the file, q/k/v and gate/up each fused into one `Linear`; under
    tensor parallelism, this rank's rows of the column-parallel ones and columns of the row-parallel ones."""
    whole = not layout.sharded
    q, kv, mlp = (None, None, None) if whole else (layout.q_rows, layout.kv_rows, layout.mlp_rows)
    attn = p + "self_attn."
    qkv = torch.cat(
        [
            take(attn + "q_proj.weight", rows=q),
            take(attn + "k_proj.weight", rows=kv),
            take(attn + "v_proj.weight", rows=kv),
        ]
    )
    bias = None
    if config.attention_bias:
        bias = torch.cat(
            [
                take(attn + "q_proj.bias", rows=q),
                take(attn + "k_proj.bias", rows=kv),
                take(attn + "v_proj.bias", rows=kv),
            ]
        )
    gate_up = torch.cat([take(p + "mlp.gate_proj.weight", rows=mlp), take(p + "mlp.up_proj.weight", rows=mlp)])
    return {
        "qkv": make_linear(qkv, bias),
        "o_proj": make_linear(take(attn + "o_proj.weight", cols=q)),
        "gate_up": make_linear(gate_up),
        "down": make_linear(take(p + "mlp.down_proj.weight", cols=mlp)),
    }


def _pad_rows(weight: torch.Tensor, layout: TensorParallelLayout) -> torch.Tensor:
    """A vocab shard of lm_head with zero rows up to the shard size every rank gathers (cut off on rank 0)."""
    missing = layout.vocab_shard - weight.shape[0] if layout.sharded else 0
    if missing <= 0:
        return weight
    return torch.cat([weight, weight.new_zeros(missing, weight.shape[1])])
