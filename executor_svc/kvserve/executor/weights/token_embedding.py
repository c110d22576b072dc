"""The token embedding lookup: a table in device memory, or rows read from the weights file.

A step looks up only its own tokens' rows, a few hundred of the vocabulary's tens of
thousands. On CPU the table is therefore not loaded at all: it is a read-only view of the
safetensors file, and the OS pages in the rows that are looked up. A tied lm_head still
needs the whole matrix, but in its GEMM layout (`kvserve.executor.weights.linear`), so the two never
hold the same matrix twice in anonymous memory: the saving is the table's whole size
(113 MB fp32 for SmolLM2-135M), with bit-identical rows.

The safetensors layout is documented and stable: an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range, then the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16}
"""File dtypes numpy can map directly (BF16 has no numpy dtype: such tables are loaded)."""


@dataclass(slots=True)
class TokenEmbedding:
    table: torch.Tensor
    """[vocab, hidden], in memory, or mapped from the file."""
    dtype: torch.dtype
    """What the forward pass computes in; rows are converted as they are looked up."""
    first_row: int | None = None
    """Tensor parallelism: `table` holds the vocabulary rows from this one on; a token outside them
    looks up zeros, which the other ranks' rows complete in an all-reduce. None: the whole table."""

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A fresh tensor (the forward pass adds into it in place)."""
        if self.first_row is not None:
            return self._shard_rows(input_ids)
        rows = F.embedding(input_ids, self.table)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def _shard_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.first_row is not None
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.table.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.table).to(self.dtype)
        return rows.masked_fill_(outside[:, None], 0)


def mapped_table(path: Path, name: str) -> torch.Tensor | None:
    """`name` of the safetensors file `path` as a copy-on-write file mapping; None if not mappable."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    entry = header.get(name)
    if entry is None or entry["dtype"] not in _NUMPY_DTYPES:
        return None
    begin, end = entry["data_offsets"]
    dtype = _NUMPY_DTYPES[entry["dtype"]]
    shape = tuple(entry["shape"])
    if end - begin != int(np.prod(shape)) * np.dtype(dtype).itemsize:
        return None
    # mode "c": private pages, so torch gets a writable array without a copy; nothing writes it.
    array = np.memmap(path, dtype=dtype, mode="c", offset=8 + header_len + begin, shape=shape)
    return torch.from_numpy(array)
