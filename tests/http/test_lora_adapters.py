"""LoRA adapters end to end: `kvserve serve --executor fake --lora NAME=PATH ...`, the real processes and sockets.

A request picks an adapter by its `model`, as in vLLM: the OpenAI SDK's `model`, the gRPC
`GenerateRequest.model`, `kvserve generate --model`. The fake executor loads nothing (the PATHs
do not exist) but salts every draw with the adapter's name, so adapters give different tokens;
each adapter has its own prefix cache, its KV events name it, and /metrics counts its requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import msgpack
import openai
import pytest
import zmq

from kvserve.protos.kv_events import END_SEQ, decode_seq, encode_seq
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.ports import free_ports
from kvserve.testing.server_launcher import ServeProcess, start_serve
from kvserve.testing.waiting import wait_until
from tests.clients.test_cli_commands import kvserve_argv
from tests.http.http_clients import FAKE_ARGS, async_sdk, sdk
from tests.http.test_readme_openai import run_block
from tests.shared_servers import kept_clean

pytestmark = pytest.mark.timeout(180)

BASE = "fake:smollm2-135m-instruct"
LORAS = ("sql", "beta", "gamma", "delta")
"""`sql` as the README's example names it."""
MODELS = ("", *LORAS)
"""The base model ("") and every adapter."""


@pytest.fixture(scope="module")
def _lora_server_process() -> Iterator[tuple[ServeProcess, str]]:
    """One fake-executor server with four adapters (whose paths do not exist), HTTP on and KV events replayable."""
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-lora-"))
    pub_port, replay_port = free_ports(2)
    replay = f"tcp://127.0.0.1:{replay_port}"
    adapters = [arg for name in LORAS for arg in ("--lora", f"{name}=/no/such/adapter/{name}")]
    events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}", "--kv-events-replay-endpoint", replay]
    server = start_serve([*FAKE_ARGS, *adapters, *events], tmp_dir, http=True)
    try:
        server.wait_serving()
        yield server, replay
    finally:
        server.stop()
        shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.fixture
def lora_server(
    _lora_server_process: tuple[ServeProcess, str], request: pytest.FixtureRequest
) -> Iterator[ServeProcess]:
    """The module's server, checked clean after each test (tests/shared_servers.py)."""
    with kept_clean(_lora_server_process[0], request.node.nodeid) as server:
        yield server


def unique_prompt(words: int = 60) -> str:
    """A prompt no other test sends, long enough to fill several KV blocks."""
    return f"Request {uuid.uuid4().hex}: " + " ".join(f"word{i}" for i in range(words))


