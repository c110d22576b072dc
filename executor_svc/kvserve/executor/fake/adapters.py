"""The fake executor's LoRA adapters: their names from `--lora NAME=PATH`, and what each changes.

The fake loads nothing (PATH need not exist): an adapter is a name it reports in
`ExecutorInfo.lora_names` and a salt mixed into every draw of a sequence run under it
(`tokens.context_hash`), so the same context gives other tokens under another adapter, the
same tokens under the same one, and the base model's tokens are those of a fake without
adapters. A NewSequence naming an adapter it was not given is refused (`sequences.SequenceTable`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from kvserve.executor.lora.adapter_spec import parse_adapter_specs


def lora_names(specs: Iterable[str]) -> tuple[str, ...]:
    """The adapters' names, in the order given, by the real executor's rules (`parse_adapter_specs`:
    ExecutorConfigError names an entry that is not NAME=PATH, or a name given twice)."""
    return tuple(spec.name for spec in parse_adapter_specs(list(specs)))


def lora_salt(lora_name: str) -> int:
    """The salt of an adapter's draws: 0 for the base model, else 64 bits of a hash of its name."""
    if not lora_name:
        return 0
    return int.from_bytes(hashlib.blake2b(lora_name.encode("utf-8"), digest_size=8).digest(), "big")
