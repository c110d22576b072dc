"""Copy a dataclass to and from a protobuf message, field by field, matched by name.

The wire messages mirror the contract dataclasses (`ExecutorInfo`, `SamplingParams`) field
for field, so a conversion is a table: the names both sides have, and for each whether the
message field repeats or tracks presence (an unset optional field is the dataclass's None); a
`map<K, V>` field is the dataclass's tuple of (key, value) pairs, sorted by key (hashable, and
the same on both sides whatever order the map's entries crossed in).
`FieldTable` builds that table once per pair from the dataclass's type hints and the message's
descriptor; adding a field to both then needs no edit here or in any caller.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from google.protobuf.message import Message

T = TypeVar("T")
M = TypeVar("M", bound=Message)

_PLAIN, _REPEATED, _OPTIONAL, _MAP = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class FieldTable:
    """The fields dataclass `cls` and message type `message` share: (name, kind, sequence type)."""

    cls: type
    fields: tuple[tuple[str, int, type], ...]

    def fill(self, obj: Any, out: M) -> M:
        """Write `obj`'s shared fields onto `out` (repeated fields are extended, None optionals left unset)."""
        for name, kind, _ in self.fields:
            value = getattr(obj, name)
            if kind == _REPEATED:
                getattr(out, name).extend(value)
            elif kind == _MAP:
                getattr(out, name).update(value)
            elif kind != _OPTIONAL or value is not None:
                setattr(out, name, value)
        return out

    def values(self, msg: Message) -> dict[str, Any]:
        """The shared fields of `msg` as dataclass values: a repeated field as the dataclass's list or
        tuple, a map as its (key, value) pairs sorted by key, an unset optional field as None."""
        values: dict[str, Any] = {}
        for name, kind, sequence in self.fields:
            if kind == _MAP:
                values[name] = tuple(sorted(getattr(msg, name).items()))
            elif kind == _REPEATED:
                values[name] = sequence(getattr(msg, name))
            elif kind == _OPTIONAL and not msg.HasField(name):
                values[name] = None
            else:
                values[name] = getattr(msg, name)
        return values

    def build(self, msg: Message, **extra: Any) -> Any:
        """An instance of the dataclass from `msg` (and `extra` for fields the message lacks)."""
        return self.cls(**self.values(msg), **extra)


@cache
def field_table(cls: Any, message: Any) -> FieldTable:
    """The table of `cls` against `message`, built once per pair."""
    hints = typing.get_type_hints(cls)
    by_name = message.DESCRIPTOR.fields_by_name
    rows: list[tuple[str, int, type]] = []
    for f in dataclasses.fields(cls):
        descriptor = by_name.get(f.name)
        if descriptor is None:
            continue
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            rows.append((f.name, _MAP, tuple))
        elif descriptor.is_repeated:
            sequence = typing.get_origin(hints[f.name]) or hints[f.name]
            rows.append((f.name, _REPEATED, list if sequence is list else tuple))
        else:
            rows.append((f.name, _OPTIONAL if descriptor.has_presence else _PLAIN, object))
    return FieldTable(cls, tuple(rows))


def copy_fields(obj: Any, message: type[M], **extra: Any) -> M:
    """A new `message` holding `obj`'s fields of the same names, plus `extra` keyword fields."""
    table = field_table(typing.cast(Any, type(obj)), typing.cast(Any, message))
    return table.fill(obj, message(**extra))
