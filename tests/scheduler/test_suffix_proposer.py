"""`--speculative suffix`: lookup over recent completions, bounded, and never across namespaces.

The tenant-isolation property runs two tenants whose prompts draw from disjoint token
alphabets through the scheduler and the strict fake executor (outputs are hashes over the
whole plain vocabulary, so each tenant's outputs are its own too): every token any proposal
carries must have appeared in that tenant's own prompts or outputs.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.scheduler.core.draft_proposer import SuffixProposer, proposer_for
from kvserve.scheduler.core.request import Sequence
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.core.suffix_index import SuffixIndex
from tests.scheduler.harness import Harness


def test_a_finished_completion_is_proposed_from_the_end_of_a_like_prompt() -> None:
    index = SuffixIndex(min_n=2, max_n=3, capacity=100)
    index.add("a", [1, 2, 3, 4, 5, 6, 7, 8], prompt_len=5)  # prompt [1..5], output [6, 7, 8]
    assert index.propose("a", [9, 4, 5], limit=5) == (2, [6, 7, 8])  # a new prompt ending like the old one
    assert index.propose("a", [3, 4, 5, 6], limit=1) == (3, [7])
    assert index.propose("a", [9, 9], limit=5) == (0, [])
    assert index.propose("b", [9, 4, 5], limit=5) == (0, [])  # another namespace sees nothing
    index.add("a", [5, 5], prompt_len=2)  # no output: nothing to keep
    assert index.num_tokens == 6  # the prompt's last 3 tokens and the 3 output tokens


def test_the_oldest_completion_goes_first_and_takes_only_its_own_ngrams() -> None:
    index = SuffixIndex(min_n=2, max_n=2, capacity=10)
    index.add("a", [1, 2, 3, 4, 5], prompt_len=1)  # kept: [1, 2, 3, 4, 5]
    index.add("a", [7, 2, 3, 9, 9], prompt_len=1)  # (2, 3) now continues with 9 here
    assert index.num_tokens == 10
    assert index.propose("a", [2, 3], limit=2) == (2, [9, 9])
    index.add("b", [8, 8, 6], prompt_len=1)  # evicts the first entry
    assert index.num_tokens == 8
    assert index.propose("a", [2, 3], limit=2) == (2, [9, 9])  # the newer entry's n-gram stays
    assert index.propose("a", [3, 4], limit=2) == (0, [])  # the evicted entry's own n-gram is gone
    assert index.propose("b", [8, 8], limit=1) == (2, [6])
    index.add("c", list(range(40)), prompt_len=0)  # longer than the whole index: its newest tokens
    assert index.num_tokens == 10 and index.propose("c", [35, 36], limit=9) == (2, [37, 38, 39])
    assert index.propose("a", [2, 3], limit=1) == (0, [])


def test_suffix_proposals_save_steps_on_a_repeated_request_with_identical_tokens() -> None:
    """Hashed fake outputs never repeat within a sequence, so only the index of recent completions
    can predict them: the second run of a greedy request is then mostly accepted drafts."""
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128, speculative="suffix")
    h = Harness(config)
    assert isinstance(h.scheduler._state.proposer, SuffixProposer)
    h.add("first", [1, 2, 3], max_tokens=30, temperature=0.0, ignore_eos=True)
    first_steps = h.run()
    h.add("again", [1, 2, 3], max_tokens=30, temperature=0.0, ignore_eos=True)
    again_steps = h.run()
    assert h.tokens("again") == h.tokens("first")
    stats = h.scheduler.stats()
    assert stats.draft_tokens_accepted >= 20
    assert again_steps <= first_steps - 20
    h.add("elsewhere", [1, 2, 3], max_tokens=30, temperature=0.0, ignore_eos=True, namespace="other")
    h.run()
    assert h.scheduler.stats().draft_tokens_accepted == stats.draft_tokens_accepted  # other namespace: nothing
    assert h.tokens("elsewhere") == h.tokens("first")


class RecordingSuffix(SuffixProposer):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config.ngram_min, config.ngram_max, config.suffix_cache_tokens)
        self.proposals: list[tuple[str, list[int]]] = []

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        drafts = super().propose(seq, limit)
        if drafts:
            self.proposals.append((seq.request.namespace, drafts))
        return drafts


class LeakySuffix(RecordingSuffix):
    """What the property must catch: one index for every tenant."""

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        n_own, own = self.own.match(seq, limit)
        n_recent, recent = self.recent.propose("everyone", seq.token_ids, limit)
        drafts = recent if n_recent > n_own else own
        if drafts:
            self.proposals.append((seq.request.namespace, drafts))
        return drafts

    def finished(self, seq: Sequence) -> None:
        self.recent.add("everyone", seq.token_ids, seq.prompt_len)


ALPHABETS = {"tenant-a": range(25), "tenant-b": range(25, 50)}


def _run_two_tenants(seed: int, config: SchedulerConfig, proposer: RecordingSuffix) -> list[tuple[str, list[int]]]:
    """Two tenants' requests through the scheduler; the proposals that are no run of the tokens of any
    of the proposing tenant's own sequences (prompt and output), i.e. that came from elsewhere."""
    rng = random.Random(seed)
    h = Harness(config)
    h.scheduler = Scheduler(config, clock=h.clock, proposer=proposer)
    prompts: dict[str, tuple[str, list[int]]] = {}
    bases = {name: [rng.choice(alphabet) for _ in range(6)] for name, alphabet in ALPHABETS.items()}
    for number in range(24):
        name = rng.choice(list(ALPHABETS))
        prompt = bases[name][: rng.randrange(2, 7)]  # a tenant's prompts repeat, so its index has hits
        prompts[f"r{number}"] = (name, prompt)
        h.add(f"r{number}", prompt, max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True, namespace=name)
        for _ in range(rng.randrange(0, 6)):
            h.step()
    h.run()
    sequences: dict[str, list[list[int]]] = {name: [] for name in ALPHABETS}
    for (request_id, _), completion in h.completions.items():
        name, prompt = prompts[request_id]
        sequences[name].append(prompt + completion.tokens)

    def is_run_of(drafts: list[int], tokens: list[int]) -> bool:
        return any(tokens[i : i + len(drafts)] == drafts for i in range(len(tokens) - len(drafts) + 1))

    return [(name, d) for name, d in proposer.proposals if not any(is_run_of(d, t) for t in sequences[name])]


def _config(capacity: int, ngram_min: int) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=48,
        block_size=2,
        max_model_len=40,
        speculative="suffix",
        ngram_min=ngram_min,
        ngram_max=3,
        suffix_cache_tokens=capacity,
        max_num_seqs=4,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), capacity=st.sampled_from([8, 40, 4096]), ngram_min=st.sampled_from([1, 2]))
def test_no_proposal_carries_another_tenants_tokens(seed: int, capacity: int, ngram_min: int) -> None:
    config = _config(capacity, ngram_min)
    assert _run_two_tenants(seed, config, RecordingSuffix(config)) == []


def test_the_tenant_check_catches_a_shared_index() -> None:
    """Not vacuous: the same check over one index for all tenants finds foreign proposals."""
    config = _config(4096, 1)
    assert any(_run_two_tenants(seed, config, LeakySuffix(config)) for seed in range(10))


def test_proposer_for_names_every_method() -> None:
    assert proposer_for(SchedulerConfig(num_blocks=4)) is None
    assert isinstance(proposer_for(SchedulerConfig(num_blocks=4, speculative="suffix")), SuffixProposer)
