"""The web page in a real browser against a real `kvserve serve` (fake executor: only the model is replaced).

Every wait is for an event on the page (Playwright's `wait_for_function`), with generous
timeouts; nothing depends on how long a sleep lasts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import ALICE, BOB, sdk, token_file

pytestmark = pytest.mark.timeout(300)

WAIT_MS = 60_000
SLOW_FAKE = ["--executor", "fake", "--num-blocks", "600", "--step-latency-ms", "25", "--ui-interval", "0.25"]
"""Steps slow enough that a 160-token answer runs for seconds: the grid is seen busy, then idle."""
SYSTEM = "You are the lighthouse keeper of a small island. Answer in the voice of the sea. " * 6


def _open(page, server: ServeProcess, token: str | None = None) -> None:
    page.goto(server.http_url + "/")
    if token is not None:
        page.wait_for_selector("#auth-dialog[open]", timeout=WAIT_MS)
        page.fill("#auth-token", token)
        page.click("#auth-submit")
    _wait(page, "document.querySelector('#stream-status').textContent.includes('live')")
    _wait(page, "document.querySelectorAll('#pool-grid .cell').length > 0")


def _wait(page, condition: str) -> None:
    """Until the JS expression `condition` holds on the page. Passed as a function: the page's CSP forbids
    eval, which Playwright would use on a bare expression."""
    page.wait_for_function(f"() => ({condition})", timeout=WAIT_MS)


def _send(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#message", text)
    page.click("#send")


def _wait_reply_done(page, replies: int) -> dict:
    """The stats of reply number `replies` (1-based) once it finished."""
    _wait(page, f"document.querySelectorAll('#messages .message.assistant .reply-stats').length >= {replies}")
    return page.evaluate(
        f"""(() => {{
            const s = document.querySelectorAll('#messages .message.assistant .reply-stats')[{replies - 1}];
            return Object.assign({{}}, s.dataset);
        }})()"""
    )


TOP_SUBTREES = "#prefix-tree > li.subtree"
TOP_HITS_JS = f"Math.max(-1, ...[...document.querySelectorAll('{TOP_SUBTREES}')].map(li => Number(li.dataset.hits)))"
"""The largest hit count among the top-level subtrees (-1: none shown)."""


def _distinct_colours(path: Path, box: dict) -> int:
    from PIL import Image  # here, not at the top: the GPU check collects this module without Pillow

    with Image.open(path) as image:
        region = image.convert("RGB").crop(
            (int(box["x"]), int(box["y"]), int(box["x"] + box["width"]), int(box["y"] + box["height"]))
        )
        return len(region.getcolors(maxcolors=region.width * region.height) or [])


def test_a_chat_streams_in_while_the_pool_fills_and_empties(page, http_serve_factory, artifacts) -> None:
    server = http_serve_factory(SLOW_FAKE)
    _open(page, server)
    _wait(page, "document.querySelector('#model').value !== ''")
    page.fill("#system-prompt", SYSTEM)
    _send(page, "Tell me about the tides.", max_tokens=160)
    # Streaming: text is on the page before the reply has finished (no stats yet)...
    _wait(
        page,
        "(() => { const r = document.querySelector('#messages .message.assistant');"
        " return r && r.querySelector('.content').textContent.length > 0 && !r.querySelector('.reply-stats'); })()",
    )
    # ...and the request's blocks show in the grid while it runs.
    _wait(page, "document.querySelectorAll('#pool-grid .cell.running, #pool-grid .cell.shared').length > 0")
    # Hovering names the owner: the running cells' titles carry the request's id and ref count.
    title = page.evaluate("document.querySelector('#pool-grid .cell.running').title")
    assert "chatcmpl-" in title and "ref 1" in title, title
    busy = artifacts / "chat-running.png"
    page.screenshot(path=str(busy))
    stats = _wait_reply_done(page, 1)
    assert int(stats["completionTokens"]) == 160 and int(stats["promptTokens"]) > 50
    assert float(stats["ttftMs"]) > 0 and float(stats["tokensPerS"]) > 0
    # Finished: the blocks are released (cached or free), none is held by a request any more.
    _wait(page, "document.querySelectorAll('#pool-grid .cell.running, #pool-grid .cell.shared').length === 0")
    assert page.evaluate("document.querySelectorAll('#pool-grid .cell.cached').length") > 0
    _check_regions(page, busy)
    shutil.copy(busy, artifacts / "web-page.png")


def test_two_chats_with_one_system_prompt_share_a_subtree_whose_hits_grow(page, http_serve_factory) -> None:
    server = http_serve_factory(SLOW_FAKE)
    _open(page, server)
    page.fill("#system-prompt", SYSTEM)
    _send(page, "What is the weather like?", max_tokens=4)
    _wait_reply_done(page, 1)
    _wait(page, "document.querySelectorAll('#prefix-tree li.subtree').length > 0")
    first = page.evaluate(TOP_HITS_JS)
    page.reload()  # a new conversation: the same system prompt, another question
    _open(page, server)
    page.fill("#system-prompt", SYSTEM)
    _send(page, "Which birds nest on the cliffs?", max_tokens=4)
    _wait_reply_done(page, 1)
    # The hit is counted when the second request is admitted; its own branch shows once its blocks are cached.
    branches = f"document.querySelectorAll('{TOP_SUBTREES} > ul > li.subtree').length"
    _wait(page, f"({TOP_HITS_JS}) > {first} && {branches} === 2")
    top = page.evaluate(
        f"(() => {{ const li = document.querySelector('{TOP_SUBTREES}');"
        " return {text: li.querySelector('.edge-text').textContent, count: "
        f"document.querySelectorAll('{TOP_SUBTREES}').length}}; }})()"
    )
    assert "lighthouse keeper" in top["text"], top
    assert top["count"] == 1, "one shared edge, then a branch per question"


def test_with_auth_a_tenant_sees_no_text_of_another_tenants_prompt(page, http_serve_factory, tmp_path) -> None:
    server = http_serve_factory([*SLOW_FAKE, "--auth-token-file", str(token_file(tmp_path))])
    secret = "Bob's secret plan: the treasure lies under the old oak. " * 5
    bob = sdk(server, api_key=BOB)
    bob.chat.completions.create(
        model="fake:smollm2-135m-instruct", messages=[{"role": "system", "content": secret}], max_tokens=2
    )
    _open(page, server, token=ALICE)
    assert ALICE not in page.url
    page.fill("#system-prompt", SYSTEM)
    _send(page, "Hello?", max_tokens=4)
    _wait_reply_done(page, 1)
    _wait(page, "document.querySelectorAll('#prefix-tree li.subtree').length > 0")
    _wait(page, "document.querySelectorAll('#pool-grid .cell.other').length > 0")
    seen = page.evaluate(
        "document.body.innerText + [...document.querySelectorAll('[title]')].map(e => e.title).join(' ')"
    )
    assert "lighthouse keeper" in seen, "alice sees her own prompt's text"
    assert "treasure" not in seen and "secret" not in seen, "and nothing of bob's"
    with pytest.raises(openai.AuthenticationError):
        sdk(server, api_key="not-a-token-0000000000").models.list()


BASE = "fake:smollm2-135m-instruct"
PICKER_OPTIONS_JS = "[...document.querySelectorAll('#model option')].map(o => [o.value, o.textContent])"


def _picker(page) -> list[list[str]]:
    """The picker's options as [value, label] pairs, in order."""
    return page.evaluate(PICKER_OPTIONS_JS)


