"""How the model runner is configured: which model, where, and how much KV memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import defaults
from kvserve.config.flags import flag
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.cpu_features import has_native_bf16

DTYPES = ("float32", "bfloat16", "float16")
"""What --dtype and --kv-cache-dtype take besides auto."""
WEIGHTS = ("dequantized", "native")
"""What --weights takes besides auto."""
ATTENTION_BACKENDS = ("cpu", "torch", "triton")
"""cpu: kvserve's batch-invariant CPU kernels; torch: plain torch on any device; triton: the CUDA kernels."""
COMPILE_MODES = ("on", "off")
"""What --compile takes besides auto."""


@dataclass(slots=True)
class RunnerConfig:
    """Every knob of `ModelRunner`; "auto" values are resolved once at start-up.

    Each field is a `kvserve executor` flag (kvserve.executor.entry), its help written here.
    """

    model: str | None = field(
        default=None, metadata=flag("the default model's name, an HF model directory, or a .gguf file")
    )
    device: str = field(default="auto", metadata=flag("cpu, cuda, cuda:N, or auto (cuda when available)"))
    dtype: str = field(
        default="auto",
        metadata=flag(
            "float32, bfloat16, float16, or auto (bfloat16 on cuda and on a cpu with AVX512_BF16 or AMX, "
            "else float32; float32 around --weights native)",
            choices=("auto", *DTYPES),
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "float32, bfloat16, float16, or auto (bfloat16 with --weights native, else the --dtype); a narrower "
            "KV cache than --dtype holds more tokens per GiB and converts on read (cpu and torch attention "
            "backends)",
            choices=("auto", *DTYPES),
        ),
    )
    weights: str = field(
        default="auto",
        metadata=flag(
            "dequantized (fp32/bf16 from the converted directory), native (a GGUF's Q4_1 layers as 4-bit, cpu: "
            "about half the memory; faster than float32 at every batch size on AVX2 CPUs), or auto (native with "
            "--dtype auto on a cpu without AVX-512, for a Q4_1 GGUF on one rank; dequantized elsewhere; "
            "docs/benchmarks.md)",
            choices=("auto", *WEIGHTS),
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=flag(
            "cpu (kvserve's CPU kernels: a token's output does not depend on its batch), torch (plain torch, "
            "any device; not batch-invariant on cpu), triton (cuda), or auto (triton on cuda, cpu on cpu)",
            choices=("auto", *ATTENTION_BACKENDS),
        ),
    )
    block_size: int = field(
        default=defaults.BLOCK_SIZE,
        # choices are ints (argparse compares them after type=int), so they bypass flag()'s str choices
        metadata={
            **flag("tokens per KV block (the scheduler plans with the size the executor reports)"),
            "choices": defaults.BLOCK_SIZES,
        },
    )
    kv_cache_gb: float | None = field(
        default=None,
        metadata=flag(
            f"KV cache budget in GiB; None: {defaults.KV_CACHE_GB_CPU} on cpu, and on cuda what "
            "--gpu-memory-utilization leaves (set, it overrides that)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=flag("fraction of GPU memory kvserve may use in total (cuda)")
    )
    swap_space_gb: float = field(
        default=0.0, metadata=flag("CPU swap space in GiB for swap-preemption (0 disables it: num_cpu_blocks = 0)")
    )
    max_num_batched_tokens: int = field(
        default=defaults.MAX_NUM_BATCHED_TOKENS,
        metadata=flag("largest step, in tokens (sizes the CUDA profiling pass that measures activation memory)"),
    )
    max_num_seqs: int = field(default=defaults.MAX_NUM_SEQS, metadata=flag("most sequences in one step"))
    max_model_len: int | None = field(
        default=None, metadata=flag("longest context; None: the model's max_position_embeddings")
    )
    batch_invariant: bool = field(
        default=True,
        metadata=flag(
            "cpu: compute every token's logits the same whatever shares its step, however its prompt was chunked "
            "or cached, and across a restart (kvserve's CPU kernels, fixed GEMM shapes); --no-batch-invariant "
            "gives that up for torch's own attention and unpadded GEMMs"
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=flag(
            "threads on cpu: with --weights native kvserve's kernels' (torch keeps one), else torch's; None: "
            "every usable core with --weights native, else every usable core but one, left to the scheduler "
            "process (docs/benchmarks.md, 'Threads that coexist')"
        ),
    )
    draft_model: str | None = field(
        default=None,
        metadata=flag(
            "a smaller model with the same tokenizer that proposes draft tokens for the scheduler's "
            "--speculative draft (an HF model directory, a .gguf file, or the default model's name); it runs "
            "on every step's tokens and keeps its own KV in the same blocks, so the KV budget is shared"
        ),
    )
    compile: str = field(
        default="auto",
        metadata=flag(
            "on: the decode forward compiled once per batch-size bucket at start-up: on cpu (with --weights native) "
            "by torch.compile, inductor's C++ backend, whose tokens are eager's bit for bit; on cuda as CUDA graphs "
            "(--attention-backend triton, one rank). off: eager. auto: off, because on the CPUs measured "
            "(docs/benchmarks.md) it was no faster at batch 1 or 8 and slower at 64, and the CUDA graphs are not "
            "measured on a GPU yet. "
            "A restart re-traces every bucket (seconds each from a warm cache): raise the scheduler's "
            "--executor-restart-timeout to match",
            choices=("auto", *COMPILE_MODES),
        ),
    )
    compile_cache_dir: str | None = field(
        default=None,
        metadata=flag(
            "inductor's FX-graph and kernel caches for --compile on, so only a model's first start on a machine "
            "pays the compile; None: $KVSERVE_CACHE/inductor (~/.cache/kvserve/inductor)"
        ),
    )
    compile_buckets: str = field(
        default=defaults.COMPILE_BUCKETS,
        metadata=flag("comma-separated decode batch sizes --compile on captures, ascending"),
    )
    lora: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a LoRA adapter saved by peft (a directory with adapter_config.json and adapter_model.safetensors), "
            "served under NAME: a request names it as its `model`; repeat for several",
            metavar="NAME=PATH",
        ),
    )
    max_loras: int = field(
        default=defaults.MAX_LORAS,
        metadata=flag(
            "LoRA adapters resident at once; a step's adapters beyond them wait, the least recently used swaps out"
        ),
    )
    max_lora_rank: int = field(
        default=defaults.MAX_LORA_RANK,
        metadata=flag("the largest LoRA rank an adapter may have (refused at load beyond)"),
    )
    kv_host_gb: float = field(
        default=defaults.KV_HOST_GB,
        metadata=flag(
            "host memory for the prefix cache's host tier: blocks the pool evicts are held there and read back "
            "instead of recomputed (0: off)"
        ),
    )
    kv_disk_dir: str | None = field(
        default=None,
        metadata=flag(
            "a directory for the prefix cache's disk tier: cached KV blocks are written there and read back "
            "instead of recomputed, also after a restart (off when not given)",
            metavar="DIR",
        ),
    )
    kv_disk_gb: float = field(
        default=defaults.KV_DISK_GB,
        metadata=flag("the most the --kv-disk-dir tier holds; the least recently used blocks go first"),
    )

    def __post_init__(self) -> None:
        check_block_size(self.block_size)


def check_block_size(block_size: int) -> None:
    """Refuse a block size the kernels and backends are not tested at (`kvserve.config.defaults.BLOCK_SIZES`)."""
    if block_size not in defaults.BLOCK_SIZES:
        allowed = ", ".join(map(str, defaults.BLOCK_SIZES))
        raise ExecutorConfigError(f"--block-size must be one of {allowed}, got {block_size!r}")


def resolve_device(config: RunnerConfig, local_rank: int | None = None) -> str:
    """`local_rank`: a tensor-parallel rank's index on its host, which picks its GPU for a bare "cuda"."""
    import torch

    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and local_rank is not None:
        return f"cuda:{local_rank}"
    return device


def resolve_num_threads(config: RunnerConfig, ranks_on_host: int = 1, weights: str = "dequantized") -> int:
    """`ranks_on_host`: tensor-parallel ranks sharing this host's cores, each taking its share.

    `weights` native: every usable core. That path runs its whole step in kvserve's kernels, whose
    loops let the caller take over a chunk from a thread that lost its core (kernels/cpu/work_pool.h),
    so a busy neighbour slows a step instead of stalling it. Measured on 2 cores (docs/benchmarks.md,
    "The kernels' own threads"): two threads served 1.5x the tokens of one at 16 in flight and took
    a batch-1 step in 7.1 ms against 9.3-10.8; beside a process that never yields its core, 12-13 ms
    against one thread's 10-11.

    Otherwise every usable core but one, left to the scheduler process (HTTP, gRPC, tokenizers, the
    step loop) and whatever else runs on the host: torch's GEMMs are OpenMP regions whose threads wait
    for each other at every op. With both cores a batch-1 step took 38 ms alone and 240 ms beside one
    busy process; with one thread, 43 ms and 44 ms."""
    import os

    if config.num_threads:
        return config.num_threads
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if weights != "native" and usable > 1:
        usable -= 1
    return max(1, usable // ranks_on_host)


def resolve_dtype(config: RunnerConfig, device: str, weights: str) -> str:
    """auto: float32 around native weights (`weights`, as `resolve_weights` chose them); else
    bfloat16 where the hardware multiplies it natively, which passes the quality bar (`kvserve bench
    quality`: perplexity within 0.1% of fp32), and float32 where a bfloat16 GEMM is emulated and
    slower than fp32."""
    check_choice("dtype", config.dtype, DTYPES)
    if config.dtype == "auto":
        if weights == "native":
            return "float32"
        if device.startswith("cuda"):
            return "bfloat16"
        return "bfloat16" if has_native_bf16() else "float32"
    return config.dtype


def resolve_kv_cache_dtype(config: RunnerConfig, dtype: str, attention_backend: str, weights: str) -> str:
    """auto: bfloat16 under native weights, else the activation dtype. Another dtype than the
    activations' is stored converted and widened on read, which the cpu and torch backends do (the
    Triton kernels take K/V in the activation dtype).

    Why bfloat16 on the native path: a decode step there reads its context's K/V beside 4-bit
    weights, so at 640 tokens fp32 K/V were a fifth of the step's bytes. Rounding them to bfloat16
    holds twice the tokens per GiB and made such a step 4-16% faster, at no quality cost `bench quality`
    could see (docs/benchmarks.md). bfloat16 rather than float16: a Q4_1 file of any Llama-family model
    may run there, and bfloat16 keeps fp32's range."""
    check_choice("kv_cache_dtype", config.kv_cache_dtype, DTYPES)
    if config.kv_cache_dtype == "auto":
        return "bfloat16" if weights == "native" else dtype
    if config.kv_cache_dtype != dtype and attention_backend == "triton":
        raise ExecutorConfigError(
            f"--kv-cache-dtype {config.kv_cache_dtype} with --dtype {dtype} needs --attention-backend cpu or torch, "
            f"not {attention_backend}"
        )
    return config.kv_cache_dtype


NATIVE_WHY = (
    "kvserve's Q4_1 kernels (8-bit activations, VNNI where the CPU has it) beat the dequantized weights on "
    "every CPU kind measured (docs/benchmarks.md)"
)
"""The reason the `chose dtype and weights` line gives for auto's native weights."""


def resolve_weights(config: RunnerConfig, device: str, ranks: int = 1, gguf: bool = True) -> str:
    """dequantized or native; native needs the cpu, float32 between its layers, and a GGUF source (`gguf`).

    auto is native on the cpu with --dtype auto, on one rank (tensor parallelism: not measured), for a
    GGUF; the runner then serves dequantized weights after all when it has no Q4_1 layers to serve
    (`NativeWeightsUnavailable`: another format, q/k/v biases). Measured per CPU kind, native against
    the dequantized path auto chose before (docs/benchmarks.md, in one run each):
    - 2-core AVX2 EPYC (Zen 3), against float32: 3.0x at decode batch 1, 2.2x at 8, 1.6x at 64, 1.7x
      at prefill, at +0.09% perplexity;
    - 2-core Zen 4 EPYC (AVX-512, VNNI), against bfloat16: 4.9x at batch 1, 3.0x at 8, 2.0x at 32,
      1.8x at 64, 1.4x at prefill (the VNNI tiles);
    - 2-core AMX Xeon, against bfloat16 (before the VNNI tiles): 3.2x at batch 1, 2.4x at 8, one
      stream served 4.3x; it lost at 64 (0.65x) and prefill (0.5x), where it still beat llama.cpp.
    An explicit --dtype float32 keeps the dequantized path checked token for token against transformers."""
    check_choice("weights", config.weights, WEIGHTS)
    if config.weights == "auto":
        pays = device == "cpu" and config.dtype == "auto" and ranks == 1 and gguf
        return "native" if pays else "dequantized"
    if config.weights != "native":
        return "dequantized"
    if device != "cpu" or config.dtype not in ("auto", "float32"):
        raise ExecutorConfigError(f"--weights native runs on cpu with --dtype float32, not {device} / {config.dtype}")
    return "native"


def resolve_compile(config: RunnerConfig, device: str, weights: str, attention_backend: str, ranks: int) -> bool:
    """Whether the decode forward is compiled: on the CPU by torch.compile (`decode_graphs`), on CUDA
    as CUDA graphs (`cuda_graphs`). auto is off. On the CPUs measured (docs/benchmarks.md, "Compiled
    decode") the compiled native step was no faster at batch 1 or 8 and slower at 64, for tens of
    seconds of compilation a bucket. On CUDA the graphs have not yet been measured on a GPU
    (`scripts/gpu_check.sh` does), so auto does not choose them."""
    check_choice("compile", config.compile, COMPILE_MODES)
    if config.compile != "on":
        return False
    if device.startswith("cuda"):
        if attention_backend != "triton" or ranks > 1:
            raise ExecutorConfigError(
                "--compile on on cuda captures CUDA graphs, which need --attention-backend triton and one rank "
                f"(no tensor parallelism), got {attention_backend}, {ranks} rank(s)"
            )
        return True
    if device != "cpu" or weights != "native" or attention_backend != "cpu" or ranks > 1:
        raise ExecutorConfigError(
            "--compile on needs device cpu, --weights native, --attention-backend cpu and one rank (inductor lowers "
            "the dequantized weights' prepacked oneDNN linears only when frozen), or device cuda with "
            f"--attention-backend triton, got {device}, {weights}, {attention_backend}, {ranks} rank(s)"
        )
    return True


def compile_buckets(config: RunnerConfig) -> tuple[int, ...]:
    """--compile-buckets as ascending positive batch sizes."""
    try:
        sizes = tuple(int(part) for part in config.compile_buckets.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ExecutorConfigError(
            f"--compile-buckets must be ascending positive batch sizes such as 1,2,4,8, got {config.compile_buckets!r}"
        )
    return sizes


def resolve_attention_backend(config: RunnerConfig, device: str) -> str:
    """auto: triton on cuda; on cpu, kvserve's CPU kernels, or torch without --batch-invariant."""
    check_choice("attention_backend", config.attention_backend, ATTENTION_BACKENDS)
    if config.attention_backend == "auto":
        if device.startswith("cuda"):
            return "triton"
        return "cpu" if config.batch_invariant else "torch"
    return config.attention_backend


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Refuse a value that is neither auto nor one of `allowed`, naming the field and the choices."""
    if value != "auto" and value not in allowed:
        choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise ExecutorConfigError(f"{name} must be auto, {choices}, got {value!r}")
