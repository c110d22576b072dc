"""The fake executor's vocabulary: size, eos ids and the ids it may emit, without a tokenizer library.

Read from a model directory's config.json / tokenizer.json / generation_config.json, so
the fake reports what the real model would and never emits special tokens; or made up
from a size alone, for tests that speak token ids only and have no model files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Vocabulary:
    size: int
    eos_token_ids: list[int]
    samplable: list[int]
    """Token ids the fake may emit: every id except special tokens and eos."""
    max_position_embeddings: int | None = None
    name: str = "fake"
    bounded: bool = True
    """Whether plan token ids must be below `size`; a plain vocabulary's ids are mere labels."""


def plain_vocabulary(size: int) -> Vocabulary:
    """Samples ids 0..size-1, all ordinary (no eos, no special tokens), and accepts any
    non-negative id in a plan: tests that speak token ids only pick prompt ids freely."""
    if size < 1:
        raise ValueError("vocab_size must be positive")
    return Vocabulary(size=size, eos_token_ids=[], samplable=list(range(size)), name="plain", bounded=False)


def default_model_dir() -> Path:
    from kvserve.executor.weights.model_store import ensure_model_dir  # no torch when already converted

    return ensure_model_dir()


def load_vocabulary(model_dir: Path, vocab_size: int | None) -> Vocabulary:
    """Vocabulary size, eos ids and special ids from config.json / tokenizer.json, no tokenizer library."""
    config: dict = {}
    if (model_dir / "config.json").is_file():
        config = json.loads((model_dir / "config.json").read_text())
    special: set[int] = set()
    tokenizer_vocab = 0
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
        special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
        tokenizer_vocab = max([len(tokenizer.get("model", {}).get("vocab", {})), *(i + 1 for i in special)], default=0)
    size = vocab_size or config.get("vocab_size") or tokenizer_vocab
    if not size:
        raise ValueError(f"{model_dir}: no vocab_size in config.json or tokenizer.json; pass vocab_size")
    eos = _eos_ids(config, model_dir)
    excluded = special | set(eos)
    samplable = [i for i in range(size) if i not in excluded]
    if not samplable:
        raise ValueError("the vocabulary has no ordinary tokens to sample")
    return Vocabulary(
        size=int(size),
        eos_token_ids=[e for e in eos if e < size],
        samplable=samplable,
        max_position_embeddings=config.get("max_position_embeddings"),
        name=model_dir.name,
    )


def _eos_ids(config: dict, model_dir: Path) -> list[int]:
    sources = [config.get("eos_token_id")]
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    ids: list[int] = []
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
