"""The official `openai` SDK against `kvserve serve --executor fake`: chat and completions, streamed and not."""

from __future__ import annotations

import asyncio

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import async_sdk, sdk

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def model_id(server: ServeProcess) -> str:
    return sdk(server).models.list().data[0].id


def tokenize(server: ServeProcess, **body) -> int:
    return httpx.post(f"{server.http_url}/tokenize", json=body, timeout=30).json()["count"]


def test_models_lists_the_served_id(http_server: ServeProcess) -> None:
    models = sdk(http_server).models.list()
    assert [m.id for m in models.data] == ["fake:smollm2-135m-instruct"]
    assert models.data[0].object == "model"


def test_chat_with_n_seed_and_logprobs(http_server: ServeProcess) -> None:
    client = sdk(http_server)
    kwargs = dict(model=model_id(http_server), messages=QUESTION, max_tokens=6, n=2, seed=11)
    first = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(**kwargs)
    assert isinstance(first, ChatCompletion) and first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]  # seeded
    assert first.choices[0].message.content != first.choices[1].message.content
    for choice in first.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert again.choices[0].logprobs is None
    usage = first.usage
    assert usage.prompt_tokens == tokenize(http_server, messages=QUESTION)  # counted once for n = 2
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12


def test_stop_string_ends_with_finish_reason_stop(http_server: ServeProcess) -> None:
    client = sdk(http_server)
    full = client.chat.completions.create(model=model_id(http_server), messages=QUESTION, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = client.chat.completions.create(
        model=model_id(http_server), messages=QUESTION, max_tokens=8, temperature=0, stop=[stop, "never-seen"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_chat_stream_with_usage_matches_the_full_answer(http_server: ServeProcess) -> None:
    client = sdk(http_server)
    kwargs = dict(model=model_id(http_server), messages=QUESTION, max_tokens=7, n=2, seed=3)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c, ChatCompletionChunk) and c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    texts, finishes, roles = {0: "", 1: ""}, {}, {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        (choice,) = chunk.choices
        roles.setdefault(choice.index, choice.delta.role)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}  # the first delta of each choice
    assert finishes == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 14
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_with_several_prompts_echo_and_logprobs(http_server: ServeProcess) -> None:
    client = sdk(http_server)
    model = model_id(http_server)
    out = client.completions.create(model=model, prompt=["Once upon", "a time"], max_tokens=4, n=2, seed=1, echo=True)
    assert isinstance(out, Completion) and out.object == "text_completion" and out.id.startswith("cmpl-")
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(p) for c, p in zip(out.choices, ["Once upon"] * 2 + ["a time"] * 2)] == [True] * 4
    assert out.usage.prompt_tokens == tokenize(http_server, prompt="Once upon") + tokenize(http_server, prompt="a time")
    assert out.usage.completion_tokens == 16
    scored = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=3, logprobs=2, temperature=0)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == scored.choices[0].text
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_completions_stream_equals_the_full_answer(http_server: ServeProcess) -> None:
    client = sdk(http_server)
    model = model_id(http_server)
    kwargs = dict(model=model, prompt="The sea", max_tokens=6, temperature=0)
    full = client.completions.create(**kwargs)
    events = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == full.choices[0].text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 6


def test_async_client_streams_concurrently(http_server: ServeProcess) -> None:
    async def scenario() -> list[str]:
        client = async_sdk(http_server)
        model = (await client.models.list()).data[0].id

        async def one(k: int) -> str:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Name a prime number above {k}."}],
                max_tokens=5,
                temperature=0,
                stream=True,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(k) for k in (10, 100, 1000, 10, 100, 1000)))
        finally:
            await client.close()

    answers = asyncio.run(scenario())
    assert all(answers) and answers[:3] == answers[3:]  # greedy: the same question, the same answer


def test_responses_parse_as_the_sdk_types_strictly(http_server: ServeProcess) -> None:
    """model_validate checks every field's type, where the SDK's own parsing is lenient."""
    base = f"{http_server.http_url}/v1"
    chat = httpx.post(f"{base}/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "logprobs": True})
    ChatCompletion.model_validate(chat.json())
    done = httpx.post(f"{base}/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0})
    Completion.model_validate(done.json())
    body = {"messages": QUESTION, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        ChatCompletionChunk.model_validate_json(line.removeprefix("data: "))