def _send_observed(page, text: str) -> tuple[str, dict]:
    """Sends `text`; the `model` of the request the page sent, and the stats of the reply once it finished."""
    replies = page.evaluate("document.querySelectorAll('#messages .message.assistant').length")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions") and r.method == "POST") as sent:
        _send(page, text, max_tokens=4)
    return json.loads(sent.value.post_data)["model"], _wait_reply_done(page, replies + 1)


def test_the_model_picker_lists_the_lora_adapters_and_the_chat_uses_the_one_picked(page, http_serve_factory) -> None:
    server = http_serve_factory([*SLOW_FAKE, "--lora", "sql=/no/such/adapter/sql"])
    _open(page, server)
    _wait(page, "document.querySelectorAll('#model option').length === 2")
    assert _picker(page) == [[BASE, BASE], ["sql", f"sql (LoRA of {BASE})"]]
    assert page.get_by_label("Model").evaluate("e => e.id") == "model", "the picker has its label"
    assert page.input_value("#model") == BASE, "the base model is picked first"

    model, stats = _send_observed(page, "Which table holds the orders?")
    assert model == BASE and stats["model"] == BASE, (model, stats)
    page.select_option("#model", "sql")
    model, stats = _send_observed(page, "And the customers?")
    assert model == "sql" and stats["model"] == "sql", (model, stats)
    assert "LoRA sql" in page.text_content("#messages .message.assistant:last-child .reply-stats")

    # Adapters come and go while the server runs: the picker reads /v1/models again when focused. Here the
    # server's own list is altered on its way to the page: first an adapter added, then `sql` dropped.
    def poetry(cards: list[dict]) -> list[dict]:
        return [*cards, {**cards[-1], "id": "poetry", "root": "poetry"}]

    _serve_altered_models(page, poetry)
    _refocus_picker(page)
    _wait(page, "[...document.querySelectorAll('#model option')].some(o => o.value === 'poetry')")
    assert _picker(page) == [[BASE, BASE], ["sql", f"sql (LoRA of {BASE})"], ["poetry", f"poetry (LoRA of {BASE})"]]
    assert page.input_value("#model") == "sql", "the picked adapter is still served: it stays picked"

    _serve_altered_models(page, lambda cards: [card for card in poetry(cards) if card["id"] != "sql"])
    _refocus_picker(page)
    _wait(page, "![...document.querySelectorAll('#model option')].some(o => o.value === 'sql')")
    assert _picker(page) == [[BASE, BASE], ["poetry", f"poetry (LoRA of {BASE})"]]
    assert page.input_value("#model") == BASE, "the picked adapter is gone: back to the base model"
    model, stats = _send_observed(page, "And the invoices?")
    assert model == BASE and stats["model"] == BASE, (model, stats)


