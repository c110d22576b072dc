"""kvserve's CPU kernels (`kernels/cpu/*.cpp`): built once per machine, registered as `torch.ops.kvserve_cpu`.

Why hand-written kernels: torch's CPU attention and its vectorized elementwise loops pick their
code by shape (a one-row product, a split of the keys, a flash-attention block that follows the
query length, a scalar tail where a thread's chunk ends), so the same token's hidden state
changed with what it was batched with and how its prompt was chunked or cached. These kernels
compute every row in one fixed order, whatever else shares the call (the sources' headers say
how), so a token's result is bit-identical however it arrived. `kvserve.kernels.reference` holds the
plain-torch semantics they are tested against.

The library is compiled by torch's extension builder (ninja and the system C++ compiler) into
`build_root / build_name()`. It is built with `-march=native`, so the name hashes the CPU's
flags too: a cache shared by two kinds of CPU holds one build for each.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = (
    "paged_attention.cpp",
    "silu_mul.cpp",
    "q8_linear.cpp",
    "q4_1_linear.cpp",
    "decoder_layer.cpp",
    "lora_add.cpp",
    "softmax.cpp",
    "work_pool.cpp",
)
HEADERS = ("vec8.h", "q8_activations.h", "interleaved_linear.h", "work_pool.h")
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-pthread")
"""-ffp-contract=off: only the explicit fused multiply-adds fuse, so vector and scalar code agree bit for bit.
-pthread: the kernels run their loops on their own threads (`cpu/work_pool.h`), not OpenMP's."""
LDFLAGS = ("-pthread",)

BUILD_LOCK = "kvserve-build.lock"
"""The file a build holds an OS lock (flock) on, in its directory."""
TORCH_BATON = "lock"
"""The file torch's extension builder creates in the build directory while it builds, and removes after."""
_lock = threading.Lock()
_loaded: Path | None = None


def build_name() -> str:
    """The library's name: a hash of its sources, flags, torch version and the CPU it is compiled for."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(cpu_identity().encode())
    digest.update(torch.__version__.encode())
    return f"kvserve_cpu_{digest.hexdigest()[:16]}"


def is_built(build_root: Path) -> bool:
    """Whether `build_root` holds this machine's compiled library already."""
    name = build_name()
    return (build_root / name / f"{name}.so").is_file()


def load(build_root: Path, verbose: bool = False) -> Path:
    """Compile (the first time on a machine: about 30 s) or reuse the library, and register its ops.

    Returns its build directory. Concurrent callers (two executors starting at once) are serialised
    by an OS lock on the directory (`BUILD_LOCK`), which dies with its process. torch's builder also
    locks the directory, with a file (`TORCH_BATON`) a killed build leaves behind, and then every later
    start waits for it forever: with the OS lock held no other kvserve build can be running, so such a
    file is stale and is removed."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        name = build_name()
        directory = build_root / name
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / BUILD_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (directory / TORCH_BATON).unlink(missing_ok=True)
            cpp_extension.load(
                name=name,
                sources=[str(SOURCE_DIR / source) for source in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                is_python_module=False,
                verbose=verbose,
            )
        _register_shapes()
        _loaded = directory
        return directory


def _register_shapes() -> None:
    """Each op's output shape and dtype without computing it, so `torch.compile` can trace a forward
    that calls the ops (`kvserve.executor.model.decode_graphs`); the compiled graph calls them as they are."""

    def like_first(x: torch.Tensor, *_operands: object) -> torch.Tensor:
        return torch.empty_like(x)

    def store(*tensors: torch.Tensor) -> None:
        return None

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    def quantized_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    shapes: dict[str, Callable[..., object]] = {
        "paged_attention": like_first,
        "store_kv": store,
        "silu_mul": silu_mul,
        "q8_linear": quantized_linear,
        "q4_1_linear": quantized_linear,
        "rms_norm": like_first,
        "decoder_layer": store,
        "lora_add": store,
        "softmax": like_first,
        "log_softmax": like_first,
    }
    for name, shape in shapes.items():
        torch.library.register_fake(f"kvserve_cpu::{name}", shape)


def is_loaded() -> bool:
    """Whether this process has loaded the library (`load`): callers with a torch fallback, such as the
    LoRA deltas, use the kernels where the executor chose them and never compile them mid-step."""
    return _loaded is not None


def head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-major caches ([blocks, block_size, kv_heads, head_dim], the other kernels' layout) in the
    head-major layout these kernels read: keys [blocks, kv_heads, head_dim, block_size] and values
    [blocks, kv_heads, block_size, head_dim], so one head's block is one contiguous run."""
    return k_cache.permute(0, 2, 3, 1).contiguous(), v_cache.permute(0, 2, 1, 3).contiguous()


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token t's K/V ([tokens, kv_heads, head_dim]) to slot `slot_mapping[t]` (int64; < 0 skipped)
    of head-major caches, in the caches' dtype."""
    torch.ops.kvserve_cpu.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's paged context.

    The semantics of `kvserve.kernels.reference.paged_attention_reference`: `query` [tokens, heads,
    head_dim] packed by sequence; head-major caches (`head_major`) already holding the new
    tokens' K/V; int32 `block_tables` [seqs, width], `query_start_loc` [seqs + 1] and `seq_lens`
    [seqs]. The output has the query's dtype; K/V may have another."""
    return torch.ops.kvserve_cpu.paged_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [tokens, 2 * width] gate/up product (gate columns first), [tokens, width]."""
    return torch.ops.kvserve_cpu.silu_mul(gate_up)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x` [rows, in] (float32 or bfloat16), rounded to Q8 blocks, times Q8_0 weights in the kernel's
    layout of eight interleaved rows (`kvserve.executor.weights.q8_0.pack`): int8 `codes` [out / 8,
    in * 8] and float32 `scales` [out / 8, in / 32, 8]. float32 [rows, out_features], each output one
    float chain over exact integer group sums (`kernels/cpu/q8_linear.cpp`)."""
    return torch.ops.kvserve_cpu.q8_linear(x, codes, scales, out_features)


