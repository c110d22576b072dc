"""Random-weight checkpoints built on the GPU machine from real configs (model_shapes.json): nothing
is downloaded. transformers' own model, made on the device in its dtype from a seed, saved beside
the SmolLM2 tokenizer so the runner, HF and `kvserve serve` all load it; reused when unchanged.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.report import Outcome
from kvserve.gpu_check.wheel_list import TOKENIZER_DIR

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

SHAPES_PATH = Path(__file__).with_name("model_shapes.json")
SEED = 1234
SHM_ROOT = Path("/dev/shm/kvserve-gpu-check-models")
SHM_MIN_FREE = 40 * 2**30
"""/dev/shm holds the models when it has room for the 8B (15 GB) and more: loading from memory is faster."""
_MARKER = ".gpu-check-model.json"


def load_shapes() -> dict[str, dict[str, Any]]:
    return json.loads(SHAPES_PATH.read_text())


def model_dir(work_dir: Path, key: str) -> Path:
    """A built checkpoint's directory; FileNotFoundError when build_models has not made it."""
    for root in (SHM_ROOT, work_dir / "models"):
        if (root / key / _MARKER).is_file():
            return root / key
    raise FileNotFoundError(f"no finished checkpoint {key} (build_models makes it)")


def tokenizer_dir(ctx: StageContext) -> Path:
    """The carried tokenizer; in the rehearsal the default model's own when no folder was carried."""
    carried = ctx.wheels_dir / TOKENIZER_DIR
    if (carried / "tokenizer.json").is_file() or ctx.sizes.device == "cuda":
        return carried
    from kvserve.executor.weights.model_store import ensure_model_dir

    return ensure_model_dir()


def build_checkpoint(key: str, spec: dict[str, Any], target: Path, tokenizer: Path, device: str) -> dict[str, Any]:
    """Make and save one model; returns its figures. Reuses a finished one of the same shape and seed."""
    import torch
    import transformers

    identity = {"key": key, "seed": SEED, "dtype": spec["dtype"], "config": spec["config"]}
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text())["identity"] == identity:
        return {**json.loads(marker.read_text())["figures"], "reused": True}
    started = time.perf_counter()
    config = transformers.LlamaConfig(**copy.deepcopy(spec["config"]))  # it may rewrite rope_scaling in place
    torch.manual_seed(SEED)
    with torch.device(device):  # made in float32 on the device (30 GB for the 8B: the H200 has room), then cast
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, spec["dtype"])).eval()
    built_s, saved = time.perf_counter() - started, time.perf_counter()
    partial = target.with_name(f".{key}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(partial)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for path in tokenizer.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(".safetensors"):
            shutil.copy2(path, partial / path.name)
    weight_bytes = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
    figures = dict(dir=str(target), params=params, dtype=spec["dtype"], weight_bytes=weight_bytes, about=spec["about"])
    figures.update(build_s=round(built_s, 2), save_s=round(time.perf_counter() - saved, 2))
    (partial / _MARKER).write_text(json.dumps({"identity": identity, "figures": figures}, indent=2))
    partial.rename(target)
    return {**figures, "reused": False}


def build_models(ctx: StageContext) -> Outcome:
    """The check: the run's big model, with the tokenizer (the small shapes are test_tiny_models.py's)."""
    tokenizer, key = tokenizer_dir(ctx), ctx.sizes.big_model
    if not (tokenizer / "tokenizer.json").is_file():
        return Outcome(False, f"no tokenizer in {tokenizer} (scripts/gpu_wheels.sh copies it)")
    roomy = SHM_ROOT.parent.is_dir() and shutil.disk_usage(SHM_ROOT.parent).free > SHM_MIN_FREE
    root = SHM_ROOT if roomy else ctx.work_dir / "models"
    root.mkdir(parents=True, exist_ok=True)
    big = build_checkpoint(key, load_shapes()[key], root / key, tokenizer, ctx.sizes.device)
    how = "reused" if big["reused"] else f"built {big['build_s']:.1f}s, saved {big['save_s']:.1f}s"
    summary = f"{key}: {big['params'] / 1e9:.2f}B params, {big['weight_bytes'] / 1e9:.1f} GB ({how})"
    return Outcome(True, summary, {"root": str(root), "tokenizer": str(tokenizer), key: big})
