"""LoRA adapters loaded and unloaded while serving: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` through the `openai` SDK, and gRPC's `LoadLoraAdapter` / `UnloadLoraAdapter`.

The real executor on a tiny random Llama (with the default model's tokenizer) reads the adapters,
so the refusals are its own: another base model's shapes, a rank over `--max-lora-rank`, an
unsupported target, missing and corrupt files, a name taken. Each is answered over both APIs,
naming the problem, and leaves what was loaded serving as before. An adapter loaded at run time
gives the tokens of the same adapter given at start (`--lora`); a load while requests stream leaves
their tokens unchanged; a kill -9 of the executor brings runtime adapters back on the new one. The
fake executor (which loads nothing) covers what is the scheduler's alone: off without
`--allow-runtime-lora`, admin tenants only, and an adapter in use is refused, not waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from kvserve.clients import AsyncClient, Client, KVServeError
from kvserve.executor.model_config import ModelConfig, load_model_config
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.lora_adapters import write_lora_adapter
from kvserve.testing.server_launcher import ServeProcess, serving
from kvserve.testing.tiny_checkpoints import TINY, with_tokenizer, write_tiny_checkpoint
from kvserve.testing.waiting import wait_until
from tests.http.http_clients import ALICE, BOB, FAKE_ARGS, async_sdk, sdk
from tests.shared_servers import REAL_MODEL_ARGS, kept_clean

pytestmark = pytest.mark.timeout(300)

SERVABLE = TINY | dict(vocab_size=49152, max_position_embeddings=512)
"""The default model's tokenizer's vocabulary, so the tiny model serves text prompts."""
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "Colors of the rainbow:")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, ModelConfig]:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("runtime-lora") / "llama", "llama", **SERVABLE)
    with_tokenizer(path, default_model_dir)
    return path, load_model_config(path)


@pytest.fixture(scope="module")
def adapters(tiny: tuple[Path, ModelConfig], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`good` (rank 8) and `other` (rank 16), and one adapter for each refusal."""
    root = tmp_path_factory.mktemp("adapters")
    model = tiny[1]
    write_lora_adapter(root / "good", model, rank=8, b_std=0.5)
    write_lora_adapter(root / "other", model, rank=16, seed=1, b_std=0.5)
    write_lora_adapter(root / "other-base", replace(model, hidden_size=96))
    write_lora_adapter(root / "rank-32", model, rank=32)
    write_lora_adapter(root / "lm-head", model, config={"target_modules": ["lm_head"]})
    cut = write_lora_adapter(root / "cut", model)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return root


@pytest.fixture(scope="module")
def _tiny_server(
    tiny: tuple[Path, ModelConfig], adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    args = [*REAL_MODEL_ARGS, "--model", str(tiny[0]), "--dtype", "float32", "--max-lora-rank", "16"]
    runtime = ["--lora", f"first={adapters / 'good'}", "--allow-runtime-lora", "--executor-restart-timeout", "120"]
    with serving([*args, *runtime], tmp_path_factory.mktemp("runtime-lora-logs"), http=True) as server:
        yield server


@pytest.fixture
def tiny_server(_tiny_server: ServeProcess, request: pytest.FixtureRequest) -> Iterator[ServeProcess]:
    with kept_clean(_tiny_server, request.node.nodeid) as server:
        yield server


def load(client: openai.OpenAI, name: str, path: str | Path) -> dict[str, Any]:
    """vLLM's load call through the SDK's own request method (it has no method of its own for it)."""
    body = {"lora_name": name, "lora_path": str(path)}
    return client.post("/load_lora_adapter", cast_to=object, body=body)  # type: ignore[return-value]


def unload(client: openai.OpenAI, name: str) -> dict[str, Any]:
    return client.post("/unload_lora_adapter", cast_to=object, body={"lora_name": name})  # type: ignore[return-value]


def stub(server: ServeProcess) -> api_pb2_grpc.KVServeStub:
    return api_pb2_grpc.KVServeStub(server.channel())


def tokens(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12) -> list[str]:
    reply = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=max_tokens, logprobs=0)
    return list(reply.choices[0].logprobs.tokens or [])


