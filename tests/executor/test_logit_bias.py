"""Logit biases in the sampler: added after the penalties, -100 bans, the grammar still wins, per row."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.executor.sampling.logit_bias import apply_logit_bias
from kvserve.executor.sampling.sampler import sample
from kvserve.executor.sampling.token_mask import TokenMasks
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


def _seq(seq_id: int, sampling: SamplingParams, seed: int = 0) -> SequenceState:
    return SequenceState(seq_id=seq_id, token_ids=[1, 2, 3], prompt_len=3, block_table=[], sampling=sampling, seed=seed)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _with_bias(sampling: SamplingParams, bias: dict[int, float]) -> SamplingParams:
    return replace(sampling, logit_bias=tuple(sorted(bias.items())))


def test_biases_add_to_their_row_only_and_minus_100_is_minus_inf() -> None:
    logits = _logits(3)
    biased = logits.clone()
    banned = apply_logit_bias(biased, [((4, 2.5), (9, -100.0)), (), ((0, -1.0),)])
    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 9] = float("-inf")
    expected[2, 0] -= 1.0
    assert banned and torch.equal(biased, expected)
    assert not apply_logit_bias(logits.clone(), [((4, 100.0),), ()])
    untouched = logits.clone()
    assert not apply_logit_bias(untouched, [(), (), ()]) and torch.equal(untouched, logits)


def test_a_bias_changes_the_greedy_token() -> None:
    logits = _logits(1)
    top = int(logits[0].argmax())
    lowest = int(logits[0].argmin())
    assert sample(logits.clone(), [_seq(0, GREEDY)])[0].token_id == top
    banned = sample(logits.clone(), [_seq(0, _with_bias(GREEDY, {top: -100}))])[0].token_id
    assert banned == int(logits[0].topk(2).indices[1])
    assert sample(logits.clone(), [_seq(0, _with_bias(GREEDY, {lowest: 100}))])[0].token_id == lowest


def test_a_banned_token_is_never_drawn_even_when_it_is_nearly_certain() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 50.0  # every seeded draw picks it, unbiased
    sampling = SamplingParams(temperature=1.5)
    seqs = [_seq(i, sampling, seed=1000 + i) for i in range(200)]
    assert {o.token_id for o in sample(logits.expand(200, -1).clone(), seqs)} == {7}
    banned = [_seq(i, _with_bias(sampling, {7: -100, 3: -100}), seed=1000 + i) for i in range(200)]
    drawn = {o.token_id for o in sample(logits.expand(200, -1).clone(), banned)}
    assert not drawn & {3, 7} and len(drawn) > 10


def test_the_grammar_mask_wins_over_plus_100() -> None:
    logits = _logits(2, seed=3)
    blocked = torch.ones(2, VOCAB, dtype=torch.bool)
    blocked[:, [10, 11]] = False  # the grammar allows 10 and 11 only
    masks = TokenMasks(torch.tensor([0, 1]), blocked, all_rows=True)
    for sampling in (GREEDY, SamplingParams(temperature=1.0)):
        seqs = [_seq(i, _with_bias(sampling, {40: 100, 11: 5}), seed=i) for i in range(2)]
        out = sample(logits.clone(), seqs, masks=masks)
        assert {o.token_id for o in out} <= {10, 11}
    forced = sample(logits.clone(), [_seq(0, _with_bias(GREEDY, {40: 100, 11: 100}))], masks=masks)
    assert forced[0].token_id == 11


def test_banning_every_token_the_grammar_allows_leaves_the_grammar_in_charge() -> None:
    logits = _logits(1, seed=4)
    blocked = torch.ones(1, VOCAB, dtype=torch.bool)
    blocked[0, 20] = False
    masks = TokenMasks(torch.tensor([0]), blocked, all_rows=True)
    for sampling in (GREEDY, SamplingParams(temperature=1.0)):
        seq = _seq(0, _with_bias(sampling, {20: -100}))
        assert sample(logits.clone(), [seq], masks=masks)[0].token_id == 20


def test_a_biased_row_gives_the_same_token_and_logprobs_alone_and_beside_unbiased_rows() -> None:
    logits = _logits(6, seed=5)
    params = [
        _with_bias(SamplingParams(temperature=1.0, logprobs=3), {int(logits[2].argmax()): -100, 5: 4.0}),
        _with_bias(GREEDY, {int(logits[4].argmin()): 100}),
    ]
    seqs = [
        _seq(0, SamplingParams(temperature=1.0, logprobs=3), seed=1),
        _seq(1, GREEDY),
        _seq(2, params[0], seed=7),
        _seq(3, SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3), seed=3),
        _seq(4, params[1]),
        _seq(5, GREEDY),
    ]
    together = sample(logits.clone(), seqs)
    for i in (2, 4):
        alone = sample(logits[i : i + 1].clone(), [seqs[i]])[0]
        assert (alone.token_id, alone.logprob, alone.top_logprobs) == (
            together[i].token_id,
            together[i].logprob,
            together[i].top_logprobs,
        )
    assert together[4].token_id == int(logits[4].argmin())
    assert together[2].token_id != int(logits[2].argmax())
    unbiased = sample(logits.clone(), [_seq(s.seq_id, replace(s.sampling, logit_bias=()), s.seed) for s in seqs])
    assert [together[i].token_id for i in (0, 1, 3, 5)] == [unbiased[i].token_id for i in (0, 1, 3, 5)]
