"""The OpenAI-compatible HTTP driver against an in-process fake server (httpx.MockTransport): no sockets, no model."""

import asyncio
import json

import httpx
import pytest

from kvserve.bench import workloads as wl
from kvserve.bench.load_driver import run_workload
from kvserve.bench.openai_driver import HttpTarget, OpenAIDriver, base_url, sse_data


class FakeOpenAIServer:
    """Streams `max_tokens` tokens as text ("w0 w1 ..."), one SSE chunk each, 1 ms apart.

    Every third chunk is preceded by an empty-text chunk (a held-back UTF-8 byte) and a
    `: ping` comment; the usage chunk reports `completion_tokens = max_tokens`.
    """

    def __init__(self, *, refuse_token_prompts: bool = False, fail_with: int = 0) -> None:
        self.refuse_token_prompts = refuse_token_prompts
        self.fail_with = fail_with
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak_in_flight = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        if self.refuse_token_prompts and isinstance(body["prompt"], list):
            return httpx.Response(400, json={"error": {"message": "prompt must be a string"}})
        if self.fail_with:
            return httpx.Response(self.fail_with, text="boom")
        self.bodies.append(body)
        prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{"text": "w0", "finish_reason": "length"}]})
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self._events(body, prompt_tokens)
        )

    async def _events(self, body: dict, prompt_tokens: int):
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.02)  # "prefill"
            n = body["max_tokens"]
            for i in range(n):
                if i % 3 == 2:
                    yield b": ping\n\n"
                    yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
                finish = "length" if i == n - 1 else None
                yield _sse({"choices": [{"index": 0, "text": f"w{i} ", "finish_reason": finish}]})
                await asyncio.sleep(0.001)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 3},
            }
        finally:
            self.in_flight -= 1  # here, not after [DONE]: the client stops reading there
        yield _sse({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class WordTokenizer:
    """Stands in for the model's tokenizer: id n is the word "wn"."""

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def encode(self, text):
        return [int(word[1:]) for word in text.split()]


async def _run(server, workload, *, prompt_mode="auto", tokenizer=None, concurrency=2):
    driver = OpenAIDriver(
        "http://fake/v1", name="fake", prompt_mode=prompt_mode, tokenizer=tokenizer, transport=server.transport()
    )
    async with driver as http:
        assert await http.wait_ready(5) == "fake-model"
        await http.warm_up(workload.sessions[0].turns[0].new_token_ids)
        result = await run_workload(
            None,
            workload,
            configuration="fake",
            concurrency=concurrency,
            request_rate=None,
            seed=0,
            progress=False,
            send_turn=http.send_turn,
        )
    return result, driver


def test_token_prompts_streamed_and_timed_like_the_grpc_driver():
    server = FakeOpenAIServer()
    workload = wl.mixed(6, 49152, seed=0, max_tokens_cap=7)
    result, driver = asyncio.run(_run(server, workload))
    assert driver.prompt_mode == "tokens"
    probe, warm, *measured = server.bodies
    reversed_head = workload.sessions[0].turns[0].new_token_ids[:16][::-1]  # shares no prefix with a prompt
    assert probe["max_tokens"] == 1 and not probe.get("stream") and probe["prompt"] == reversed_head
    assert warm["max_tokens"] == 2 and warm["prompt"] == reversed_head
    assert [b["prompt"] for b in measured] == [s.turns[0].new_token_ids for s in workload.sessions]
    for body in measured:
        assert body["model"] == "fake-model"
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 7
        assert "cache_salt" not in body
    assert server.peak_in_flight == 2  # the workload's --concurrency, not the HTTP pool
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    assert result.peak_running == 0 and result.preemptions == 0  # no stats client for a foreign server
    for record in result.records:
        assert record.output_tokens == 7  # usage.completion_tokens, not the 9 chunks
        assert record.finish_reason == "length"
        assert record.cached_tokens == 3
        assert record.ttft_s >= 0.02
        assert len(record.itl_s) == 6  # empty-text chunks and pings carry no token
        assert record.e2e_s >= record.ttft_s
        assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 6)


def test_refused_token_prompts_fall_back_to_text_and_replies_are_reencoded():
    server = FakeOpenAIServer(refuse_token_prompts=True)
    session = wl.Session("chat", [wl.Turn([1, 2, 3], 2), wl.Turn([4, 5], 3)])
    workload = wl.Workload("multi-turn", [session])
    result, driver = asyncio.run(_run(server, workload, tokenizer=WordTokenizer()))
    assert driver.prompt_mode == "text"
    prompts = [b["prompt"] for b in server.bodies[1:]]  # after the warm-up (the refused probe is not kept)
    # turn 2 resends turn 1's prompt, the reply the server returned ("w0 w1"), then its own tokens
    assert prompts == ["w1 w2 w3", "w1 w2 w3 w0 w1 w4 w5"]
    assert [r.prompt_tokens for r in result.records] == [3, 7]  # the server's count of the text
    assert [r.output_tokens for r in result.records] == [2, 3]


def test_server_errors_are_recorded_not_raised():
    server = FakeOpenAIServer()
    workload = wl.mixed(2, 49152, seed=0, max_tokens_cap=2)

    async def main():
        async with OpenAIDriver("http://fake", name="fake", transport=server.transport()) as http:
            await http.wait_ready(5)
            await http.warm_up(workload.sessions[0].turns[0].new_token_ids)
            server.fail_with = 500
            return await run_workload(
                None,
                workload,
                configuration="fake",
                concurrency=2,
                request_rate=None,
                seed=0,
                progress=False,
                send_turn=http.send_turn,
            )

    result = asyncio.run(main())
    assert [r.ok for r in result.records] == [False, False]
    assert "HTTP 500: boom" in result.records[0].error


def test_parsing_helpers():
    assert HttpTarget.parse("llama-server=http://127.0.0.1:8080/v1/") == HttpTarget(
        "llama-server", "http://127.0.0.1:8080", "auto"
    )
    assert HttpTarget.parse("vllm=127.0.0.1:8000,text") == HttpTarget("vllm", "http://127.0.0.1:8000", "text")
    for bad in ("no-equals", "=http://x", "x=", "x=http://h:1,words"):
        with pytest.raises(ValueError):
            HttpTarget.parse(bad)
    assert base_url("http://h:1/") == base_url("http://h:1/v1") == "http://h:1"
    assert sse_data('data: {"a": 1}') == {"a": 1}
    assert sse_data("data: [DONE]") == "[DONE]"
    assert sse_data(": ping") is None and sse_data("") is None and sse_data("event: x") is None


def test_wait_ready_polls_until_a_model_is_listed():
    answers = iter([httpx.Response(503, text="loading"), httpx.Response(200, json={"data": [{"id": "m"}]})])

    async def main(handler, timeout_s):
        async with OpenAIDriver("http://fake", name="fake", transport=httpx.MockTransport(handler)) as http:
            return await http.wait_ready(timeout_s)

    assert asyncio.run(main(lambda request: next(answers), 10)) == "m"
    with pytest.raises(TimeoutError, match="HTTP 503"):
        asyncio.run(main(lambda request: httpx.Response(503), 0.2))
