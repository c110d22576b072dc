"""`--weights native`: serve a GGUF's Q4_1 linear layers as they ship, through `Q4_1Linear`.

Each layer's q/k/v, o, gate/up and down matrices come from the GGUF's own 4-bit codes, and
`load_weights` reads everything else from the converted fp32 directory without ever reading
those matrices there (norms and the embedding's lookups stay fp32).

llama.cpp's converter permutes the rows of q and k for its rotary layout; the rows are
permuted back here (exact: a Q4_1 group runs along a row), and the converted directory's
fp32 weights equal `dequantize` of the result, which `tests/executor/test_native_weights.py`
checks layer by layer. The lm_head runs Q8_0 (`kvserve.executor.weights.q8_0`), whose codes equal
the default GGUF's own Q8_0 embedding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.model_config import ModelConfig
from kvserve.executor.tensor_parallel.layout import TensorParallelLayout, check_fits, plan_layout
from kvserve.executor.weights import model_store
from kvserve.executor.weights.gguf_q4_1 import GROUP, Q4_1Weight, concat_rows, parse_q4_1, select_columns, select_rows
from kvserve.executor.weights.q4_1_linear import Q4_1Linear, make_q4_1_linear

log = structlog.get_logger(__name__)

_LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class NativeWeightsUnavailable(ExecutorConfigError):
    """The model has no Q4_1 linear layers to serve natively (not a GGUF, or another format)."""


def native_linears_or_none(
    model: str | None, config: ModelConfig, layout: TensorParallelLayout | None = None, *, required: bool
) -> list[dict[str, Q4_1Linear]] | None:
    """`native_layer_linears` of the model `model` names (a `--model` or `--draft-model` source, None the
    default model); None where it has no Q4_1 layers to serve and `required` is false, so the caller loads
    dequantized weights instead. One read of the file either way: parsing its header alone took ~3 s."""
    source = model_store.resolve_source(model)
    try:
        if source.gguf_file is None:
            raise NativeWeightsUnavailable(
                f"--weights native needs a GGUF model; {source.path} is a safetensors directory"
            )
        return native_layer_linears(source.path / source.gguf_file, config, layout)
    except NativeWeightsUnavailable as why:
        if required:
            raise
        log.info("dequantized weights: the model has no Q4_1 layers to run natively", model=model, why=str(why))
        return None


def read_q4_1_layers(gguf_path: Path, config: ModelConfig) -> list[dict[str, Q4_1Weight]]:
    """Each layer's Q4_1 matrices, q and k rows back in Hugging Face order."""
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    layers = []
    for i in range(config.num_layers):
        layer = {}
        for name in _LAYER_TENSORS:
            tensor = tensors.get(f"blk.{i}.{name}.weight")
            if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q4_1:
                kind = "missing" if tensor is None else tensor.tensor_type.name
                raise NativeWeightsUnavailable(f"blk.{i}.{name}.weight is {kind}, not Q4_1")
            layer[name] = parse_q4_1(np.asarray(tensor.data))
        layer["attn_q"] = _unpermute_rows(layer["attn_q"], config.num_heads)
        layer["attn_k"] = _unpermute_rows(layer["attn_k"], config.num_kv_heads)
        layers.append(layer)
    return layers


def native_layer_linears(
    gguf_path: Path, config: ModelConfig, layout: TensorParallelLayout | None = None
) -> list[dict[str, Q4_1Linear]]:
    """Each layer's `Q4_1Linear`s on the GGUF's codes, by `weights.LINEAR_NAMES`, for `load_weights`;
    under tensor parallelism, this rank's rows and columns of them (`kvserve.executor.tensor_parallel.layout`)."""
    if config.attention_bias:
        raise NativeWeightsUnavailable("q/k/v biases are not read from GGUF files")
    check_fits(config, layout.size if layout else 1, group_columns=GROUP)
    layout = layout or plan_layout(config, 0, 1)
    q, kv, mlp = layout.q_rows, layout.kv_rows, layout.mlp_rows
    linears = [
        {
            "qkv": make_q4_1_linear(
                concat_rows(
                    [select_rows(q4["attn_q"], q), select_rows(q4["attn_k"], kv), select_rows(q4["attn_v"], kv)]
                )
            ),
            "o_proj": make_q4_1_linear(select_columns(q4["attn_output"], q)),
            "gate_up": make_q4_1_linear(
                concat_rows([select_rows(q4["ffn_gate"], mlp), select_rows(q4["ffn_up"], mlp)])
            ),
            "down": make_q4_1_linear(select_columns(q4["ffn_down"], mlp)),
        }
        for q4 in read_q4_1_layers(gguf_path, config)
    ]
    log.info(
        "native Q4_1 weights: every layer's linear matrices run from 4-bit codes (activations rounded to Q8 blocks)",
        layers=len(linears),
        kept_fp32="token embedding lookups and norms (the lm_head runs Q8_0)",
    )
    return linears


def _unpermute_rows(weight: Q4_1Weight, num_heads: int) -> Q4_1Weight:
    """Undo llama.cpp's rotary row permutation (rows of each head interleaved in pairs)."""
    rows = weight.codes.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    return Q4_1Weight(weight.codes[order], weight.d[order], weight.m[order])
