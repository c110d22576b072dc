"""Plan → flat batch tensors, and the KV cache's block operations."""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.model.input_batch import build_input_batch
from kvserve.executor.model.kv_cache import CacheGeometry, PagedKVCache
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import PlanError


def _seq(seq_id, tokens, table, computed, scheduled):
    return SequenceState(
        seq_id=seq_id,
        token_ids=tokens,
        prompt_len=len(tokens),
        block_table=table,
        sampling=SamplingParams(),
        seed=0,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
    )


def test_flat_batch_positions_slots_and_sample_rows():
    chunk = _seq(1, list(range(100, 120)), [7, 2], computed=3, scheduled=14)  # mid-prompt chunk: no sample
    decode = _seq(2, list(range(40)), [5, 0, 9], computed=39, scheduled=1)
    batch = build_input_batch([chunk, decode], block_size=16, device="cpu", scale=0.125, num_kv_heads=2)
    assert batch.input_ids.tolist() == list(range(103, 117)) + [39]
    assert batch.positions.tolist() == list(range(3, 17)) + [39]
    expected_slots = [7 * 16 + p for p in range(3, 16)] + [2 * 16 + 0] + [9 * 16 + 39 - 32]
    assert batch.attention.slot_mapping.tolist() == expected_slots
    assert batch.attention.query_start_loc.tolist() == [0, 14, 15]
    assert batch.attention.seq_lens.tolist() == [17, 40]
    assert batch.attention.block_tables.tolist() == [[7, 2, 0], [5, 0, 9]]
    assert batch.sample_indices.tolist() == [14]
    assert [s.seq_id for s in batch.sampling_seqs] == [2]


def test_block_table_too_short_is_a_plan_error():
    seq = _seq(1, list(range(20)), [3], computed=0, scheduled=20)
    with pytest.raises(PlanError, match="block table"):
        build_input_batch([seq], block_size=16, device="cpu", scale=1.0)


def test_copy_and_swap_round_trip_every_layer():
    geometry = CacheGeometry(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    cache = PagedKVCache(geometry, num_blocks=6, num_cpu_blocks=3, device="cpu")
    cache.tensor.copy_(torch.randn_like(cache.tensor))
    original = cache.tensor.clone()
    cache.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(cache.tensor[:, :, 4], original[:, :, 1])
    assert torch.equal(cache.tensor[:, :, 5], original[:, :, 2])
    cache.swap_out([(0, 2), (3, 0)])
    cache.tensor.zero_()
    cache.swap_in([(2, 1), (0, 3)])
    assert torch.equal(cache.tensor[:, :, 1], original[:, :, 0])
    assert torch.equal(cache.tensor[:, :, 3], original[:, :, 3])
    assert geometry.bytes_per_block == 2 * 3 * 4 * 2 * 4 * 4


def test_swap_without_swap_space_is_refused():
    geometry = CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
    cache = PagedKVCache(geometry, num_blocks=2, num_cpu_blocks=0, device="cpu")
    with pytest.raises(RuntimeError, match="swap"):
        cache.swap_out([(0, 0)])
