"""Speculative decoding in the scheduler core, against the strict fake executor.

An *oracle* proposer knows each sequence's true continuation (the fake executor's tokens are a
pure function of context and seed) and errs on purpose from a random position, so every accept
length from none to all comes through the KV bookkeeping. Under random interleavings of adds,
steps, aborts, finishes and executor resets, with tiny pools that force preemption in both modes:
every invariant holds after each operation, no block leaks, each completion equals an undisturbed
run, and every prefix-tree block holds exactly its key in the (shadow) KV, so no unverified draft
ever entered the tree.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.step import PlanError, StepResult
from kvserve.scheduler.core.draft_proposer import NgramProposer
from kvserve.scheduler.core.request import RequestRejected, Sequence, derive_seed
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import KV_RESERVATIONS, SchedulerConfig
from tests.scheduler.harness import Harness, strict_executor
from tests.scheduler.test_properties import configs as scheduling_configs

MAX_EXAMPLES = int(os.environ.get("KVSERVE_PROPERTY_EXAMPLES", "150"))
VOCAB = 50


class OracleProposer:
    """The true continuation, cut to a random length and wrong from a random position (or never)."""

    from_executor = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.accept_lengths: set[int] = set()
        self.proposed = 0

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        prompt, outputs = seq.token_ids[: seq.prompt_len], seq.token_ids[seq.prompt_len :]
        greedy = seq.request.sampling.temperature == 0.0
        truth = expected_completion(prompt, seq.seed, len(outputs) + limit, VOCAB, greedy=greedy)
        assert truth[: len(outputs)] == outputs  # the sequence so far is what plain decoding gives
        size = self.rng.randint(1, limit)
        drafts = truth[len(outputs) : len(outputs) + size]
        wrong_at = self.rng.randint(0, size)  # == size: all correct
        if wrong_at < size:
            drafts[wrong_at] = (drafts[wrong_at] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
        self.accept_lengths.add(wrong_at)
        self.proposed += 1
        return drafts

    def finished(self, seq: Sequence) -> None:
        pass


def _tree_matches_kv(h: Harness) -> None:
    """Every prefix-tree block holds exactly its key's tokens: nothing unverified got in."""
    tree = h.scheduler.view().tree
    for node in tree.nodes():
        if node.block < 0:
            continue
        held = h.executor.shadow.read_tokens([node.block], 0, len(node.key))
        assert tuple(held) == node.key, f"tree block {node.block} holds {held}, its key is {node.key}"


@st.composite
def configs(draw, kv_reservation: str) -> SchedulerConfig:
    """The scheduling property tests' tight configurations, with speculation's own knobs drawn too."""
    return dataclasses.replace(
        draw(scheduling_configs(kv_reservation)),
        num_speculative_tokens=draw(st.integers(1, 6)),
        speculative_max_batch=draw(st.sampled_from([1, 3, 8])),
        speculative_min_acceptance=draw(st.sampled_from([0.0, 0.5])),
    )


OPS = ("add", "add", "add", "step", "step", "step", "step", "abort", "finish", "reset")


