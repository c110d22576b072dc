"""CUDA graphs of the decode step (`--compile on` on CUDA): used, faster than eager, the same tokens.

The measure stage's runner decodes at each graph batch size twice, eagerly and through captured
buckets, timing the median step (`bench executor`'s loop), and runs the same greedy requests both
ways. At a full bucket a graph runs eager's kernels on eager's shapes, so the tokens must be
identical. The CPU rehearsal runs the same code on a toy runner with the Triton interpreter and no
graph captured (`capture=False`): the plumbing, not a figure.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.kv_sizing import big_runner
from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

NEW_TOKENS = 8
TOKEN_PROMPT_LEN = 64
"""The greedy comparison's prompts: short, so its prefills cost little beside the timed decode."""
REHEARSAL_MAX_MODEL_LEN = 256


def _rehearsal_runner(ctx: StageContext) -> Any:
    """On CPU: the toy model on the Triton backend (interpreted), which is what the graphs run on."""
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig

    config = RunnerConfig(
        model=str(model_dir(ctx.work_dir, ctx.sizes.big_model)),
        device="cpu",
        attention_backend="triton",
        kv_cache_gb=0.02,
        max_model_len=REHEARSAL_MAX_MODEL_LEN,
        max_num_seqs=max(ctx.sizes.graph_batches),
    )
    return ctx.shared("graphs_runner", lambda: ModelRunner(config), close=lambda runner: runner.close())


def _greedy_tokens(runner: Any, batch: int, prompt_len: int, seq_base: int) -> dict[int, list[int]]:
    from kvserve.protos.sampling import SamplingParams
    from kvserve.testing.plan_driver import PlanDriver

    rng, vocab = random.Random(batch), runner.model_config.vocab_size
    driver = PlanDriver(runner)
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        driver.add(seq_base + i, prompt, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0))
    return {seq - seq_base: tokens for seq, tokens in driver.run().items()}


def measure(ctx: StageContext) -> Outcome:
    import torch

    from kvserve.bench.executor import time_decode
    from kvserve.executor.model.cuda_graphs import CudaDecodeGraphs
    from kvserve.protos.sampling import SamplingParams

    sizes, on_gpu = ctx.sizes, ctx.sizes.device == "cuda"
    runner = big_runner(ctx) if on_gpu else _rehearsal_runner(ctx)
    buckets = sizes.graph_batches
    width = -(-runner.max_model_len // runner.config.block_size)
    started = time.perf_counter()
    graphs = CudaDecodeGraphs(runner.model, runner.cache, runner.backend, buckets, width, capture=on_gpu)
    graphs.capture_all()
    capture_s = time.perf_counter() - started
    greedy, prompt_len = SamplingParams(temperature=0.0), sizes.decode_prompt_len
    points: list[dict[str, Any]] = []
    rows = []
    try:
        for i, batch in enumerate(buckets):
            seq_base = (80 + i) * 100_000
            runner.graphs = None
            eager_s = time_decode(runner, batch, prompt_len, sizes.decode_steps, greedy, seq_base)[0]
            eager_tokens = _greedy_tokens(runner, batch, TOKEN_PROMPT_LEN, seq_base + 10_000)
            runner.graphs, before = graphs, graphs.replays
            graph_s = time_decode(runner, batch, prompt_len, sizes.decode_steps, greedy, seq_base + 20_000)[0]
            graph_tokens = _greedy_tokens(runner, batch, TOKEN_PROMPT_LEN, seq_base + 30_000)
            used = graphs.replays > before
            identical = sum(graph_tokens[s] == eager_tokens[s] for s in eager_tokens)
            points.append(dict(batch=batch, eager_step_s=eager_s, graph_step_s=graph_s, used=used, identical=identical))
            speed = f"{eager_s * 1e3:.2f} -> {graph_s * 1e3:.2f} ms/step ({eager_s / graph_s:.2f}x)"
            tokens = f"{identical}/{batch} identical greedy sequences"
            rows.append(("decode step, CUDA graphs vs eager", f"batch {batch}", speed, "-", tokens))
    finally:
        runner.graphs = None
        del graphs
        if on_gpu:
            torch.cuda.empty_cache()
    passed = all(p["used"] and p["identical"] == p["batch"] for p in points)
    how = "captured" if on_gpu else "rehearsed without capture"
    summary = f"{how}, {len(buckets)} buckets in {capture_s:.1f} s; " + "; ".join(
        f"B={p['batch']}: {p['eager_step_s'] / p['graph_step_s']:.2f}x eager's speed, "
        f"{p['identical']}/{p['batch']} identical" + ("" if p["used"] else ", NOT USED")
        for p in points
    )
    error = None if passed else "a bucket was not used, or its greedy tokens differ from eager's"
    return Outcome(passed, summary, dict(capture_s=capture_s, points=points), rows, error)
