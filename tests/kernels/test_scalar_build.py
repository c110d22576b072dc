"""A native step gives the same bits on any x86 CPU: every kernel in its scalar, AVX2 and native builds, and the
torch ops after the layers at each of torch's CPU capabilities (issue 49).

`vec8.h` and the format tiles have a plain C++ version for CPUs without AVX2 (ARM, old x86), an AVX2
one, and for the quantized tiles a VNNI one (`interleaved_linear.h`). All promise the same bits:
exact integer sums, the same float32 chain per output, exp by the same polynomial in every lane. The
first test builds every kernel source for baseline x86-64 (no AVX2) and, on a CPU whose native build
takes the VNNI tiles, for Haswell (AVX2, no VNNI), one child process per build, runs them on the same
operands as the native build loaded here and compares every output bit for bit: the quantized
kernels (row counts that fill and leave ragged tiles and chunks, ragged output widths, both
activation dtypes), `lora_add` (every activation dtype, ragged widths, per-projection columns, several
rows per slot), `silu_mul` (ragged widths, every dtype, gates where exp overflows and underflows),
`softmax` and `log_softmax` (the full vocabulary and ragged widths, masked entries, entries around
exp's clamp), `store_kv`, `paged_attention` (prefill and decode rows of sequences of different
lengths, every block size, query and cache dtypes) and the whole `decoder_layer` op at the default
model's size.

After the layers a step runs torch's ops: the final RMSNorm (`llama.rms_norm`) and the sampler,
around the Q8_0 head kernel. torch picks its vector code by CPU capability, so the second test runs
that tail under each `ATEN_CPU_CAPABILITY` the CPU offers and compares the bits: every sampler path
(greedy, temperature, top_k, top_p, min_p, penalties, biases, the seeded race) and the logprobs.
torch's own softmax and log_softmax do differ between capabilities (their exp and sums follow the
vector width), so the sampler takes the kernels' (`kvserve.executor.sampling.row_softmax`, as
teacher-forced scoring does): the top_p and min_p filters' probabilities and the reported logprobs
are the same bits on any x86 CPU, and nothing of the tail is left out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.cpu_features import cpu_flags
from kvserve.executor.model.llama import rms_norm
from kvserve.executor.sampling import row_softmax
from kvserve.executor.sampling.logit_bias import apply_logit_bias
from kvserve.executor.sampling.penalties import apply_penalties
from kvserve.executor.sampling.sampler import _race, filtered_logits, sample
from kvserve.executor.sampling.seeded_noise import UNIFORM_BITS, row_key, uniform_noise, uniforms_from_hashes
from kvserve.executor.sequence_state import SequenceState
from kvserve.executor.weights.gguf_q4_1 import random_q4_1
from kvserve.executor.weights.q4_1_linear import make_q4_1_linear
from kvserve.executor.weights.q8_0 import Q8Linear, pack
from kvserve.kernels import cpu_ops
from kvserve.protos.sampling import SamplingParams
from tests.kernels.paged_steps import step_metadata

pytestmark = pytest.mark.slow

BUILD_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from torch.utils import cpp_extension
    from kvserve.kernels import cpu_ops

    build, operands, out, march = sys.argv[1:]
    cpu_ops._put_ninja_on_path()
    flags = [f for f in cpu_ops.CFLAGS if f != "-march=native"] + [f"-march={march}"]
    # Every source in one translation unit: torch's headers parsed once, not once a source (2.5x less compiling).
    # The sources' anonymous namespaces share no names; a clash would stop this build, not the product's.
    unity = Path(build) / "kernels.cpp"
    unity.write_text("".join(f'#include "{cpu_ops.SOURCE_DIR / source}"\\n' for source in cpu_ops.SOURCES))
    name = "kvserve_" + march.replace("-", "_") + "_check"
    cpp_extension.load(name=name, sources=[str(unity)], extra_cflags=flags, extra_ldflags=list(cpu_ops.LDFLAGS),
                       build_directory=build, is_python_module=False)
    results = []
    for op, args in torch.load(operands):
        result = getattr(cpu_ops, op)(*args)
        results.append(args if result is None else result)  # an in-place op: its operands after the call
    torch.save(results, out)
    """
)

