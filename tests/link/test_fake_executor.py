"""The fake executor: deterministic whatever the batch, and strict about plans."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvserve.executor.fake.executor import FakeExecutor, FakeExecutorConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import KnownSequence, NewSequence, PlanError, StepPlan
from kvserve.testing.plan_driver import PlanDriver

BS = 4
PROMPT_A = list(range(100, 111))  # 11 tokens: 2 full blocks + a partial one
PROMPT_B = list(range(500, 507))
PROMPT_C = list(range(900, 930))
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_dir) -> str:
    return str(default_model_dir)


def make_fake(tokenizer_dir: str, **overrides) -> FakeExecutor:
    config = FakeExecutorConfig(num_blocks=64, block_size=BS, num_cpu_blocks=16, tokenizer_path=tokenizer_dir)
    for key, value in overrides.items():
        setattr(config, key, value)
    return FakeExecutor(config)


def generate_alone(tokenizer_dir: str, prompt: list[int], n: int, sampling=GREEDY, seed: int = 0) -> list[int]:
    driver = PlanDriver(make_fake(tokenizer_dir), 64)
    seq = driver.add(1, prompt, sampling=sampling, seed=seed)
    while len(seq.outputs) < n:
        driver.step()
    return seq.outputs


def test_tokens_do_not_depend_on_the_batch(tokenizer_dir: str) -> None:
    alone = generate_alone(tokenizer_dir, PROMPT_A, 12)
    # Same prompt inside a batch, prefilled in chunks of 3, on other physical blocks.
    driver = PlanDriver(make_fake(tokenizer_dir), 64, first_block=7)
    driver.add(5, PROMPT_C)
    a = driver.add(1, PROMPT_A)
    driver.add(9, PROMPT_B, sampling=SamplingParams(temperature=0.8), seed=3)
    while len(a.outputs) < 12:
        driver.step(chunk=3)
    assert a.outputs[:12] == alone
    assert len(set(alone)) > 6, "tokens should look varied, not constant"


def test_a_new_executor_instance_gives_the_same_tokens(tokenizer_dir: str) -> None:
    assert generate_alone(tokenizer_dir, PROMPT_B, 8) == generate_alone(tokenizer_dir, PROMPT_B, 8)


def test_recompute_after_preemption_reproduces_outputs(tokenizer_dir: str) -> None:
    undisturbed = generate_alone(tokenizer_dir, PROMPT_A, 10)
    driver = PlanDriver(make_fake(tokenizer_dir), 64)
    seq = driver.add(1, PROMPT_A)
    driver.add(2, PROMPT_B)
    for _ in range(4):
        driver.step()
    driver.preempt(1)
    driver.step(only=[2])  # seq 1 waits one step, its blocks go to others
    while len(seq.outputs) < 10:
        driver.step()
    assert seq.outputs[:10] == undisturbed


def test_swap_out_and_in_moves_the_kv(tokenizer_dir: str) -> None:
    undisturbed = generate_alone(tokenizer_dir, PROMPT_A, 9)
    fake = make_fake(tokenizer_dir)
    driver = PlanDriver(fake, 64)
    seq = driver.add(1, PROMPT_A)
    for _ in range(4):
        driver.step()
    cpu_blocks = list(range(len(seq.block_table)))
    driver.swap_out(1, cpu_blocks)
    driver.add(2, PROMPT_C)  # overwrites the freed device blocks
    driver.step(only=[2])
    driver.swap_in(1, cpu_blocks)
    assert 0 < seq.num_computed < len(seq.token_ids)  # resumes from the swapped KV, no recompute
    while len(seq.outputs) < 9:
        driver.step()
    assert seq.outputs[:9] == undisturbed


def test_prefix_sharing_and_partial_block_copy(tokenizer_dir: str) -> None:
    fake = make_fake(tokenizer_dir)
    first = fake.execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT_A, 11, 0, 11, [0, 1, 2], GREEDY, 0)]))
    # Seq 2 has the same 11-token prompt: shares full blocks 0 and 1, copies partial block 2 into 3.
    second = fake.execute(
        StepPlan(2, copies=[(2, 3)], new_seqs=[NewSequence(2, PROMPT_A, 11, 10, 1, [0, 1, 3], GREEDY, 0)])
    )
    assert second.outputs[0].token_id == first.outputs[0].token_id
    assert fake.shadow_tokens(2) == PROMPT_A


def test_logprobs_are_deterministic_and_shaped(tokenizer_dir: str) -> None:
    params = SamplingParams(temperature=0.0, logprobs=3)
    plan = StepPlan(1, new_seqs=[NewSequence(1, PROMPT_A, 11, 0, 11, [0, 1, 2], params, 0)])
    out1 = make_fake(tokenizer_dir).execute(plan).outputs[0]
    out2 = make_fake(tokenizer_dir).execute(plan).outputs[0]
    assert out1 == out2
    assert out1.logprob is not None and out1.logprob < 0
    assert len(out1.top_logprobs) == 3 and out1.top_logprobs[0].token_id == out1.token_id
    no_lp = (
        make_fake(tokenizer_dir)
        .execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT_A, 11, 0, 11, [0, 1, 2], GREEDY, 0)]))
        .outputs[0]
    )
    assert no_lp.logprob is None and no_lp.top_logprobs == []


def test_seeds_matter_only_when_sampling(tokenizer_dir: str) -> None:
    hot = SamplingParams(temperature=1.0)
    by_seed = [tuple(generate_alone(tokenizer_dir, PROMPT_A, 6, hot, seed)) for seed in (1, 1, 2)]
    assert by_seed[0] == by_seed[1] != by_seed[2]
    assert generate_alone(tokenizer_dir, PROMPT_A, 6, GREEDY, 1) == generate_alone(
        tokenizer_dir, PROMPT_A, 6, GREEDY, 2
    )


def test_eos_only_when_asked(tokenizer_dir: str) -> None:
    fake = make_fake(tokenizer_dir)
    eos = fake.info().eos_token_ids
    special = set(range(17))  # SmolLM2's special tokens
    tokens = generate_alone(tokenizer_dir, PROMPT_A, 60)
    assert not set(tokens) & (special | set(eos))
    driver = PlanDriver(make_fake(tokenizer_dir, eos_probability=1.0), 64)
    ends = driver.add(1, PROMPT_A, sampling=SamplingParams(temperature=0.0, min_tokens=2))
    ignores = driver.add(2, PROMPT_B, sampling=SamplingParams(temperature=0.0, ignore_eos=True))
    for _ in range(3):
        driver.step()
    assert ends.outputs[2] == eos[0] and eos[0] not in ends.outputs[:2]
    assert eos[0] not in ignores.outputs


def test_step_latency(tokenizer_dir: str) -> None:
    fake = make_fake(tokenizer_dir, step_latency_ms=60.0)
    started = time.perf_counter()
    result = fake.execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT_B, 7, 0, 7, [0, 1], GREEDY, 0)]))
    assert time.perf_counter() - started >= 0.06 and result.execute_time_s >= 0.06


def _prefilled(tokenizer_dir: str) -> FakeExecutor:
    """Seq 1 = PROMPT_A in blocks 0,1,2 and seq 2 = PROMPT_B in blocks 4,5, both sampled once."""
    fake = make_fake(tokenizer_dir)
    fake.execute(
        StepPlan(
            1,
            new_seqs=[
                NewSequence(1, PROMPT_A, 11, 0, 11, [0, 1, 2], GREEDY, 0),
                NewSequence(2, PROMPT_B, 7, 0, 7, [4, 5], GREEDY, 0),
            ],
        )
    )
    return fake


def _next_token(fake: FakeExecutor, seq_id: int) -> int:
    return fake.seqs[seq_id].last_sampled


@pytest.mark.parametrize(
    "case, match",
    [
        ("stale_prefix_hit", "holds token"),
        ("prefix_after_reset", "holds nothing"),
        ("wrong_block_table", "holds"),
        ("write_into_shared_block", "share"),
        ("copy_into_live_block", "overwritten"),
        ("computed_count_off", "num_computed_tokens"),
        ("wrong_sampled_token", "sampled"),
        ("unknown_sequence", "unknown"),
        ("beyond_block_table", "beyond its block table"),
        ("block_out_of_range", "outside"),
        ("known_sent_as_new", "already known"),
    ],
)
def test_scheduler_bugs_are_caught(tokenizer_dir: str, case: str, match: str) -> None:
    fake = _prefilled(tokenizer_dir)
    t1 = _next_token(fake, 1)
    bad = {
        # Seq 3 claims PROMPT_B's prefix is in seq 1's blocks: a wrong prefix-tree match.
        "stale_prefix_hit": StepPlan(9, new_seqs=[NewSequence(3, PROMPT_B + [1], 8, 4, 4, [0, 6], GREEDY, 0)]),
        # A KV hit after the executor lost its cache.
        "prefix_after_reset": None,
        # Seq 1's next token goes to block 3, but its table says its third block is seq 2's block 5.
        "wrong_block_table": StepPlan(9, new_seqs=[NewSequence(7, PROMPT_A + [t1], 11, 11, 1, [0, 1, 5], GREEDY, 0)]),
        # Seq 3 shares seq 1's partial block 2 and writes into it without copy-on-write.
        "write_into_shared_block": StepPlan(
            9, new_seqs=[NewSequence(3, PROMPT_A + [42], 12, 11, 1, [0, 1, 2], GREEDY, 0)]
        ),
        "copy_into_live_block": StepPlan(9, copies=[(0, 4)]),
        "computed_count_off": StepPlan(9, known_seqs=[KnownSequence(1, [t1], 10, 1)]),
        "wrong_sampled_token": StepPlan(9, known_seqs=[KnownSequence(1, [t1 + 1], 11, 1)]),
        "unknown_sequence": StepPlan(9, known_seqs=[KnownSequence(77, [5], 0, 1)]),
        # Position 12 (the 13th token) needs a 4th block that was never sent.
        "beyond_block_table": StepPlan(9, known_seqs=[KnownSequence(1, [t1, 7], 11, 2)]),
        "block_out_of_range": StepPlan(9, known_seqs=[KnownSequence(1, [t1], 11, 1, [64])]),
        "known_sent_as_new": StepPlan(9, new_seqs=[NewSequence(1, PROMPT_A, 11, 0, 11, [8, 9, 10], GREEDY, 0)]),
    }[case]
    if case == "prefix_after_reset":
        fake.reset()
        bad = StepPlan(9, new_seqs=[NewSequence(1, PROMPT_A, 11, 8, 3, [0, 1, 2], GREEDY, 0)])
    with pytest.raises(PlanError, match=match):
        fake.execute(bad)


def test_a_correct_plan_after_the_same_setup_passes(tokenizer_dir: str) -> None:
    """The negative cases above fail for their bug, not because the setup is broken."""
    fake = _prefilled(tokenizer_dir)
    t1, t2 = _next_token(fake, 1), _next_token(fake, 2)
    result = fake.execute(
        StepPlan(
            9,
            copies=[(2, 3)],
            known_seqs=[KnownSequence(1, [t1], 11, 1, [8]), KnownSequence(2, [t2], 7, 1)],
            new_seqs=[NewSequence(3, PROMPT_A + [42], 12, 11, 1, [0, 1, 3], GREEDY, 0)],
        )
    )
    assert {o.seq_id for o in result.outputs} == {1, 2, 3}


def test_fake_executor_process_never_imports_torch() -> None:
    code = (
        "import sys, kvserve.cli, kvserve.executor.fake.executor, kvserve.executor.link_worker; "
        "import kvserve.executor.process; "
        "kvserve.cli.build_parser().parse_args(['executor', '--executor', 'fake']); "
        "kvserve.executor.fake.executor.FakeExecutor(); "
        "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
