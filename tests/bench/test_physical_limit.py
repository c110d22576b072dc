"""The physical limit of a decode step (`kvserve.bench.physical_limit`): what it counts, for kvserve
and for llama.cpp on the same GGUF."""

from __future__ import annotations

import pytest
import torch

from kvserve.bench.physical_limit import copy_bandwidth, gguf_bytes_per_step, limit_tokens_per_s, stored_bytes
from kvserve.executor.weights.q8_0 import quantize
from kvserve.executor.weights.row_invariance import RowFixedLinear


def test_a_matrix_counts_the_bytes_it_stores_through_its_wrappers() -> None:
    head = RowFixedLinear(quantize(torch.randn(64, 96)), min_rows=1)  # type: ignore[arg-type]
    assert stored_bytes(head) == 64 * 96 * 1 + 64 * 3 * 4  # int8 codes, float32 scales
    assert stored_bytes(torch.zeros(10, dtype=torch.bfloat16)) == 20
    assert stored_bytes("not a tensor") == 0


def test_a_batch_shares_one_read_of_the_weights_but_not_of_its_kv() -> None:
    assert limit_tokens_per_s(bandwidth=100e9, weight_bytes=100_000_000, kv_bytes_per_seq=0, batch=1) == 1000
    # 4 sequences: 4 tokens per read of 100 MB of weights and 4 × 25 MB of KV.
    assert limit_tokens_per_s(100e9, 100_000_000, 25_000_000, batch=4) == 2000


@pytest.mark.slow
def test_llama_cpp_reads_every_tensor_its_tied_embedding_as_the_head() -> None:
    from gguf import GGUFReader

    from kvserve.executor.weights.model_store import default_model_source

    source = default_model_source()
    path = source.path / source.gguf_file
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    assert "output.weight" not in tensors  # SmolLM2 ties them
    weights, kv = gguf_bytes_per_step(path, context=128)
    assert weights == sum(tensors.values())  # the embedding read whole once, by the head
    assert kv == 128 * 2 * 30 * 3 * 64 * 2  # f16 K and V, 30 layers of 3 KV heads of 64


def test_the_copy_runs_on_the_threads_asked_for_and_leaves_torchs_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native path leaves torch one thread and gives the kernels the rest: its bandwidth must be
    measured with the kernels' threads, not torch's one (issue 49: 12.9 against 23-25 GB/s)."""
    seen: list[int] = []
    real_copy = torch.Tensor.copy_

    def recording_copy(self: torch.Tensor, src: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real_copy(self, src, *args, **kwargs)

    kept = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
        assert copy_bandwidth("cpu", mib=4, repeats=2, threads=2) > 0
        assert seen and set(seen) == {2}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(kept)
