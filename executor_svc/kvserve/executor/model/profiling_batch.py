"""The CUDA profiling pass: one forward at the largest batch, to measure activation memory."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.executor.model.input_batch import build_input_batch
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams


def profile_peak_activation_bytes(runner: Any) -> int:  # a ModelRunner: not imported, it imports this package
    """Peak extra memory of a max_num_batched_tokens forward (dummy tokens, scratch cache)."""
    cfg = runner.config
    num_tokens = min(cfg.max_num_batched_tokens, runner.max_model_len * cfg.max_num_seqs)
    num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
    per_seq = max(1, num_tokens // num_seqs)
    blocks_per_seq = -(-per_seq // cfg.block_size)
    scratch = PagedKVCache(runner.geometry, num_seqs * blocks_per_seq, 0, runner.device)
    seqs = [
        SequenceState(
            seq_id=i,
            token_ids=[0] * per_seq,
            prompt_len=per_seq,
            block_table=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sampling=SamplingParams(temperature=0.0),
            seed=0,
            num_computed_tokens=0,
            num_scheduled_tokens=per_seq,
        )
        for i in range(num_seqs)
    ]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        batch = build_input_batch(
            seqs, cfg.block_size, runner.device, runner.model.scale, runner.dtype, runner.shard_config.num_kv_heads
        )
        runner.model.forward(batch, scratch, runner.backend)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del scratch
    torch.cuda.empty_cache()
    return int(peak)
