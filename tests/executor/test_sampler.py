"""The batched sampler: greedy, seeded draws, filters, penalties (hand-computed) and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.executor.sampling.penalties import apply_penalties
from kvserve.executor.sampling.sampler import filtered_logits, sample
from kvserve.executor.sampling.seeded_noise import row_key, uniform_noise
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams

VOCAB = 64


def _seq(seq_id: int, sampling: SamplingParams, seed: int = 0, prompt=(1, 2, 3), output=()) -> SequenceState:
    tokens = list(prompt) + list(output)
    return SequenceState(
        seq_id=seq_id, token_ids=tokens, prompt_len=len(prompt), block_table=[], sampling=sampling, seed=seed
    )


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exact_argmax_even_next_to_random_rows():
    logits = _logits(6)
    seqs = [_seq(i, SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0), seed=i) for i in range(6)]
    out = sample(logits.clone(), seqs)
    for i in range(0, 6, 2):
        assert out[i].token_id == int(logits[i].argmax())


def test_top_k_one_equals_greedy():
    logits = _logits(8, seed=1)
    seqs = [_seq(i, SamplingParams(temperature=1.3, top_k=1), seed=1000 + i) for i in range(8)]
    assert [o.token_id for o in sample(logits.clone(), seqs)] == logits.argmax(-1).tolist()


def test_seeded_draws_do_not_depend_on_batch_composition():
    logits = _logits(5, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    seqs = [_seq(i, params, seed=77 + i, output=[5] * i) for i in range(5)]
    together = [o.token_id for o in sample(logits.clone(), seqs)]
    alone = [sample(logits[i : i + 1].clone(), [seqs[i]])[0].token_id for i in range(5)]
    order = [3, 0, 4, 1, 2]
    shuffled = sample(logits[order].clone(), [seqs[i] for i in order])
    assert together == alone
    assert {o.seq_id: o.token_id for o in shuffled} == {s.seq_id: t for s, t in zip(seqs, together)}


def test_draws_depend_on_seed_and_output_position():
    flat = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=1.0)
    by_seed = {sample(flat.clone(), [_seq(0, params, seed=s)])[0].token_id for s in range(20)}
    by_pos = {sample(flat.clone(), [_seq(0, params, seed=5, output=[1] * p)])[0].token_id for p in range(20)}
    assert len(by_seed) > 5 and len(by_pos) > 5


def test_seeded_samples_follow_the_softmax_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :].repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    seqs = [_seq(i, params, seed=12345 + i) for i in range(4000)]
    tokens = torch.tensor([o.token_id for o in sample(logits, seqs)])
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_uniform_noise_is_in_open_unit_interval_and_uncorrelated_across_rows():
    u = uniform_noise([row_key(1, 0), row_key(1, 1), row_key(2, 0)], 10_000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_top_p_min_p_and_top_k_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)
    probs = logits.softmax(-1)[0]
    # top_p=0.8: keep the smallest prefix whose mass reaches 0.8.
    kept = filtered_logits(logits, [1.0], [-1], [0.8], [0.0])[0].isfinite()
    cumulative = probs.cumsum(0)
    expected_keep = int((cumulative < 0.8).sum()) + 1
    assert kept.tolist() == [i < expected_keep for i in range(5)]
    kept = filtered_logits(logits, [1.0], [2], [1.0], [0.0])[0].isfinite()
    assert kept.tolist() == [True, True, False, False, False]
    kept = filtered_logits(logits, [1.0], [-1], [1.0], [0.3])[0].isfinite()
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()


def test_filtered_tokens_are_never_sampled():
    logits = torch.tensor([[2.0, 1.9, 1.8, -5.0, -5.0, -5.0]]).repeat(500, 1)
    seqs = [_seq(i, SamplingParams(temperature=2.0, top_k=2), seed=i) for i in range(500)]
    tokens = {o.token_id for o in sample(logits, seqs)}
    assert tokens == {0, 1}


BASE = [2.0, -1.0, 0.5, 3.0]


def _penalised(**kwargs) -> list[float]:
    logits = torch.tensor([BASE])
    args = dict(repetition=[1.0], presence=[0.0], frequency=[0.0]) | {k: [v] for k, v in kwargs.items()}
    apply_penalties(logits, prompt_tokens=[[0]], output_tokens=[[1, 1, 3]], **args)
    return logits[0].tolist()


def test_repetition_penalty_hand_computed():
    # Seen in prompt or output: 0, 1, 3. Positive logits divided, negative multiplied.
    assert _penalised(repetition=2.0) == pytest.approx([1.0, -2.0, 0.5, 1.5])


def test_presence_penalty_hand_computed():
    # Output tokens {1, 3} lose 0.5 once each; the prompt token 0 is untouched.
    assert _penalised(presence=0.5) == pytest.approx([2.0, -1.5, 0.5, 2.5])


def test_frequency_penalty_hand_computed():
    # Token 1 appears twice in the output, token 3 once.
    assert _penalised(frequency=0.25) == pytest.approx([2.0, -1.5, 0.5, 2.75])


def test_penalties_change_the_greedy_choice_through_the_sampler():
    logits = torch.tensor([BASE])
    plain = _seq(0, SamplingParams(temperature=0.0), prompt=[0], output=[1, 1, 3])
    penalised = _seq(0, SamplingParams(temperature=0.0, frequency_penalty=1.5), prompt=[0], output=[1, 1, 3])
    assert sample(logits.clone(), [plain])[0].token_id == 3
    assert sample(logits.clone(), [penalised])[0].token_id == 0  # 3.0 - 1.5 < 2.0


def test_logprobs_of_sampled_and_top_tokens():
    logits = _logits(3, seed=4)
    seqs = [
        _seq(0, SamplingParams(temperature=0.0, logprobs=3)),
        _seq(1, SamplingParams(temperature=0.7, logprobs=0), seed=9),
        _seq(2, SamplingParams(temperature=0.0)),
    ]
    out = sample(logits.clone(), seqs)
    reference = logits.log_softmax(-1)
    assert out[0].logprob == pytest.approx(float(reference[0].max()), abs=1e-5)
    assert [t.token_id for t in out[0].top_logprobs] == reference[0].topk(3).indices.tolist()
    assert out[1].logprob == pytest.approx(float(reference[1, out[1].token_id]), abs=1e-5)
    assert out[1].top_logprobs == []
    assert out[2].logprob is None
    assert all(math.isfinite(t.logprob) for t in out[0].top_logprobs)


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 10.0  # EOS is the clear favourite
    logits[:, 6] = 9.0  # then a stop token
    early = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,))
    seqs = [
        _seq(0, early, output=[1]),  # 1 output so far < 2: both banned
        _seq(1, early, output=[1, 1]),  # min_tokens reached: EOS allowed
        _seq(2, SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output=[]),
    ]
    out = sample(logits.clone(), seqs, eos_token_ids=[5])
    assert out[0].token_id not in (5, 6)
    assert out[1].token_id == 5
    assert out[2].token_id == 5  # ignore_eos: EOS does not stop, so it is not suppressed


FULL_VOCAB = 49_152
"""The default model's vocabulary: long enough a tail for float32 cumulative sums to pass 1.0."""
NEIGHBOURS = [
    SamplingParams(temperature=1.0, top_p=1.0),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.1),
]


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return filtered_logits(
        logits,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )


@pytest.mark.parametrize("trial", range(5))
def test_each_row_is_filtered_the_same_alone_or_beside_rows_with_other_filters(trial):
    logits = torch.randn(len(NEIGHBOURS), FULL_VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
    together = _filtered(logits, NEIGHBOURS)
    seqs = [_seq(i, p, seed=trial * 10 + i) for i, p in enumerate(NEIGHBOURS)]
    tokens = [o.token_id for o in sample(logits.clone(), seqs)]
    for i, params in enumerate(NEIGHBOURS):
        alone = _filtered(logits[i : i + 1], [params])
        assert torch.equal(together[i : i + 1], alone), f"row {i} ({params}) changed beside other filters"
        assert sample(logits[i : i + 1].clone(), [seqs[i]])[0].token_id == tokens[i]
    assert bool(together[0].isfinite().all()), "a top_p=1.0 row lost tokens"


def test_a_top_k_row_keeps_exactly_k_tokens_whatever_its_tail_mass():
    logits = torch.randn(1, FULL_VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    kept = _filtered(logits, [SamplingParams(temperature=1.0, top_k=49_000)]).isfinite().sum()
    assert int(kept) == 49_000  # at top_p 1.0 a cumulative-mass cut took 3,563 more of them
