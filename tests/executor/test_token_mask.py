"""Structured output in the executor: bitmask unpacking and masking against a plain-Python reference,
and the batched sampler with constrained and unconstrained rows side by side."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.executor.sampling.sampler import sample
from kvserve.executor.sampling.token_mask import TokenMasks, apply_token_masks, plan_token_masks, unpack_blocked
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import PlanError, StepPlan

VOCAB = 100


def _packed(allowed_rows: list[set[int]], words: int) -> bytes:
    """The wire form, built the slow obvious way: bit t % 32 of little-endian word t // 32."""
    out = bytearray()
    for allowed in allowed_rows:
        for w in range(words):
            value = sum(1 << b for b in range(32) if w * 32 + b in allowed)
            out += value.to_bytes(4, "little")
    return bytes(out)


def _random_rows(rng: random.Random, rows: int, vocab: int, density: float) -> list[set[int]]:
    return [{t for t in range(vocab) if rng.random() < density} | {rng.randrange(vocab)} for _ in range(rows)]


@pytest.mark.parametrize("words", [3, 4, 5], ids=["narrower", "exact", "wider"])
def test_unpacked_bitmask_equals_the_bit_by_bit_reference(words: int) -> None:
    vocab = 128  # 4 words; 3 leaves tokens 96.. past the row (disallowed), 5 has padding bits
    rng = random.Random(words)
    rows = _random_rows(rng, 5, words * 32, 0.3)
    rows[0] |= {31, 32, 63}  # word edges, including the sign bit of an int32
    blocked = unpack_blocked(_packed(rows, words), len(rows), vocab, "cpu")
    assert blocked.shape == (len(rows), vocab) and blocked.dtype == torch.bool
    for r, expected in enumerate(rows):
        assert set((~blocked[r]).nonzero().flatten().tolist()) == {t for t in expected if t < vocab}


@pytest.mark.parametrize("constrained_rows", [[1, 4, 5], [0, 1, 2, 3, 4, 5]], ids=["some-rows", "all-rows"])
def test_masked_logits_are_minus_inf_exactly_where_the_mask_is_zero(constrained_rows: list[int]) -> None:
    rng = random.Random(1)
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = _random_rows(rng, len(constrained_rows), VOCAB, 0.2)
    blocked = unpack_blocked(_packed(rows, 4), len(rows), VOCAB, "cpu")
    masks = TokenMasks(torch.tensor(constrained_rows), blocked, all_rows=len(constrained_rows) == 6)
    out = logits.clone()
    apply_token_masks(out, masks)
    for r in range(6):
        for t in range(VOCAB):
            if r in constrained_rows and t not in rows[constrained_rows.index(r)]:
                assert out[r, t] == float("-inf")
            else:
                assert out[r, t] == logits[r, t]


def test_a_row_whose_only_allowed_token_was_held_back_gets_that_token() -> None:
    logits = torch.randn(2, VOCAB)
    logits[0, 7] = float("-inf")  # min_tokens suppressed eos (7), which is all the grammar still allows
    masks = TokenMasks(torch.tensor([0]), unpack_blocked(_packed([{7}], 4), 1, VOCAB, "cpu"))
    out = logits.clone()
    apply_token_masks(out, masks)
    assert out[0, 7] == 0.0 and torch.isinf(out[0, torch.arange(VOCAB) != 7]).all()
    assert torch.equal(out[1], logits[1])


def _seq(seq_id: int, sampling: SamplingParams, seed: int = 0) -> SequenceState:
    return SequenceState(seq_id=seq_id, token_ids=[1, 2, 3], prompt_len=3, block_table=[], sampling=sampling, seed=seed)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_a_mixed_batch_gives_unconstrained_rows_exactly_their_tokens_alone(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, logprobs=2)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    seqs = [_seq(i, params, seed=100 + i) for i in range(8)]
    constrained = [0, 3, 6]
    allowed_sets = [{5, 17, 99}, {42}, set(range(50, 60))]
    masks = TokenMasks(torch.tensor(constrained), unpack_blocked(_packed(allowed_sets, 4), 3, VOCAB, "cpu"))
    batch = sample(logits.clone(), seqs, masks=masks)
    for i, out in enumerate(batch):
        if i in constrained:
            allowed = allowed_sets[constrained.index(i)]
            assert out.token_id in allowed
            # logprobs are those of the masked distribution: all mass on the allowed tokens
            assert all(t.token_id in allowed for t in out.top_logprobs if math.isfinite(t.logprob))
            masked = logits[i].masked_fill(~torch.isin(torch.arange(VOCAB), torch.tensor(sorted(allowed))), -math.inf)
            assert out.logprob == pytest.approx(masked.log_softmax(-1)[out.token_id].item(), abs=1e-5)
        else:
            alone = sample(logits[i : i + 1].clone(), [seqs[i]])[0]
            assert (out.token_id, out.logprob) == (alone.token_id, alone.logprob)


def test_plan_masks_follow_the_sampling_rows_and_refuse_a_row_that_does_not_sample() -> None:
    plan = StepPlan(step_id=1, mask_seq_ids=[9, 4], token_masks=_packed([{1}, {2}], 4))
    masks = plan_token_masks(plan, [4, 7, 9], VOCAB, "cpu")
    assert masks is not None and masks.rows.tolist() == [2, 0] and not masks.all_rows
    assert (~masks.blocked[0]).nonzero().flatten().tolist() == [1]
    every = plan_token_masks(
        StepPlan(step_id=3, mask_seq_ids=[4, 7], token_masks=_packed([{1}, {2}], 4)), [4, 7], 9, "cpu"
    )
    assert every is not None and every.all_rows
    assert plan_token_masks(StepPlan(step_id=2), [4], VOCAB, "cpu") is None
    with pytest.raises(PlanError, match="seq 9"):
        plan_token_masks(plan, [4, 7], VOCAB, "cpu")


def test_the_grammar_wins_over_min_tokens_when_only_the_end_is_left() -> None:
    held = _seq(1, SamplingParams(temperature=0.0, min_tokens=5))
    free = _seq(2, SamplingParams(temperature=0.0))
    masks = TokenMasks(torch.tensor([0]), unpack_blocked(_packed([{7}], 4), 1, VOCAB, "cpu"))
    outs = sample(torch.randn(2, VOCAB), [held, free], eos_token_ids=[7], masks=masks)
    assert outs[0].token_id == 7