def grpc_generate(server: ServeProcess, prompt: str, model: str, max_tokens: int = 8) -> api_pb2.GenerateResponse:
    """The one (final) response of a greedy single-completion Generate call."""
    stub = api_pb2_grpc.KVServeStub(server.channel())
    request = api_pb2.GenerateRequest(
        text=prompt,
        model=model,
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    last = api_pb2.GenerateResponse()
    tokens: list[int] = []
    for response in stub.Generate(request, timeout=60):
        tokens.extend(response.token_ids)
        last = response
    del last.token_ids[:]
    last.token_ids.extend(tokens)
    return last


def test_the_openai_sdk_picks_an_adapter_by_model(lora_server: ServeProcess) -> None:
    client = sdk(lora_server)
    messages = [{"role": "user", "content": "Which adapter answers?"}]
    answers = {}
    for model in (BASE, *LORAS):
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert answer.model == model and answer.choices[0].message.content
        answers[model] = answer.choices[0].message.content
    assert len(set(answers.values())) == len(answers), answers
    completion = client.completions.create(model="beta", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert completion.model == "beta" and completion.choices[0].text


def test_models_lists_each_adapter_after_the_base_model(lora_server: ServeProcess) -> None:
    models = sdk(lora_server).models.list().data
    assert [m.id for m in models] == [BASE, *LORAS]
    assert models[0].model_dump()["parent"] is None
    for card in models[1:]:
        assert card.object == "model"
        assert (card.model_dump()["parent"], card.model_dump()["root"]) == (BASE, card.id)


def test_an_unknown_model_is_404_model_not_found_naming_it(lora_server: ServeProcess) -> None:
    client = sdk(lora_server)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="epsilon", messages=[{"role": "user", "content": "hi"}])
    body = info.value.body
    assert (body["code"], body["param"], body["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert body["message"].startswith("the model 'epsilon' does not exist; this server serves ")
    assert all(repr(name) in body["message"] for name in (BASE, *LORAS))
    with pytest.raises(openai.NotFoundError, match="epsilon"):
        client.completions.create(model="epsilon", prompt="hi", max_tokens=2)
    tokenized = httpx.post(f"{lora_server.http_url}/tokenize", json={"model": "sql", "prompt": "hi"}, timeout=30)
    assert tokenized.status_code == 200, tokenized.text
    assert "Traceback" not in lora_server.log_text()


def test_grpc_names_the_adapter_in_generate_request_model(lora_server: ServeProcess) -> None:
    prompt = unique_prompt(10)
    tokens = {model: list(grpc_generate(lora_server, prompt, model).token_ids) for model in MODELS}
    assert len({tuple(t) for t in tokens.values()}) == len(MODELS), tokens
    assert list(grpc_generate(lora_server, prompt, BASE).token_ids) == tokens[""], "the base id is the base model"
    stub = api_pb2_grpc.KVServeStub(lora_server.channel())
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(api_pb2.GenerateRequest(text="hi", model="epsilon"), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details().startswith("model: the model 'epsilon' does not exist; this server serves ")
    assert list(stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=30).lora_names) == list(LORAS)


def test_the_prefix_cache_is_per_adapter(lora_server: ServeProcess) -> None:
    client = sdk(lora_server)
    prompt = unique_prompt()
    salt = {"cache_salt": uuid.uuid4().hex}  # namespaces of this test's own, so the first look-up finds nothing

    def cached(model: str) -> int:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=salt)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("sql") == 0
    assert cached("beta") == 0, "the same prompt under another adapter must not hit the first one's KV"
    assert cached(BASE) == 0, "nor the base model's"
    assert cached("sql") > 0, "the same adapter hits its own KV"
    assert cached("beta") > 0 and cached(BASE) > 0


def test_the_same_adapter_gives_the_same_tokens_alone_and_in_a_mixed_batch(lora_server: ServeProcess) -> None:
    prompt = unique_prompt(20)
    alone = {model: list(grpc_generate(lora_server, prompt, model, max_tokens=12).token_ids) for model in MODELS}
    assert len({tuple(t) for t in alone.values()}) == len(MODELS), alone

    async def mixed() -> list[tuple[str, list[int]]]:
        async with lora_server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)

            async def one(model: str) -> tuple[str, list[int]]:
                request = api_pb2.GenerateRequest(
                    text=prompt,
                    model=model,
                    sampling=api_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                )
                tokens = [t async for response in stub.Generate(request, timeout=60) for t in response.token_ids]
                return model, tokens

            return await asyncio.gather(*(one(MODELS[i % len(MODELS)]) for i in range(16)))

    results = asyncio.run(mixed())
    assert sorted({model for model, _ in results}) == sorted(MODELS)
    for model, tokens in results:
        assert tokens == alone[model], model


def test_concurrent_sdk_requests_under_adapters_match_their_answers_alone(lora_server: ServeProcess) -> None:
    prompt = unique_prompt(15)
    kwargs = dict(prompt=prompt, max_tokens=6, temperature=0.7, seed=11)
    alone = {model: sdk(lora_server).completions.create(model=model, **kwargs).choices[0].text for model in LORAS}

    async def together() -> list[str]:
        client = async_sdk(lora_server)
        answers = await asyncio.gather(*(client.completions.create(model=m, **kwargs) for m in LORAS * 2))
        return [a.choices[0].text for a in answers]

    assert asyncio.run(together()) == [alone[m] for m in LORAS * 2]


def replayed_batches(endpoint: str) -> list[list]:
    """Every batch the replay socket still holds, from the first, as vLLM's schema decodes them."""
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.connect(endpoint)
        req.send_multipart((b"", encode_seq(0)))
        batches = []
        while req.poll(30_000):
            _, seq, payload = req.recv_multipart()
            if decode_seq(seq) == END_SEQ:
                return batches
            batches.append(msgpack.unpackb(payload)[1])
        raise AssertionError("the replay did not end")
    finally:
        ctx.destroy(linger=0)


def test_kv_events_name_the_adapter_and_its_id(
    lora_server: ServeProcess, _lora_server_process: tuple[ServeProcess, str]
) -> None:
    prompt = unique_prompt()
    stub = api_pb2_grpc.KVServeStub(lora_server.channel())
    block_size = stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=30).block_size
    first_block = list(stub.Tokenize(api_pb2.TokenizeRequest(text=prompt), timeout=30).token_ids)[:block_size]
    for model in ("beta", "", "delta"):
        grpc_generate(lora_server, prompt, model, max_tokens=2)

    def chain_starts() -> list[tuple[str | None, int | None]] | None:
        events = [e for batch in replayed_batches(_lora_server_process[1]) for e in batch]
        starts = [
            (e["lora_name"], e["lora_id"])
            for e in events
            if e["type"] == "BlockStored"
            and e["parent_block_hash"] is None
            and e["token_ids"][:block_size] == first_block
        ]
        return starts if len(starts) == 3 else None

    starts = wait_until(chain_starts, 30, "the three requests' BlockStored events")
    assert starts == [("beta", 2), (None, None), ("delta", 4)]


