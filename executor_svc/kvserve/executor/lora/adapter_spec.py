"""The `--lora NAME=PATH` entries: which adapters to load and the names requests choose them by.

Why a module of its own: a name is what a request names (`NewSequence.lora_name`) and what the
executor reports (`ExecutorInfo.lora_names`), so an entry without a name or a path, or a name given
twice, is refused before any file is read, quoting the entry, rather than serving one of two
adapters under a name a client believes means the other. (The fake executor, which loads nothing,
reads the same flag by the same rules: `kvserve.executor.fake.adapters`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.executor.config_error import ExecutorConfigError


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One `--lora` entry: the adapter's name and the directory PEFT saved it in."""

    name: str
    path: Path


def parse_adapter_specs(entries: Sequence[str]) -> list[AdapterSpec]:
    """The entries in the order given (the order `ExecutorInfo.lora_names` reports)."""
    specs: dict[str, AdapterSpec] = {}
    for entry in entries:
        name, equals, path = entry.partition("=")
        if not equals or not name or not path:
            raise ExecutorConfigError(
                f"--lora {entry!r}: expected NAME=PATH, a name, '=', and the directory PEFT saved the adapter in "
                "(adapter_config.json and adapter_model.safetensors)"
            )
        if name in specs:
            raise ExecutorConfigError(
                f"--lora: the name {name!r} is given twice ({specs[name].path} and {path}); each adapter needs "
                "a name of its own"
            )
        specs[name] = AdapterSpec(name, Path(path))
    return list(specs.values())
