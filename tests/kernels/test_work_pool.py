"""The kernels' own threads (`kernels/cpu/work_pool.h`), seen through the ops that use them.

Which thread runs which chunk must never change a bit; an error inside a chunk must reach the
caller and leave the pool usable; a forked child and a second calling thread must work too.
That a busy core no longer stalls a step is a speed claim, measured by
`python -m kvserve.bench.step_profile --neighbours 1` (docs/benchmarks.md), not tested here."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.kernels import cpu_ops

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 16, 2, 4, 32


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


@pytest.fixture
def threads() -> Iterator[Callable[[int], int]]:
    """Set the kernels' thread count (which sizes the pool) for one test, and put it back after."""
    before = cpu_ops.set_num_threads(0)
    yield cpu_ops.set_num_threads
    cpu_ops.set_num_threads(before)


def _q4_1_case(gen: torch.Generator, out_features: int = 1000, in_features: int = 256):
    blocks, groups = (out_features + 7) // 8, in_features // 32
    codes = torch.randint(0, 256, (blocks, in_features * 4), generator=gen, dtype=torch.uint8)
    scales = torch.cat(
        [torch.rand(blocks, groups, 1, 8, generator=gen), -torch.rand(blocks, groups, 1, 8, generator=gen)], 2
    )
    return codes, scales.half().float().contiguous(), out_features


def _attention_case(gen: torch.Generator, block_size: int = BLOCK):
    """Three sequences of 40, 7 and 65 new tokens on empty contexts: many work items."""
    lens = [40, 7, 65]
    blocks = [-(-n // block_size) for n in lens]
    k = torch.randn(sum(blocks), block_size, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(sum(blocks), block_size, KV_HEADS, HEAD_DIM, generator=gen)
    tables, first = [], 0
    for count in blocks:
        tables.append(list(range(first, first + count)) + [0] * (max(blocks) - count))
        first += count
    query = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=gen)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (query, *cpu_ops.head_major(k, v), torch.tensor(tables, dtype=torch.int32), starts,
            torch.tensor(lens, dtype=torch.int32), HEAD_DIM**-0.5)  # fmt: skip


def test_the_results_are_the_same_bits_on_one_two_and_five_threads(threads) -> None:
    """Five threads on a small machine's cores: helpers lose their cores mid-loop, and chunks move between threads."""
    gen = torch.Generator().manual_seed(1)
    x, matrix = torch.randn(70, 256, generator=gen), _q4_1_case(gen)
    gate_up = torch.randn(70, 2 * 1536, generator=gen)
    attention = _attention_case(gen)

    def run() -> list[torch.Tensor]:
        return [cpu_ops.q4_1_linear(x, *matrix), cpu_ops.silu_mul(gate_up), cpu_ops.paged_attention(*attention),
                cpu_ops.rms_norm(gate_up, torch.ones(2 * 1536), 1e-5)]  # fmt: skip

    threads(1)
    one = run()
    for count in (2, 5, 2):  # five, then back to two: the pool is resized both ways
        threads(count)
        assert cpu_ops.num_threads() == count
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(run(), one, strict=True)), count


def test_an_error_inside_a_chunk_reaches_the_caller_and_the_pool_goes_on(threads) -> None:
    """paged_attention refuses a block size inside its loop over work items, on whichever thread runs one."""
    gen = torch.Generator().manual_seed(2)
    threads(2)
    bad = _attention_case(gen, block_size=12)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="block_size must be 8, 16, 32 or 64"):
            cpu_ops.paged_attention(*bad)
    good = _attention_case(gen)
    got = cpu_ops.paged_attention(*good)
    threads(1)
    assert torch.equal(got, cpu_ops.paged_attention(*good))


def _child(queue, x, matrix) -> None:
    cpu_ops.set_num_threads(2)
    queue.put(cpu_ops.q4_1_linear(x, *matrix).tolist())  # plain floats: a tensor would travel as a shared fd


def test_a_forked_child_runs_the_kernels_on_a_pool_of_its_own(threads) -> None:
    """The parent's helpers do not exist in a child forked while they sleep or spin."""
    gen = torch.Generator().manual_seed(3)
    x, matrix = torch.randn(33, 256, generator=gen), _q4_1_case(gen)
    threads(2)
    expected = cpu_ops.q4_1_linear(x, *matrix)  # the parent's pool now has its helper
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue, x, matrix))
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(got), expected)


def test_two_calling_threads_at_once_each_get_their_own_results(threads) -> None:
    """One loop runs on the pool at a time; a loop called beside it runs on its own caller."""
    gen = torch.Generator().manual_seed(4)
    cases = [(torch.randn(64, 256, generator=gen), _q4_1_case(gen)) for _ in range(2)]
    threads(1)
    expected = [cpu_ops.q4_1_linear(x, *matrix) for x, matrix in cases]
    threads(2)
    failures: list[str] = []

    def call(index: int) -> None:
        x, matrix = cases[index]
        for round_ in range(40):
            if not torch.equal(cpu_ops.q4_1_linear(x, *matrix), expected[index]):
                failures.append(f"caller {index}, round {round_}")

    callers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=300)
    assert not any(caller.is_alive() for caller in callers)
    assert failures == []


def test_a_negative_thread_count_is_refused_by_name(threads) -> None:
    before = cpu_ops.num_threads()
    with pytest.raises(RuntimeError, match="threads must be >= 0"):
        cpu_ops.set_num_threads(-1)
    assert cpu_ops.num_threads() == before
