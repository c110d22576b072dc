"""The decode forward compiled once per batch-size bucket (`--compile on`).

A step in which every scheduled row samples (a decode step: one new token per sequence; or a
speculative verification step: each sequence's last token and its drafts) of R rows pads up to the
smallest bucket that holds R and runs that bucket's compiled graph (`torch.compile`, inductor's
C++ backend, static shapes); a step past the largest bucket, or any step with a prefill in it,
runs eagerly. Padding rows read block 0 and write nowhere (slot -1, which the KV store skips),
and their logits are dropped.

A bucket of B rows always holds B sequences, so one graph serves decode and verification alike:
a step's S sequences, then one padding sequence per padding row, then R - S empty sequences (no
query rows, no context), which the attention kernel skips.

Compiled and eager rows are bit-identical, so a request's tokens do not depend on which path
its steps took: every reduction runs in an op the graph calls as it is (kvserve's CPU kernels,
its Q4_1 GEMM among them, and `opaque_norm`'s RMSNorm), and inductor fuses only elementwise work. The
block tables are padded to the longest context, so a graph's shapes never change with the
sequences' lengths and one capture serves a bucket for the whole run.

Inductor's FX-graph and kernel caches live under `--compile-cache-dir`: a warm start re-traces
each bucket (dynamo) but reuses the compiled code, and the log says which.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from kvserve.executor.attention.base import AttentionBackend, AttentionMetadata
from kvserve.executor.model.input_batch import InputBatch
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.model.llama import LlamaModel
from kvserve.executor.model.opaque_norm import opaque_rms_norm

log = structlog.get_logger(__name__)

PAD_SLOT = -1
"""The slot a padding row's K/V goes to: none (the CPU store skips slots < 0)."""


@dataclass(frozen=True, slots=True)
class BucketCompile:
    """What capturing one bucket cost, and whether inductor's on-disk cache supplied its code."""

    batch: int
    seconds: float
    cache_hits: int
    cache_misses: int


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `rows`; None past the largest."""
    return next((size for size in buckets if size >= rows), None)


def buckets_up_to(buckets: tuple[int, ...], max_rows: int) -> tuple[int, ...]:
    """The buckets a step of at most `max_rows` rows can take: those below it and the first that
    holds it (all of them when none does). Capturing the others would cost start-up and memory."""
    cap = bucket_for(max_rows, buckets)
    return buckets if cap is None else tuple(size for size in buckets if size <= cap)


def every_row_samples(batch: InputBatch) -> bool:
    """Each scheduled row is sampled: a decode or a verification step, the steps a graph serves.
    A prefill (or a chunk of one) has rows that do not sample."""
    return batch.sample_indices.shape[0] == batch.num_tokens


def pad_decode_batch(batch: InputBatch, bucket: int, table_width: int) -> InputBatch:
    """`batch` (every row sampling, at most `bucket` rows) padded to `bucket` rows, `bucket`
    sequences and `table_width` block-table columns. Padding rows: token 0 at position 0, slot -1,
    each its own one-token sequence in block 0; then empty sequences up to `bucket`."""
    meta, rows = batch.attention, batch.num_tokens
    seqs = meta.seq_lens.shape[0]
    pad, empty = bucket - rows, rows - seqs
    device = batch.input_ids.device
    tables = torch.zeros(bucket, table_width, dtype=torch.int32, device=device)
    tables[:seqs, : meta.block_tables.shape[1]] = meta.block_tables
    starts = torch.arange(rows + 1, rows + pad + 1, dtype=torch.int32, device=device)
    padded_meta = AttentionMetadata(
        slot_mapping=_extend(meta.slot_mapping, pad, PAD_SLOT),
        query_start_loc=_extend(torch.cat([meta.query_start_loc, starts]), empty, bucket),
        seq_lens=_extend(_extend(meta.seq_lens, pad, 1), empty, 0),
        block_tables=tables,
        query_lens_cpu=meta.query_lens_cpu + [1] * pad + [0] * empty,
        seq_lens_cpu=meta.seq_lens_cpu + [1] * pad + [0] * empty,
        max_query_len=meta.max_query_len,
        max_seq_len=max(meta.max_seq_len, 1),
        scale=meta.scale,
        block_size=meta.block_size,
        num_kv_heads=meta.num_kv_heads,
        dtype=meta.dtype,
    )
    return InputBatch(
        input_ids=_extend(batch.input_ids, pad, 0),
        positions=_extend(batch.positions, pad, 0),
        attention=padded_meta,
        sample_indices=torch.arange(bucket, dtype=torch.long, device=device),
        sampling_seqs=batch.sampling_seqs,
        sample_counts=batch.sample_counts,
    )


def padding_only_batch(bucket: int, table_width: int, model: LlamaModel, cache: PagedKVCache) -> InputBatch:
    """`bucket` padding rows: captures a bucket's graph at start-up without a sequence or a cache write."""
    device = cache.layer(0)[0].device
    empty = InputBatch(
        input_ids=torch.zeros(0, dtype=torch.long, device=device),
        positions=torch.zeros(0, dtype=torch.long, device=device),
        attention=AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            query_lens_cpu=[],
            seq_lens_cpu=[],
            max_query_len=1,
            max_seq_len=1,
            scale=model.scale,
            block_size=cache.geometry.block_size,
            num_kv_heads=cache.geometry.num_kv_heads,
            dtype=model.dtype,
        ),
        sample_indices=torch.zeros(0, dtype=torch.long, device=device),
        sampling_seqs=[],
    )
    return pad_decode_batch(empty, bucket, table_width)


