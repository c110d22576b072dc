"""The seeded noise and the race it feeds: every uniform strictly inside (0, 1), no excluded token ever drawn.

A uniform of exactly 1.0 (what the 24-bit mapping gave for the top hash code) makes a zero
exponential and an infinite score: the token wins whatever its probability, filter or grammar
mask. These tests prove the bound on every code, not by sampling, and then draw at the default
model's full vocabulary, where a row of 49,152 tokens held such a code 0.3% of the time.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.sampling.sampler import _race, sample
from kvserve.executor.sampling.seeded_noise import (
    UNIFORM_BITS,
    fmix32,
    key_tensor,
    row_key,
    token_hashes,
    uniform_noise,
    uniform_noise_at,
    uniforms_from_hashes,
)
from kvserve.executor.sampling.token_mask import TokenMasks
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams

VOCAB = 49_152
"""SmolLM2's vocabulary: the default model's, where the tail is as long as it gets in serving."""
GOLDEN = 0x9E3779B9


def _reference_hash(key: int, token: int) -> int:
    h = fmix32(((token * GOLDEN) & 0xFFFFFFFF) + key)
    return fmix32(h ^ key)


def test_int32_lanes_equal_the_plain_integer_hash():
    keys = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, row_key(7, 3), row_key(2**63 + 5, 10_000)]
    tokens = [0, 1, 2, 12_345, VOCAB - 1, 2**31 - 1]
    lanes = token_hashes(key_tensor(keys, "cpu")[:, None], torch.tensor(tokens, dtype=torch.int32)[None, :])
    for i, key in enumerate(keys):
        for j, token in enumerate(tokens):
            assert int(lanes[i, j]) & 0xFFFFFFFF == _reference_hash(key, token), (key, token)


def test_every_hash_code_gives_a_uniform_strictly_inside_the_unit_interval_and_a_finite_score():
    codes = torch.arange(1 << UNIFORM_BITS, dtype=torch.int64)
    low_bits = (1 << (32 - UNIFORM_BITS)) - 1
    for fill in (0, low_bits):  # the lowest and the highest hash of each code
        hashes = (codes << (32 - UNIFORM_BITS)) | fill
        u = uniforms_from_hashes(hashes)
        assert float(u.min()) > 0.0 and float(u.max()) < 1.0
        exponential = -torch.log(u)
        assert bool((exponential > 0).all()) and bool(exponential.isfinite().all())
        assert bool(_race(torch.zeros_like(u), u).isfinite().all())
        assert bool(torch.isneginf(_race(torch.full_like(u, float("-inf")), u)).all())
    extremes = uniforms_from_hashes(torch.tensor([0, 0xFFFFFFFF], dtype=torch.int64))
    assert extremes.tolist() == [2.0**-24, 1.0 - 2.0**-24]


def test_uniform_noise_is_the_same_bits_dense_or_at_chosen_tokens():
    keys = [row_key(s, 4) for s in range(3)]
    dense = uniform_noise(keys, VOCAB)
    rows = torch.tensor([0, 0, 1, 2, 2], dtype=torch.long)
    tokens = torch.tensor([0, VOCAB - 1, 5, 42_351, 7], dtype=torch.long)
    assert torch.equal(uniform_noise_at(keys, rows, tokens), dense[rows, tokens])


SEED_WITH_TOP_CODE, TOKEN_WITH_TOP_CODE = 331, 42_351
"""Seed 331 at output position 0 hashes token 42,351 to 0xffffffdc: the top code of both the old
24-bit mapping (its uniform was exactly 1.0) and the current 23-bit one."""


def _seq(seq_id: int, sampling: SamplingParams, seed: int) -> SequenceState:
    return SequenceState(seq_id=seq_id, token_ids=[1, 2, 3], prompt_len=3, block_table=[], sampling=sampling, seed=seed)


def test_the_top_hash_code_cannot_draw_a_masked_or_filtered_token():
    key = row_key(SEED_WITH_TOP_CODE, 0)
    assert _reference_hash(key, TOKEN_WITH_TOP_CODE) >> (32 - UNIFORM_BITS) == (1 << UNIFORM_BITS) - 1
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, TOKEN_WITH_TOP_CODE] = -30.0  # improbable, but not excluded by anything but the filters below
    for sampling in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.5),
    ):
        token = sample(logits.clone(), [_seq(0, sampling, SEED_WITH_TOP_CODE)])[0].token_id
        assert token != TOKEN_WITH_TOP_CODE, sampling
    blocked = torch.ones(1, VOCAB, dtype=torch.bool)
    blocked[0, 17] = False
    masks = TokenMasks(torch.tensor([0]), blocked, all_rows=True)
    seq = _seq(0, SamplingParams(temperature=1.0), SEED_WITH_TOP_CODE)
    assert sample(logits.clone(), [seq], masks=masks)[0].token_id == 17


@pytest.mark.slow  # half a minute: 200,000 rows of 49,152 logits
def test_a_mask_with_one_allowed_token_wins_200_000_seeded_draws_at_full_vocabulary():
    rows, batches = 128, 1_563  # 200,064 draws; batches this small reuse their memory
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    blocked = torch.ones(rows, VOCAB, dtype=torch.bool)
    allowed = torch.randint(0, VOCAB, (rows,), generator=torch.Generator().manual_seed(2))
    blocked[torch.arange(rows), allowed] = False
    masks = TokenMasks(torch.arange(rows), blocked, all_rows=True)
    for batch in range(batches):
        sampling = SamplingParams(temperature=0.5 + batch / batches)
        seqs = [_seq(i, sampling, seed=batch * rows + i) for i in range(rows)]  # every draw its own key
        tokens = torch.tensor([o.token_id for o in sample(logits.clone(), seqs, masks=masks)])
        assert torch.equal(tokens, allowed), f"batch {batch}: {int((tokens != allowed).sum())} masked tokens drawn"


def test_a_row_draws_the_same_token_with_noise_for_its_samplable_tokens_or_for_all(monkeypatch):
    from kvserve.executor.sampling import sampler

    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    logits[5] = float("-inf")  # nothing samplable: token 0, as a dense argmax gives
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.5),
        SamplingParams(temperature=1.0),
    ]
    seqs = [_seq(i, p, seed=100 + i) for i, p in enumerate(params)]
    by_share = {}
    for share in (0, VOCAB + 1):  # 0: every row hashes only its samplable tokens; VOCAB + 1: every row hashes all
        monkeypatch.setattr(sampler, "SPARSE_ROW_SHARE", share)
        by_share[share] = [o.token_id for o in sample(logits.clone(), seqs)]
    assert by_share[0] == by_share[VOCAB + 1]
    assert by_share[0][5] == 0
