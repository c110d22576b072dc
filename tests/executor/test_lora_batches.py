"""LoRA adapters in the executor on a tiny random Llama: a row's logits do not depend on its step.

Four adapters of other ranks and targets and the base model share steps: every row must get the
logits it gets alone, bit for bit (batch invariance), the base rows those of an executor without
adapters, and the adapters must change what they touch. With fewer slots than adapters
(`--max-loras`), swapping them in and out, or running one past the slots from a step's own copy,
gives the same bits. The delta itself is checked row by row at the default model's shapes, on the
C++ kernel's path and on the torch path, and from the slots' stacks against a step's own copy. The
default model's native path and PEFT's own outputs: test_lora_native.py, test_lora_vs_peft.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.lora.adapter import LoraAdapter, LoraMatrix
from kvserve.executor.lora.adapter_spec import parse_adapter_specs
from kvserve.executor.lora.peft_weights import load_peft_adapter
from kvserve.executor.lora.slots import AdapterSlots, SlottedAdapter
from kvserve.executor.lora.step_deltas import KernelLoraStep, lora_step, rows_by_adapter
from kvserve.executor.model_config import load_model_config
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.kernels import cpu_ops
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import NewSequence, PlanError, StepPlan
from kvserve.testing.lora_adapters import write_lora_adapter
from kvserve.testing.plan_driver import PlanDriver
from kvserve.testing.tiny_checkpoints import PROMPTS, TINY, write_tiny_checkpoint
from tests.executor.lora_logits import LogitLog, run_alone, run_mixed

NEW_TOKENS = 6
B_STD = 0.05
"""lora_B's spread: deltas of about the tiny model's own outputs (its weights are drawn with std 0.02)."""
ADAPTERS = {
    # name: (rank, targets, rslora); not in alphabetical order: lora_names keeps the order given
    "sql": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "chat": (16, ("q_proj", "v_proj"), False),
    "code": (4, ("gate_proj", "up_proj", "down_proj"), True),
    "math": (8, ("k_proj", "o_proj", "up_proj"), False),
}
JOBS = [
    (0, PROMPTS[0], ""),
    (1, PROMPTS[1], "sql"),
    (2, PROMPTS[2], "chat"),
    (3, PROMPTS[3], "code"),
    (4, PROMPTS[1], "math"),
    (5, PROMPTS[1], "sql"),
    (6, PROMPTS[1], ""),
    (7, PROMPTS[2], "chat"),
]
"""(sequence id, prompt, adapter): the base model twice, each adapter at least once, two adapters twice."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[str, ...]]:
    """The tiny model's directory and the `--lora` entries of its four adapters."""
    root = tmp_path_factory.mktemp("lora")
    model_dir = write_tiny_checkpoint(root / "model", "llama", **TINY)
    config = load_model_config(model_dir)
    entries = []
    for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        settings = {"use_rslora": rslora}
        path = write_lora_adapter(
            root / name, config, rank=rank, targets=targets, seed=seed, b_std=B_STD, config=settings
        )
        entries.append(f"{name}={path}")
    return model_dir, tuple(entries)


def _runner(model_dir: Path, lora: tuple[str, ...], **config: object) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=str(model_dir), dtype="float32", kv_cache_gb=0.002, lora=lora, **config))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runner(tiny) -> Iterator[ModelRunner]:
    runner = _runner(*tiny)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def alone(runner) -> dict[tuple[int, int], torch.Tensor]:
    """Every job run by itself: its logits per (sequence, tokens known)."""
    return run_alone(runner, JOBS, NEW_TOKENS)


def test_info_names_the_adapters_in_the_order_given(runner) -> None:
    assert runner.info().lora_names == ["sql", "chat", "code", "math"]


def test_adapters_change_the_logits_of_their_rows_only(tiny, alone) -> None:
    without = _runner(tiny[0], ())
    base = run_alone(without, [job for job in JOBS if not job[2]], NEW_TOKENS)
    without.close()
    for key, logits in base.items():
        assert torch.equal(alone[key], logits), f"base row {key} changed by an executor holding adapters"
    first_step = {seq_id: alone[(seq_id, len(prompt))] for seq_id, prompt, _ in JOBS}
    # The same prompt under the base model and three adapters: four different distributions.
    same_prompt = [first_step[i] for i in (6, 1, 4)]
    for i, a in enumerate(same_prompt):
        for b in same_prompt[i + 1 :]:
            assert (a - b).abs().max() > 1e-3
    assert torch.equal(first_step[1], first_step[5])  # one adapter, one prompt: the same bits


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompts", "chunks-of-7"])
def test_a_mixed_step_gives_every_row_its_logits_alone(runner, alone, chunk) -> None:
    log = run_mixed(runner, JOBS, NEW_TOKENS, chunk)
    assert log.mixed_steps >= NEW_TOKENS - 1  # steps holding the base model and several adapters
    assert log.rows.keys() == alone.keys()
    for key, logits in log.rows.items():
        assert torch.equal(logits, alone[key]), f"row {key} differs batched"