def served(client: openai.OpenAI) -> dict[str, str | None]:
    """Each model of /v1/models and its parent."""
    return {m.id: getattr(m, "parent", None) for m in client.models.list().data}


def test_an_adapter_loaded_at_run_time_gives_the_tokens_of_the_same_one_given_at_start(
    tiny_server: ServeProcess, adapters: Path
) -> None:
    client = sdk(tiny_server)
    base = client.models.list().data[0].id
    reply = load(client, "again", adapters / "good")
    assert reply["lora_names"] == ["first", "again"] and "'again' loaded" in reply["message"]
    assert served(client) == {base: None, "first": base, "again": base}
    assert list(stub(tiny_server).ModelInfo(api_pb2.ModelInfoRequest()).lora_names) == ["first", "again"]
    for prompt in PROMPTS:
        under_first = tokens(client, "first", prompt)
        assert tokens(client, "again", prompt) == under_first != tokens(client, base, prompt)
    assert unload(client, "again")["lora_names"] == ["first"]
    with pytest.raises(openai.NotFoundError) as gone:
        tokens(client, "again", PROMPTS[0])
    assert gone.value.code == "model_not_found" and "'again' does not exist" in gone.value.message


def test_grpc_loads_and_unloads_and_the_request_field_picks_the_adapter(
    tiny_server: ServeProcess, adapters: Path
) -> None:
    api = stub(tiny_server)
    loaded = api.LoadLoraAdapter(api_pb2.LoadLoraAdapterRequest(lora_name="g", lora_path=str(adapters / "other")))
    assert list(loaded.lora_names) == ["first", "g"]
    request = api_pb2.GenerateRequest(
        text=PROMPTS[1], model="g", sampling=api_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    over_grpc = [t for r in api.Generate(request, timeout=60) for t in r.token_ids]
    reply = sdk(tiny_server).completions.create(model="g", prompt=PROMPTS[1], temperature=0, max_tokens=8)
    assert reply.usage is not None and len(over_grpc) == reply.usage.completion_tokens == 8
    assert list(api.UnloadLoraAdapter(api_pb2.UnloadLoraAdapterRequest(lora_name="g")).lora_names) == ["first"]
    with pytest.raises(grpc.RpcError) as gone:
        api.UnloadLoraAdapter(api_pb2.UnloadLoraAdapterRequest(lora_name="g"))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert gone.value.details() == "lora_name: no LoRA adapter 'g' is loaded; loaded: 'first'"


REFUSALS: dict[str, tuple[Callable[[Path], str], str, str]] = {
    "another base model": (lambda a: str(a / "other-base"), "lora_path", "trained on another base model"),
    "rank over the maximum": (lambda a: str(a / "rank-32"), "lora_path", "its rank 32 is over --max-lora-rank 16"),
    "unsupported target": (lambda a: str(a / "lm-head"), "lora_path", "targets 'lm_head'"),
    "missing file": (lambda a: str(a / "nowhere"), "lora_path", "adapter_config.json is missing"),
    "corrupt file": (lambda a: str(a / "cut"), "lora_path", "cannot be read as safetensors"),
    "relative path": (lambda a: "good", "lora_path", "must be an absolute path on the server"),
    "name of a loaded adapter": (lambda a: str(a / "good"), "lora_name", "'first' is already loaded"),
    "name of the base model": (lambda a: str(a / "good"), "lora_name", "is a name of the base model"),
}
"""Each refusal: the adapter's path, the field the error names, and a part of its message."""


def _refused_name(case: str, base: str) -> str:
    return {"name of a loaded adapter": "first", "name of the base model": base}.get(case, "new")


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_adapter_is_refused_over_both_apis_and_nothing_loaded_is_disturbed(
    tiny_server: ServeProcess, adapters: Path, case: str
) -> None:
    client = sdk(tiny_server)
    base = client.models.list().data[0].id
    before = tokens(client, "first", PROMPTS[0])
    path_of, field, message = REFUSALS[case]
    name = _refused_name(case, base)
    with pytest.raises(openai.BadRequestError) as http_refusal:
        load(client, name, path_of(adapters))
    assert http_refusal.value.param == field and message in http_refusal.value.message
    with pytest.raises(grpc.RpcError) as grpc_refusal:
        stub(tiny_server).LoadLoraAdapter(api_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path_of(adapters)))
    assert grpc_refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_refusal.value.details().startswith(f"{field}: ") and message in grpc_refusal.value.details()
    assert served(client) == {base: None, "first": base}
    assert tokens(client, "first", PROMPTS[0]) == before
    assert "Traceback" not in tiny_server.log_text()


