"""Who proposes draft tokens for speculative decoding: one protocol, chosen by `--speculative`.

The step builder asks a `DraftProposer` for at most `limit` tokens that may follow a decoding
sequence's tokens; the executor verifies them. Proposers run in the scheduler, on the tokens it
already owns, with no model. Tests plug in their own (an oracle that knows the right
continuation and errs on purpose) to drive every accept length through the KV bookkeeping.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.scheduler.core.ngram_index import NgramIndex
from kvserve.scheduler.core.request import Sequence
from kvserve.scheduler.core.scheduler_config import SchedulerConfig


class DraftProposer(Protocol):
    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` (≥ 1) tokens that may follow `seq.token_ids`; [] to decode plainly."""
        ...


class NgramProposer:
    """`--speculative ngram`: prompt lookup over the sequence's own prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        index = seq.ngram
        if index is None:
            index = seq.ngram = NgramIndex(self.min_n, self.max_n)
        return index.propose(seq.token_ids, limit)


def proposer_for(config: SchedulerConfig) -> DraftProposer | None:
    """The proposer `config.speculative` names (None: off)."""
    if config.speculative == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    return None
