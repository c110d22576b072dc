"""The model runner against transformers on CUDA: greedy tokens on tiny models, logits on the 8B.

Tiny models: the CPU suite's own cases (tests/executor/test_tiny_models.py: random Llama with
llama3 and linear rope, Mistral, Qwen2 with qkv bias; same checkpoints, prompts and plan
driver), plus the random SmolLM2-135M, in float32 with both attention backends. The stage
sets TRITON_F32_DEFAULT=ieee so the Triton dots are full fp32 too; greedy tokens must then be
equal to HF's, as on CPU.

8B-shaped model: greedy tokens of two bf16 implementations part at the first near-tie (random
weights make many), so it is the logits that are compared, with the same tokens fed to both:
a prefill, then 32 single-token decode steps through the paged decode kernel, against HF's one
forward over the whole sequence. Two bf16 implementations also differ from each other by a few
percent over 32 layers, so the yardstick is HF in float32: the runner in bf16 must be about as
close to it as HF's own bf16 run is.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import structlog

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.results import Outcome
from kvserve.testing.plan_driver import RUN_NEW_TOKENS

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

log = structlog.get_logger(__name__)

NEW_TOKENS = RUN_NEW_TOKENS
"""What `run_prompts` generates by default."""
FP32_REL_L2_LIMIT = 1e-3
"""Float32 against float32 (the CPU rehearsal): only op order differs."""
BF16_ERROR_RATIO = 2.0
BF16_ERROR_SLACK = 0.01
"""In bf16 the runner must be about as close to HF's float32 logits as HF's own bf16 run is:
its relative L2 error at most 2x HF bf16's + 0.01, at every position and at the median. (Two
bf16 implementations differ by a few % from each other, more with depth; a wrong mask, rope
or block is off by tens of %.)"""


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _runner(path: Any, device: str, dtype: str, backend: str, kv_cache_gb: float, **extra: Any) -> Any:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig

    config = RunnerConfig(
        model=str(path), device=device, dtype=dtype, attention_backend=backend, kv_cache_gb=kv_cache_gb, **extra
    )
    return ModelRunner(config)


def _compare_greedy(ours: dict[int, list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    mismatches = []
    compared = 0
    for i, expected in enumerate(theirs):
        got = ours[i][: len(expected)]
        compared += len(expected)
        if got != expected:
            first = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b) if got else 0
            mismatches.append({"prompt": i, "first_mismatch": first, "runner": got, "hf": expected})
    return {"tokens_equal": not mismatches, "compared_tokens": compared, "mismatches": mismatches[:3]}


def _check_one(name: str, path: Any, hf: Any, prompts: list[list[int]], ctx: CheckContext, logits_case: bool) -> dict:
    """Both backends of the runner on one checkpoint against HF's greedy tokens (and logits)."""
    import torch

    from kvserve.executor.token_scoring import every_position_logits
    from kvserve.gpu_check.hf_reference import greedy_tokens, sequence_logits
    from kvserve.testing.plan_driver import run_prompts

    device = ctx.scale.device
    expected = [greedy_tokens(hf, p, NEW_TOKENS) for p in prompts]
    tokens = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    hf_logits = sequence_logits(hf, tokens) if logits_case else None
    found: dict[str, Any] = {}
    for backend in ("triton", "torch"):
        runner = _runner(path, device, "float32", backend, kv_cache_gb=0.05)
        outcome = _compare_greedy(run_prompts(runner, prompts, chunk_size=9), expected)
        if hf_logits is not None:
            with torch.inference_mode():
                got = every_position_logits(runner, tokens, split=20)
            outcome["max_abs_logit_diff"] = float((got.float() - hf_logits).abs().max())
        found[backend] = outcome
        runner.close()
        _free(device)
    log.info("runner vs hf", model=name, **{b: r["tokens_equal"] for b, r in found.items()})
    return found


