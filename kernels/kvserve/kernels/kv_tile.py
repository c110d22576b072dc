"""The tile of cached tokens one iteration of an attention kernel's KV loop reads.

Both attention kernels walk a sequence's context through its block table, one tile of
TILE_N consecutive positions at a time, and reduce over the tile with `tl.dot(p, v)`. On
CUDA a dot of 16-bit inputs needs a reduction dimension of at least 16, so a tile is one
block when blocks hold 16 or more tokens and several blocks when they hold fewer (8): then
each position looks up its own block. Block sizes must be powers of two (tiles are
`tl.arange` ranges).
"""

from __future__ import annotations

import triton
import triton.language as tl

MIN_DOT_K = 16
"""The smallest reduction dimension of `tl.dot` on CUDA for bfloat16/float16 inputs."""


def kv_tile_tokens(block_size: int) -> int:
    """TILE_N for a cache of `block_size`-token blocks: one block, or enough blocks to make MIN_DOT_K."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"the Triton kernels need a power-of-two block size, got {block_size}")
    return max(MIN_DOT_K, block_size)


@triton.jit
def tile_slots(block_table_ptr, tile, seq_len, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton JIT: untyped by nature
    """(cache slots, positions) of positions [tile * TILE_N, (tile + 1) * TILE_N) of the sequence
    whose block-table row starts at `block_table_ptr`. Positions at or past `seq_len` get some
    valid slot (of block 0 when the tile spans blocks); callers mask them out of the scores."""
    offs = tl.arange(0, TILE_N)
    pos = tile * TILE_N + offs
    if TILE_N == BLOCK_SIZE:
        phys = tl.load(block_table_ptr + tile).to(tl.int64)
        slots = phys * BLOCK_SIZE + offs
    else:
        # the row holds cdiv(seq_len, BLOCK_SIZE) entries or more: never read past them
        phys = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos < seq_len, other=0).to(tl.int64)
        slots = phys * BLOCK_SIZE + pos % BLOCK_SIZE
    return slots, pos
