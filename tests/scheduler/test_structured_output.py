"""Structured output in the scheduling core: masks for exactly the constrained rows that sample,
the grammar's end as the finish, and a matcher state that survives preemption and an executor reset."""

from __future__ import annotations

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.step import SampledToken, StepResult
from kvserve.protos.stop_rules import FinishReason
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.choice_grammar import ChoiceGrammar
from tests.scheduler.harness import Harness

CHOICES = [[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 20, 21, 22, 23, 24, 25], [10, 30, 31, 32, 33, 34, 35, 36, 37]]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


config = checked_configs(num_blocks=64, block_size=4, max_model_len=64)


def run_one(h: Harness, grammar: ChoiceGrammar, **sampling) -> list[int]:
    sampling.setdefault("max_tokens", 20)
    h.add("c", PROMPT, constraint=grammar, **sampling)
    h.run()
    return h.tokens("c")


def test_constrained_and_unconstrained_side_by_side() -> None:
    h = Harness(config(max_num_batched_tokens=6))  # the 9-token prompt is prefilled in two chunks
    grammar = ChoiceGrammar(CHOICES, h.vocab_size)
    h.add("free", [5, 6, 7], max_tokens=10, ignore_eos=True)
    h.add("c", PROMPT, max_tokens=20, constraint=grammar)
    constrained = {h.scheduler.request("c").seqs[0].seq_id}
    h.run()
    assert h.tokens("c") in CHOICES and h.reason("c") is FinishReason.GRAMMAR
    assert h.tokens("free") == expected_completion([5, 6, 7], 7, 10) and h.reason("free") is FinishReason.LENGTH
    (matcher,) = grammar.matchers
    # One mask per sampled token, none for the first prompt chunk, none after the end.
    assert matcher.masks_at == list(range(len(h.tokens("c"))))
    masked_steps = [p for p in h.plans if p.mask_seq_ids]
    assert len(masked_steps) == len(h.tokens("c"))
    assert all(len(p.mask_seq_ids) == 1 and len(p.token_masks) == p.mask_row_bytes == 8 for p in masked_steps)
    assert all(set(p.mask_seq_ids) == constrained for p in masked_steps)


def test_a_batch_without_constraints_sends_no_masks() -> None:
    h = Harness(config())
    h.add("a", [1, 2, 3], max_tokens=5, ignore_eos=True)
    h.add("b", [4, 5, 6], max_tokens=5, ignore_eos=True)
    h.run()
    assert all(p.mask_seq_ids == [] and p.token_masks == b"" for p in h.plans)


def test_the_matcher_survives_recompute_preemption_unchanged() -> None:
    undisturbed = run_one(Harness(config()), ChoiceGrammar(CHOICES, 50))
    # 8 blocks of 4: the hog's 16-token prompt and the constrained prompt fill 7, and both grow.
    h = Harness(config(num_blocks=8))
    grammar = ChoiceGrammar(CHOICES, h.vocab_size)
    h.add("hog", list(range(20, 36)), max_tokens=12, ignore_eos=True, arrival_time=0.5)
    h.add("c", PROMPT, max_tokens=20, constraint=grammar, arrival_time=1.0)
    h.run()
    assert h.scheduler.stats().num_preemptions >= 1
    assert h.tokens("c") == undisturbed and h.reason("c") is FinishReason.GRAMMAR
    assert grammar.matchers[0].fed == undisturbed  # fed once per token, never replayed


def test_an_executor_reset_keeps_the_matcher_and_the_output() -> None:
    undisturbed = run_one(Harness(config()), ChoiceGrammar(CHOICES, 50))
    h = Harness(config())
    grammar = ChoiceGrammar(CHOICES, h.vocab_size)
    h.add("c", PROMPT, max_tokens=20, constraint=grammar)
    for _ in range(3):
        h.step()
    h.collect(h.scheduler.reset_executor())
    h.executor.reset()
    h.run()
    assert h.tokens("c") == undisturbed and grammar.matchers[0].fed == undisturbed


def test_n_completions_each_follow_their_own_matcher() -> None:
    h = Harness(config())
    grammar = ChoiceGrammar(CHOICES, h.vocab_size)
    h.add("c", PROMPT, max_tokens=20, n=4, temperature=1.0, constraint=grammar)
    h.run()
    assert len(grammar.matchers) == 4
    for index, matcher in enumerate(grammar.matchers):
        assert h.tokens("c", index) in CHOICES and matcher.fed == h.tokens("c", index)
        assert h.reason("c", index) is FinishReason.GRAMMAR


def test_max_tokens_still_cuts_a_constrained_completion() -> None:
    h = Harness(config())
    grammar = ChoiceGrammar([[10, 11, 12, 13, 14, 15, 16]], h.vocab_size)
    assert run_one(h, grammar, max_tokens=3) == [10, 11, 12]
    assert h.reason("c") is FinishReason.LENGTH


def test_a_token_the_mask_forbade_ends_the_completion_with_an_internal_error() -> None:
    h = Harness(config())
    grammar = ChoiceGrammar([[10, 11, 12]], h.vocab_size)
    h.add("c", PROMPT, max_tokens=20, constraint=grammar)
    plan = h.schedule()
    (seq_id,) = plan.mask_seq_ids
    h.executor.execute(plan)  # what an executor ignoring the mask could return instead:
    outputs = h.scheduler.update(StepResult(plan.step_id, [SampledToken(seq_id, 49)]))
    h.collect(outputs)
    assert h.reason("c") is FinishReason.INTERNAL  # the executor's bug: never the "executor change" ERROR
    (output,) = outputs
    assert output.error == "the executor sampled a token the grammar forbids (token id 49)"
    assert not h.scheduler.has_unfinished()
