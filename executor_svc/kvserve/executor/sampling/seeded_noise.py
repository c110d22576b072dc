"""Counter-based random numbers: a uniform per (seed, output position, token id).

A draw must not depend on a generator's running state, batch order, or whether a
sequence was recomputed after preemption; so each number is a pure hash of its
coordinates. The hash is murmur3's 32-bit finaliser, evaluated vectorised in int32
lanes: products wrap modulo 2**32 as the hash wants, and right shifts are masked to be
logical. That is 3-7x faster than int64 lanes with split products (docs/benchmarks.md), and the
same bits (`tests/executor/test_seeded_noise.py` holds the lanes equal to the plain-integer `fmix32`).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9

UNIFORM_BITS = 23
"""Bits of each hash a uniform keeps. With 23, `code + 0.5` needs 24 significant bits, all that
float32 holds, so every uniform is exact: from 2**-24 up to 1 - 2**-24, never 0 or 1. (With 24
bits the top code's 2**24 - 0.5 rounds to 2**24 and its uniform to exactly 1.0: a zero
exponential, an infinite score, a token drawn whatever its probability or mask.)"""


def fmix32(h: int) -> int:
    """murmur3's 32-bit finaliser on a Python int: the reference the tensor lanes must equal."""
    h &= _MASK32
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 13
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def row_key(seed: int, position: int) -> int:
    """A 32-bit key for one draw; mixes all 64 bits of the seed and the output position."""
    h = fmix32(position * _GOLDEN + 1)
    h = fmix32(h ^ (seed & _MASK32))
    return fmix32(h ^ ((seed >> 32) & _MASK32) ^ _GOLDEN)


def _signed32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _shift_right(h: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int32 lanes (torch's is arithmetic: it copies the sign bit)."""
    return (h >> bits) & ((1 << (32 - bits)) - 1)


def _fmix32_lanes(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _shift_right(h, 16)
    h = h * _signed32(_M1)
    h = h ^ _shift_right(h, 13)
    h = h * _signed32(_M2)
    return h ^ _shift_right(h, 16)


def token_hashes(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash (as int32 bits) of each (key, token) pair; `keys` and `tokens` broadcast."""
    h = _fmix32_lanes(tokens * _signed32(_GOLDEN) + keys)
    return _fmix32_lanes(h ^ keys)


def uniforms_from_hashes(h: torch.Tensor) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1) from 32-bit hashes (int32 or wider lanes)."""
    codes = _shift_right(h.to(torch.int32), 32 - UNIFORM_BITS)
    return (codes.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def key_tensor(keys: list[int], device: torch.device | str) -> torch.Tensor:
    """Row keys as int32 lanes."""
    return torch.tensor([_signed32(k) for k in keys], dtype=torch.int32, device=device)


def uniform_noise(keys: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys), vocab] float32 uniforms strictly inside (0, 1); row i depends only on keys[i]."""
    token = torch.arange(vocab, dtype=torch.int32, device=device)[None, :]
    return uniforms_from_hashes(token_hashes(key_tensor(keys, device)[:, None], token))


def uniform_noise_at(keys: list[int], rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The uniforms of `uniform_noise` at (rows[j], tokens[j]) only: the same bits, without the rest."""
    key = key_tensor(keys, tokens.device).index_select(0, rows)
    return uniforms_from_hashes(token_hashes(key, tokens.to(torch.int32)))
