"""Every refusal in OpenAI's error shape: the SDK's exception classes, and the raw bodies over httpx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvserve.testing.server_launcher import ServeProcess, start_serve
from kvserve.testing.waiting import wait_until_async
from tests.http.http_clients import FAKE_ARGS, async_sdk, sdk

QUESTION = [{"role": "user", "content": "Hello there"}]
LIMIT_BYTES = 4096


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServeProcess]:
    """One running sequence, one queued request at most, 4 KiB bodies: the limits are easy to reach."""
    args = [*FAKE_ARGS[:-2], "--step-latency-ms", "20", "--max-num-seqs", "1", "--max-queued-requests", "1"]
    server = start_serve([*args, "--max-request-bytes", str(LIMIT_BYTES), "--served-model-name", "tiny"], http=True)
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"n": 99}, "n"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"description": "nameless"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 7}}]}, "tools[0].function.parameters"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "maybe", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "g"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tool_choice.function.name",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "response_format": {"type": "json_object"},
            },
            "response_format.type",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
    ],
)
def test_bad_chat_fields_raise_bad_request_naming_the_param(http_server: ServeProcess, kwargs: dict, param: str):
    request = {"model": sdk(http_server).models.list().data[0].id, "messages": QUESTION, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        sdk(http_server).chat.completions.create(**request)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["message"].startswith(f"{param}: ")


def test_bad_completion_prompt_names_its_index(http_server: ServeProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk(http_server).completions.create(model="fake:smollm2-135m-instruct", prompt=[[5, 6], [10**9]])
    assert info.value.body["param"] == "prompt[1]"


def test_unknown_model_is_not_found(http_server: ServeProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sdk(http_server).chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_served_model_name_aliases_are_listed_and_accepted(small_server: ServeProcess) -> None:
    client = sdk(small_server)
    assert [m.id for m in client.models.list().data] == ["fake:smollm2-135m-instruct", "tiny"]
    answer = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
    assert answer.model == "tiny" and answer.choices[0].message.content


def test_malformed_json_is_a_400_without_a_traceback(http_server: ServeProcess) -> None:
    url = f"{http_server.http_url}/v1/chat/completions"
    for body in (b'{"messages": [', b"\xff\xfe\x00", b"[1, 2]", b"", b"[" * 100_000):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400, (body[:20], response.text)
        assert error_of(response)["type"] == "invalid_request_error"
    assert "Traceback" not in http_server.log_text()


def test_framework_errors_have_the_openai_shape(http_server: ServeProcess) -> None:
    missing = httpx.get(f"{http_server.http_url}/v1/nothing-here")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    wrong_method = httpx.get(f"{http_server.http_url}/v1/chat/completions")
    assert wrong_method.status_code == 405 and "GET" in error_of(wrong_method)["message"]


def test_unknown_fields_are_ignored_with_one_warning(http_server: ServeProcess) -> None:
    body = {"messages": QUESTION, "max_tokens": 2, "frobnicate": 1, "stream_options": None, "zzz_extra": {}}
    response = httpx.post(f"{http_server.http_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    warnings = [e for e in http_server.log_events("http_unknown_fields_ignored") if "zzz_extra" in e["fields"]]
    assert len(warnings) == 1 and warnings[0]["fields"] == ["frobnicate", "zzz_extra"]


def test_oversize_body_is_413_whether_declared_or_streamed(small_server: ServeProcess) -> None:
    url = f"{small_server.http_url}/v1/completions"
    big = {"prompt": "x " * LIMIT_BYTES, "max_tokens": 1}
    declared = httpx.post(url, json=big, timeout=30)
    assert declared.status_code == 413 and error_of(declared)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server must count while reading
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"y" * 1024
        yield b'"}'

    streamed = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
    assert streamed.status_code == 413
    ok = httpx.post(url, json={"prompt": "small", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_queue_full_is_rate_limited(small_server: ServeProcess) -> None:
    """One request runs (--max-num-seqs 1), one waits (--max-queued-requests 1), the third gets a 429."""
    long = {"model": "tiny", "messages": QUESTION, "max_tokens": 2000, "stream": True}

    async def scenario() -> openai.RateLimitError:
        async with (
            httpx.AsyncClient(base_url=f"{small_server.http_url}/v1", timeout=120) as http,
            http.stream("POST", "/chat/completions", json=long) as running,
        ):
            lines = running.aiter_lines()  # held, not left by `break`: closing it would hang up (and abort)
            while '"delta":{"content":' not in await anext(lines):
                pass  # until its first token: it runs, so it no longer counts as queued
            async with http.stream("POST", "/chat/completions", json=long) as waiting:
                assert waiting.status_code == 200
                await wait_until_async(
                    lambda: asyncio.to_thread(lambda: small_server.stats().requests_waiting >= 1),
                    60,
                    "the second request to queue",
                    interval_s=0.05,
                )
                client = async_sdk(small_server)
                try:
                    await client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=1)
                except openai.RateLimitError as exc:
                    return exc
                finally:
                    await client.close()
        pytest.fail("the third request was not refused")

    error = asyncio.run(scenario())
    assert error.status_code == 429 and "queue full" in error.body["message"]
    stats = small_server.wait_idle(timeout_s=60)
    assert stats.blocks_referenced == 0 and stats.requests_running == 0