def lora_counts(server: ServeProcess) -> dict[str, float]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    return {
        name: float(value)
        for name, value in re.findall(r'^kvserve:lora_requests_total\{lora_name="([^"]*)"\} (\S+)$', text, re.M)
    }


def test_metrics_count_the_requests_of_each_adapter(lora_server: ServeProcess) -> None:
    before = lora_counts(lora_server)
    client = sdk(lora_server)
    for model in ("gamma", "gamma", "delta", BASE, "gamma"):
        client.completions.create(model=model, prompt="count me", max_tokens=2, n=2)
    grpc_generate(lora_server, "and me", "gamma", max_tokens=1)
    after = lora_counts(lora_server)
    assert after["gamma"] - before.get("gamma", 0.0) == 4, "one per request, whatever its n"
    assert after["delta"] - before.get("delta", 0.0) == 1
    assert "" not in after and BASE not in after, "the base model's requests are not counted"


def test_kvserve_generate_model_picks_an_adapter(lora_server: ServeProcess) -> None:
    prompt = unique_prompt(8)
    address = ["--host", "127.0.0.1", "--port", str(lora_server.port)]
    flags = ["--json", "--max-tokens", "6", "--temperature", "0", "--ignore-eos", *address]

    def generate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*kvserve_argv(), "generate", prompt, *flags, *extra], capture_output=True, text=True, timeout=60
        )

    adapted = generate("--model", "sql")
    assert adapted.returncode == 0, adapted.stderr
    assert json.loads(adapted.stdout)["token_ids"] == list(grpc_generate(lora_server, prompt, "sql", 6).token_ids)
    base = generate()
    assert base.returncode == 0 and json.loads(base.stdout)["token_ids"] != json.loads(adapted.stdout)["token_ids"]
    unknown = generate("--model", "epsilon")
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("kvserve generate: NOT_FOUND: model: the model 'epsilon' does not exist")


def test_an_adapter_named_like_the_base_model_is_refused_at_start(serve_factory) -> None:
    server = serve_factory([*FAKE_ARGS, "--served-model-name", "sql", "--lora", "sql=/x"], wait=False)
    assert server.process.wait(timeout=60) == 2
    assert "the LoRA adapter name 'sql' is also a name of the base model" in server.log_text()


def test_the_readme_lora_example_picks_its_adapter(lora_server: ServeProcess, capsys: pytest.CaptureFixture) -> None:
    run_block('model="sql"', lora_server, "README-lora")
    printed = capsys.readouterr().out.strip()
    client = sdk(lora_server)
    messages = [{"role": "user", "content": "List the tables."}]

    def reply(model: str) -> str:
        answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
        return answer.choices[0].message.content or ""

    assert printed == reply("sql").strip() != reply(BASE).strip()
