"""Triton kernel: scatter new tokens' K and V into the paged cache by slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # Triton JIT: untyped by nature
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_value_t,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_ROW)
    mask = offs < ROW
    k = tl.load(key_ptr + token * stride_key_t + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`key`/`value`: [T, kv_heads, head_dim] (rows may be strided views); caches contiguous."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and key.stride(1) == head_dim, "heads of a token must be contiguous"
    assert value.stride(2) == 1 and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK_ROW=triton.next_power_of_2(row),
    )
