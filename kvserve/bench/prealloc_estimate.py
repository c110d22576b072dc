"""What a contiguous, max-length KV preallocation would allow, from the same trace.

A server that reserves one contiguous KV region per request must size it for the longest
request it may get. We give that baseline the most favourable setting: the region is
exactly the workload's largest prompt + max_tokens, not the model's context length. Its
concurrency in a KV budget of B tokens is then B // max_request_len; kvserve's is the peak
number of sequences it actually ran at once in the same budget.

`bench serve --baselines prealloc` also runs that baseline for real (a server started with
`--kv-reservation max-model-len --no-prefix-caching --max-model-len` = the workload's longest
request); this estimate stays beside it as the cross-check: a reservation is whole blocks, so
the run fits num_blocks // ceil(L/b) sequences, at most the estimate's B // L.

Partial-block waste: a paged cache loses only the unused tail of each sequence's last
block. For final lengths L_i and block size b, waste = Σ(ceil(L_i/b)·b − L_i) over
Σ ceil(L_i/b)·b allocated slots; each run is counted at its own server's block size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PreallocEstimate:
    budget_tokens: int
    max_request_len: int
    prealloc_concurrency: int
    kvserve_peak_concurrency: int

    @property
    def ratio(self) -> float | None:
        """kvserve's peak over the preallocation's concurrency (None when it fits nothing)."""
        if self.prealloc_concurrency <= 0:
            return None
        return self.kvserve_peak_concurrency / self.prealloc_concurrency

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def prealloc_concurrency(budget_tokens: int, max_request_len: int) -> int:
    """Requests a contiguous max-length reservation fits in `budget_tokens`."""
    if max_request_len <= 0:
        raise ValueError(f"max_request_len must be positive, got {max_request_len}")
    return max(0, budget_tokens) // max_request_len


def estimate(num_blocks: int, block_size: int, max_request_len: int, kvserve_peak: int) -> PreallocEstimate:
    budget = num_blocks * block_size
    return PreallocEstimate(
        budget_tokens=budget,
        max_request_len=max_request_len,
        prealloc_concurrency=prealloc_concurrency(budget, max_request_len),
        kvserve_peak_concurrency=kvserve_peak,
    )


@dataclass(slots=True)
class BlockWaste:
    num_sequences: int
    used_tokens: int
    allocated_tokens: int

    @property
    def waste_pct(self) -> float:
        if self.allocated_tokens == 0:
            return 0.0
        return 100.0 * (self.allocated_tokens - self.used_tokens) / self.allocated_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "waste_pct": self.waste_pct}

    @classmethod
    def combined(cls, parts: Iterable[BlockWaste]) -> BlockWaste:
        """The waste of several runs together (each counted at its own block size)."""
        total = cls(num_sequences=0, used_tokens=0, allocated_tokens=0)
        for part in parts:
            total.num_sequences += part.num_sequences
            total.used_tokens += part.used_tokens
            total.allocated_tokens += part.allocated_tokens
        return total


def partial_block_waste(sequence_lengths: Iterable[int], block_size: int) -> BlockWaste:
    """Slots allocated but unused in each sequence's last block, over all allocated slots."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    used = allocated = count = 0
    for length in sequence_lengths:
        if length < 0:
            raise ValueError(f"sequence length must be non-negative, got {length}")
        used += length
        allocated += -(-length // block_size) * block_size
        count += 1
    return BlockWaste(num_sequences=count, used_tokens=used, allocated_tokens=allocated)