class DecodeGraphs:
    """One compiled decode forward per bucket, captured by `capture_all` at start-up."""

    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        backend: AttentionBackend,
        buckets: tuple[int, ...],
        table_width: int,
        cache_dir: Path,
    ) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.buckets, self.table_width = buckets, table_width
        # Read by inductor at its first compile; everything it caches (FX graphs, C++ kernels) goes here.
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(buckets) + 1)
        model.norm = opaque_rms_norm  # a traced RMSNorm's sum would follow the bucket's shape
        self._compiled: Callable[[InputBatch], torch.Tensor | None] = torch.compile(self._forward, dynamic=False)

    def _forward(self, batch: InputBatch) -> torch.Tensor | None:
        return self.model.forward(batch, self.cache, self.backend)

    def capture_all(self) -> list[BucketCompile]:
        """Compile every bucket on a padding-only batch, a progress line each."""
        from torch._dynamo.utils import counters

        captured = []
        for index, bucket in enumerate(self.buckets, start=1):
            hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
            started = time.monotonic()
            with torch.inference_mode():
                self._compiled(padding_only_batch(bucket, self.table_width, self.model, self.cache))
            done = BucketCompile(
                batch=bucket,
                seconds=round(time.monotonic() - started, 1),
                cache_hits=counters["inductor"]["fxgraph_cache_hit"] - hits,
                cache_misses=counters["inductor"]["fxgraph_cache_miss"] - misses,
            )
            log.info(
                "compiled decode bucket",
                bucket=f"{index}/{len(self.buckets)}",
                batch=bucket,
                seconds=done.seconds,
                inductor_cache="hit" if done.cache_hits and not done.cache_misses else "miss",
            )
            captured.append(done)
        return captured

    def forward(self, batch: InputBatch) -> torch.Tensor | None:
        """Logits of a decode or verification step through its bucket's graph; None when no graph
        serves the step (run it eagerly)."""
        bucket = bucket_for(batch.num_tokens, self.buckets) if every_row_samples(batch) else None
        if bucket is None:
            return None
        logits = self._compiled(pad_decode_batch(batch, bucket, self.table_width))
        assert logits is not None  # graphs run on one rank, which always returns logits
        return logits[: batch.num_tokens]


def _extend(values: torch.Tensor, count: int, fill: int) -> torch.Tensor:
    if count == 0:
        return values
    return torch.cat([values, torch.full((count,), fill, dtype=values.dtype, device=values.device)])
