"""Where speculative decoding steps aside: `--speculative-min-acceptance` and `--speculative-max-batch`.

A scripted proposer makes each proposal right (the fake executor's true continuation, all
accepted) or wrong (every draft rejected) in the order the test says, so the scheduler core's
draft counters (`draft_verify_steps`, `draft_tokens_proposed`, `draft_tokens_accepted`) can be
read after every step and drawn as a timeline: `V` a step that verified drafts for the sequence,
`.` one that decoded it plainly.

- The adaptive pause: a sequence's acceptance is a moving average (half the old value, half
  this step's share); below the floor it stops proposing for 4 steps, doubling per failed probe
  up to 64. A probe that is accepted resumes it at once, and the next pause starts at 4 again.
- The batch limit: no drafts in a step with more running sequences than the limit; at the limit
  itself, drafts.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.executor.fake.tokens import expected_completion
from kvserve.scheduler.core.request import Sequence
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from tests.scheduler.harness import Harness

VOCAB = 50
K = 4
"""Drafts per proposal (`num_speculative_tokens`)."""


class ScriptedProposer:
    """Proposal i is the true continuation if `script[i]` (else every draft is wrong); after the script, `then`."""

    from_executor = False

    def __init__(self, script: str = "", then: bool = True) -> None:
        self.script = [c == "+" for c in script]
        self.then = then
        self.calls = 0

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        right = self.script[self.calls] if self.calls < len(self.script) else self.then
        self.calls += 1
        outputs = len(seq.token_ids) - seq.prompt_len
        truth = expected_completion(seq.token_ids[: seq.prompt_len], seq.seed, outputs + limit, VOCAB, greedy=True)
        assert truth[:outputs] == seq.token_ids[seq.prompt_len :]
        drafts = truth[outputs:]
        return drafts if right else [(t + 1) % VOCAB for t in drafts]

    def finished(self, seq: Sequence) -> None:
        pass


def _config(**policy) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=256, block_size=4, max_model_len=512, num_speculative_tokens=K, **policy)


def _harness(config: SchedulerConfig, proposer: ScriptedProposer | None) -> Harness:
    h = Harness(config, vocab_size=VOCAB)
    if proposer is not None:
        h.scheduler = Scheduler(config, clock=h.clock, proposer=proposer)
    return h


def _timeline(h: Harness) -> tuple[str, list[int]]:
    """Run one greedy request to its end: (a V or . per decode step, drafts accepted per verifying step)."""
    marks, accepted = [], []
    h.step()  # the prompt: nothing to verify yet
    assert h.scheduler.stats().draft_verify_steps == 0
    while h.scheduler.has_unfinished():
        before = h.scheduler.stats()
        h.step()
        after = h.scheduler.stats()
        verified = after.draft_verify_steps - before.draft_verify_steps
        assert verified in (0, 1)
        marks.append("V" if verified else ".")
        if verified:
            accepted.append(after.draft_tokens_accepted - before.draft_tokens_accepted)
        else:
            assert after.draft_tokens_proposed == before.draft_tokens_proposed
    return "".join(marks), accepted


def test_failing_drafts_pause_for_4_steps_doubling_per_failed_probe_up_to_64() -> None:
    """Every draft rejected, floor 0.5: acceptance 1 → 0.5 → 0.25 pauses for 4 steps; each probe after a
    pause fails too and doubles it (8, 16, 32, 64, then 64 again). With the floor at 0 every step verifies."""
    h = _harness(_config(speculative_min_acceptance=0.5), ScriptedProposer(then=False))
    h.add("r", [1, 2, 3], max_tokens=260, temperature=0.0, ignore_eos=True)
    marks, accepted = _timeline(h)
    pauses = "".join("V" + "." * n for n in (4, 8, 16, 32, 64))
    assert marks == "V" + pauses + "V" + "." * 64 + "V" + "." * 63  # 259 decode steps, the last pause cut short
    stats = h.scheduler.stats()
    assert (stats.draft_verify_steps, stats.draft_tokens_proposed, stats.draft_tokens_accepted) == (8, 8 * K, 0)
    assert accepted == [0] * 8

    never = _harness(_config(speculative_min_acceptance=0.0), ScriptedProposer(then=False))
    never.add("r", [1, 2, 3], max_tokens=260, temperature=0.0, ignore_eos=True)
    marks, _ = _timeline(never)
    assert marks == "V" * 258 + "."  # the last step may output one token only: nothing left to draft
    assert never.scheduler.stats().draft_verify_steps == 258
    assert never.tokens("r") == h.tokens("r")


def test_an_accepted_probe_resumes_at_once_and_the_next_pause_starts_short_again() -> None:
    """Rejected twice (pause 4), a rejected probe (pause 8), then an accepted probe: every step verifies
    again at once. The next rejection pauses for 4 steps, not 16, and its failed probe for 8."""
    proposer = ScriptedProposer("---" + "+++" + "--", then=True)
    h = _harness(_config(speculative_min_acceptance=0.5), proposer)
    h.add("r", [1, 2, 3], max_tokens=80, temperature=0.0, ignore_eos=True)
    marks, accepted = _timeline(h)
    expected = "VV" + "." * 4 + "V" + "." * 8 + "VVVV" + "." * 4 + "V" + "." * 8 + "V"
    assert marks.startswith(expected), marks
    assert set(marks[len(expected) : -1]) == {"V"}  # right from then on: no pause before the end
    assert accepted[:9] == [0, 0, 0, K, K, K, 0, 0, K]
    assert proposer.calls == marks.count("V")
    plain = _harness(_config(), None)
    plain.add("r", [1, 2, 3], max_tokens=80, temperature=0.0, ignore_eos=True)
    plain.run()
    assert h.tokens("r") == plain.tokens("r")


def test_an_accepted_probe_need_only_reach_the_floor() -> None:
    """A paused sequence resumes with its average at the floor, so a probe accepted in part (2 of 4 at a
    floor of 0.5) is enough: the average stays at the floor and the sequence proposes at every step."""

    class HalfRight(ScriptedProposer):
        def propose(self, seq: Sequence, limit: int) -> list[int]:
            drafts = super().propose(seq, limit)
            if self.calls > 2 and len(drafts) == K:  # after the first pause: right, right, wrong, wrong
                drafts[2:] = [(t + 1) % VOCAB for t in drafts[2:]]
            return drafts

    h = _harness(_config(speculative_min_acceptance=0.5), HalfRight("--", then=True))
    h.add("r", [1, 2, 3], max_tokens=40, temperature=0.0, ignore_eos=True)
    marks, accepted = _timeline(h)
    assert marks.startswith("VV" + "...." + "VVVVV"), marks
    assert accepted[:7] == [0, 0, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("source", ["scheduler-side", "draft-model"])
def test_no_drafts_while_more_sequences_run_than_the_batch_limit(source: str) -> None:
    """Three requests, limit 2: while all three run no step proposes (nor asks the draft model to); once the
    shortest ends, the other two verify drafts every step. A limit of 3 drafts from the first step.
    `scheduler-side`: a proposer in the scheduler (as ngram and suffix are); `draft-model`: the fake
    executor's draft model (`--speculative draft`), asked one step ahead."""

    def run(limit: int) -> tuple[Harness, list[tuple[int, int]], ScriptedProposer | None]:
        config = _config(speculative_max_batch=limit, speculative_min_acceptance=0.0)
        proposer = None
        if source == "draft-model":
            config = dataclasses.replace(config, speculative="draft")
        else:
            proposer = ScriptedProposer(then=True)
        h = _harness(config, proposer)
        for request_id, max_tokens in (("short", 6), ("a", 40), ("b", 40)):
            h.add(request_id, [1, 2, len(request_id)], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        h.step()  # the three prompts
        steps = []  # (sequences running when the step was built, sequences that verified drafts in it)
        while h.scheduler.has_unfinished():
            running = len(h.scheduler.view().running)
            before = h.scheduler.stats().draft_verify_steps
            plan = h.step()
            steps.append((running, h.scheduler.stats().draft_verify_steps - before))
            if running > limit:
                assert not plan.draft_requests
        return h, steps, proposer

    h, steps, proposer = run(2)
    crowded = [verified for running, verified in steps if running == 3]
    assert len(crowded) >= 4 and crowded == [0] * len(crowded)
    assert steps[: len(crowded)] == [(3, 0)] * len(crowded)
    if proposer is not None:
        assert proposer.calls == h.scheduler.stats().draft_verify_steps
    pair = [verified for running, verified in steps if running == 2]
    # The first step with two left verifies both; the draft model is only asked for proposals in it.
    first = 0 if source == "scheduler-side" else 1
    assert len(pair) > first and pair[first] == 2 and pair[:first] == [0] * first
    assert h.scheduler.stats().draft_tokens_accepted > 0

    roomy, steps, _ = run(3)
    assert steps[0] == (3, 3)  # at the limit itself: drafts
    assert roomy.scheduler.stats().draft_verify_steps > h.scheduler.stats().draft_verify_steps
    for request_id in ("short", "a", "b"):
        assert roomy.tokens(request_id) == h.tokens(request_id)