def test_a_load_while_requests_stream_leaves_their_tokens_unchanged(tiny_server: ServeProcess, adapters: Path) -> None:
    client = sdk(tiny_server)
    base = client.models.list().data[0].id
    jobs = [(model, prompt) for prompt in PROMPTS for model in (base, "first")]
    alone = [tokens(client, model, prompt, max_tokens=48) for model, prompt in jobs]
    aclient = async_sdk(tiny_server)

    async def streams_with_a_load_between() -> tuple[list[list[str]], dict[str, Any]]:
        started = [asyncio.Event() for _ in jobs]

        async def one(i: int, model: str, prompt: str) -> list[str]:
            stream = await aclient.completions.create(
                model=model, prompt=prompt, temperature=0, max_tokens=48, logprobs=0, stream=True
            )
            out: list[str] = []
            async for chunk in stream:
                out.extend(chunk.choices[0].logprobs.tokens or [] if chunk.choices[0].logprobs else [])
                started[i].set()
            return out

        tasks = [asyncio.create_task(one(i, model, prompt)) for i, (model, prompt) in enumerate(jobs)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
        body = {"lora_name": "midway", "lora_path": str(adapters / "other")}
        loaded = await aclient.post("/load_lora_adapter", cast_to=object, body=body)
        return list(await asyncio.gather(*tasks)), loaded  # type: ignore[return-value]

    together, loaded = asyncio.run(streams_with_a_load_between())
    assert loaded["lora_names"] == ["first", "midway"]
    assert together == alone
    assert tokens(client, "midway", PROMPTS[0]) != tokens(client, base, PROMPTS[0])
    unload(client, "midway")


def test_a_runtime_adapter_comes_back_after_a_kill_9_of_the_executor(
    _tiny_server: ServeProcess, adapters: Path
) -> None:
    """The last test of the module: it replaces the shared server's executor."""
    server = _tiny_server
    client = sdk(server)
    load(client, "kept", adapters / "other")
    unload(client, "first")
    before = tokens(client, "kept", PROMPTS[2])
    server.kill_executor(150)
    assert list(stub(server).ModelInfo(api_pb2.ModelInfoRequest()).lora_names) == ["kept"]
    assert tokens(client, "kept", PROMPTS[2]) == before
    with pytest.raises(openai.NotFoundError):
        tokens(client, "first", PROMPTS[2])  # unloaded at run time: its --lora does not bring it back
    assert "Traceback" not in server.log_text()


# --- the scheduler's rules, on the fake executor --------------------------------------------------


@pytest.fixture(scope="module")
def fake_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServeProcess]]:
    """`off`: no --allow-runtime-lora; `auth`: tokens for alice (admin) and bob; `slow`: 20 ms steps."""
    root = tmp_path_factory.mktemp("fake-runtime-lora")
    tokens_file = root / "tokens"
    tokens_file.write_text(f"{ALICE} alice\n{BOB} bob\n")
    auth = ["--allow-runtime-lora", "--auth-token-file", str(tokens_file), "--admin-tenant", "alice"]
    slow = [arg if arg != "2" else "20" for arg in FAKE_ARGS] + ["--allow-runtime-lora"]
    with (
        serving(FAKE_ARGS, root, name="off", http=True) as off,
        serving([*FAKE_ARGS, *auth], root, name="auth", http=True) as with_auth,
        serving(slow, root, name="slow", http=True) as slow_server,
    ):
        yield {"off": off, "auth": with_auth, "slow": slow_server}


