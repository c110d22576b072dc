"""The seeded noise's cost per sampled step: int32 hash lanes against the int64 lanes they replaced.

    .venv/bin/python -m tests.executor.measure_seeded_noise

A sampled row without a filter hashes one uniform per vocabulary token (49,152 for the default
model). The int64 form split each 32-bit product in two; int32 lanes wrap as the hash wants. Both
give the same bits (checked here before timing). Not a test: docs/benchmarks.md records its output.
"""

from __future__ import annotations

import time

import torch

from kvserve.executor.sampling.seeded_noise import UNIFORM_BITS, row_key, uniform_noise

VOCAB = 49_152
_MASK32 = 0xFFFFFFFF
_M1, _M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def _mul32(h: torch.Tensor, m: int) -> torch.Tensor:
    return (h * (m & 0xFFFF) + (((h * (m >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 13)
    h = _mul32(h, _M2)
    return h ^ (h >> 16)


def int64_lanes(keys: list[int], vocab: int) -> torch.Tensor:
    """The earlier form: int64 lanes, each product split so nothing overflows."""
    key = torch.tensor(keys, dtype=torch.int64)[:, None]
    token = torch.arange(vocab, dtype=torch.int64)[None, :]
    h = _fmix32(_fmix32((_mul32(token, _GOLDEN) + key) & _MASK32) ^ key)
    return ((h >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def _ms(fn, keys: list[int], repeats: int) -> float:
    fn(keys, VOCAB)
    started = time.perf_counter()
    for _ in range(repeats):
        fn(keys, VOCAB)
    return (time.perf_counter() - started) / repeats * 1000


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocabulary {VOCAB:,}")
    for rows in (1, 8, 64):
        keys = [row_key(seed, 0) for seed in range(rows)]
        assert torch.equal(int64_lanes(keys, VOCAB), uniform_noise(keys, VOCAB))
        before, now = _ms(int64_lanes, keys, 20), _ms(uniform_noise, keys, 20)
        print(f"{rows:3d} rows: int64 lanes {before:7.2f} ms, int32 lanes {now:6.2f} ms ({before / now:.1f}x)")


if __name__ == "__main__":
    main()
