"""Sampling defaults that suit the model: its `generation_config.json`, else the API's own.

A request that leaves a sampling field unset gets the value the model's authors chose
where they chose one (like vLLM's `--generation-config auto`): `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` as the default `max_tokens`.
Every other field, and every one the file does not set, keeps the API's documented
default (protos/sampling.py: temperature 1.0, no filters, 16 tokens).

The file is read once at start-up from the directory the executor names
(`ExecutorInfo.tokenizer_path`), as plain JSON: no transformers. A value out of the API's
range is dropped with a warning, so a request never fails on a field it did not send.
HF's `do_sample` is ignored, as vLLM does: a model that wants greedy says temperature 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

import structlog

from kvserve.protos.sampling import InvalidFieldError, SamplingParams

log = structlog.get_logger(__name__)

GENERATION_CONFIG = "generation_config.json"
SOURCE_AUTO = "auto"
"""Read the model directory's generation_config.json."""
SOURCE_API = "api"
"""Ignore it: the API's documented defaults only."""

_API = SamplingParams()
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The values unset request fields take; the field defaults are the API's documented ones."""

    temperature: float = _API.temperature
    top_k: int = _API.top_k
    top_p: float = _API.top_p
    min_p: float = _API.min_p
    repetition_penalty: float = _API.repetition_penalty
    max_tokens: int = _API.max_tokens
    """Clamped to the room the prompt leaves in the context, unlike an explicit max_tokens."""

    def values(self) -> dict[str, float | int]:
        return asdict(self)


def load_sampling_defaults(model_dir: str | Path | None, source: str = SOURCE_AUTO) -> SamplingDefaults:
    """The defaults for a model; logs the ones in use (call once, at start-up).

    `source`: "auto" reads `model_dir/generation_config.json`; "api" uses the API's defaults;
    any other value is a directory holding the generation_config.json to use.
    """
    if source == SOURCE_API or (source == SOURCE_AUTO and not model_dir):
        return _logged(SamplingDefaults(), "api")
    path = Path(model_dir if source == SOURCE_AUTO else source) / GENERATION_CONFIG  # type: ignore[arg-type]
    if not path.is_file():
        return _logged(SamplingDefaults(), "api", looked_for=str(path))
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("generation_config_unreadable", path=str(path), error=str(exc))
        return _logged(SamplingDefaults(), "api")
    if not isinstance(raw, dict):
        log.warning("generation_config_unreadable", path=str(path), error="not a JSON object")
        return _logged(SamplingDefaults(), "api")
    defaults, taken = sampling_defaults_from(raw, where=str(path))
    return _logged(defaults, str(path) if taken else "api", from_file=sorted(taken))


def sampling_defaults_from(raw: dict, *, where: str = GENERATION_CONFIG) -> tuple[SamplingDefaults, set[str]]:
    """Defaults from a parsed generation_config and the names of the fields it supplied."""
    found: dict[str, float | int] = {}
    for key in _FLOAT_KEYS:
        value = raw.get(key)
        if _is_number(value):
            found[key] = float(value)
        elif value is not None:
            _drop(where, key, value, "not a number")
    top_k = raw.get("top_k")
    if _is_integral(top_k):
        found["top_k"] = int(top_k) or _API.top_k  # 0 means off, as in the API
    elif top_k is not None:
        _drop(where, "top_k", top_k, "not an integer")
    max_new = raw.get("max_new_tokens")
    if _is_integral(max_new):
        found["max_tokens"] = int(max_new)
    elif max_new is not None:
        _drop(where, "max_new_tokens", max_new, "not an integer")
    defaults = SamplingDefaults()
    taken: set[str] = set()
    for name, value in found.items():
        change: dict[str, Any] = {name: value}  # a float or an int, as that field is
        try:
            SamplingParams(**change).validate()
        except InvalidFieldError as exc:
            _drop(where, "max_new_tokens" if name == "max_tokens" else name, value, exc.reason)
            continue
        defaults = replace(defaults, **change)
        taken.add(name)
    return defaults, taken


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_integral(value: object) -> TypeGuard[int | float]:
    return _is_number(value) and float(value) == int(value)


def _drop(where: str, key: str, value: object, why: str) -> None:
    log.warning("generation_config_value_ignored", path=where, key=key, value=repr(value)[:64], reason=why)


def _logged(defaults: SamplingDefaults, source: str, **extra: object) -> SamplingDefaults:
    log.info("sampling_defaults", source=source, **defaults.values(), **extra)
    return defaults