@pytest.mark.parametrize("source", ["oracle", "draft-model"])
@pytest.mark.parametrize("kv_reservation", KV_RESERVATIONS)
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ops=st.lists(st.sampled_from(OPS), min_size=4, max_size=50), seed=st.integers(0, 2**32))
def test_random_accept_lengths_keep_every_invariant(
    kv_reservation: str, source: str, data, ops: list[str], seed: int
) -> None:
    """`oracle`: drafts from the scheduler side; `draft-model`: `--speculative draft`, proposals asked of
    the (fake) executor's draft model in one plan and sent back as drafts in the next."""
    config = data.draw(configs(kv_reservation), label="config")
    draft = source == "draft-model"
    if draft:
        config = dataclasses.replace(config, speculative="draft")
    rng = random.Random(seed)
    h = Harness(config)
    if not draft:
        h.scheduler = Scheduler(config, clock=h.clock, proposer=OracleProposer(random.Random(seed + 1)))
    sched = h.scheduler
    prompts: dict[str, tuple[list[int], int, bool]] = {}
    for number, op in enumerate(ops):
        live = list(sched.view().requests)
        if op == "add":
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            request_id, request_seed, greedy = f"r{number}", rng.randrange(1000), rng.random() < 0.5
            try:
                h.add(
                    request_id,
                    prompt,
                    max_tokens=rng.randrange(1, 14),
                    n=rng.choice([1, 1, 2]),
                    seed=request_seed,
                    temperature=0.0 if greedy else 1.0,
                    ignore_eos=True,
                    stop_token_ids=rng.choice([(), (7,)]),
                    logprobs=rng.choice([None, 2]),
                    namespace=rng.choice(["a", "b"]),
                )
            except RequestRejected:
                continue
            prompts[request_id] = (prompt, request_seed, greedy)
        elif op == "step":
            h.step()
        elif op == "abort" and live:
            h.collect(sched.abort(rng.choice(live)))
        elif op == "finish" and live:
            request = sched.request(rng.choice(live))
            out = sched.finish_sequence(request.request_id, rng.randrange(len(request.seqs)))
            if out is not None:
                h.collect([out])
        elif op == "reset":
            plan = h.schedule()  # lost with the executor
            h.collect(sched.reset_executor())
            h.executor = strict_executor(
                config.num_blocks, config.block_size, config.num_cpu_blocks, VOCAB, draft=draft
            )
            if not plan.is_empty:
                h.collect(sched.update(StepResult(plan.step_id)))  # late: ignored
        sched.check_invariants()
        _tree_matches_kv(h)
    h.run(max_steps=3000)
    _tree_matches_kv(h)
    stats = sched.stats()
    assert stats.blocks_referenced == stats.blocks_reserved == 0
    assert stats.blocks_free + stats.blocks_cached == stats.num_blocks
    assert stats.draft_tokens_accepted <= stats.draft_tokens_proposed
    for (request_id, index), completion in h.completions.items():
        assert completion.finish_reason is not None
        counts = completion.outputs[-1].blocks
        assert counts is not None and counts.allocated + counts.hit - counts.copied == counts.freed
        if request_id not in prompts:
            continue
        prompt, request_seed, greedy = prompts[request_id]
        expected = expected_completion(
            prompt, derive_seed(request_seed, index), len(completion.tokens), VOCAB, greedy=greedy
        )
        assert completion.tokens == expected
        logprobs = [lp for out in completion.outputs if out.logprobs is not None for lp in out.logprobs]
        assert all(lp.token_id == t for lp, t in zip(logprobs, completion.tokens, strict=False))


def test_the_oracle_drives_every_accept_length_and_drafts_save_steps() -> None:
    """Not vacuous: proposals are made, each accept length 0..k occurs, and accepted drafts cut the
    steps a long greedy completion needs (with identical tokens)."""
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128, num_speculative_tokens=4)
    plain = Harness(config)
    plain.add("r", [1, 2, 3], max_tokens=60, temperature=0.0, ignore_eos=True)
    plain_steps = plain.run()
    oracle = OracleProposer(random.Random(3))
    spec = Harness(config)
    spec.scheduler = Scheduler(config, clock=spec.clock, proposer=oracle)
    spec.add("r", [1, 2, 3], max_tokens=60, temperature=0.0, ignore_eos=True)
    spec_steps = spec.run()
    assert spec.tokens("r") == plain.tokens("r") and len(spec.tokens("r")) == 60
    assert oracle.accept_lengths == {0, 1, 2, 3, 4}
    stats = spec.scheduler.stats()
    assert stats.draft_verify_steps == oracle.proposed > 0 and stats.draft_tokens_accepted > 0
    assert spec_steps == plain_steps - stats.draft_tokens_accepted  # each accepted draft is a step saved


