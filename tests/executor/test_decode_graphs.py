"""`--compile on`: the decode forward compiled per batch-size bucket gives eager's tokens, bit for bit.

The padding helpers and the flag's refusals are checked without compiling. The rest runs the
default model's native path (the one `--compile on` serves) compiled at buckets 1, 4 and 16
against an eager runner: alone, padded into a larger bucket, at a full bucket, past the largest
bucket (eager), prefix-shared, sampled under a fixed seed with logprobs, and verifying `ngram`
drafts (the same graphs, no recompile). Of two fresh processes on one compile cache, the first
must report inductor cache misses and the second only hits.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.executor.attention.base import AttentionMetadata
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.model.decode_graphs import (
    PAD_SLOT,
    bucket_for,
    buckets_up_to,
    every_row_samples,
    pad_decode_batch,
)
from kvserve.executor.model.input_batch import InputBatch
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig, compile_buckets, resolve_compile
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.in_process_serving import serve_in_process
from kvserve.testing.plan_driver import PlanDriver

BUCKETS = "1,4,16"
NEW_TOKENS = 8


def decode_batch(rows: int, width: int) -> InputBatch:
    """A decode step of `rows` sequences with contexts of 5, 6, ... tokens in blocks 1, 2, ..."""
    tables = torch.arange(1, rows * width + 1, dtype=torch.int32).view(rows, width)
    seq_lens = [5 + i for i in range(rows)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(rows, dtype=torch.long) + 100,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[1] * rows,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        scale=0.125,
        block_size=16,
    )
    return InputBatch(
        input_ids=torch.arange(rows, dtype=torch.long) + 7,
        positions=torch.tensor(seq_lens) - 1,
        attention=meta,
        sample_indices=torch.arange(rows, dtype=torch.long),
        sampling_seqs=[object()] * rows,  # type: ignore[list-item]
    )


def test_a_step_takes_the_smallest_bucket_that_holds_it() -> None:
    buckets = (1, 4, 16)
    assert [bucket_for(n, buckets) for n in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, None]


def test_buckets_past_the_largest_step_are_not_captured() -> None:
    buckets = (1, 2, 4, 8, 16)
    assert buckets_up_to(buckets, 5) == (1, 2, 4, 8)
    assert buckets_up_to(buckets, 4) == (1, 2, 4)
    assert buckets_up_to(buckets, 64) == buckets  # no bucket holds it: all of them, and larger steps run eagerly


def test_padding_rows_write_nowhere_and_read_one_token_of_block_0() -> None:
    batch = decode_batch(3, 2)
    padded = pad_decode_batch(batch, 4, 8)
    meta = padded.attention
    assert padded.input_ids.tolist() == [7, 8, 9, 0] and padded.positions.tolist() == [4, 5, 6, 0]
    assert meta.slot_mapping.tolist() == [100, 101, 102, PAD_SLOT]
    assert meta.seq_lens.tolist() == [5, 6, 7, 1] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_tables.shape == (4, 8)
    assert meta.block_tables[:3, :2].tolist() == batch.attention.block_tables.tolist()
    assert not meta.block_tables[:, 2:].any() and not meta.block_tables[3].any()
    assert padded.sample_indices.tolist() == [0, 1, 2, 3]


def verification_batch() -> InputBatch:
    """Two sequences verifying drafts: 3 rows (2 drafts) with a 10-token context, 2 rows with 6."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([107, 108, 109, 200, 201]),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([10, 6], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        query_lens_cpu=[3, 2],
        seq_lens_cpu=[10, 6],
        max_query_len=3,
        max_seq_len=10,
        scale=0.125,
        block_size=8,
    )
    return InputBatch(
        input_ids=torch.tensor([5, 6, 7, 8, 9]),
        positions=torch.tensor([7, 8, 9, 4, 5]),
        attention=meta,
        sample_indices=torch.arange(5),
        sampling_seqs=[object()] * 2,  # type: ignore[list-item]
        sample_counts=[3, 2],
    )


def test_a_verification_step_pads_to_as_many_sequences_as_rows() -> None:
    """5 rows of 2 sequences into bucket 8: 3 one-token padding sequences, then 3 empty ones, so
    the graph sees 8 sequences whatever the step's mix of decode and drafts."""
    padded = pad_decode_batch(verification_batch(), 8, 4)
    meta = padded.attention
    assert padded.input_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6, 7, 8, 8, 8, 8]
    assert meta.seq_lens.tolist() == [10, 6, 1, 1, 1, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [107, 108, 109, 200, 201, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert meta.block_tables.shape == (8, 4) and meta.block_tables[:2, :2].tolist() == [[1, 2], [3, 0]]
    assert not meta.block_tables[2:].any()
    assert padded.sample_indices.tolist() == list(range(8)) and padded.sample_counts == [3, 2]


def test_steps_where_every_row_samples_are_served_by_a_graph() -> None:
    assert every_row_samples(decode_batch(3, 2)) and every_row_samples(verification_batch())
    prefill = decode_batch(3, 2)
    prefill.sample_indices = prefill.sample_indices[1:]  # a prefill chunk shares the step: its row does not sample
    assert not every_row_samples(prefill)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compile": "sometimes"}, "compile must be auto, on or off, got 'sometimes'"),
        ({"compile": "on", "weights": "dequantized"}, "--compile on needs device cpu, --weights native"),
    ],
)
def test_compile_refusals_name_the_flag(kwargs, message) -> None:
    config = RunnerConfig(**kwargs)
    with pytest.raises(ExecutorConfigError, match=message):
        resolve_compile(config, "cpu", config.weights, "cpu", 1)


