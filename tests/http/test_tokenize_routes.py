"""`/tokenize` and `/detokenize` as vLLM's clients and vllm-router call them, and their bad input."""

from __future__ import annotations

import httpx
import pytest

from kvserve.testing.server_launcher import ServeProcess


def _post(server: ServeProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", json=body, timeout=30)


def test_text_and_token_prompts_tokenize_alike(http_server: ServeProcess) -> None:
    text = _post(http_server, "/tokenize", {"prompt": "The sea was calm that night."}).json()
    ids = _post(http_server, "/tokenize", {"prompt": text["tokens"]}).json()
    assert ids["tokens"] == text["tokens"] and ids["count"] == text["count"] > 3
    assert ids["token_strs"] == text["token_strs"]
    back = _post(http_server, "/detokenize", {"tokens": ids["tokens"]}).json()
    assert back["prompt"] == "The sea was calm that night."


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": [1001, 10**9]}, "prompt[1]"),
        ("/tokenize", {"prompt": [1001, "x"]}, "prompt[1]"),
        ("/tokenize", {"prompt": [-1]}, "prompt[0]"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_ids_are_refused_naming_the_element(http_server: ServeProcess, path: str, body: dict, param: str) -> None:
    response = _post(http_server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
