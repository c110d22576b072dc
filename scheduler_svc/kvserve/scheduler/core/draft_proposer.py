"""Who proposes draft tokens for speculative decoding: one protocol, chosen by `--speculative`.

The step builder asks a `DraftProposer` for at most `limit` tokens that may follow a decoding
sequence's tokens; the executor verifies them. The lookup proposers run in the scheduler, on
the tokens it already owns, with no model. `draft` is the executor's draft model: the plan of
one step asks for proposals (`from_executor`), the result brings them, and the next step's
builder hands them out like any others. Tests plug in their own (an oracle that knows the
right continuation and errs on purpose) to drive every accept length through the KV bookkeeping.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.scheduler.core.ngram_index import NgramIndex
from kvserve.scheduler.core.request import Sequence
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.core.suffix_index import SuffixIndex


class DraftProposer(Protocol):
    from_executor: bool
    """The executor's draft model computes the drafts: the step before asks for them in its plan."""

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` (≥ 1) tokens that may follow `seq.token_ids`; [] to decode plainly."""
        ...

    def finished(self, seq: Sequence) -> None:
        """`seq` ended (any reason): a proposer that learns from completions may keep its tokens."""
        ...


class NgramProposer:
    """`--speculative ngram`: prompt lookup over the sequence's own prompt and output."""

    from_executor = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.match(seq, limit)[1]

    def match(self, seq: Sequence, limit: int) -> tuple[int, list[int]]:
        """(length of the suffix n-gram matched, its continuation); (0, []) if none."""
        index = seq.ngram
        if index is None:
            index = seq.ngram = NgramIndex(self.min_n, self.max_n)
        return index.propose(seq.token_ids, limit)

    def finished(self, seq: Sequence) -> None:
        seq.ngram = None  # its index dies with it


class SuffixProposer:
    """`--speculative suffix`: the sequence's own n-grams and its namespace's recent completions.

    The longer suffix match wins (the sequence's own on a tie): a rewrite copies its prompt, a
    repeated question follows an earlier answer. Completions are indexed as they end, and a
    lookup reads only the sequence's own prefix namespace, so tenants never see each other's.
    """

    from_executor = False

    def __init__(self, min_n: int, max_n: int, capacity: int) -> None:
        self.own = NgramProposer(min_n, max_n)
        self.recent = SuffixIndex(min_n, max_n, capacity)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        n_own, own = self.own.match(seq, limit)
        if n_own >= self.recent.max_n:
            return own  # nothing in the index can match longer
        n_recent, recent = self.recent.propose(seq.request.namespace, seq.token_ids, limit)
        return recent if n_recent > n_own else own

    def finished(self, seq: Sequence) -> None:
        self.own.finished(seq)
        self.recent.add(seq.request.namespace, seq.token_ids, seq.prompt_len)


class DraftModelProposer:
    """`--speculative draft`: the tokens the executor's draft model proposed after the last step.

    They follow the sequence's tokens as that step left them, so they are used at once or never:
    a sequence that was not scheduled in between, or was preempted, gets new ones next time.
    """

    from_executor = True

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        drafts, seq.executor_drafts = seq.executor_drafts, []
        return drafts[:limit]

    def finished(self, seq: Sequence) -> None:
        seq.executor_drafts = []


def proposer_for(config: SchedulerConfig) -> DraftProposer | None:
    """The proposer `config.speculative` names (None: off)."""
    if config.speculative == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative == "suffix":
        return SuffixProposer(config.ngram_min, config.ngram_max, config.suffix_cache_tokens)
    if config.speculative == "draft":
        return DraftModelProposer()
    return None
