"""The models stage (an 8B-shaped checkpoint from model_shapes.json, its logits against HF's) and model helpers."""

from __future__ import annotations

import copy
import gc
import json
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.gpu_check.report import Outcome, StageContext
from kvserve.gpu_check.wheel_list import TOKENIZER_DIR
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.tiny_checkpoints import with_tokenizer

SHAPES: dict[str, dict[str, Any]] = json.loads(Path(__file__).with_name("model_shapes.json").read_text())
SHM_ROOT = Path("/dev/shm/kvserve-gpu-check-models")
SHM_MIN_FREE = 40 * 2**30  # /dev/shm holds the models when it has room for the 8B (15 GB): loading is faster
SEED, _MARKER = 1234, ".gpu-check-model.json"  # a checkpoint is reused when its marker names the same seed and shape
FP32_REL_L2_LIMIT = 1e-3  # float32 against float32 (the CPU rehearsal): only the order of operations differs
BF16_ERROR_RATIO, BF16_ERROR_SLACK = 2.0, 0.01
"""In bf16 the runner's relative L2 error against HF float32 may be at most 2x HF bf16's + 0.01, at the
worst position and at the median (a wrong mask, rope or block is off by tens of percent)."""


def model_dir(work_dir: Path, key: str) -> Path:
    """A built checkpoint's directory; FileNotFoundError when build_models has not made it."""
    for root in (SHM_ROOT, work_dir / "models"):
        if (root / key / _MARKER).is_file():
            return root / key
    raise FileNotFoundError(f"no finished checkpoint {key} (build_models makes it)")


def free_memory() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def new_runner(ctx: StageContext, **config: Any) -> Any:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig

    model = str(model_dir(ctx.work_dir, ctx.sizes.big_model))
    return ModelRunner(RunnerConfig(model=model, device=ctx.sizes.device, **config))


def with_hf_model(ctx: StageContext, dtype: str, use: Callable[[Any], Any]) -> Any:
    """`use(model)`, HF's model of the big checkpoint in eval and inference mode on the device, freed after. Its
    transformers is the image's, maybe older than the suite's: `torch_dtype` before 4.56, perhaps no accelerate."""
    import torch
    import transformers

    version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    kwargs: dict[str, Any] = {"dtype" if version >= (4, 56) else "torch_dtype": getattr(torch, dtype)}
    path, device = str(model_dir(ctx.work_dir, ctx.sizes.big_model)), ctx.sizes.device
    auto = transformers.AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, device_map=device, **kwargs).eval()
    except (ImportError, ValueError, TypeError, RuntimeError):
        model = auto.from_pretrained(path, **kwargs).to(device).eval()  # type: ignore[arg-type]
    try:
        with torch.inference_mode():
            return use(model)
    finally:
        del model
        free_memory()