def q4_1_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x` [rows, in] (float32 or bfloat16), rounded to Q8 blocks, times Q4_1 weights in the kernel's
    layout of eight interleaved rows (`kvserve.executor.weights.q4_1_linear.pack`): uint8 `codes`
    [out / 8, in * 4] and float32 `scales` [out / 8, in / 32, 2, 8]. float32 [rows, out_features], each
    output one float chain over exact integer group sums (`kernels/cpu/q4_1_linear.cpp` says which)."""
    return torch.ops.kvserve_cpu.q4_1_linear(x, codes, scales, out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 rows [rows, width] (width a multiple of 8), each row's squares summed in one
    fixed order, so a row's result does not depend on the batch (`kernels/cpu/decoder_layer.cpp`)."""
    return torch.ops.kvserve_cpu.rms_norm(x, weight, eps)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of a contiguous float32 [rows, n] tensor, each row in one fixed order
    (its exps summed in eight lanes in index order): the same bits on any x86 CPU, in any batch and at
    any thread count (`kernels/cpu/softmax.cpp`). A row needs a finite entry; -inf entries give 0."""
    return torch.ops.kvserve_cpu.softmax(x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of a contiguous float32 [rows, n] tensor: (x - max) - log(sum), the
    sum as `softmax` adds it and its log rounded to float from double operations alone, so the same bits
    on any x86 CPU, in any batch and at any thread count (`kernels/cpu/softmax.cpp`)."""
    return torch.ops.kvserve_cpu.log_softmax(x)


@dataclass(frozen=True, slots=True)
class LayerLora:
    """A decoder layer's LoRA deltas as `decoder_layer` adds them: `lora_add`'s operands for each source
    of adapters (a stack of slots, or an adapter running from tensors of its own).

    Per source: its rows' slots (`row_slots`, -1 for a row not its own) and its slots' `scaling`. Per
    product p (qkv, o_proj, gate_up, down; `PRODUCTS`) and source s, at p * sources + s: `a`, `b`,
    `ranks` and `columns` (int64) as `lora_add` takes them, an empty `a` where the source has no matrix
    for p and an empty `ranks` for None."""

    row_slots: list[torch.Tensor]
    scaling: list[torch.Tensor]
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    ranks: list[torch.Tensor]
    columns: list[torch.Tensor]

    PRODUCTS = ("qkv", "o_proj", "gate_up", "down")
    """The fused products of a layer, in the order of its lists."""

    def add(self, product: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` += product `product`'s deltas for the rows of `x` under adapters: the `lora_add` calls
        `decoder_layer` makes after that product, for a layer run op by op (so with the same bits)."""
        sources, index = len(self.row_slots), self.PRODUCTS.index(product)
        for source in range(sources):
            i = index * sources + source
            if self.a[i].numel():
                ranks = self.ranks[i] if self.ranks[i].numel() else None
                columns = self.columns[i].tolist()
                lora_add(x, self.row_slots[source], self.a[i], self.b[i], ranks, columns, self.scaling[source], out)


def decoder_layer(
    x: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    matrices: tuple[list[torch.Tensor], list[torch.Tensor], list[int]],
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    heads: tuple[int, int],
    caches: tuple[torch.Tensor, torch.Tensor],
    attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    lora: LayerLora | None = None,
) -> None:
    """One native decoder layer on float32 `x` [tokens, hidden], in place: `rms_norm` (input norm), the
    Q4_1 qkv product, rotate-half RoPE of q and k, `store_kv`, `paged_attention`, the o_proj product
    added to `x`, `rms_norm` (post-attention norm), gate_up, `silu_mul`, down added to `x`.

    `matrices`: the qkv, o_proj, gate_up and down codes, scales and out_features (`q4_1_linear`'s
    layout); `rotary`: int64 positions and the float32 cos and sign-folded sin tables [positions,
    head_dim]; `heads`: (num_heads, num_kv_heads); `attention`: slot_mapping, block_tables,
    query_start_loc, seq_lens and the softmax scale, as `store_kv` and `paged_attention` take them;
    `lora`: the deltas added to each product for the rows under adapters, as `lora_add` adds them."""
    codes, scales, out_features = matrices
    positions, cos, sin_signed = rotary
    slot_mapping, block_tables, query_start_loc, seq_lens, scale = attention
    deltas = ([],) * 6 if lora is None else (lora.row_slots, lora.scaling, lora.a, lora.b, lora.ranks, lora.columns)
    torch.ops.kvserve_cpu.decoder_layer(
        x, norms[0], norms[1], eps, codes, scales, out_features, positions, cos, sin_signed, heads[0], heads[1],
        caches[0], caches[1], slot_mapping, block_tables, query_start_loc, seq_lens, scale, *deltas,
    )  # fmt: skip


def lora_add(
    x: torch.Tensor,
    row_slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor | None,
    columns: Sequence[int],
    scaling: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`out` += the LoRA delta of every row under an adapter slot, for one fused product, in one call.

    The semantics of `kvserve.kernels.reference.lora_add_reference`: row t under slot s = `row_slots[t]`
    (int32 or int64; -1: left as it is) gets scaling[s] * ((x[t] @ A_s.T) @ B_s), computed in float32 and
    added to float32(out[t]), rounded once to out's dtype. The slot's pair belongs to the product's
    projections in turn, `ranks[s, p]` rows to projection p (int32 or int64 [slots, projections]; None: one
    projection of every stacked row), and a projection reaches only its columns of out, [columns[p],
    columns[p + 1]) (empty: every column); a projection with no rows leaves its columns as they are.
    `a` [slots, widest, in] stacks the A rows; `b` [slots, floats] packs the B blocks
    (`kvserve.executor.lora.adapter.LoraMatrix.packed_b`). `x` [rows, in] and `out` [rows, out] float32,
    bfloat16 or float16 with contiguous rows; `a`, `b` and `scaling` [slots] contiguous float32. A row's
    bits depend only on its own operands (`kernels/cpu/lora_add.cpp`)."""
    torch.ops.kvserve_cpu.lora_add(x, row_slots, a, b, ranks, columns, scaling, out)


def set_num_threads(threads: int) -> int:
    """The kernels' loop threads, the caller included (`cpu/work_pool.h`); 0: torch's count.
    Returns the previous setting."""
    return int(torch.ops.kvserve_cpu.set_num_threads(threads))


def num_threads() -> int:
    """How many threads the kernels' loops run on."""
    return int(torch.ops.kvserve_cpu.num_threads())


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI package's binary sits in the environment's bin,
    which is not on PATH when the executor is started by an absolute interpreter path."""
    try:
        import ninja
    except ImportError:
        return  # a system ninja, if any
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def cpu_identity() -> str:
    """The CPU's model name and flags (of the first processor): what a native build and its measurements depend on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()