def test_two_slots_for_three_adapters_swap_and_give_the_same_bits(tiny, alone) -> None:
    model_dir, entries = tiny
    runner = _runner(model_dir, entries[:3], max_loras=2)
    log = LogitLog(runner)
    driver = PlanDriver(runner)
    jobs = [job for job in JOBS if job[2] in ("sql", "chat", "code")]
    by_adapter = {adapter: [j[0] for j in jobs if j[2] == adapter] for adapter in ("sql", "chat", "code")}
    for seq_id, prompt, adapter in jobs:
        driver.add(seq_id, prompt, NEW_TOKENS, lora_name=adapter)
    pairs = [("sql", "chat"), ("code", "sql"), ("chat", "code")]  # each step evicts the adapter it lacks
    for step in range(4):
        first, second = pairs[step % 3]
        driver.step(only=[*by_adapter[first], *by_adapter[second]])
    assert runner.loras.slots.loads == 5  # two, then one swapped in at each step
    assert runner.loras.slots.overflows == 0
    driver.run()  # the rest: all three adapters in one step, one of them past the two slots
    assert runner.loras.slots.overflows >= 1
    log.detach()
    runner.close()
    assert log.rows.keys() == {key for key in alone if key[0] in {j[0] for j in jobs}}
    for key, logits in log.rows.items():
        assert torch.equal(logits, alone[key]), f"row {key} differs after swapping"


def test_a_plan_naming_an_unknown_adapter_is_refused_before_it_changes_anything(runner) -> None:
    greedy = SamplingParams(temperature=0.0)
    driver = PlanDriver(runner)
    driver.add(40, PROMPTS[0], lora_name="chat")
    driver.step()
    plan = StepPlan(
        99,
        new_seqs=[NewSequence(41, PROMPTS[1], len(PROMPTS[1]), 0, 4, [60], greedy, 0, lora_name="sqll")],
        drop_seq_ids=[40],
    )
    loaded = r"sequence 41: LoRA adapter 'sqll' is not loaded in this executor; loaded: 'sql', 'chat', 'code', 'math'"
    with pytest.raises(PlanError, match=loaded):
        runner.execute(plan)
    assert 40 in runner.seqs and 41 not in runner.seqs
    driver.finish(40)
    driver.run()


def test_an_executor_without_adapters_refuses_a_named_one(tiny) -> None:
    runner = _runner(tiny[0], ())
    assert runner.info().lora_names == []
    greedy = SamplingParams(temperature=0.0)
    plan = StepPlan(1, new_seqs=[NewSequence(1, [1, 2], 2, 0, 2, [0], greedy, 0, lora_name="sql")])
    with pytest.raises(PlanError, match=r"'sql' is not loaded in this executor; loaded: none$"):
        runner.execute(plan)
    runner.close()


# The default model's fused matrices (in, out) and their LoRA widths (in ranks) at ranks 8 and 16.
SHAPES = [(576, 960, 3), (576, 576, 1), (576, 3072, 2), (1536, 576, 1)]