def test_ngram_proposals_on_repeating_text_are_exact_and_rolled_back_when_wrong() -> None:
    """The prompt-lookup proposer on a prompt that repeats: fake-model outputs never follow it, so
    every draft is rejected, its blocks go back, and the tokens equal speculation off."""
    config = SchedulerConfig(num_blocks=40, block_size=2, max_model_len=96, ngram_min=1, speculative="ngram")
    prompt = [5, 6, 7, 8] * 6
    off = Harness(SchedulerConfig(num_blocks=40, block_size=2, max_model_len=96))
    off.add("r", prompt, max_tokens=30, ignore_eos=True)
    off.run()
    on = Harness(config)
    assert isinstance(on.scheduler._state.proposer, NgramProposer)
    on.add("r", prompt, max_tokens=30, ignore_eos=True)
    on.run()
    assert on.tokens("r") == off.tokens("r")
    stats = on.scheduler.stats()
    assert stats.draft_tokens_proposed > 0
    assert any(plan.trims for plan in on.plans)  # rejected drafts' blocks were cut from the executor's table


def test_drafts_never_preempt_and_respect_max_tokens() -> None:
    """A pool with room for the tokens but not the drafts: drafts shrink, nobody is preempted, and no
    step proposes past the request's output limit."""
    config = SchedulerConfig(num_blocks=6, block_size=4, max_model_len=24, num_speculative_tokens=8)
    oracle = OracleProposer(random.Random(0))
    h = Harness(config)
    h.scheduler = Scheduler(config, clock=h.clock, proposer=oracle)
    h.add("a", [1, 2, 3, 4, 5], max_tokens=6, temperature=0.0, ignore_eos=True)
    h.add("b", [2, 2, 3, 4, 5], max_tokens=6, temperature=0.0, ignore_eos=True)
    h.run()
    assert h.scheduler.stats().num_preemptions == 0
    for plan in h.plans:
        for known in plan.known_seqs:
            # The last output token is never computed: positions stop one short of prompt + max_tokens.
            assert known.num_computed_tokens + known.num_scheduled_tokens <= 5 + 6 - 1
    assert len(h.tokens("a")) == len(h.tokens("b")) == 6


def test_draft_model_proposals_come_one_step_ahead_and_save_steps() -> None:
    """`--speculative draft`: a plan asks for proposals, the result brings them, the next plan sends
    them as drafts; tokens equal speculation off, and the (fake) draft model's deliberate misses
    make both accepted and rejected drafts."""
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128, num_speculative_tokens=4)
    plain = Harness(config)
    plain.add("r", [1, 2, 3], max_tokens=60, temperature=0.0, ignore_eos=True)
    plain_steps = plain.run()
    spec = Harness(dataclasses.replace(config, speculative="draft"))
    spec.add("r", [1, 2, 3], max_tokens=60, temperature=0.0, ignore_eos=True)
    spec_steps = spec.run()
    assert spec.tokens("r") == plain.tokens("r")
    stats = spec.scheduler.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed
    assert spec_steps == plain_steps - stats.draft_tokens_accepted
    asked = [plan for plan in spec.plans if plan.draft_requests]
    assert asked and all(count <= 4 for plan in asked for _, count in plan.draft_requests)
    for before, after in zip(spec.plans, spec.plans[1:], strict=False):
        if before.draft_requests and after.known_seqs:
            assert len(after.known_seqs[0].draft_token_ids) <= dict(before.draft_requests)[after.known_seqs[0].seq_id]


def test_a_plan_asking_a_fake_without_a_draft_model_for_proposals_is_refused() -> None:
    h = Harness(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, speculative="draft"))
    h.executor = strict_executor(16, 4, vocab_size=VOCAB)  # no draft model
    h.add("r", [1, 2, 3], max_tokens=5, ignore_eos=True)
    with pytest.raises(PlanError, match="no --draft-model"):
        h.run()
