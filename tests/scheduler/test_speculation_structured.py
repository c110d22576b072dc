"""Speculative decoding under a grammar: a mask for every verified position, a matcher that only
ever holds verified tokens, and the same output as speculation off."""

from __future__ import annotations

import random

import pytest

from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.request import Sequence
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.token_matcher import allows, constrained_drafts
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.choice_grammar import ChoiceGrammar
from tests.scheduler.harness import Harness

CHOICES = [[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 20, 21, 22, 23, 24, 25], [10, 30, 31, 32, 33, 34, 35, 36, 37]]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]

config = checked_configs(num_blocks=64, block_size=4, max_model_len=64)


def test_drafts_stop_before_a_refused_token_and_before_the_grammars_end() -> None:
    grammar = ChoiceGrammar(CHOICES, 50)
    matcher = grammar.new_matcher()
    kept, masks = constrained_drafts(matcher, [10, 11, 99, 13])
    assert kept == [10, 11] and len(masks) == 3
    assert allows(masks[2], 12) and allows(masks[2], 20) and not allows(masks[2], 99)
    assert matcher.fed == []  # rolled back
    matcher.accept(10)
    kept, masks = constrained_drafts(matcher, [30, 31, 32, 33, 34, 35, 36, 37])
    assert kept == [30, 31, 32, 33, 34, 35, 36]  # 37 would end the grammar: drawn under its own mask instead
    assert len(masks) == 8 and allows(masks[7], 37) and matcher.fed == [10]
    kept, masks = constrained_drafts(matcher, [11, 12])
    assert kept == [11, 12] and len(masks) == 3 and matcher.fed == [10]
    assert constrained_drafts(matcher, [5]) == ([], [masks[0]])


class ChoiceProposer:
    """Drafts from one of the choices the output still agrees with, sometimes with a wrong token."""

    from_executor = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        out = seq.token_ids[seq.prompt_len :]
        fitting = [c for c in CHOICES if c[: len(out)] == out and len(c) > len(out)]
        if not fitting:
            return []
        drafts = self.rng.choice(fitting)[len(out) : len(out) + limit]
        if self.rng.random() < 0.3:
            drafts[self.rng.randrange(len(drafts))] = self.rng.choice([40, 41, 12, 21])
        return drafts

    def finished(self, seq: Sequence) -> None:
        pass


@pytest.mark.parametrize("seed", range(12))
def test_constrained_outputs_equal_speculation_off_with_a_mask_per_position(seed: int) -> None:
    rng = random.Random(seed)
    sampling = {"max_tokens": 20, "temperature": rng.choice([0.0, 1.0]), "seed": seed}
    off = Harness(config())
    off.add("c", PROMPT, constraint=ChoiceGrammar(CHOICES, off.vocab_size), **sampling)
    off.run()
    h = Harness(config(num_speculative_tokens=rng.randint(1, 8)))
    h.scheduler = Scheduler(h.scheduler.config, clock=h.clock, proposer=ChoiceProposer(rng))
    grammar = ChoiceGrammar(CHOICES, h.vocab_size)
    h.add("c", PROMPT, constraint=grammar, **sampling)
    h.add("free", [5, 6, 7], max_tokens=12, ignore_eos=True)  # an unconstrained neighbour in the same steps
    h.run()
    assert h.tokens("c") == off.tokens("c") and h.tokens("c") in CHOICES
    assert h.reason("c") is FinishReason.GRAMMAR
    (matcher,) = grammar.matchers
    assert matcher.fed == h.tokens("c")  # only verified tokens stayed in the matcher
    verifying = [
        (plan, known)
        for plan in h.plans
        for known in plan.known_seqs
        if known.draft_token_ids and plan.mask_seq_ids and known.seq_id in plan.mask_seq_ids
    ]
    for plan, known in verifying:
        assert plan.mask_seq_ids.count(known.seq_id) == len(known.draft_token_ids) + 1
        assert len(plan.token_masks) == len(plan.mask_seq_ids) * plan.mask_row_bytes
    assert verifying, "the constrained sequence verified no drafts"


def test_speculation_saves_steps_under_a_grammar() -> None:
    """A proposer that knows the choice the fake model makes: the constrained output needs fewer steps."""
    off = Harness(config())
    off.add("c", PROMPT, constraint=ChoiceGrammar(CHOICES, off.vocab_size), max_tokens=20, temperature=0.0)
    plain_steps = off.run()
    truth = off.tokens("c")

    class Knowing(ChoiceProposer):
        def propose(self, seq: Sequence, limit: int) -> list[int]:
            out = seq.token_ids[seq.prompt_len :]
            return truth[len(out) : len(out) + limit]

    h = Harness(config(num_speculative_tokens=4))
    h.scheduler = Scheduler(h.scheduler.config, clock=h.clock, proposer=Knowing(random.Random(0)))
    h.add("c", PROMPT, constraint=ChoiceGrammar(CHOICES, h.vocab_size), max_tokens=20, temperature=0.0)
    spec_steps = h.run()
    assert h.tokens("c") == truth
    assert spec_steps < plain_steps - 2
