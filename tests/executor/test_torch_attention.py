"""The torch attention backend against the one-sequence-at-a-time reference, including
decode batches spread over many context lengths (split into length buckets), at every
block size `--block-size` accepts."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.config.defaults import BLOCK_SIZES
from kvserve.executor.attention.base import AttentionMetadata
from kvserve.executor.attention.torch_backend import MIN_BUCKET_SEQS, TorchAttentionBackend, context_buckets
from kvserve.kernels.reference import paged_attention_reference

KV_HEADS, HEADS, HEAD_DIM = 2, 6, 8


def _case(query_lens: list[int], seq_lens: list[int], seed: int, block_size: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=padded,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=HEAD_DIM**-0.5,
        block_size=block_size,
        num_kv_heads=KV_HEADS,
    )
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    query = torch.randn(starts[-1], HEADS, HEAD_DIM)
    expected = paged_attention_reference(query, k_cache, v_cache, starts, seq_lens, tables, meta.scale)
    return meta, query, k_cache, v_cache, expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1] * 5, [3, 9, 17, 4, 30]),  # one decode group
        ([1] * 24, [random.Random(1).randrange(1, 200) for _ in range(24)]),  # decodes over many lengths: buckets
        ([7, 1, 1, 12, 1, 7, 1] + [1] * 10, [7, 40, 2, 30, 90, 19, 5] + list(range(100, 200, 10))),  # mixed step
        ([16], [16]),  # a fresh prefill
        ([70, 1, 64], [134, 64, 64]),  # an extend over 64 cached tokens, a decode and a prefill of whole blocks
    ],
)
def test_matches_reference(query_lens, seq_lens, block_size):
    meta, query, k_cache, v_cache, expected = _case(query_lens, seq_lens, seed=len(seq_lens), block_size=block_size)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    for _ in range(2):  # a second layer reuses the prepared groups and the workspace
        got = backend.forward(query, k_cache, v_cache, meta)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_decode_buckets_bound_padding_and_cover_every_sequence():
    rng = random.Random(0)
    seq_lens = [rng.randrange(64, 800) for _ in range(32)]
    buckets = context_buckets(list(range(32)), seq_lens)
    assert len(buckets) > 1
    assert sorted(i for b in buckets for i in b) == list(range(32))
    padded = sum(len(b) * max(seq_lens[i] for i in b) for b in buckets)
    assert padded < 0.8 * len(seq_lens) * max(seq_lens)  # one group would pad everything to the longest
    assert all(len(b) >= MIN_BUCKET_SEQS for b in buckets)


def test_few_or_equal_decodes_stay_one_group():
    assert context_buckets([0, 1, 2], [10, 500, 90]) == [[0, 1, 2]]
    assert context_buckets(list(range(16)), [128] * 16) == [list(range(16))]
