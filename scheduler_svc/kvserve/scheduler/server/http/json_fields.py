"""Typed reads of one JSON object's fields, refusing a wrong JSON type with the OpenAI field name.

OpenAI bodies arrive as plain JSON, so types are checked here (a string where a number
belongs, a boolean where an integer belongs) before any value reaches the shared
validation; JSON `null` counts as absent, as the OpenAI API treats it. Every key read is
remembered, so the keys nobody read are the unknown fields.
"""

from __future__ import annotations

import math
from typing import Any

from kvserve.scheduler.server.http.errors import bad_field

_INT64 = (-(2**63), 2**63 - 1)
"""The proto fields are int64: larger JSON integers are refused here rather than by protobuf."""


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def as_integer(value: Any, param: str) -> int:
    """An int64: a JSON integer, or a number with no fractional part (2.0)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(param, f"must be an integer, got {json_type(value)}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise bad_field(param, "must fit in a 64-bit integer")
    return value


def as_number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_field(param, f"must be a number, got {json_type(value)}")
    try:
        return float(value)
    except OverflowError:
        raise bad_field(param, "is too large") from None


def as_string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad_field(param, f"must be a string, got {json_type(value)}")
    return value


def as_boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad_field(param, f"must be a boolean, got {json_type(value)}")
    return value


def as_list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad_field(param, f"must be an array, got {json_type(value)}")
    return value


def as_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_field(param, f"must be an object, got {json_type(value)}")
    return value


class JsonObject:
    """One decoded JSON object; each typed getter returns None for a missing or null field."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self._data = data
        self._prefix = prefix
        self._read: set[str] = set()

    def param(self, name: str) -> str:
        """The OpenAI name of a field of this object (`stream_options.include_usage`)."""
        return f"{self._prefix}{name}"

    def raw(self, name: str) -> Any:
        self._read.add(name)
        return self._data.get(name)

    def present(self, name: str) -> bool:
        return self.raw(name) is not None

    def integer(self, name: str) -> int | None:
        value = self.raw(name)
        return None if value is None else as_integer(value, self.param(name))

    def number(self, name: str) -> float | None:
        value = self.raw(name)
        return None if value is None else as_number(value, self.param(name))

    def string(self, name: str) -> str | None:
        value = self.raw(name)
        return None if value is None else as_string(value, self.param(name))

    def boolean(self, name: str) -> bool | None:
        value = self.raw(name)
        return None if value is None else as_boolean(value, self.param(name))

    def array(self, name: str) -> list[Any] | None:
        value = self.raw(name)
        return None if value is None else as_list(value, self.param(name))

    def child(self, name: str) -> JsonObject | None:
        value = self.raw(name)
        if value is None:
            return None
        return JsonObject(as_object(value, self.param(name)), prefix=f"{self.param(name)}.")

    def unread(self) -> list[str]:
        """The fields no getter asked for, with their full names: what the server ignores."""
        return [self.param(key) for key in self._data if key not in self._read]
