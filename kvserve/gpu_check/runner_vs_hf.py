"""The model runner's logits on the 8B against transformers', HF's own bf16 error the yardstick.

Two bf16 implementations part at the first near-tie, so tokens cannot be compared: the runner's
relative L2 error against HF float32 is bounded by HF bf16's. transformers is the image's, which
may be older than the suite's (`torch_dtype` before 4.56, no accelerate).
"""

from __future__ import annotations

import gc
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

FP32_REL_L2_LIMIT = 1e-3
"""Float32 against float32 (the CPU rehearsal): only the order of operations differs."""
BF16_ERROR_RATIO, BF16_ERROR_SLACK = 2.0, 0.01
"""In bf16 the runner's relative L2 error against HF float32 may be at most 2x HF bf16's + 0.01, at the
worst position and at the median (a wrong mask, rope or block is off by tens of percent)."""


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_hf_model(path: Path, dtype: Any, device: str) -> Any:
    """`AutoModelForCausalLM` in eval mode on `device`, in `dtype`."""
    import transformers

    version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    kwargs = {"dtype" if version >= (4, 56) else "torch_dtype": dtype}
    load = transformers.AutoModelForCausalLM.from_pretrained
    try:
        return load(str(path), device_map=device, **kwargs).eval()
    except (ImportError, ValueError, TypeError, RuntimeError):
        return load(str(path), **kwargs).to(device).eval()  # type: ignore[arg-type]


def stepwise_logits(runner: Any, tokens: list[int], prefill_len: int) -> Any:
    """The runner's logits at positions prefill_len-1 .. len(tokens)-1: one prefill, then one decode step
    (max_query_len 1: the paged decode kernel) per further token, fed the given token, not a sampled one."""
    import torch

    from kvserve.executor.model.input_batch import build_input_batch
    from kvserve.executor.sequence_state import SequenceState
    from kvserve.protos.sampling import SamplingParams

    block_size, kv_heads = runner.config.block_size, runner.model_config.num_kv_heads
    blocks = list(range(-(-len(tokens) // block_size)))
    seq = SequenceState(1, list(tokens), len(tokens), blocks, SamplingParams(temperature=0.0), seed=0)
    rows = []
    for start, count in [(0, prefill_len)] + [(p, 1) for p in range(prefill_len, len(tokens))]:
        seq.num_computed_tokens, seq.num_scheduled_tokens = start, count
        with torch.inference_mode():
            batch = build_input_batch([seq], block_size, runner.device, runner.model.scale, runner.dtype, kv_heads)
            batch.sample_indices = torch.tensor([count - 1], device=runner.device)
            rows.append(runner.model.forward(batch, runner.cache, runner.backend).float())
    return torch.cat(rows)


def logit_agreement(ours: Any, theirs: Any) -> dict[str, Any]:
    """Per-position relative L2 error, cosine and top-1 agreement of two [positions, vocab] tensors."""
    import torch.nn.functional as F

    rel = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    return {
        "rel_l2_max": float(rel.max()),
        "rel_l2_median": float(rel.median()),
        "cosine_min": float(F.cosine_similarity(ours, theirs, dim=-1).min()),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
        "rel_l2_by_position": [round(float(x), 5) for x in rel],
    }


def _hf_logits(path: Path, dtype: str, device: str, tokens: list[int], first: int) -> Any:
    """HF's logits at positions first.. of one forward pass over `tokens`, the model freed after."""
    import torch

    hf = load_hf_model(path, getattr(torch, dtype), device)
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens], device=device)).logits[0, first:].float()
    del hf
    free_memory()
    return logits


def check_8b_logits(ctx: StageContext) -> Outcome:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig

    sizes, device = ctx.sizes, ctx.sizes.device
    low = "bfloat16" if device == "cuda" else "float32"
    path = model_dir(ctx.work_dir, sizes.big_model)
    prompt_len, steps = sizes.logits_prompt_len, sizes.logits_decode_steps
    rng = random.Random(8)
    tokens = [rng.randrange(100, 49000) for _ in range(prompt_len + steps)]
    kv_cache_gb = 2.0 if device == "cuda" else 0.05
    config = RunnerConfig(
        model=str(path), device=device, dtype=low, attention_backend="triton", kv_cache_gb=kv_cache_gb
    )
    runner = ModelRunner(config)
    ours = stepwise_logits(runner, tokens, prompt_len)
    runner.close()
    del runner
    free_memory()
    exact = _hf_logits(path, "float32", device, tokens, prompt_len - 1)
    figures: dict[str, Any] = {"dtype": low, "prompt_len": prompt_len, "decode_steps": steps}
    err = figures["runner_vs_hf_float32"] = logit_agreement(ours, exact)
    if low == "float32":
        ok, verdict = err["rel_l2_max"] <= FP32_REL_L2_LIMIT, f"limit {FP32_REL_L2_LIMIT}"
    else:
        hf_err = logit_agreement(_hf_logits(path, low, device, tokens, prompt_len - 1), exact)
        limits = {k: BF16_ERROR_RATIO * hf_err[k] + BF16_ERROR_SLACK for k in ("rel_l2_max", "rel_l2_median")}
        figures.update(hf_bfloat16_vs_hf_float32=hf_err, limits=limits)
        ok = all(err[k] <= limit for k, limit in limits.items())
        verdict = f"HF bf16 {hf_err['rel_l2_max']:.4f}, limit {limits['rel_l2_max']:.4f}"
    summary = (
        f"{low} logits, prefill + {steps} decode steps, against HF float32: rel L2 max {err['rel_l2_max']:.4f} "
        f"({verdict}), top-1 agreement {err['top1_agreement']:.0%}"
    )
    return Outcome(ok, summary, figures)
