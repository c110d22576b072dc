"""Drive an OpenAI-compatible HTTP server with the serving workloads, timed like the gRPC driver.

Used for kvserve's own HTTP API (`bench serve --api openai`) and for other servers given as
`--target NAME=URL` (llama.cpp's `llama-server`, vLLM), so every configuration of a run gets
the same requests and the same report columns. Only `send_turn` (one turn = one request) is
specific to HTTP: sessions, arrivals, the concurrency gate, `TokenClock` timing and the
records are `load_driver`'s.

Each turn is one streaming `POST /v1/completions` with `max_tokens`, `ignore_eos: true`,
`temperature: 0` and `stream_options: {"include_usage": true}`. The prompt is the token-id
list itself where the server accepts one (kvserve, llama-server and vLLM do), else the text
the model's tokenizer decodes it to (`tokens` / `text`; `auto` tries tokens on the untimed
warm-up request and falls back to text on a 4xx). A chunk carries tokens when its choice has
non-empty `text` (or `token_ids`); the output length is the final `usage.completion_tokens`,
which also makes TPOT exact when a chunk holds back an incomplete UTF-8 character.

The client is `httpx.AsyncClient` reading SSE lines, not the `openai` SDK: the SDK retries
failed requests (twice by default), which would hide errors and skew latencies; it parses
every chunk into pydantic models, client CPU the timed path does not need on a 2-core
machine; and the non-standard fields (`ignore_eos`, `cache_salt`) would go through
`extra_body` anyway. With httpx each `data:` line is timestamped as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from kvserve.bench.load_driver import RequestRecord, TokenClock
from kvserve.bench.sessions import Session

log = structlog.get_logger(__name__)

PROMPT_MODES = ("auto", "tokens", "text")
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
READ_TIMEOUT_S = 600.0
"""Longest silence between two chunks of one stream before the request counts as failed."""
_READY_POLL_S = 0.5


class OpenAIServerError(RuntimeError):
    """The server answered a request with an error status or an error event."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}" if status else detail)
        self.status = status


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """An OpenAI-compatible baseline server: `NAME=URL[,tokens|,text]` on the command line."""

    name: str
    url: str
    prompt_mode: str = "auto"

    @classmethod
    def parse(cls, spec: str) -> HttpTarget:
        name, sep, rest = spec.partition("=")
        url, _, mode = rest.partition(",")
        mode = mode.strip() or "auto"
        if not sep or not name.strip() or not url.strip():
            raise ValueError(f"--target wants NAME=URL[,tokens|,text], got {spec!r}")
        if mode not in PROMPT_MODES:
            raise ValueError(f"--target {name}: prompt mode must be one of {', '.join(PROMPT_MODES)}, got {mode!r}")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        return cls(name.strip(), base_url(url.strip()), mode)