def test_auto_does_not_compile() -> None:
    assert resolve_compile(RunnerConfig(weights="native"), "cpu", "native", "cpu", 1) is False


@pytest.mark.parametrize("buckets", ["", "4,1", "1,1,2", "0,2", "one"])
def test_bad_buckets_are_refused(buckets) -> None:
    with pytest.raises(ExecutorConfigError, match="--compile-buckets must be ascending positive batch sizes"):
        compile_buckets(RunnerConfig(compile_buckets=buckets))


# --- the default model, compiled against eager -------------------------------------------


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    compile_cache = tmp_path_factory.mktemp("inductor")
    base = {"weights": "native", "kv_cache_gb": 0.25, "max_model_len": 2048}
    eager = ModelRunner(RunnerConfig(**base))
    compiled = ModelRunner(
        RunnerConfig(**base, compile="on", compile_buckets=BUCKETS, compile_cache_dir=str(compile_cache))
    )
    yield eager, compiled
    compiled.close()
    eager.close()


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(count)
    return [[rng.randrange(1, 49152) for _ in range(9 + 5 * i)] for i in range(count)]


def run(runner: ModelRunner, count: int, sampling: SamplingParams | None = None, **add) -> dict[int, list]:
    """Tokens (and logprobs, when sampled) of `count` sequences decoding side by side."""
    driver = PlanDriver(runner)
    for i, ids in enumerate(prompts(count)):
        driver.add(i, ids, NEW_TOKENS, sampling=sampling, seed=1000 + i, **add)
    tokens = driver.run()
    if sampling is None:
        return tokens
    logprobs: dict[int, list[float | None]] = {}
    for result in driver.last_results:
        for out in result.outputs:
            logprobs.setdefault(out.seq_id, []).append(out.logprob)
    return {i: list(zip(tokens[i], logprobs[i])) for i in tokens}


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 3, 4, 16, 17], ids=["alone", "padded-3-into-4", "4", "16", "past-the-last-17"])
def test_compiled_decode_gives_the_eager_tokens(runners, count) -> None:
    eager, compiled = runners
    assert compiled.graphs is not None
    assert run(compiled, count) == run(eager, count)


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens_on_a_shared_prefix(runners) -> None:
    eager, compiled = runners
    outputs = []
    for runner in (eager, compiled):
        driver = PlanDriver(runner)
        prompt = prompts(1)[0] * 4  # 36 tokens: two full blocks to share
        driver.add(100, prompt, max_new_tokens=1, retain=True)
        driver.run()
        shared = driver.retained[100][:2]
        for i in range(3):
            driver.add(i, prompt[:32] + [11 + i, 12, 13], NEW_TOKENS, prefix_blocks=shared)
        outputs.append(driver.run())
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_sampled_tokens_and_logprobs_under_a_seed_match_eager_exactly(runners) -> None:
    """Tolerance zero: the compiled logits are eager's, bit for bit, so the logprobs are too."""
    eager, compiled = runners
    sampling = SamplingParams(temperature=0.9, top_p=0.95, logprobs=0)
    assert run(compiled, 3, sampling) == run(eager, 3, sampling)


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2], ids=["alone", "two-verifying"])
def test_verification_steps_run_in_the_graphs_with_the_tokens_of_eager_without_drafts(
    runners, count, monkeypatch
) -> None:
    """`ngram` speculation on the compiled runner: its verification steps (up to 6 rows a
    sequence, 12 for two, padded into bucket 16) go through a graph, and the greedy tokens are
    those of the eager runner with speculation off. The prompts repeat a random phrase, which
    the model goes on repeating, so drafts are accepted."""
    eager, compiled = runners
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    requests = {f"r{i}": (ids[:8] * 4, greedy) for i, ids in enumerate(prompts(count))}
    reference = serve_in_process(eager, requests)
    graphs = compiled.graphs
    assert graphs is not None
    verified_in_a_graph: list[int] = []
    forward = graphs.forward

    def spy(batch):
        logits = forward(batch)
        if logits is not None and batch.attention.max_query_len > 1:
            verified_in_a_graph.append(batch.num_tokens)
        return logits

    monkeypatch.setattr(graphs, "forward", spy)
    compiles = inductor_compiles()
    served = serve_in_process(compiled, requests, speculative="ngram")
    assert served.tokens == reference.tokens
    assert served.scheduler is not None and served.scheduler.stats().draft_tokens_accepted > 0
    assert verified_in_a_graph, "no verification step ran in a graph"
    assert inductor_compiles() == compiles, "verification steps recompiled instead of reusing the decode graphs"


def inductor_compiles() -> int:
    """Graphs inductor has compiled or loaded from its cache in this process: a recompile adds one."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"]


START = """
import json, sys
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.log_config import configure_logging
configure_logging(level="WARNING")
from torch._dynamo.utils import counters
runner = ModelRunner(RunnerConfig(weights="native", kv_cache_gb=0.25, max_model_len=2048, compile="on",
                                  compile_buckets="1", compile_cache_dir=sys.argv[1]))
print(json.dumps(dict(counters["inductor"])))
"""


def start_compiled(cache: Path) -> dict[str, int]:
    """Inductor's counters after a fresh executor process compiled bucket 1 with `cache`."""
    done = subprocess.run([sys.executable, "-c", START, str(cache)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_only_the_first_start_on_a_machine_pays_the_compile(tmp_path) -> None:
    """Two fresh processes, one cache: the first compiles (misses), the second reuses its code (hits)."""
    first = start_compiled(tmp_path)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0, first
    second = start_compiled(tmp_path)
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0, second
