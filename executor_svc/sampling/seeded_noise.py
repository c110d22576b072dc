"""Counter-based random numbers: a uniform per (seed, output position, token id).

A draw must not depend on a generator's running state, batch order, or whether a
sequence was recomputed after preemption; so each number is a pure hash of its
coordinates. The hash is murmur3's 32-bit finaliser, evaluated vectorised in int64
lanes (products split so nothing overflows), which needs no per-row generator.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9


def _fmix32_int(h: int) -> int:
    h &= _MASK32
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 13
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def row_key(seed: int, position: int) -> int:
    """A 32-bit key for one draw; mixes all 64 bits of the seed and the output position."""
    h = _fmix32_int(position * _GOLDEN + 1)
    h = _fmix32_int(h ^ (seed & _MASK32))
    return _fmix32_int(h ^ ((seed >> 32) & _MASK32) ^ _GOLDEN)


def _mul32(h: torch.Tensor, m: int) -> torch.Tensor:
    return (h * (m & 0xFFFF) + (((h * (m >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 13)
    h = _mul32(h, _M2)
    return h ^ (h >> 16)


def uniform_noise(keys: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys), vocab] float32 uniforms in (0, 1); row i depends only on keys[i]."""
    key = torch.tensor(keys, dtype=torch.int64, device=device)[:, None]
    token = torch.arange(vocab, dtype=torch.int64, device=device)[None, :]
    h = _fmix32((_mul32(token, _GOLDEN) + key) & _MASK32)
    h = _fmix32(h ^ key)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