def check_tiny_models(ctx: CheckContext) -> Outcome:
    import os

    from kvserve.gpu_check.hf_reference import load_hf_model
    from kvserve.testing.tiny_checkpoints import CASES, PROMPTS, tiny_checkpoint

    device = ctx.scale.device
    figures: dict[str, Any] = {"triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"), "models": {}}
    for case, (arch, overrides) in CASES.items():
        options: dict[str, Any] = overrides
        model, path = tiny_checkpoint(ctx.work_dir / "tiny" / case, arch, **options)
        figures["models"][case] = _check_one(case, path, model.to(device), PROMPTS, ctx, logits_case=True)
        del model
    small = ctx.scale.small_model
    try:
        path = model_dir(ctx.work_dir, small)
        hf = load_hf_model(path, _torch_dtype("float32"), device)
        prompts = [[(7919 * i + 104729 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((5, 16, 23, 40))]
        figures["models"][small] = _check_one(small, path, hf, prompts, ctx, logits_case=False)
        del hf
        _free(device)
    except FileNotFoundError as exc:
        figures["models"][small] = {"error": str(exc)}
    results = [(m, b, r) for m, by in figures["models"].items() for b, r in by.items() if isinstance(r, dict)]
    failed = [f"{m}/{b}" for m, b, r in results if not r.get("tokens_equal")]
    missing = [m for m, by in figures["models"].items() if "error" in by]
    compared = sum(r.get("compared_tokens", 0) for _, _, r in results)
    summary = f"{len(results) - len(failed)}/{len(results)} model x backend greedy runs equal HF ({compared} tokens)"
    if failed or missing:
        summary += f"; differ: {', '.join(failed) or '-'}; not run: {', '.join(missing) or '-'}"
    return Outcome(not failed and not missing, summary, figures)


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def stepwise_logits(runner: Any, tokens: list[int], prefill_len: int) -> Any:
    """The runner's logits for positions prefill_len-1 .. len(tokens)-1: one prefill of
    `prefill_len` tokens, then one decode step per further token (max_query_len 1: the
    paged decode kernel), each feeding the given token rather than a sampled one."""
    import torch

    from kvserve.executor.model.input_batch import build_input_batch
    from kvserve.executor.sequence_state import SequenceState
    from kvserve.protos.sampling import SamplingParams

    block_size = runner.config.block_size
    seq = SequenceState(
        seq_id=1,
        token_ids=list(tokens),
        prompt_len=len(tokens),
        block_table=list(range(-(-len(tokens) // block_size))),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
    )
    rows = []
    for start, count in [(0, prefill_len)] + [(p, 1) for p in range(prefill_len, len(tokens))]:
        seq.num_computed_tokens, seq.num_scheduled_tokens = start, count
        with torch.inference_mode():
            batch = build_input_batch(
                [seq], block_size, runner.device, runner.model.scale, runner.dtype, runner.model_config.num_kv_heads
            )
            batch.sample_indices = torch.tensor([count - 1], device=runner.device)
            rows.append(runner.model.forward(batch, runner.cache, runner.backend).float())
    return torch.cat(rows)


def logit_agreement(ours: Any, theirs: Any) -> dict[str, Any]:
    """Per-position relative L2 error, cosine and top-1 agreement of two [positions, vocab] tensors."""
    import torch.nn.functional as F

    rel = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    cosine = F.cosine_similarity(ours, theirs, dim=-1)
    return {
        "positions": ours.shape[0],
        "rel_l2_max": float(rel.max()),
        "rel_l2_median": float(rel.median()),
        "cosine_min": float(cosine.min()),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
        "max_abs_diff": float((ours - theirs).abs().max()),
        "hf_logit_std": float(theirs.std()),
        "rel_l2_by_position": [round(float(x), 5) for x in rel],
    }


def _hf_logits(path: Any, dtype: str, device: str, tokens: list[int], first: int) -> tuple[Any, float]:
    """HF's logits from position `first` on, and its load time; the model is freed before returning."""
    from kvserve.gpu_check.hf_reference import load_hf_model, sequence_logits

    started = time.perf_counter()
    hf = load_hf_model(path, _torch_dtype(dtype), device)
    loaded_s = time.perf_counter() - started
    logits = sequence_logits(hf, tokens)[first:]
    del hf
    _free(device)
    return logits, loaded_s


def check_8b_logits(ctx: CheckContext) -> Outcome:
    scale, device = ctx.scale, ctx.scale.device
    low = "bfloat16" if device.startswith("cuda") else "float32"
    path = model_dir(ctx.work_dir, scale.big_model)
    rng = random.Random(8)
    prompt_len, steps = scale.logits_prompt_len, scale.logits_decode_steps
    tokens = [rng.randrange(100, 49000) for _ in range(prompt_len + steps)]
    started = time.perf_counter()
    runner = _runner(path, device, low, "triton", kv_cache_gb=2.0 if device.startswith("cuda") else 0.05)
    loads = {"runner": round(time.perf_counter() - started, 1)}
    ours = stepwise_logits(runner, tokens, prompt_len)
    runner.close()
    del runner
    _free(device)
    exact, loads["hf_float32"] = _hf_logits(path, "float32", device, tokens, prompt_len - 1)
    figures: dict[str, Any] = {"dtype": low, "prompt_len": prompt_len, "decode_steps": steps, "load_s": loads}
    figures["runner_vs_hf_float32"] = ours_err = logit_agreement(ours, exact)
    if low == "float32":
        ok = ours_err["rel_l2_max"] <= FP32_REL_L2_LIMIT
        verdict = f"limit {FP32_REL_L2_LIMIT}"
    else:
        hf_low, loads["hf_bfloat16"] = _hf_logits(path, low, device, tokens, prompt_len - 1)
        figures["hf_bfloat16_vs_hf_float32"] = hf_err = logit_agreement(hf_low, exact)
        figures["runner_vs_hf_bfloat16"] = logit_agreement(ours, hf_low)
        limits = {k: BF16_ERROR_RATIO * hf_err[k] + BF16_ERROR_SLACK for k in ("rel_l2_max", "rel_l2_median")}
        figures["limits"] = limits
        ok = all(ours_err[k] <= limit for k, limit in limits.items())
        verdict = f"HF bf16 {hf_err['rel_l2_max']:.4f}, limit {limits['rel_l2_max']:.4f}"
    summary = (
        f"{low} logits, prefill + {steps} decode steps, against HF float32: rel L2 max "
        f"{ours_err['rel_l2_max']:.4f} ({verdict}), top-1 agreement {ours_err['top1_agreement']:.0%}"
    )
    return Outcome(ok, summary, figures)
