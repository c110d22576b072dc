"""The one table: the stages in order, each a subprocess with a time budget (a fault costs it alone), and the checks."""

from __future__ import annotations

from dataclasses import dataclass

CHECK, MEASUREMENT = "check", "measurement"  # the kinds: a measurement passes when measured, goal met or not


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    budget_s: float
    beside_next: bool = False  # runs beside the next stage (CPU-bound compiles), waited for before the one after
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    kind: str
    stage: str
    target: str | None  # `module:function` under kvserve.gpu_check, called with a StageContext; None: not implemented
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
    Check("build_models", CHECK, "models", "models:build_models", "random 8B-shaped checkpoint"),
    Check("runner_vs_hf_8b_logits", CHECK, "models", "models:check_8b_logits", "8B bf16 logits vs HF fp32"),
    Check("device_peaks", MEASUREMENT, "measure", "measure:measure_device_peaks", "copy BW, bf16 matmul"),
    Check("decode_attention_bandwidth", MEASUREMENT, "measure", "measure:attention", "paged decode K/V bytes/s"),
    Check("kv_sizing", CHECK, "measure", "measure:check_kv_sizing", "KV pool fills the budget; stress steps fit"),
    Check("decode_throughput", MEASUREMENT, "measure", "measure:measure_decode", "8B decode tok/s"),
    Check("prefill_throughput", MEASUREMENT, "measure", "measure:measure_prefill", "8B prefill tok/s"),
    Check("cuda_graphs_compile", MEASUREMENT, "measure", "measure:measure_cuda_graphs", "decode, CUDA graphs vs eager"),
    Check("bench_serve_vs_hf", MEASUREMENT, "serve", "serve:measure_bench_serve", "bench serve vs HF"),
    Check("serve_64_streams", CHECK, "serve", "serve:check_64_streams", "64 concurrent streams complete"),
    Check("serve_kill9", CHECK, "serve", "serve:check_kill9", "kill -9 of the executor under 64 streams"),
)