def _deltas(x: torch.Tensor, adapter_of_row: list[int], adapters: list[LoraAdapter], kernel: bool) -> torch.Tensor:
    """What `LoraStep.add` adds to a zero product for rows `x` under `adapter_of_row`."""
    step = lora_step(rows_by_adapter(adapter_of_row), dict(enumerate(adapters)), "cpu", kernel=kernel)
    out = torch.zeros(x.shape[0], adapters[0].layers[0]["qkv"].b_t.shape[1])
    step.add(0, "qkv", x, out)
    return out


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Sets torch's thread count, which the kernels' loops follow, for one test, and puts both back after."""
    torch_threads, kernel_threads = torch.get_num_threads(), cpu_ops.set_num_threads(0)
    yield torch.set_num_threads
    torch.set_num_threads(torch_threads)
    cpu_ops.set_num_threads(kernel_threads)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "bmm"])
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("rank", [8, 16])
def test_a_rows_delta_has_the_same_bits_alone_and_in_any_batch(threads, count: int, rank: int, kernel: bool) -> None:
    """Each row alone against steps of 2 to 256 rows from several offsets, under one adapter or two
    interleaved, the weights in a slot's view or in tensors of their own; the C++ kernel's path and
    the torch path, at one thread and at two."""
    ensure_kernels()
    threads(count)
    gen = torch.Generator().manual_seed(rank)
    for n_in, n_out, parts in SHAPES:
        width = rank * parts
        slots_a = torch.randn(3, 48, n_in, generator=gen)
        slots_b = torch.randn(3, 48, n_out, generator=gen) * 0.1
        in_slot = LoraMatrix(slots_a[1, :width], slots_b[1, :width])
        own = LoraMatrix(in_slot.a.clone(), in_slot.b_t.clone())
        other = LoraMatrix(slots_a[2, :width], slots_b[2, :width])
        adapters = [LoraAdapter(n, rank, s, [{"qkv": m}]) for n, s, m in (("a", 2.0, own), ("b", 0.5, other))]
        x = torch.randn(300, n_in, generator=gen)
        single = torch.cat([_deltas(x[i : i + 1], [0], adapters, kernel) for i in range(300)])
        slotted = [LoraAdapter("a", rank, 2.0, [{"qkv": in_slot}]), adapters[1]]
        assert torch.equal(_deltas(x, [0] * 300, slotted, kernel), single)
        for rows in (*range(2, 34), 64, 65, 128, 256):
            for start in (0, 5, 300 - rows):
                got = _deltas(x[start : start + rows], [0] * rows, adapters, kernel)
                assert torch.equal(got, single[start : start + rows]), (n_in, n_out, width, rows, start)
                mixed = _deltas(x[start : start + rows], [i % 2 for i in range(rows)], adapters, kernel)
                assert torch.equal(mixed[::2], single[start : start + rows : 2]), (n_in, n_out, width, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_stacks_and_a_steps_own_copy_give_every_row_its_bits_alone(tiny, threads, dtype) -> None:
    """Three adapters in two slots: a step runs two from the slots' stacks (one kernel call for both)
    and the third from a copy of its own, at every fused matrix of every layer, at two threads. Each
    row gets the bits it gets alone from its adapter's host tensors, base rows keep theirs, and the
    torch path (two roundings of float32 sums apart) agrees within float32's precision."""
    ensure_kernels()
    threads(2)
    model_dir, entries = tiny
    config = load_model_config(model_dir)
    adapters = [load_peft_adapter(spec, config, 16) for spec in parse_adapter_specs(entries[:3])]
    found = AdapterSlots(adapters, 2, "cpu").acquire([0, 1, 2])
    assert [isinstance(found[i], SlottedAdapter) for i in range(3)] == [True, True, False]
    adapter_of_row = [i % 4 - 1 for i in range(23)]  # the base model and each adapter, interleaved
    gen = torch.Generator().manual_seed(9)
    step = lora_step(rows_by_adapter(adapter_of_row), found, "cpu")
    assert isinstance(step, KernelLoraStep)
    torch_step = lora_step(rows_by_adapter(adapter_of_row), found, "cpu", kernel=False)
    for layer in range(config.num_layers):
        for fused, (n_in, n_out) in _fused_shapes(adapters, layer).items():
            x = torch.randn(23, n_in, generator=gen).to(dtype)
            out = torch.randn(23, n_out, generator=gen).to(dtype)
            got, by_torch = out.clone(), out.clone()
            step.add(layer, fused, x, got)
            torch_step.add(layer, fused, x, by_torch)
            for row, index in enumerate(adapter_of_row):
                alone = out[row : row + 1].clone()
                if index >= 0:
                    own = {index: adapters[index].to("cpu")}
                    lora_step({index: [0]}, own, "cpu").add(layer, fused, x[row : row + 1], alone)
                assert torch.equal(got[row : row + 1], alone), (layer, fused, row)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got, by_torch, rtol=tolerance, atol=tolerance)


def _fused_shapes(adapters: list[LoraAdapter], layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each fused matrix of `layer` that one of `adapters` targets."""
    return {
        fused: (matrix.a.shape[1], matrix.b_t.shape[1])
        for adapter in adapters
        for fused, matrix in adapter.layers[layer].items()
    }