def build_models(ctx: StageContext) -> Outcome:
    """The big model, seeded random weights (nothing is downloaded) beside the SmolLM2 tokenizer so the runner, HF and
    `kvserve serve` all load it; reused when unchanged. Without a carried tokenizer the rehearsal uses the default's."""
    import torch
    import transformers

    tokenizer, key, device = ctx.wheels_dir / TOKENIZER_DIR, ctx.sizes.big_model, ctx.sizes.device
    if not (tokenizer / "tokenizer.json").is_file() and device != "cuda":
        from kvserve.executor.weights.model_store import ensure_model_dir

        tokenizer = ensure_model_dir()
    if not (tokenizer / "tokenizer.json").is_file():
        return Outcome(False, f"no tokenizer in {tokenizer} (scripts/gpu_wheels.sh copies it)")
    roomy = SHM_ROOT.parent.is_dir() and shutil.disk_usage(SHM_ROOT.parent).free > SHM_MIN_FREE
    root = SHM_ROOT if roomy else ctx.work_dir / "models"
    root.mkdir(parents=True, exist_ok=True)
    spec, target = SHAPES[key], root / key
    identity = {"key": key, "seed": SEED, "dtype": spec["dtype"], "config": spec["config"]}
    if (target / _MARKER).is_file() and json.loads((target / _MARKER).read_text())["identity"] == identity:
        big = {**json.loads((target / _MARKER).read_text())["figures"], "reused": True}
    else:
        started = time.perf_counter()
        config = transformers.LlamaConfig(**copy.deepcopy(spec["config"]))  # it may rewrite rope_scaling in place
        torch.manual_seed(SEED)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(getattr(torch, spec["dtype"])).eval()
        built_s, saved = time.perf_counter() - started, time.perf_counter()
        partial = target.with_name(f".{key}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        model.save_pretrained(partial)
        params = sum(p.numel() for p in model.parameters())
        del model
        free_memory()
        with_tokenizer(partial, tokenizer)
        weight_bytes = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
        big = dict(dir=str(target), params=params, dtype=spec["dtype"], weight_bytes=weight_bytes, about=spec["about"])
        big.update(build_s=round(built_s, 2), save_s=round(time.perf_counter() - saved, 2), reused=False)
        (partial / _MARKER).write_text(json.dumps({"identity": identity, "figures": big}, indent=2))
        partial.rename(target)
    how = "reused" if big["reused"] else f"built {big['build_s']:.1f}s, saved {big['save_s']:.1f}s"
    summary = f"{key}: {big['params'] / 1e9:.2f}B params, {big['weight_bytes'] / 1e9:.1f} GB ({how})"
    return Outcome(True, summary, {"root": str(root), "tokenizer": str(tokenizer), key: big})


def logit_agreement(ours: Any, theirs: Any) -> dict[str, Any]:
    import torch.nn.functional as F

    rel = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    found: dict[str, Any] = dict(rel_l2_max=float(rel.max()), rel_l2_median=float(rel.median()))
    found["cosine_min"] = float(F.cosine_similarity(ours, theirs, dim=-1).min())
    found["top1_agreement"] = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    return found | {"rel_l2_by_position": [round(float(x), 5) for x in rel]}


def check_8b_logits(ctx: StageContext) -> Outcome:
    """The runner's logits over a prefill and decode steps against HF's: two bf16 implementations part at the first
    near-tie, so not tokens but the relative L2 error against HF float32 is compared, bounded by HF bf16's own."""
    import torch

    from kvserve.executor.model.input_batch import build_input_batch
    from kvserve.executor.sequence_state import SequenceState

    device, prompt_len, steps = ctx.sizes.device, ctx.sizes.logits_prompt_len, ctx.sizes.logits_decode_steps
    low, rng = "bfloat16" if device == "cuda" else "float32", random.Random(8)
    tokens = [rng.randrange(100, 49000) for _ in range(prompt_len + steps)]
    runner = new_runner(ctx, dtype=low, attention_backend="triton", kv_cache_gb=2.0 if device == "cuda" else 0.05)
    # one prefill, then a decode step (max_query_len 1: the paged decode kernel) per token, fed it, not a sample
    block_size, kv_heads = runner.config.block_size, runner.model_config.num_kv_heads
    blocks = list(range(-(-len(tokens) // block_size)))
    seq = SequenceState(1, list(tokens), len(tokens), blocks, SamplingParams(temperature=0.0), seed=0)
    rows = []
    for start, count in [(0, prompt_len)] + [(p, 1) for p in range(prompt_len, len(tokens))]:
        seq.num_computed_tokens, seq.num_scheduled_tokens = start, count
        with torch.inference_mode():
            batch = build_input_batch([seq], block_size, runner.device, runner.model.scale, runner.dtype, kv_heads)
            batch.sample_indices = torch.tensor([count - 1], device=runner.device)
            rows.append(runner.model.forward(batch, runner.cache, runner.backend).float())
    ours = torch.cat(rows)
    runner.close()
    del runner, batch, rows
    free_memory()

    def hf_logits(hf: Any) -> Any:  # at the same positions, from one forward pass over the tokens
        return hf(torch.tensor([tokens], device=device)).logits[0, prompt_len - 1 :].float()

    exact = with_hf_model(ctx, "float32", hf_logits)
    figures: dict[str, Any] = {"dtype": low, "prompt_len": prompt_len, "decode_steps": steps}
    err = figures["runner_vs_hf_float32"] = logit_agreement(ours, exact)
    if low == "float32":
        ok, verdict = err["rel_l2_max"] <= FP32_REL_L2_LIMIT, f"limit {FP32_REL_L2_LIMIT}"
    else:
        hf_err = logit_agreement(with_hf_model(ctx, low, hf_logits), exact)
        limits = {k: BF16_ERROR_RATIO * hf_err[k] + BF16_ERROR_SLACK for k in ("rel_l2_max", "rel_l2_median")}
        figures.update(hf_bfloat16_vs_hf_float32=hf_err, limits=limits)
        ok = all(err[k] <= limit for k, limit in limits.items())
        verdict = f"HF bf16 {hf_err['rel_l2_max']:.4f}, limit {limits['rel_l2_max']:.4f}"
    summary = f"{low} logits, prefill + {steps} decode steps, against HF float32: rel L2 max {err['rel_l2_max']:.4f} "
    summary += f"({verdict}), top-1 agreement {err['top1_agreement']:.0%}"
    return Outcome(ok, summary, figures)
