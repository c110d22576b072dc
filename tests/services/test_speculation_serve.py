"""`kvserve serve --speculative ngram` over the real sockets: the same tokens as off, and its counts visible.

Two fake-executor servers, speculation on and off, whose fake model copies its input
(`--copy-period`: a greedy token repeats the token six positions back), so prompt-lookup
drafts are accepted as they are on text a real model rewrites. Every answer must be the
off server's, token for token; the on server reports its drafts in `usage.speculative`
(HTTP, through the openai SDK, and gRPC, through the client), in `/metrics`, in
`ServerStats` and in `kvserve stats`. `--speculative suffix` reuses a tenant's earlier answers
and never another tenant's. `--speculative-min-acceptance` and `--speculative-max-batch` reach
the scheduler from the command line.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from kvserve.clients import Client
from kvserve.testing.server_launcher import ServeProcess, serving, start_serve
from tests.clients.test_cli_commands import port_args, run_cli
from tests.http.http_clients import ALICE, BOB, FAKE_ARGS, sdk, token_file
from tests.services.test_structured_fake_service import ENUM_SCHEMA

pytestmark = pytest.mark.timeout(240)

COPYING = ["--copy-period", "6"]
PROMPT = "the quick brown fox jumps over"
MODEL = "fake:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """(speculation on, speculation off), both over one copying fake model."""
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-spec-"))
    on = start_serve(
        [*FAKE_ARGS, *COPYING, "--speculative", "ngram", "--ngram-min", "1"], tmp_dir, http=True, name="on"
    )
    off = start_serve([*FAKE_ARGS, *COPYING], tmp_dir, http=True, name="off")
    try:
        on.wait_serving()
        off.wait_serving()
        yield on, off
    finally:
        on.stop()
        off.stop()
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _complete(server: ServeProcess, **kwargs):
    return sdk(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, **kwargs)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_http_answers_equal_speculation_off_and_carry_their_draft_counts(servers, sampling: dict) -> None:
    on, off = servers
    spec = _complete(on, logprobs=2, **sampling)
    plain = _complete(off, logprobs=2, **sampling)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
    assert spec.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == 40
    counts = spec.usage.model_extra["speculative"]
    assert plain.usage.model_extra.get("speculative") is None  # speculation off: no extension field
    assert 0 <= counts["accepted_tokens"] <= counts["proposed_tokens"]
    if sampling["temperature"] == 0:
        # The copying model follows the lookup: most of the 40 tokens came from accepted drafts.
        assert counts["accepted_tokens"] >= 20
        assert counts["verify_steps"] + counts["accepted_tokens"] <= 40
    else:
        assert counts["proposed_tokens"] > 0  # proposed, and (hashed draws) rarely accepted


def test_grpc_usage_carries_the_same_counts(servers) -> None:
    on, _ = servers
    http = _complete(on, temperature=0).usage.model_extra["speculative"]
    with Client(on.address) as client:
        completion = client.generate(PROMPT, max_tokens=40, temperature=0)
    spec = completion.usage.speculative
    assert spec is not None
    assert (spec.proposed_tokens, spec.accepted_tokens, spec.verify_steps) == (
        http["proposed_tokens"],
        http["accepted_tokens"],
        http["verify_steps"],
    )


def test_stop_string_inside_accepted_drafts_ends_where_plain_decoding_ends(servers) -> None:
    """Accepted drafts bring several tokens at once; the text and the token count still stop at the
    token that completed the stop string, as without speculation."""
    on, off = servers
    plain = _complete(off, temperature=0).choices[0].text
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    answers = []
    for server in (on, off):
        stream = sdk(server).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        answers.append((text, chunks[-1].usage.completion_tokens))
    assert answers[0] == answers[1]
    assert stop not in answers[0][0] and answers[0][1] < 40


def test_metrics_stats_and_cli_show_the_acceptance(servers) -> None:
    on, off = servers
    _complete(on, temperature=0)
    stats = on.stats()
    assert stats.draft_tokens_accepted > 0 and stats.draft_tokens_proposed >= stats.draft_tokens_accepted
    metrics = httpx.get(f"{on.http_url}/metrics", timeout=30).text

    def counter(name: str) -> float:
        match = re.search(rf"^kvserve:{name}_total (\S+)$", metrics, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    assert counter("spec_decode_num_draft_tokens") == stats.draft_tokens_proposed
    assert counter("spec_decode_num_accepted_tokens") == stats.draft_tokens_accepted
    assert counter("spec_decode_num_bonus_tokens") == stats.draft_verify_steps
    assert re.search(r"^kvserve:spec_decode_mean_accepted_length_count [1-9]", metrics, re.MULTILINE)
    text = run_cli("stats", *port_args(on)).stdout
    assert re.search(r"draft acceptance: \d+\.\d%", text), text
    assert "draft acceptance" not in run_cli("stats", *port_args(off)).stdout


def test_the_acceptance_floor_and_the_batch_limit_reach_the_scheduler(servers, tmp_path: Path) -> None:
    """`--speculative-min-acceptance 1` pauses a sequence after any rejected draft, and
    `--speculative-max-batch 1` drafts only in steps where one sequence runs, against the module's
    server at the defaults (0.2 and 8): the same text, fewer drafts, as each request's counts and
    `ServerStats` show. (The rules themselves, step by step: tests/scheduler/test_speculation_thresholds.py.)"""
    on, _ = servers
    args = [*FAKE_ARGS, *COPYING, "--speculative", "ngram", "--ngram-min", "1"]
    args += ["--speculative-min-acceptance", "1", "--speculative-max-batch", "1"]
    with serving(args, tmp_path, http=True, name="strict") as strict:

        def answer(server: ServeProcess, **kwargs) -> tuple[list[str], dict]:
            completion = _complete(server, **kwargs)
            return [c.text for c in completion.choices], completion.usage.model_extra["speculative"]

        # Greedy on the copying model: every draft is accepted, so a floor of 1 never pauses, and one
        # sequence is within a limit of 1.
        greedy = answer(strict, temperature=0)
        assert greedy == answer(on, temperature=0) and greedy[1]["verify_steps"] > 0
        # Seeded: the copying model copies three draws in four, so drafts are rejected, and at a floor of 1
        # each rejection pauses the sequence.
        (text, paused), (text_on, counts_on) = (
            answer(strict, temperature=1.0, seed=11),
            answer(on, temperature=1.0, seed=11),
        )
        assert text == text_on
        assert 0 < paused["verify_steps"] < counts_on["verify_steps"]
        assert paused["proposed_tokens"] < counts_on["proposed_tokens"]
        # n = 2: two sequences run from the step the second joins until the first ends; only in that step
        # (built while the first ran alone) and after the first has ended may either propose.
        (texts, pair), (texts_on, pair_on) = answer(strict, n=2, temperature=0), answer(on, n=2, temperature=0)
        assert texts == texts_on and len(texts) == 2
        assert pair["verify_steps"] <= 2 and pair_on["verify_steps"] >= 10
        stats = strict.stats()
    assert stats.draft_verify_steps == sum(c["verify_steps"] for c in (greedy[1], paused, pair))
    assert stats.draft_tokens_proposed == sum(c["proposed_tokens"] for c in (greedy[1], paused, pair))


def test_suffix_lookup_reuses_a_tenants_earlier_answer_and_no_one_elses(tmp_path: Path) -> None:
    """Hashed fake outputs (no copying) can only be predicted from an earlier completion: Alice's
    repeated request is answered mostly from accepted drafts; Bob's identical request, under his own
    tenant, is offered none of Alice's tokens."""
    tokens = token_file(tmp_path)
    server = start_serve([*FAKE_ARGS, "--speculative", "suffix", "--auth-token-file", str(tokens)], tmp_path, http=True)
    try:
        server.wait_serving()

        def ask(key: str) -> dict:
            completion = sdk(server, api_key=key).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0
            )
            return {"text": completion.choices[0].text, **completion.usage.model_extra["speculative"]}

        first, again, other = ask(ALICE), ask(ALICE), ask(BOB)
    finally:
        server.stop()
    assert first["text"] == again["text"] == other["text"]
    assert first["accepted_tokens"] == 0
    assert again["accepted_tokens"] >= 30
    assert other["accepted_tokens"] == 0


