"""The decode forward as one CUDA graph per batch-size bucket (`--compile on` on CUDA).

Why: a small model's decode step on a GPU is a few hundred kernel launches (about a dozen a layer),
each a few microseconds of Python and driver work, against microseconds of arithmetic; a graph
replays them all from one launch. This is vLLM's pattern, through the same buckets as the CPU's
compiled graphs (`decode_graphs`).

How: each bucket of B rows owns static input tensors (ids, positions, slots, sequence lengths,
block tables) at fixed addresses, made as the CPU graphs' padding-only batch
(`decode_graphs.padding_only_batch`). A step of R <= B sequences copies its tensors into the bucket's
and replays its graph; rows R..B are padding: token 0 at position 0, each its own one-token
sequence in block 0, writing to slot -1, which the Triton KV store skips. The Triton decode kernel
reads every length from the device tensors and takes its split count from the batch size alone
(`kvserve.kernels.paged_decode`), so one capture serves every context the block tables can hold.

Which steps: pure decode only (one new token per sequence, each sampled) of at most the largest
bucket's rows. A prefill or extend chunk, a speculative verification (several rows per sequence,
the extend kernel) and a bucket miss run eagerly. A full bucket computes eager's bits (the same
kernels on the same shapes); a padded one computes them for more rows, and on CUDA a row's bits
follow its batch size (cuBLAS, the decode split count: docs/architecture.md), so there graph and
eager logits agree to rounding.

`capture=False` runs the same static-input path without a graph (on CPU, under
`TRITON_INTERPRET=1`), which is how the tests without a GPU check the padding and the copies.
The graphs' memory pool comes on top of the KV cache that start-up sized from free memory: the
largest bucket's activations and float32 logits (about 0.2 GB for an 8B model at 256 rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvserve.executor.attention.base import AttentionBackend
from kvserve.executor.model.decode_graphs import (
    PAD_SLOT,
    BucketCompile,
    bucket_for,
    every_row_samples,
    padding_only_batch,
)
from kvserve.executor.model.input_batch import InputBatch
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.model.llama import LlamaModel

log = structlog.get_logger(__name__)

WARMUP_RUNS = 2
"""Eager runs of a bucket before its capture: Triton compiles its kernels and the allocator settles."""


@dataclass(slots=True)
class _Bucket:
    """One bucket's static inputs, its output and (when captured) its graph."""

    size: int
    batch: InputBatch
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


def is_pure_decode(batch: InputBatch) -> bool:
    """One new token per sequence, each sampled: the only steps a CUDA graph serves."""
    return batch.num_tokens > 0 and batch.attention.max_query_len == 1 and every_row_samples(batch)


class CudaDecodeGraphs:
    """One captured decode forward per bucket; `capture_all` at start-up, `forward` every step."""

    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        backend: AttentionBackend,
        buckets: tuple[int, ...],
        table_width: int,
        capture: bool = True,
    ) -> None:
        if backend.name != "triton":
            raise ValueError(f"CUDA graphs need the triton attention backend, got {backend.name}")
        self.model, self.cache, self.backend = model, cache, backend
        self.buckets, self.table_width, self.capture = buckets, table_width, capture
        self._static: dict[int, _Bucket] = {}
        self._pool: Any = None  # the graphs' shared memory pool handle (torch's own type)
        self.replays = 0
        """Steps served through a bucket (the tests read it)."""

    def capture_all(self) -> list[BucketCompile]:
        """Warm up and capture every bucket, the largest first so the smaller ones reuse its memory
        pool; a progress line each."""
        captured = []
        for index, size in enumerate(sorted(self.buckets, reverse=True), start=1):
            started = time.monotonic()
            bucket = _Bucket(size, padding_only_batch(size, self.table_width, self.model, self.cache))
            with torch.inference_mode():
                self._capture(bucket)
            self._static[size] = bucket
            done = BucketCompile(batch=size, seconds=round(time.monotonic() - started, 2), cache_hits=0, cache_misses=0)
            log.info(
                "captured decode bucket" if self.capture else "prepared decode bucket (no graph)",
                bucket=f"{index}/{len(self.buckets)}",
                batch=size,
                seconds=done.seconds,
            )
            captured.append(done)
        return sorted(captured, key=lambda c: c.batch)

    def forward(self, batch: InputBatch) -> torch.Tensor | None:
        """Logits of a pure decode step through its bucket's graph; None when no graph serves the
        step (run it eagerly)."""
        size = bucket_for(batch.num_tokens, self.buckets) if is_pure_decode(batch) else None
        if size is None:
            return None
        bucket = self._static[size]
        self._load(bucket, batch)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.logits = self._run(bucket)
        self.replays += 1
        assert bucket.logits is not None
        # A copy: the next replay overwrites the static output while a caller may still hold these rows.
        return bucket.logits[: batch.num_tokens].clone()

    # --- internals ---------------------------------------------------------------

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        logits = self.model.forward(bucket.batch, self.cache, self.backend)
        assert logits is not None  # graphs run on one rank, which always returns logits
        return logits

    def _capture(self, bucket: _Bucket) -> None:
        if not self.capture:
            bucket.logits = self._run(bucket)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = self._run(bucket)
        self._pool = graph.pool()
        bucket.graph = graph

    @staticmethod
    def _load(bucket: _Bucket, batch: InputBatch) -> None:
        """Copy a step's inputs into the bucket's tensors; the rows past them become padding again.
        Block-table columns past the step's width keep older entries, which are block indices the
        kernels never read (a row reads only the blocks its length covers)."""
        rows, static, meta = batch.num_tokens, bucket.batch, batch.attention
        smeta = static.attention
        static.input_ids[:rows].copy_(batch.input_ids)
        static.positions[:rows].copy_(batch.positions)
        smeta.slot_mapping[:rows].copy_(meta.slot_mapping)
        smeta.seq_lens[:rows].copy_(meta.seq_lens)
        smeta.block_tables[:rows, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if rows < bucket.size:
            static.input_ids[rows:].zero_()
            static.positions[rows:].zero_()
            smeta.slot_mapping[rows:].fill_(PAD_SLOT)
            smeta.seq_lens[rows:].fill_(1)
            smeta.block_tables[rows:, 0].zero_()
