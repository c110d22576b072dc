"""LoRA adapters through the whole server on the default model: `kvserve serve --lora NAME=PATH`.

The executor tests hold the arithmetic to PEFT's (tests/executor/test_lora_vs_peft.py) and the fake
executor's tests hold the API (tests/http/test_lora_adapters.py); this one checks the real executor
and the scheduler agree end to end: the handshake's adapter names, each request's adapter reaching
its rows, a mixed batch giving each request its tokens alone, and a prefix cache per adapter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvserve.executor.model_config import load_model_config
from kvserve.testing.lora_adapters import write_lora_adapter
from kvserve.testing.server_launcher import ServeProcess, serving
from tests.shared_servers import REAL_MODEL_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ADAPTERS = ("sql", "chat")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are")


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    config = load_model_config(default_model_dir)
    root = tmp_path_factory.mktemp("adapters")
    lora = []
    for seed, name in enumerate(ADAPTERS):
        write_lora_adapter(root / name, config, rank=8 * (seed + 1), seed=seed, b_std=0.2)
        lora += ["--lora", f"{name}={root / name}"]
    with serving([*REAL_MODEL_ARGS, *lora], root, http=True) as served:
        yield served


def completion(client: openai.OpenAI, model: str, prompt: str) -> list[str]:
    reply = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12, logprobs=0)
    return list(reply.choices[0].logprobs.tokens or [])


def test_adapters_are_listed_and_change_the_output(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    models = client.models.list().data
    base = models[0].id
    assert [m.id for m in models[-2:]] == list(ADAPTERS)
    outputs = {model: [completion(client, model, p) for p in PROMPTS] for model in (base, *ADAPTERS)}
    assert outputs["sql"] != outputs[base] and outputs["chat"] != outputs[base] and outputs["sql"] != outputs["chat"]


def test_a_mixed_batch_gives_each_request_its_tokens_alone(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    base = client.models.list().data[0].id
    jobs = [(model, prompt) for prompt in PROMPTS for model in (base, *ADAPTERS)]
    alone = [completion(client, model, prompt) for model, prompt in jobs]
    aclient = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused")

    async def together() -> list[list[str]]:
        async def one(model: str, prompt: str) -> list[str]:
            reply = await aclient.completions.create(
                model=model, prompt=prompt, temperature=0, max_tokens=12, logprobs=0
            )
            return list(reply.choices[0].logprobs.tokens or [])

        return await asyncio.gather(*(one(model, prompt) for model, prompt in jobs))

    assert asyncio.run(together()) == alone


def test_the_prefix_cache_is_per_adapter(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    prompt = "A shared system prompt that spans several blocks of the cache. " * 6

    def cached(model: str) -> int:
        reply = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=2)
        details = reply.usage.prompt_tokens_details if reply.usage else None
        return (details.cached_tokens or 0) if details else 0

    assert cached("sql") == 0
    assert cached("sql") > 0, "the same adapter hits its own blocks"
    assert cached("chat") == 0, "another adapter never hits them"
    assert "Traceback" not in server.log_text()