def test_draft_method_proposals_from_the_executor_over_the_link(servers, tmp_path: Path) -> None:
    """`--speculative draft --draft-model`: the (fake) draft model proposes in the executor process,
    proposals cross the link in the result and come back as drafts; the text is speculation off's."""
    _, off = servers
    args = [*FAKE_ARGS, *COPYING, "--speculative", "draft", "--draft-model", "fake"]
    with serving(args, tmp_path, http=True, name="draft") as server:
        spec = _complete(server, temperature=0)
    plain = _complete(off, temperature=0)
    assert spec.choices[0].text == plain.choices[0].text
    counts = spec.usage.model_extra["speculative"]
    assert 0 < counts["accepted_tokens"] < counts["proposed_tokens"]  # the fake draft errs one time in four


def test_draft_method_without_a_draft_model_stops_with_a_clear_error(tmp_path: Path) -> None:
    server = start_serve([*FAKE_ARGS, "--speculative", "draft"], tmp_path, name="no-draft")
    assert server.process.wait(timeout=120) == 2
    log = server.log_text()
    assert "--speculative draft needs a draft model" in log and "Traceback" not in log


def test_json_schema_output_under_speculation_is_valid_and_that_of_off(servers) -> None:
    """Drafts under a grammar are cut where it refuses them and verified under a mask per position:
    the JSON is valid and speculation off's, for greedy and seeded requests."""
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ENUM_SCHEMA, "strict": True}}
    on, off = servers
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        texts = [
            sdk(server)
            .chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Describe an item."}],
                max_tokens=64,
                response_format=fmt,
                **sampling,
            )
            .choices[0]
            .message.content
            for server in (on, off)
        ]
        assert texts[0] == texts[1]
        jsonschema.validate(json.loads(texts[0]), ENUM_SCHEMA)
