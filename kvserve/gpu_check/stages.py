"""The GPU check's one table: its stages in order, each with a time budget, and the checks they run.

A stage is one subprocess, so a CUDA fault or a hang costs that stage only; its checks share what
is expensive to load. The CPU rehearsal multiplies the budgets by `Sizes.budget_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECK = "check"
MEASUREMENT = "measurement"


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    budget_s: float
    beside_next: bool = False
    """Runs beside the next stage (CPU-bound kernel compiles) and is waited for before the one after."""
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    kind: str
    stage: str
    target: str | None
    """`module:function` under kvserve.gpu_check, called with the stage's context; None: not implemented."""
    about: str


STAGES = (
    Stage("env", 60),  # ~10 s
    # ~60-120 s, mostly Triton compiling; fp32 dots at full precision, so the tiny models match transformers
    Stage("kernels", 300, beside_next=True, env=(("TRITON_F32_DEFAULT", "ieee"),)),
    Stage("models", 300),  # ~75 s
    Stage("measure", 240),  # ~85 s
    Stage("serve", 300),  # ~160 s: HF static batches, a server start, the restarted executor reloading 15 GB
)

CHECKS = (
    Check("environment", CHECK, "env", "environment:check_environment", "CUDA, versions, imports, glibc"),
    Check("pytest_cuda", CHECK, "kernels", "pytest_check:run_pytest_cuda", "`pytest -m cuda`: kernels, models"),
    Check("runner_vs_hf_tiny", CHECK, "kernels", "pytest_check:tiny_models_result", "fp32 tiny logits = HF's"),
    Check("build_models", CHECK, "models", "random_models:build_models", "random 8B-shaped checkpoint"),
    Check("runner_vs_hf_8b_logits", CHECK, "models", "runner_vs_hf:check_8b_logits", "8B bf16 logits vs HF fp32"),
    Check("device_peaks", MEASUREMENT, "measure", "device_peaks:measure_device_peaks", "copy BW, bf16 matmul"),
    Check("decode_attention_bandwidth", MEASUREMENT, "measure", "decode_attention:measure", "paged decode K/V bytes/s"),
    Check("kv_sizing", CHECK, "measure", "kv_sizing:check_kv_sizing", "KV pool fills the budget; stress steps fit"),
    Check("decode_throughput", MEASUREMENT, "measure", "model_throughput:measure_decode", "8B decode tok/s"),
    Check("prefill_throughput", MEASUREMENT, "measure", "model_throughput:measure_prefill", "8B prefill tok/s"),
    Check("cuda_graphs_compile", MEASUREMENT, "measure", "cuda_graphs:measure", "decode, CUDA graphs vs eager"),
    Check("bench_serve_vs_hf", MEASUREMENT, "serve", "serve_bench:measure_bench_serve", "bench serve vs HF"),
    Check("serve_64_streams", CHECK, "serve", "serve_checks:check_64_streams", "64 concurrent streams complete"),
    Check("serve_kill9", CHECK, "serve", "serve_checks:check_kill9", "kill -9 of the executor under 64 streams"),
)


def checks_of(stage: str) -> list[Check]:
    return [c for c in CHECKS if c.stage == stage]
