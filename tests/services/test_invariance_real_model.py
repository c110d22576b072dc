"""The same request gives the same tokens however it is served: the invariance matrix, on the real model.

For what `--dtype auto --weights auto` picks (native Q4_1 weights on every CPU), the dequantized
weights (bfloat16 where the CPU has it) and, on a CPU without native bfloat16, a forced bfloat16:
16 requests (8 chat prompts, each greedy and seeded-sampled) go through real `kvserve serve`
processes, and every way of serving them must give the tokens of the first:

- alone, one after another (greedy prompts cold; each seeded twin finds its prompt cached);
- alone again, every prompt now fully cached;
- all 16 at once (batched with each other, cached);
- all 16 at once with the executor killed (-9) once every stream is under way: recomputed
  on a new executor;
- all 16 at once on a server with a 24-token step budget (every prompt chunked, cold);
- all 16 at once in a KV pool too small for them, preempted by recompute, and by swap to CPU
  (the swap counter tells the two apart);
- one at a time in that small pool, which evicts earlier prompts from the prefix cache.

And JSON-schema requests swapped to CPU and back give the tokens they give alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import pytest

from kvserve.executor.cpu_features import has_native_bf16
from kvserve.executor.runner_config import NATIVE_WHY
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess, serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Translate 'hello' to Spanish.",
    "Explain in two sentences why the sky is blue, as if to a child who keeps asking why.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show your working step by step before giving the answer.",
    "Name a famous painter and one of their paintings.",
    "Describe a quiet morning in a small fishing village at the edge of the northern sea.",
]
MAX_TOKENS = 24
SEED = 1234
BASE = ["--executor", "torch", "--kv-cache-gb", "0.25"]
TINY_POOL = ["--executor", "torch", "--kv-cache-gb", "0.012"]
"""17 blocks of fp32 KV (34 of bfloat16) for 16 requests of ~5 blocks each: preemption throughout."""

CONFIGS = {"auto": [], "dequantized": ["--weights", "dequantized"]}
"""auto serves the default model (a Q4_1 GGUF) natively on every CPU; the dequantized weights run as well."""
if not has_native_bf16():
    CONFIGS["forced-bfloat16"] = ["--dtype", "bfloat16"]


def _requests() -> list[api_pb2.GenerateRequest]:
    requests = []
    for i, prompt in enumerate(PROMPTS):
        chat = api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content=prompt)])
        greedy = api_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        seeded = api_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=SEED + i, max_tokens=MAX_TOKENS)
        requests += [
            api_pb2.GenerateRequest(chat=chat, sampling=greedy),
            api_pb2.GenerateRequest(chat=chat, sampling=seeded),
        ]
    return requests


REQUESTS = _requests()


async def _tokens(
    stub: api_pb2_grpc.KVServeStub, request: api_pb2.GenerateRequest, started: asyncio.Event
) -> list[int]:
    ids: list[int] = []
    async for chunk in stub.Generate(request, timeout=900):
        ids.extend(chunk.token_ids)
        if ids:
            started.set()
    return ids


def _alone(server: ServeProcess, requests: list[api_pb2.GenerateRequest] = REQUESTS) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            return [await _tokens(stub, r, asyncio.Event()) for r in requests]

    return asyncio.run(run())


def _together(
    server: ServeProcess, kill_executor: bool = False, requests: list[api_pb2.GenerateRequest] = REQUESTS
) -> list[list[int]]:
    """All requests at once; `kill_executor`: kill -9 the executor once every stream has a token."""

    async def run() -> list[list[int]]:
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            started = [asyncio.Event() for _ in requests]
            tasks = [asyncio.create_task(_tokens(stub, r, e)) for r, e in zip(requests, started, strict=True)]
            if kill_executor:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=600)
                os.kill(server.executor_pids()[-1], signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


def _chosen(server: ServeProcess) -> dict:
    (line,) = server.log_events("model runner ready")
    return line


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def config(request) -> Iterator[tuple[str, list[str], list[list[int]]]]:
    """(name, serve args, the reference tokens: every request alone on a fresh server)."""
    name, extra = request.param, CONFIGS[request.param]
    with serving(BASE + extra, name=f"reference-{name}") as server:
        ready = _chosen(server)
        if name == "auto":
            (chose,) = server.log_events("chose dtype and weights")
            assert (ready["weights"], ready["dtype"], chose["why"]) == ("native", "float32", NATIVE_WHY), chose
        if name == "dequantized":
            # On a CPU with native bf16, auto's dtype is bf16 where its GEMMs probe batch-invariant at an
            # affordable padding, and it says why it fell back to fp32 where not (AMX's bf16 kernels).
            (chose,) = server.log_events("chose dtype and weights")
            if not has_native_bf16():
                assert ready["dtype"] == "float32", chose
            elif ready["dtype"] == "float32":
                assert "batch-invariant on this CPU only from" in chose["why"], chose
            else:
                assert ready["dtype"] == "bfloat16" and "batch-invariant from" in chose["why"], chose
        assert ready["attention"] == "cpu", ready
        # the native path stores K/V in bfloat16 (runner_config.resolve_kv_cache_dtype), the others in --dtype
        assert ready["kv_cache_dtype"] == ("bfloat16" if ready["weights"] == "native" else ready["dtype"]), ready
        if name == "dequantized":
            assert ready["weights"] == "dequantized", ready
        reference = _alone(server)
        assert all(len(ids) > 0 for ids in reference)
        assert reference[0::2] != reference[1::2], "seeded sampling gave the greedy tokens: it was not exercised"
        assert _alone(server) == reference, "fully cached prompts gave other tokens than cold ones"
        assert _together(server) == reference, "batched requests gave other tokens than alone"
        assert _together(server, kill_executor=True) == reference, "tokens changed across a kill -9 of the executor"
        stats = server.wait_idle(timeout_s=120)
        assert stats.executor_restarts == 1 and stats.prefix_hit_tokens > 0, stats
        yield name, extra, reference


def test_prompts_chunked_by_a_small_step_budget_give_the_same_tokens(config) -> None:
    name, extra, reference = config
    with serving(BASE + extra + ["--max-num-batched-tokens", "24"], name=f"chunked-{name}") as server:
        assert _together(server) == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_give_the_same_tokens(config, mode) -> None:
    name, extra, reference = config
    args = TINY_POOL + ["--preemption-mode", mode] + extra
    if mode == "swap":  # ample CPU space: every preemption is a swap, none falls back to recompute
        args += ["--swap-space-gb", "1"]
    with serving(args, name=f"preempt-{mode}-{name}") as server:
        assert _together(server) == reference
        stats = server.wait_idle(timeout_s=120)
        assert stats.num_preemptions > 0, "the pool never ran short: nothing was preempted"
        # Swap and recompute are told apart by the swap counter: every swap preemption really swapped.
        assert stats.num_swap_outs == (stats.num_preemptions if mode == "swap" else 0), stats
        assert stats.blocks_referenced == 0


def test_prompts_evicted_from_the_prefix_cache_give_the_same_tokens(config) -> None:
    """One request at a time in a pool of ~17 blocks: later prompts evict the cached blocks of
    earlier ones, and a seeded twin finds its prompt cached or evicted; tokens stay a fresh server's."""
    name, extra, reference = config
    with serving(TINY_POOL + extra, name=f"evict-{name}") as server:
        assert _alone(server) == reference
        stats = server.wait_idle(timeout_s=120)
        assert stats.num_evicted_blocks > 0 and stats.prefix_hit_tokens > 0, stats
        assert stats.num_preemptions == 0, stats  # alone, each fits: the cache alone made room


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confidence": {"type": "integer"}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


def _structured_requests() -> list[api_pb2.GenerateRequest]:
    structured = api_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    requests = []
    for request in REQUESTS:
        copy = api_pb2.GenerateRequest()
        copy.CopyFrom(request)
        copy.structured.CopyFrom(structured)
        copy.sampling.max_tokens = 40
        requests.append(copy)
    return requests


def test_structured_output_across_a_swap_gives_the_same_tokens() -> None:
    """JSON-schema requests (greedy and seeded) swapped to CPU and back: each matcher resumes where
    its sequence stopped, so the tokens are those of each request alone on a roomy server."""
    requests = _structured_requests()
    with serving(BASE, name="structured-reference") as server:
        reference = _alone(server, requests)
    assert all(reference), reference
    args = [*TINY_POOL, "--preemption-mode", "swap", "--swap-space-gb", "1"]
    with serving(args, name="structured-swap") as server:
        assert _together(server, requests=requests) == reference
        stats = server.wait_idle(timeout_s=120)
        assert stats.num_swap_outs > 0, stats