CAPABILITY_CHILD = textwrap.dedent(
    """
    import importlib.util
    import sys
    import torch

    test_file, operands, out = sys.argv[1:]
    torch.set_num_threads(1)  # as the native path runs torch's ops
    spec = importlib.util.spec_from_file_location("scalar_build_check", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.save((torch.backends.cpu.get_cpu_capability(), module._step_tail(torch.load(operands))), out)
    """
)

Call = tuple[str, tuple[object, ...]]

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 64, 65, 130)
"""Whole and partial tiles of four rows, one chunk of 64 rows and more (interleaved_linear.h)."""
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
"""What torch's AVX512 capability needs."""
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 576, 9, 3, 64, 1536, 49152
"""The default model's sizes."""
EPS = 1e-5
CACHED, NEW = [0, 19, 40, 3, 90], [21, 1, 1, 5, 17]
"""A step's sequences: a prefill of more than one attention tile (16 rows), two decode rows, a short
run of new tokens and a chunk of a longer prompt, contexts crossing blocks."""


def _builds() -> tuple[str, ...]:
    """Each build compared with the native one, by -march: baseline x86-64 runs every kernel's scalar code;
    Haswell the quantized kernels' AVX2 tiles, which only a VNNI CPU's native build does not run already."""
    return ("x86-64", "haswell") if cpu_flags() & VNNI_FLAGS else ("x86-64",)