def _serve_altered_models(page, alter) -> None:
    """From now on the page gets the server's /v1/models with its `data` passed through `alter`."""

    def handle(route) -> None:
        response = route.fetch()
        body = response.json()
        body["data"] = alter(body["data"])
        route.fulfill(response=response, json=body)

    page.unroute("**/v1/models")
    page.route("**/v1/models", handle)


def _refocus_picker(page) -> None:
    page.focus("#message")
    page.focus("#model")


def _check_regions(page, screenshot: Path) -> None:
    """The screenshot shows the page's main regions: each is on screen, sized, and drawn (not blank)."""
    for selector in ("#chat", "#engine", "#pool-grid", "#prefix-tree", "#messages", "#queues"):
        box = page.locator(selector).bounding_box()
        assert box is not None and box["width"] > 50 and box["height"] > 20, (selector, box)
        assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= 1400, (selector, box)
    assert _distinct_colours(screenshot, page.locator("#pool-grid").bounding_box()) >= 3, "cells in several states"
    assert _distinct_colours(screenshot, page.locator("#messages").bounding_box()) >= 3, "text in the chat"


@pytest.mark.slow
def test_the_default_model_answers_on_the_page(page, http_serve_factory, artifacts) -> None:
    """What `make serve` then the browser gives: a real answer and the live view of the default model.

    Its screenshot is the README's (docs/img/web-page.png is a copy of test-artifacts/ui/web-page-default-model.png)."""
    server = http_serve_factory(["--ui-interval", "0.25"])
    page.set_viewport_size({"width": 1400, "height": 1400})  # the whole engine view, prefix tree included
    _open(page, server)
    _wait(page, "document.querySelector('#model').value !== ''")
    assert "smollm2" in page.input_value("#model").lower()
    page.fill("#system-prompt", "You are a concise geography tutor.")
    _send(page, "What is the capital of France? Answer in one sentence.", max_tokens=40)
    stats = _wait_reply_done(page, 1)
    answer = page.text_content("#messages .message.assistant .content")
    assert "Paris" in answer, answer
    assert int(stats["completionTokens"]) > 0
    _wait(page, "document.querySelectorAll('#pool-grid .cell.cached').length > 0")
    _wait(page, "document.querySelectorAll('#prefix-tree > li.subtree').length > 0")
    shot = artifacts / "web-page-default-model.png"
    page.screenshot(path=str(shot))
    _check_regions(page, shot)