def base_url(url: str) -> str:
    """The server root: `http://h:p`, `http://h:p/` and `http://h:p/v1` all give `http://h:p`."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def sse_data(line: str) -> dict[str, Any] | str | None:
    """The JSON of one SSE `data:` line, the string `[DONE]`, or None for any other line."""
    if not line.startswith("data:"):
        return None  # blank separators, `: ping` comments, `event:` / `id:` fields
    payload = line[5:].strip()
    if payload == "[DONE]":
        return payload
    return json.loads(payload) if payload else None


class WorkloadTokenizer:
    """The model's `tokenizer.json` (the `tokenizers` library), loaded on first use.

    Needed only to send text prompts, and to turn a reply given as text back into token ids
    for the next turn of a multi-turn chat.
    """

    def __init__(self, model_dir: Callable[[], Path]) -> None:
        self._model_dir = model_dir
        self._tokenizer: Any = None

    def _get(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self._model_dir() / "tokenizer.json"))
        return self._tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._get().decode(ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self._get().encode(text, add_special_tokens=False).ids)


class OpenAIDriver:
    """One OpenAI-compatible server: readiness, the prompt-mode probe, and `send_turn` for `run_workload`."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        prompt_mode: str = "auto",
        tokenizer: WorkloadTokenizer | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if prompt_mode not in PROMPT_MODES:
            raise ValueError(f"prompt_mode must be one of {PROMPT_MODES}, got {prompt_mode!r}")
        self.url = base_url(url)
        self.name = name
        self.prompt_mode = prompt_mode
        self.model: str | None = None
        self._tokenizer = tokenizer
        self._timeout = httpx.Timeout(10.0, read=read_timeout_s)
        self._transport = transport  # tests pass an httpx.MockTransport
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> OpenAIDriver:
        # No pool limit: the workload's own --concurrency is the only gate on requests in flight.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=self._timeout, limits=limits, transport=self._transport
        )
        return self

    async def __aexit__(self, *_exc_info: object) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("use OpenAIDriver as an async context manager")
        return self._http

    async def wait_ready(self, timeout_s: float) -> str:
        """Poll `GET /v1/models` until it lists a model (llama-server answers 503 while loading); its id."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                response = await self.http.get(MODELS_PATH, timeout=5.0)
                if response.status_code == 200:
                    models = response.json().get("data") or []
                    if models:
                        self.model = str(models[0].get("id") or "") or None
                        return self.model or ""
                last = f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(_READY_POLL_S)
        raise TimeoutError(f"{self.name} at {self.url} not ready after {timeout_s:g}s (last: {last})")

    async def warm_up(self, token_ids: list[int]) -> None:
        """One short untimed request (after the prompt-mode probe, when the mode is `auto`).

        The prompt is the first 16 ids reversed: the OpenAI API has no cache namespace, and the
        warm-up must not leave a prefix of the first measured prompt in the server's cache.
        """
        probe = list(reversed(token_ids[:16]))
        if self.prompt_mode == "auto":
            self.prompt_mode = await self._probe_prompt_mode(probe)
            log.info("prompt mode chosen", target=self.name, prompt_mode=self.prompt_mode)
        record, _ = await self.send_turn(Session("warmup", []), 0, probe, 2, "bench-warmup")
        if not record.ok:
            raise OpenAIServerError(0, f"{self.name} warm-up failed: {record.error}")

    async def _probe_prompt_mode(self, probe: list[int]) -> str:
        """`tokens` when the server takes a token-id prompt, `text` when it refuses one with a 4xx."""
        body = {"prompt": probe, "max_tokens": 1, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        response = await self.http.post(COMPLETIONS_PATH, json=body)
        if response.status_code == 200:
            return "tokens"
        if 400 <= response.status_code < 500:
            log.info("token-id prompt refused", target=self.name, status=response.status_code, body=response.text[:200])
            return "text"
        raise OpenAIServerError(response.status_code, f"{self.name} probe failed: {response.text[:300]}")

    def _body(self, prompt: list[int], max_tokens: int, cache_salt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt if self.prompt_mode != "text" else self._need_tokenizer().decode(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        if cache_salt:
            body["cache_salt"] = cache_salt  # kvserve and vLLM know it; only cold-warm and its primer set one
        return body

    def _need_tokenizer(self) -> WorkloadTokenizer:
        if self._tokenizer is None:
            raise RuntimeError(f"{self.name}: text prompts and text replies need the model's tokenizer")
        return self._tokenizer

    async def send_turn(
        self, session: Session, turn_index: int, prompt: list[int], max_tokens: int, request_id: str
    ) -> tuple[RequestRecord, list[int]]:
        """One streamed completion; the record is filled exactly like the gRPC driver's."""
        record = RequestRecord(session.session_id, turn_index, len(prompt), max_tokens)
        body = self._body(prompt, max_tokens, session.cache_salt)
        reply_text: list[str] = []
        reply_ids: list[int] = []
        token_chunks = 0
        usage: dict[str, Any] = {}
        clock = TokenClock(record)
        try:
            async with self.http.stream(
                "POST", COMPLETIONS_PATH, json=body, headers={"x-request-id": request_id}
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    raise OpenAIServerError(response.status_code, detail)
                async for line in response.aiter_lines():
                    event = sse_data(line)
                    if event is None:
                        continue
                    if isinstance(event, str):  # [DONE]
                        break
                    if "error" in event:
                        raise OpenAIServerError(0, f"error event: {json.dumps(event['error'])[:300]}")
                    for choice in event.get("choices") or ():
                        text, ids = choice.get("text") or "", choice.get("token_ids") or []
                        if text or ids:
                            clock.tokens_arrived()
                            token_chunks += 1
                            reply_text.append(text)
                            reply_ids.extend(ids)
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
                    if event.get("usage"):
                        usage = event["usage"]
            clock.finish()
        except Exception as exc:
            clock.finish(exc)
        reported = usage.get("completion_tokens")
        record.output_tokens = int(reported) if reported is not None else (len(reply_ids) or token_chunks)
        record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        record.output_text = "".join(reply_text)
        if self.prompt_mode == "text" and usage.get("prompt_tokens"):
            record.prompt_tokens = int(usage["prompt_tokens"])  # the server's count of the decoded text
        return record, self._reply_ids(session, turn_index, record, reply_ids, "".join(reply_text))

    def _reply_ids(
        self, session: Session, turn_index: int, record: RequestRecord, reply_ids: list[int], text: str
    ) -> list[int]:
        """The reply's token ids for the next turn's prompt; only a turn that has a next one needs them."""
        if len(reply_ids) == record.output_tokens or not record.ok or turn_index + 1 >= len(session.turns):
            return reply_ids
        return self._need_tokenizer().encode(text)  # the reply came as text: re-encode it
