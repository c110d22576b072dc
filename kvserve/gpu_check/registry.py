"""Every check and measurement of the GPU run, in order, with its stage and time limit.

One table, so the dry run, the real run, the report and the test agree on the names. A stage
is one subprocess: its checks share what is expensive to load (the 8B model, a server) and
a CUDA fault or hang in it loses that stage only. Limits are per check; expected times on an
H200 are in the comments and add up to about six minutes of the eight the run may take.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECK = "check"
MEASUREMENT = "measurement"


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    background: bool = False
    """Runs beside the next stages (CPU-bound compiles) instead of before them."""
    waits_for: tuple[str, ...] = ()
    """Background stages that must have finished first (a measurement wants the GPU to itself)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the stage process."""


@dataclass(frozen=True, slots=True)
class CheckSpec:
    name: str
    kind: str
    stage: str
    time_limit_s: float
    target: str
    """`module:function` under kvserve.gpu_check, run as `function(ctx) -> Outcome`."""
    about: str
    needs: tuple[str, ...] = ()
    """Checks that must have passed first (else this one fails without running)."""

    @property
    def module(self) -> str:
        return "kvserve.gpu_check." + self.target.split(":")[0]

    @property
    def function(self) -> str:
        return self.target.split(":")[1]


STAGES = (
    Stage("env"),
    Stage("kernels", background=True),
    # fp32 dots at full precision, so fp32 greedy tokens can be compared with transformers exactly
    Stage("models", env=(("TRITON_F32_DEFAULT", "ieee"),)),
    Stage("measure", waits_for=("kernels",)),
    Stage("serve"),
)

CHECKS = (
    CheckSpec(
        "environment",
        CHECK,
        "env",
        60,
        "environment:check_environment",
        "CUDA is visible; torch/triton/transformers versions; every import kvserve needs resolves, "
        "grpcio/protobuf new enough for the generated code, glibc new enough for the wheels",
    ),
    CheckSpec(
        "cuda_graphs_compile",
        MEASUREMENT,
        "env",
        20,
        "graph_usage:measure_graph_usage",
        "CUDA graphs / torch.compile speedup: measured only if the executor uses them (a source scan decides)",
    ),
    CheckSpec(  # ~60-120 s of Triton compiles, beside the models stage
        "pytest_cuda",
        CHECK,
        "kernels",
        300,
        "pytest_check:run_pytest_cuda",
        "`pytest -m cuda`: every kernel against its torch reference on CUDA in fp16/bf16/fp32, "
        "the CPU tests' shapes plus 8k-token contexts and 256 sequences",
    ),
    CheckSpec(  # ~30 s: the 8B is made on the GPU and written (~15 GB)
        "build_models",
        CHECK,
        "models",
        150,
        "random_models:build_models",
        "random seeded SmolLM2-135M and Llama-3.1-8B-shaped checkpoints (HF directories with the SmolLM2 tokenizer)",
    ),
    CheckSpec(  # ~20 s
        "runner_vs_hf_tiny",
        CHECK,
        "models",
        120,
        "runner_vs_hf:check_tiny_models",
        "greedy tokens of the runner on CUDA (fp32; triton and torch attention) equal transformers' for tiny "
        "random Llama/Mistral/Qwen2 and random SmolLM2-135M",
    ),
    CheckSpec(  # ~40 s: two loads of 15 GB
        "runner_vs_hf_8b_logits",
        CHECK,
        "models",
        150,
        "runner_vs_hf:check_8b_logits",
        "bf16 logits of the runner (triton) on the 8B-shaped model, prefill then 32 decode steps: as close to HF "
        "float32 as HF's own bf16 run is",
        needs=("build_models",),
    ),
    CheckSpec(  # ~5 s
        "device_peaks",
        MEASUREMENT,
        "measure",
        45,
        "device_peaks:measure_device_peaks",
        "device copy bandwidth and bf16 matmul peak, the yardsticks of the figures below",
    ),
    CheckSpec(  # ~15 s
        "decode_attention_bandwidth",
        MEASUREMENT,
        "measure",
        90,
        "decode_attention:measure_decode_attention",
        "Triton paged decode attention: K/V bytes read per second against the copy bandwidth "
        "(goal >= 70%), contexts 1k/8k x batch 1/64/256",
    ),
    CheckSpec(  # ~35 s: load, profile a 131k-token step, two stress steps
        "kv_sizing",
        CHECK,
        "measure",
        150,
        "kv_sizing:check_kv_sizing",
        "the KV pool sized from free memory fills the budget (weights + pool + activation peak = utilization) "
        "and neither the largest step nor a decode over every block runs out of memory",
        needs=("build_models",),
    ),
    CheckSpec(  # ~20 s
        "decode_throughput",
        MEASUREMENT,
        "measure",
        120,
        "model_throughput:measure_decode",
        "8B-shaped decode tokens/s at batch 1/8/64/256, as a fraction of HBM bandwidth "
        "((weights + KV) bytes per step / step time / copy bandwidth)",
        needs=("build_models",),
    ),
    CheckSpec(  # ~10 s
        "prefill_throughput",
        MEASUREMENT,
        "measure",
        90,
        "model_throughput:measure_prefill",
        "8B-shaped prefill tokens/s, as a fraction of the measured bf16 matmul peak",
        needs=("build_models",),
    ),
    CheckSpec(  # ~90 s: HF static batches, a server start, the mixed workload
        "bench_serve_vs_hf",
        MEASUREMENT,
        "serve",
        240,
        "serve_bench:measure_bench_serve",
        "`bench serve` mixed on the 8B-shaped model against HF generate (static batches, bf16, CUDA): "
        "output tokens/s ratio (goal >= 6)",
        needs=("build_models",),
    ),
    CheckSpec(  # ~10 s
        "serve_64_streams",
        CHECK,
        "serve",
        120,
        "serve_checks:check_64_streams",
        "`kvserve serve` on CUDA with the 8B-shaped model: 64 concurrent token-id streams all complete",
        needs=("build_models",),
    ),
    CheckSpec(  # ~60 s: the restarted executor reloads 15 GB
        "serve_kill9",
        CHECK,
        "serve",
        210,
        "serve_checks:check_kill9",
        "kill -9 of the executor under 64 streams: it is restarted, every stream completes in full, no block leaks",
        needs=("build_models",),
    ),
)


def checks_of(stage: str) -> list[CheckSpec]:
    return [c for c in CHECKS if c.stage == stage]


def check_names() -> list[str]:
    return [c.name for c in CHECKS]


def stage_of(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)