def test_without_the_flag_runtime_loading_is_off_over_both_apis(fake_servers: dict[str, ServeProcess]) -> None:
    server = fake_servers["off"]
    with pytest.raises(openai.NotFoundError) as http_off:
        load(sdk(server), "a", "/adapters/a")
    assert http_off.value.code == "runtime_lora_disabled" and "--allow-runtime-lora" in http_off.value.message
    with pytest.raises(grpc.RpcError) as grpc_off:
        stub(server).UnloadLoraAdapter(api_pb2.UnloadLoraAdapterRequest(lora_name="a"))
    assert grpc_off.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--allow-runtime-lora" in grpc_off.value.details()


def test_with_tokens_only_an_admin_tenant_changes_adapters(fake_servers: dict[str, ServeProcess]) -> None:
    server = fake_servers["auth"]
    with pytest.raises(openai.PermissionDeniedError) as http_denied:
        load(sdk(server, api_key=BOB), "a", "/adapters/a")
    assert "tenant 'bob'" in http_denied.value.message and "admin tenants only" in http_denied.value.message
    with pytest.raises(openai.AuthenticationError):
        load(sdk(server, api_key="wrong-token-000000000000"), "a", "/adapters/a")
    bob = [("authorization", f"Bearer {BOB}")]
    with pytest.raises(grpc.RpcError) as grpc_denied:
        stub(server).LoadLoraAdapter(api_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path="/a"), metadata=bob)
    assert grpc_denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert load(sdk(server, api_key=ALICE), "a", "/adapters/a")["lora_names"] == ["a"]
    alice = [("authorization", f"Bearer {ALICE}")]
    assert (
        not stub(server).UnloadLoraAdapter(api_pb2.UnloadLoraAdapterRequest(lora_name="a"), metadata=alice).lora_names
    )


def test_an_adapter_in_use_is_refused_until_its_requests_have_ended(fake_servers: dict[str, ServeProcess]) -> None:
    """Refused, not waited for: the caller learns at once, and no request is cut short."""
    server = fake_servers["slow"]
    client = sdk(server)
    load(client, "busy", "/adapters/busy")
    stream = client.completions.create(model="busy", prompt="a long answer", max_tokens=5000, stream=True)
    next(iter(stream))  # running now, for 100 s at 20 ms a token
    with pytest.raises(openai.ConflictError) as in_use:
        unload(client, "busy")
    assert in_use.value.code == "lora_adapter_in_use" and "'busy' has 1 request(s) in flight" in in_use.value.message
    with pytest.raises(grpc.RpcError) as grpc_in_use:
        stub(server).UnloadLoraAdapter(api_pb2.UnloadLoraAdapterRequest(lora_name="busy"))
    assert grpc_in_use.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stream.close()  # the request is aborted at the next step boundary
    wait_until(lambda: server.stats().requests_running == 0, 60, "the aborted request to end")
    assert unload(client, "busy")["lora_names"] == []


def test_the_python_clients_load_and_unload(fake_servers: dict[str, ServeProcess]) -> None:
    server = fake_servers["slow"]
    with Client(server.address) as client:
        assert client.load_lora_adapter("from-client", "/adapters/c") == ["from-client"]
        assert client.model_info()["lora_names"] == ["from-client"]

    async def unload_twice() -> KVServeError:
        async with AsyncClient(server.address) as aclient:
            assert await aclient.unload_lora_adapter("from-client") == []
            with pytest.raises(KVServeError) as gone:
                await aclient.unload_lora_adapter("from-client")
            return gone.value

    error = asyncio.run(unload_twice())
    assert error.code == grpc.StatusCode.NOT_FOUND and "no LoRA adapter 'from-client' is loaded" in error.details
