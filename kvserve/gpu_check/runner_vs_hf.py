"""The model runner against transformers: greedy tokens on tiny models, logits on the 8B.

Tiny models (kvserve.testing's, plus random SmolLM2-135M) in fp32, Triton dots at full precision:
tokens must equal HF's. Two bf16 implementations part at the first near-tie, so on the 8B the
logits are compared, the runner's error against HF fp32 bounded by HF bf16's own.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.hf_reference import greedy_tokens, load_hf_model, sequence_logits
from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

FP32_REL_L2_LIMIT = 1e-3
"""Float32 against float32 (the CPU rehearsal): only the order of operations differs."""
BF16_ERROR_RATIO, BF16_ERROR_SLACK = 2.0, 0.01
"""In bf16 the runner's relative L2 error against HF float32 may be at most 2x HF bf16's + 0.01, at the
worst position and at the median (a wrong mask, rope or block is off by tens of percent)."""


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _runner(path: Path, device: str, dtype: str, backend: str, kv_cache_gb: float) -> Any:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig

    return ModelRunner(
        RunnerConfig(model=str(path), device=device, dtype=dtype, attention_backend=backend, kv_cache_gb=kv_cache_gb)
    )


def _against_hf(path: Path, hf: Any, prompts: list[list[int]], device: str) -> dict[str, Any]:
    """Both attention backends of the runner on one checkpoint against HF's greedy tokens."""
    from kvserve.testing.plan_driver import RUN_NEW_TOKENS, run_prompts

    expected = [greedy_tokens(hf, p, RUN_NEW_TOKENS) for p in prompts]
    found = {}
    for backend in ("triton", "torch"):
        runner = _runner(path, device, "float32", backend, kv_cache_gb=0.05)
        got = run_prompts(runner, prompts, chunk_size=9)
        runner.close()
        _free()
        differ = [{"prompt": i, "runner": got[i][: len(want)], "hf": want} for i, want in enumerate(expected)]
        differ = [d for d in differ if d["runner"] != d["hf"]]
        found[backend] = {"tokens_equal": not differ, "tokens": sum(map(len, expected)), "mismatches": differ[:3]}
    return found


def check_tiny_models(ctx: StageContext) -> Outcome:
    import torch

    from kvserve.testing.tiny_checkpoints import CASES, PROMPTS, tiny_checkpoint

    device = ctx.sizes.device
    models: dict[str, Any] = {}
    for case, (arch, overrides) in CASES.items():
        hf, path = tiny_checkpoint(ctx.work_dir / "tiny" / case, arch, **overrides)
        models[case] = _against_hf(path, hf.to(device), PROMPTS, device)
    path = model_dir(ctx.work_dir, ctx.sizes.small_model)
    prompts = [[(7919 * i + 104729 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((5, 16, 23, 40))]
    models[ctx.sizes.small_model] = _against_hf(path, load_hf_model(path, torch.float32, device), prompts, device)
    runs = [(f"{m}/{b}", r) for m, by in models.items() for b, r in by.items()]
    differ = [name for name, r in runs if not r["tokens_equal"]]
    summary = f"{len(runs) - len(differ)}/{len(runs)} model x backend greedy runs equal HF"
    summary += f" ({sum(r['tokens'] for _, r in runs)} tokens)" + (f"; differ: {', '.join(differ)}" if differ else "")
    return Outcome(not differ, summary, {"models": models})


def stepwise_logits(runner: Any, tokens: list[int], prefill_len: int) -> Any:
    """The runner's logits at positions prefill_len-1 .. len(tokens)-1: one prefill, then one decode step
    (max_query_len 1: the paged decode kernel) per further token, fed the given token, not a sampled one."""
    import torch

    from kvserve.executor.model.input_batch import build_input_batch
    from kvserve.executor.sequence_state import SequenceState
    from kvserve.protos.sampling import SamplingParams

    block_size = runner.config.block_size
    blocks = list(range(-(-len(tokens) // block_size)))
    seq = SequenceState(1, list(tokens), len(tokens), blocks, SamplingParams(temperature=0.0), seed=0)
    rows = []
    for start, count in [(0, prefill_len)] + [(p, 1) for p in range(prefill_len, len(tokens))]:
        seq.num_computed_tokens, seq.num_scheduled_tokens = start, count
        with torch.inference_mode():
            kv_heads = runner.model_config.num_kv_heads
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
    import torch

    hf = load_hf_model(path, getattr(torch, dtype), device)
    logits = sequence_logits(hf, tokens)[first:]
    del hf
    _free()
    return logits


def check_8b_logits(ctx: StageContext) -> Outcome:
    sizes, device = ctx.sizes, ctx.sizes.device
    low = "bfloat16" if device == "cuda" else "float32"
    path = model_dir(ctx.work_dir, sizes.big_model)
    prompt_len, steps = sizes.logits_prompt_len, sizes.logits_decode_steps
    rng = random.Random(8)
    tokens = [rng.randrange(100, 49000) for _ in range(prompt_len + steps)]
    runner = _runner(path, device, low, "triton", kv_cache_gb=2.0 if device == "cuda" else 0.05)
    ours = stepwise_logits(runner, tokens, prompt_len)
    runner.close()
    del runner
    _free()
    exact = _hf_logits(path, "float32", device, tokens, prompt_len - 1)
    figures: dict[str, Any] = {"dtype": low, "prompt_len": prompt_len, "decode_steps": steps}
    err = figures["runner_vs_hf_float32"] = logit_agreement(ours, exact)
    if low == "float32":
        ok, verdict = err["rel_l2_max"] <= FP32_REL_L2_LIMIT, f"limit {FP32_REL_L2_LIMIT}"
    else:
        hf_err = figures["hf_bfloat16_vs_hf_float32"] = logit_agreement(
            _hf_logits(path, low, device, tokens, prompt_len - 1), exact
        )
        limits = {k: BF16_ERROR_RATIO * hf_err[k] + BF16_ERROR_SLACK for k in ("rel_l2_max", "rel_l2_median")}
        figures["limits"] = limits
        ok = all(err[k] <= limit for k, limit in limits.items())
        verdict = f"HF bf16 {hf_err['rel_l2_max']:.4f}, limit {limits['rel_l2_max']:.4f}"
    summary = (
        f"{low} logits, prefill + {steps} decode steps, against HF float32: rel L2 max {err['rel_l2_max']:.4f} "
        f"({verdict}), top-1 agreement {err['top1_agreement']:.0%}"
    )
    return Outcome(ok, summary, figures)