def _start_build(tmp_path: Path, march: str) -> subprocess.Popen[str]:
    """A child that builds every source for `march` and saves its ops' outputs on the saved calls."""
    build = tmp_path / march
    build.mkdir()
    operands, out = tmp_path / "operands.pt", build / "out.pt"
    command = [sys.executable, "-c", BUILD_CHILD, str(build), str(operands), str(out), march]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _quantized_calls(gen: torch.Generator) -> list[Call]:
    calls: list[Call] = []
    for n, k in [(101, 96), (200, 1536)]:  # a ragged last block; several groups and 16-bit partial sums
        q4 = make_q4_1_linear(random_q4_1(n, k, gen))
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 included
        q8 = pack(codes, torch.rand(n, k // 32, generator=gen).half().float() * 0.01)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, k, generator=gen) * 3
            x[0, :32] = 0  # a group of zeros
            for activations in (x, x.bfloat16()):
                calls.append(("q4_1_linear", (activations, q4.codes, q4.scales, n)))
                calls.append(("q8_linear", (activations, q8.codes, q8.d, n)))
        calls.append(("rms_norm", (x, torch.randn(k, generator=gen), EPS)))
    return calls


def _lora_calls(gen: torch.Generator) -> list[Call]:
    calls: list[Call] = []
    for n_in, outs, ranks in [(576, [576, 192, 192], [[16, 16, 16], [8, 0, 8]]), (100, [21, 43], [[5, 7], [0, 12]])]:
        bounds = [0]
        for width in outs:
            bounds.append(bounds[-1] + width)
        a = torch.randn(2, 48, n_in, generator=gen)
        b = torch.randn(2, 48 * bounds[-1], generator=gen)
        row_slots = torch.tensor([0, 1, -1, 0, 0, 1, 0, 0, 1], dtype=torch.int32)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(9, n_in, generator=gen) * 3).to(dtype)
            out = torch.randn(9, bounds[-1], generator=gen).to(dtype)
            rank_tensor = torch.tensor(ranks, dtype=torch.int32)
            calls.append(("lora_add", (x, row_slots, a, b, rank_tensor, bounds, torch.tensor([0.5, 2.0]), out)))
    return calls


def _silu_calls(gen: torch.Generator) -> list[Call]:
    """Gates where exp overflows, underflows to subnormals and to zero, beside ordinary ones."""
    extremes = torch.tensor([-200.0, -104.0, -90.0, -88.5, -20.0, -0.0, 0.0, 20.0, 88.5, 90.0, 104.0, 200.0])
    calls: list[Call] = []
    for width in (INTERMEDIATE, 100, 13):  # whole groups of 32, a tail of 8 and a short last chunk, a short row
        for rows in (1, 5, 33):
            gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
            gate_up[0, : len(extremes)] = extremes
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                calls.append(("silu_mul", (gate_up.to(dtype),)))
    return calls


def _softmax_calls(gen: torch.Generator) -> list[Call]:
    """`softmax` and `log_softmax` at the full vocabulary and ragged widths, with masked (-inf) entries and
    entries around exp's clamp (x - max near -87, where the kernel zeroes exp) and far below it."""
    below_max = torch.tensor([0.0, -86.9, -87.0, -87.1, -88.0, -103.0, -200.0, float("-inf")])
    calls: list[Call] = []
    for width in (VOCAB, 100, 13, 1):
        for rows in (1, 5):
            x = torch.randn(rows, width, generator=gen) * 4
            if width > 1:
                x[torch.rand(rows, width, generator=gen) < 0.25] = float("-inf")
                x[:, 0] = 50.0  # each row's max, so the entries below sit where they say
                x[0, : len(below_max)] = 50.0 + below_max[:width]
            calls += [("softmax", (x,)), ("log_softmax", (x,))]
    return calls


def _batch(block: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Positions, slot mapping, block tables (blocks in a shuffled order), query starts and lengths of
    the step of CACHED and NEW."""
    needed = [-(-(before + count) // block) for before, count in zip(CACHED, NEW, strict=True)]
    order = torch.randperm(sum(needed), generator=gen).tolist()
    tables = [[order.pop() for _ in range(blocks)] for blocks in needed]
    return step_metadata(CACHED, NEW, tables, block)


def _caches(
    blocks: int, block: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-major caches with random contents standing for earlier tokens."""
    k, v = (torch.randn(blocks, block, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    return cpu_ops.head_major(k, v)


def _attention_calls(gen: torch.Generator) -> list[Call]:
    """`paged_attention` at every block size, with query and cache dtypes the kernels read, and `store_kv`
    into each cache dtype with a skipped slot."""
    calls: list[Call] = []
    shapes = [(HEADS, KV_HEADS, HEAD_DIM, 16, torch.float32, torch.bfloat16), (HEADS, KV_HEADS, HEAD_DIM, 16,
              torch.float32, torch.float32), (8, 2, 128, 32, torch.bfloat16, torch.bfloat16), (4, 4, 16, 8,
              torch.float16, torch.float16), (6, 1, 256, 64, torch.float32, torch.float16)]  # fmt: skip
    for heads, kv_heads, head_dim, block, q_dtype, kv_dtype in shapes:
        positions, slots, tables, starts, lens = _batch(block, gen)
        k_cache, v_cache = _caches(int(tables.max()) + 1, block, kv_heads, head_dim, kv_dtype, gen)
        query = (torch.randn(len(positions), heads, head_dim, generator=gen) * 3).to(q_dtype)
        scale = head_dim**-0.5
        calls.append(("paged_attention", (query, k_cache, v_cache, tables, starts, lens, scale)))
        key, value = (torch.randn(len(positions), kv_heads, head_dim, generator=gen).to(q_dtype) for _ in range(2))
        skipped = slots.clone()
        skipped[1] = -1
        calls.append(("store_kv", (key, value, k_cache.clone(), v_cache.clone(), skipped)))
    return calls


def _layer_calls(gen: torch.Generator) -> list[Call]:
    """The fused `decoder_layer` at the default model's size on the step of CACHED and NEW, with the
    native path's bfloat16 caches and with float32 ones."""
    norms = tuple(1 + 0.1 * torch.randn(HIDDEN, generator=gen) for _ in range(2))
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTERMEDIATE, HIDDEN),
              (HIDDEN, INTERMEDIATE)]  # fmt: skip
    q4 = [make_q4_1_linear(random_q4_1(out, inp, gen)) for out, inp in shapes]
    matrices = ([m.codes for m in q4], [m.scales for m in q4], [m.out_features for m in q4])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(128, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    half = HEAD_DIM // 2
    sin_signed = torch.cat([-angles[:, :half].sin(), angles[:, half:].sin()], dim=-1)
    positions, slots, tables, starts, lens = _batch(16, gen)
    calls: list[Call] = []
    for kv_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(len(positions), HIDDEN, generator=gen)
        caches = _caches(int(tables.max()) + 1, 16, KV_HEADS, HEAD_DIM, kv_dtype, gen)
        rotary = (positions, angles.cos(), sin_signed)
        attention = (slots, tables, starts, lens, HEAD_DIM**-0.5)
        calls.append(("decoder_layer", (x, norms, EPS, matrices, rotary, (HEADS, KV_HEADS), caches, attention)))
    return calls


def _cloned(value: object) -> object:
    """`value` with every tensor in it copied, so an in-place op leaves the saved operands as they are."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_cloned(item) for item in value)
    return value


def _here(op: str, args: tuple[object, ...]) -> object:
    """What the native build loaded here computes; an in-place op's operands after the call, as the child saves them."""
    own = _cloned(args)
    assert isinstance(own, tuple)
    result = getattr(cpu_ops, op)(*own)
    return own if result is None else result


def _same_bits(a: object, b: object) -> bool:
    """Equal bit for bit, tensors in lists and tuples included (NaN payloads too, where torch.equal fails)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
        return torch.equal(a, b)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same_bits, a, b))
    return a == b


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="without AVX2 the kernels' build is the scalar one already")
def test_scalar_and_avx2_builds_of_the_kernels_give_the_same_bits(tmp_path: Path) -> None:
    ensure_kernels()
    gen = torch.Generator().manual_seed(0)
    calls = _quantized_calls(gen) + _lora_calls(gen) + _silu_calls(gen) + _softmax_calls(gen) + _attention_calls(gen)
    calls += _layer_calls(gen)
    torch.save(calls, tmp_path / "operands.pt")
    children = {march: _start_build(tmp_path, march) for march in _builds()}
    for march, child in children.items():  # side by side: each is mostly its compiler
        _, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, (march, stderr[-3000:])
    here = [_here(op, args) for op, args in calls]
    for march in children:
        built = torch.load(tmp_path / march / "out.pt")
        for index, ((op, args), got, expected) in enumerate(zip(calls, built, here, strict=True)):
            first = args[0]
            assert isinstance(first, torch.Tensor)
            assert _same_bits(got, expected), (march, index, op, first.dtype, tuple(first.shape))


def _capabilities() -> tuple[str, ...]:
    """torch's CPU capabilities this CPU can run (`ATEN_CPU_CAPABILITY`), the plain one first."""
    flags = cpu_flags()
    return ("default",) + (("avx2",) if "avx2" in flags else ()) + (("avx512",) if flags >= AVX512_FLAGS else ())


def _tail_operands(gen: torch.Generator) -> dict[str, object]:
    """Final hidden rows, the final norm, a Q8_0 head of the default model's size, and sequences whose
    sampling takes every path of the sampler: greedy, temperature, top_k, top_p, min_p, penalties, logit
    biases (a ban among them) and logprobs (the sampled token's alone, and top ones)."""
    head = pack(torch.randint(-128, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8),
                torch.rand(VOCAB, HIDDEN // 32, generator=gen).half().float() * 0.01)  # fmt: skip
    params = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 40},
        {"temperature": 1.3, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2},
        {"temperature": 0.0, "repetition_penalty": 1.2, "logit_bias": ((5, 2.5), (17, -100.0))},
        {"temperature": 0.9, "logit_bias": ((100, 5.0), (101, -3.0))},
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 2.0, "top_k": 1000, "frequency_penalty": 0.4},
        {"temperature": 1.0, "top_p": 0.9, "logprobs": 5},
        {"temperature": 1.5, "min_p": 0.05},
        {"temperature": 0.8, "top_k": 200, "top_p": 0.8, "min_p": 0.01, "logprobs": 0},
        {"temperature": 0.0, "presence_penalty": 0.3, "logprobs": 20},
    ]
    return {
        "hidden": torch.randn(len(params), HIDDEN, generator=gen) * 3,
        "final_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "head": (head.codes, head.d, head.out_features),
        "params": params,
        "tokens": [torch.randint(0, VOCAB, (24,), generator=gen).tolist() for _ in params],
    }


def _step_tail(operands: dict) -> dict[str, torch.Tensor]:
    """The native step after its layers, as `LlamaModel.forward` and `sample` run it: the final norm, the
    head, penalties and biases, the filters (temperature, top_k, top_p, min_p) and the probabilities that
    top_p and min_p cut by, the seeded race's scores, the sampled tokens and their logprobs; and the race's
    noise term at every uniform the sampler can draw (its only transcendental: the whole of its domain).
    The softmax and log_softmax are the CPU kernels' (`row_softmax`): `ensure_kernels` loads them here,
    in the child too, as the executor does when it chose them."""
    ensure_kernels()
    logits = Q8Linear(*operands["head"])(rms_norm(operands["hidden"], operands["final_norm"], EPS)).float()
    seqs = [
        SequenceState(seq_id=i, token_ids=t, prompt_len=16, block_table=[], sampling=SamplingParams(**p), seed=1000 + i)
        for i, (p, t) in enumerate(zip(operands["params"], operands["tokens"], strict=True))
    ]
    params = [s.sampling for s in seqs]
    penalised = apply_penalties(
        logits.clone(),
        [s.token_ids[: s.prompt_len] for s in seqs],
        [s.token_ids[s.prompt_len :] for s in seqs],
        [p.repetition_penalty for p in params],
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
    )
    apply_logit_bias(penalised, [p.logit_bias for p in params])
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    temperatures = torch.tensor([params[i].temperature for i in drawn])[:, None]
    scaled = filtered_logits(
        penalised[drawn], [params[i].temperature for i in drawn], [params[i].top_k for i in drawn],
        [params[i].top_p for i in drawn], [params[i].min_p for i in drawn],
    )  # fmt: skip
    noise = uniform_noise([row_key(seqs[i].seed, seqs[i].output_len) for i in drawn], VOCAB)
    every_uniform = uniforms_from_hashes(torch.arange(1 << UNIFORM_BITS, dtype=torch.int32) << (32 - UNIFORM_BITS))
    sampled = sample(logits.clone(), seqs)
    reported = [s for s in sampled if s.logprob is not None]
    return {
        "final norm and head": logits,
        "penalties and biases": penalised,
        # What min_p compares and top_p sums (before its top_k cut): the probabilities, whose bits decide
        # a token on a filter's boundary.
        "filter probabilities": row_softmax.softmax(penalised[drawn] / temperatures),
        "temperature, top_k, top_p and min_p": scaled,
        "race scores": _race(scaled, noise),
        "race noise at every uniform": _race(torch.zeros_like(every_uniform), every_uniform),
        "sampled tokens": torch.tensor([s.token_id for s in sampled]),
        "logprobs of the penalised logits": row_softmax.log_softmax(penalised),
        "sampled tokens' logprobs": torch.tensor([s.logprob for s in reported], dtype=torch.float64),
        "top logprobs": torch.tensor(
            [(t.token_id, t.logprob) for s in reported for t in s.top_logprobs], dtype=torch.float64
        ),
    }


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="without AVX2 torch runs its plain capability only")
def test_the_steps_torch_ops_give_the_same_bits_at_every_cpu_capability(tmp_path: Path) -> None:
    ensure_kernels()  # built once here, loaded by the children
    # The operands are made here: torch's randn itself draws other numbers under another capability.
    torch.save(_tail_operands(torch.Generator().manual_seed(1)), tmp_path / "operands.pt")
    children = {}
    for capability in _capabilities():
        command = [sys.executable, "-c", CAPABILITY_CHILD, __file__, str(tmp_path / "operands.pt"),
                   str(tmp_path / f"{capability}.pt")]  # fmt: skip
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        children[capability] = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    for capability, child in children.items():
        _, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, (capability, stderr[-3000:])
    tails = {}
    for capability in children:
        ran, tails[capability] = torch.load(tmp_path / f"{capability}.pt")
        assert ran == capability.upper()  # the child ran the capability it was given
    for capability, tail in tails.items():
        for name, result in tail.items():
            assert _same_bits(result, tails["default"][name]), (capability, name)
