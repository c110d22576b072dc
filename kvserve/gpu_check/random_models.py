"""Random-weight checkpoints built on the GPU machine from real configs: nothing is downloaded.

Each model of `model_shapes.json` is made by transformers' own `LlamaForCausalLM(config)`
directly on the device in its dtype, filled from a seeded generator (N(0, 0.02) matrices, unit
norms: speed does not depend on the values, and HF loads the same weights for the correctness
checks), then saved with `save_pretrained` beside the carried SmolLM2 tokenizer files, so
`kvserve serve --model DIR`, the runner and transformers all load it. A finished directory
carries a marker of its shape and seed and is reused by a later run on the same machine.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kvserve.gpu_check.results import Outcome
from kvserve.gpu_check.wheel_list import TOKENIZER_DIR

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

log = structlog.get_logger(__name__)

SHAPES_PATH = Path(__file__).with_name("model_shapes.json")
SEED = 1234
_MARKER = ".gpu-check-model.json"
_ROOT_RECORD = "models-root.txt"
_SHM = Path("/dev/shm")


def load_shapes() -> dict[str, dict[str, Any]]:
    return json.loads(SHAPES_PATH.read_text())


def checkpoint_bytes(spec: dict[str, Any]) -> int:
    """Bytes of the saved weights, from the config alone (for choosing where they fit)."""
    c = spec["config"]
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    params = v * h * (1 if c.get("tie_word_embeddings") else 2) + layers * per_layer + h
    return params * (4 if spec["dtype"] == "float32" else 2)


def models_root(work_dir: Path, need_bytes: int = 0) -> Path:
    """Where the checkpoints live: chosen once per work dir (recorded), /dev/shm when it has room."""
    record = work_dir / _ROOT_RECORD
    if record.is_file():
        recorded = Path(record.read_text().strip())
        recorded.mkdir(parents=True, exist_ok=True)
        return recorded
    root = work_dir / "models"
    if _SHM.is_dir() and need_bytes and shutil.disk_usage(_SHM).free > 1.5 * need_bytes:
        root = _SHM / "kvserve-gpu-check-models"
    root.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(str(root))
    return root


def model_dir(work_dir: Path, key: str) -> Path:
    """A built checkpoint's directory; FileNotFoundError when build_models has not made it."""
    path = models_root(work_dir) / key
    if not (path / _MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a finished checkpoint (build_models makes it)")
    return path


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_checkpoint(key: str, spec: dict[str, Any], target: Path, tokenizer_dir: Path, device: str) -> dict:
    """Make, fill and save one model; returns its figures. Reuses a finished one of the same shape and seed."""
    import torch
    import transformers

    identity = copy.deepcopy({"key": key, "seed": SEED, "dtype": spec["dtype"], "config": spec["config"]})
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("identity") == identity:
        figures = json.loads(marker.read_text())["figures"]
        return {**figures, "reused": True}
    started = time.perf_counter()
    dtype = getattr(torch, spec["dtype"])
    config = transformers.LlamaConfig(**copy.deepcopy(spec["config"]))  # it may rewrite rope_scaling in place
    with _default_dtype(dtype), torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator(device=device).manual_seed(SEED)
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
            if param.ndim >= 2:
                param.normal_(0.0, config.initializer_range, generator=generator)
            else:
                param.fill_(1.0)  # RMSNorm weights
    model.eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    log.info("random model built", model=key, params=params, seconds=round(built_s, 1))

    partial = target.with_name(f".{key}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    saved = time.perf_counter()
    model.save_pretrained(partial)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    for path in tokenizer_dir.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, partial / path.name)
    saved_s = time.perf_counter() - saved
    weight_bytes = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
    figures = {
        "dir": str(target),
        "params": params,
        "dtype": spec["dtype"],
        "weight_bytes": weight_bytes,
        "build_s": round(built_s, 2),
        "save_s": round(saved_s, 2),
        "save_gb_per_s": round(weight_bytes / 1e9 / max(saved_s, 1e-9), 2),
        "about": spec["about"],
        "reused": False,
    }
    (partial / _MARKER).write_text(json.dumps({"identity": identity, "figures": figures}, indent=2))
    partial.rename(target)
    log.info("random model saved", model=key, dir=str(target), gb=round(weight_bytes / 1e9, 2), seconds=saved_s)
    return figures


def build_models(ctx: CheckContext) -> Outcome:
    """The check: both models of the run's scale, with the carried tokenizer."""
    shapes = load_shapes()
    keys = [ctx.scale.small_model, ctx.scale.big_model]
    tokenizer_dir = ctx.wheels_dir / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return Outcome(False, f"no tokenizer in {tokenizer_dir} (scripts/gpu_wheels.sh copies it)")
    root = models_root(ctx.work_dir, need_bytes=sum(checkpoint_bytes(shapes[k]) for k in keys))
    figures: dict[str, Any] = {"root": str(root)}
    for key in keys:
        figures[key] = build_checkpoint(key, shapes[key], root / key, tokenizer_dir, ctx.scale.device)
    big = figures[ctx.scale.big_model]
    how = "reused" if big["reused"] else f"built {big['build_s']:.1f}s, saved {big['save_s']:.1f}s"
    summary = f"{ctx.scale.big_model}: {big['params'] / 1e9:.2f}B params, {big['weight_bytes'] / 1e9:.1f} GB ({how})"
    return Outcome(True, summary, figures)
