"""The physical limit of a decode step: every weight read once, at the machine's copy bandwidth.

At batch 1 a decode step reads each matrix whole to produce one token, so no implementation can
beat bytes read per token ÷ memory bandwidth. `kvserve bench executor` reports each decode batch
against that limit: the bytes its runner holds for the layers, norms and lm_head (as stored: Q4_1,
Q8_0, bfloat16 or packed float32), one embedding row per token, and each sequence's KV context,
with the bandwidth of a large copy measured in the same run (STREAM's convention: bytes read plus
bytes written, per second). The same arithmetic over a GGUF file's tensors gives llama.cpp's limit
(`python -m kvserve.bench.physical_limit GGUF --context N`, which `scripts/bench_cpu_table.sh`
runs), so both engines' B=1 figures are measured against one ceiling.

At larger batches the weights are shared by B tokens and the step turns compute-bound; the limit
there is still a true upper bound, just a looser one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.weights.loader import ModelWeights

COPY_MIB = 512
"""Far past any cache this project's CPUs have, so the copy streams from memory."""


def copy_bandwidth(device: str, mib: int = COPY_MIB, repeats: int = 5, threads: int | None = None) -> float:
    """Best-of-`repeats` bytes/s of copying `mib` MiB (read + written, as STREAM counts a copy), on the CPU
    with `threads` of torch's threads (the executor's compute threads: on the native path torch itself
    keeps one thread and the kernels get the rest, and one thread's copy measured half the bandwidth)."""
    import torch

    kept = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**20 // 4, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            started = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(kept)
    return 2 * src.numel() * src.element_size() / best


def stored_bytes(obj: object) -> int:
    """The bytes of every tensor an object holds in its dataclass fields, recursively (a layer
    matrix of any kind: its weight or codes, scales and bias; a `RowFixedLinear` its inner layer)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(stored_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def weight_bytes_per_step(weights: ModelWeights) -> int:
    """What one decode step reads of the weights: every layer matrix and norm, the final norm and
    the lm_head whole, and one embedding row (per token, but one row is noise beside a matrix)."""
    layers = sum(stored_bytes(layer) for layer in weights.layers)
    table = weights.embed.table
    embedding_row = table.shape[1] * weights.embed.dtype.itemsize
    return layers + stored_bytes(weights.final_norm) + stored_bytes(weights.lm_head) + embedding_row


@dataclass(slots=True)
class MemoryLimit:
    """What the physical limit of a decode step is made of, as `kvserve bench executor --json` reports it."""

    copy_bandwidth: float
    """Bytes/s of a large copy, read plus written."""
    weight_bytes: int
    """Read once per decode step, by every rank together."""
    kv_bytes_per_seq: int
    """Each sequence's KV context, read once per step."""


def memory_limit(runner: ModelRunner, context: int) -> MemoryLimit:
    """The bytes a decode step of `runner` reads (rank 0's weights × ranks, a sequence's KV of
    `context` tokens) and the copy bandwidth, measured now with the threads its kernels use."""
    geometry = runner.geometry
    kv_per_token = geometry.bytes_per_block // geometry.block_size  # the cache's own formula
    ranks = runner.layout.size
    return MemoryLimit(
        copy_bandwidth=copy_bandwidth(runner.device, threads=runner.num_threads or None),
        weight_bytes=ranks * weight_bytes_per_step(runner.model.weights),
        kv_bytes_per_seq=ranks * kv_per_token * context,
    )


def limit_tokens_per_s(bandwidth: float, weight_bytes: int, kv_bytes_per_seq: int, batch: int) -> float:
    """The most tokens/s a decode step of `batch` sequences can reach: B tokens per read of the
    weights and of each sequence's KV context."""
    return batch * bandwidth / (weight_bytes + batch * kv_bytes_per_seq)


def gguf_bytes_per_step(path: Path, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per sequence) llama.cpp reads per decode step of a GGUF model: every
    tensor as stored but the token embedding, of which a lookup reads one row, unless the file ties it
    to the lm_head, which reads it whole; and an f16 KV cache (llama.cpp's default) of `context` tokens."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    embedding = tensors.pop("token_embd.weight")
    fields = {f.name: f for f in reader.fields.values()}
    arch = bytes(fields["general.architecture"].parts[-1]).decode()

    def number(key: str) -> int:
        return int(fields[f"{arch}.{key}"].parts[-1][0])

    layers, heads, kv_heads = number("block_count"), number("attention.head_count"), number("attention.head_count_kv")
    head_dim = number("embedding_length") // heads
    weights = sum(tensors.values()) + (0 if "output.weight" in tensors else embedding)
    return weights, context * 2 * layers * kv_heads * head_dim * 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.physical_limit",
        description="Bytes a llama.cpp decode step reads of a GGUF model (JSON on stdout).",
    )
    parser.add_argument("gguf", type=Path, help="the GGUF file")
    parser.add_argument("--context", type=int, default=128, help="tokens of KV context per sequence")
    args = parser.parse_args(argv)
    weights, kv = gguf_bytes_per_step(args.gguf, args.context)
    print(json.dumps({"weight_bytes": weights, "kv_bytes_per_seq": kv, "context": args.context}))
    return 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
