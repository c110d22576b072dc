"""What the HTTP tests share besides fixtures: SDK clients that never retry, polling, tokens.

SDK clients use `max_retries=0`, so each error case is one request and a 429 or 503
reaches the test instead of being retried away.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from kvserve.testing.server_launcher import ServeProcess
from kvserve.testing.waiting import wait_until

FAKE_ARGS = ["--executor", "fake", "--num-blocks", "4096", "--step-latency-ms", "2"]
ALICE = "alice-http-token-0000000000000001"
BOB = "bob-http-token-00000000000000000002"


def sdk(server: ServeProcess, api_key: str = "unused", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


def async_sdk(server: ServeProcess, api_key: str = "unused", **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


def wait_for_status(url: str, status: int, timeout_s: float, headers: dict | None = None) -> httpx.Response:
    """The first answer of GET `url` with `status`; fails the test after `timeout_s`."""
    last: list[object] = [None]

    def answered() -> httpx.Response | None:
        try:
            response = httpx.get(url, timeout=30, headers=headers)
        except httpx.HTTPError as exc:
            last[0] = exc
            return None
        last[0] = response.status_code
        return response if response.status_code == status else None

    return wait_until(answered, timeout_s, lambda: f"{url} to answer {status} (last: {last[0]!r})", interval_s=0.05)


def token_file(directory: Path) -> Path:
    path = directory / "tokens"
    path.write_text(f"{ALICE} alice\n{BOB} bob\n")
    return path
