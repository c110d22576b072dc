"""Speculative decoding on the real default model: the same tokens as speculation off, however served.

The 12 chat prompts `bench quality` continues and 4 requests of the `copy` workload (whose
answers copy their prompts, so drafts are accepted) go through the real scheduler and the real
model runner at the default configuration, every plan and result through the wire codec
(`kvserve.testing.in_process_serving`). Each request's greedy tokens with speculation off,
served one after another, are the reference. With speculation they must be the same:

- `ngram`, one after another;
- `suffix`, every request twice one after another (the second time its earlier answer is in the
  index of recent completions);
- `ngram`, all 16 at once, every sequence verifying drafts in one batch;
- all at once under a 24-token step budget (prompts chunked, drafts squeezed by the budget);
- all at once in a KV pool too small for them, preempted by recompute, and by swap to CPU
  (`suffix` too, batched and swapped);

and seeded sampled requests with n = 3 give the tokens and logprobs of speculation off. The
JSON-schema requests of the structured-output tests, through real servers with speculation on
and off, give the same valid JSON. One more check runs
the real `kvserve serve --speculative ngram` process: the openai SDK gets the reference text and
the draft counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from kvserve.bench.copy_workload import ModelTextEncoder, copy_workload
from kvserve.bench.quality import PROMPTS
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.in_process_serving import Served, serve_in_process
from kvserve.testing.server_launcher import ServeProcess, serving
from tests.http.http_clients import sdk
from tests.services.person_requests import PEOPLE, PERSON, ask_all, person_prompt
from tests.shared_servers import REAL_MODEL_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

CHAT_TOKENS = 24
COPY_TOKENS = 64
COPY_REQUESTS = 4
TINY_POOL = 26
"""KV blocks for the scheduler in the preemption runs: far fewer than the 16 requests need at once."""


@pytest.fixture(scope="module")
def encoder(default_model_dir) -> ModelTextEncoder:
    return ModelTextEncoder(lambda: default_model_dir)


@pytest.fixture(scope="module")
def prompts(encoder: ModelTextEncoder) -> dict[str, tuple[list[int], int]]:
    """Request id → (prompt token ids, max_tokens)."""
    chats = {f"chat-{i}": (encoder.encode_chat(text), CHAT_TOKENS) for i, text in enumerate(PROMPTS)}
    copies = copy_workload(COPY_REQUESTS, seed=2, encoder=encoder, max_tokens_cap=COPY_TOKENS)
    return chats | {s.session_id: (s.turns[0].new_token_ids, s.turns[0].max_tokens) for s in copies.sessions}


@pytest.fixture(scope="module")
def runner() -> Iterator[ModelRunner]:
    yield ModelRunner(RunnerConfig(kv_cache_gb=0.25, swap_space_gb=0.05))


def _greedy(prompts: dict[str, tuple[list[int], int]]) -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        rid: (ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for rid, (ids, n) in prompts.items()
    }


def _tokens(served: Served) -> dict[str, list[int]]:
    return {rid: tokens for (rid, _), tokens in served.tokens.items()}


@pytest.fixture(scope="module")
def reference(runner: ModelRunner, prompts) -> dict[str, list[int]]:
    """Speculation off, one request after another."""
    served = serve_in_process(runner, _greedy(prompts), one_at_a_time=True)
    tokens = _tokens(served)
    assert len({tuple(t) for t in tokens.values()}) == len(tokens) == len(prompts)  # 16 different answers
    return tokens


def test_ngram_one_at_a_time_gives_the_reference_with_accepted_drafts(runner, prompts, reference) -> None:
    served = serve_in_process(runner, _greedy(prompts), one_at_a_time=True, speculative="ngram")
    assert _tokens(served) == reference
    copied = sum(counts.accepted for rid, counts in served.drafts.items() if rid.startswith("copy"))
    assert copied >= 30  # the copy requests' answers come mostly from accepted drafts


def test_suffix_reuses_earlier_answers_with_the_same_tokens(runner, prompts, reference) -> None:
    """Every request twice, one after another: the second time, the index of recent completions
    holds the first answer, so far more drafts are accepted, and the tokens stay the reference."""
    greedy = _greedy(prompts)
    twice = {f"{rid}@{n}": request for n in (1, 2) for rid, request in greedy.items()}
    served = serve_in_process(runner, twice, one_at_a_time=True, speculative="suffix")
    assert _tokens(served) == {f"{rid}@{n}": tokens for n in (1, 2) for rid, tokens in reference.items()}

    def accepted(n: int) -> int:
        return sum(counts.accepted for key, counts in served.drafts.items() if key.endswith(f"@{n}"))

    total = sum(len(t) for t in reference.values())
    assert accepted(2) >= max(2 * accepted(1), total // 2)


SERVINGS = {
    "batched": {"speculative_max_batch": 64},
    "chunked": {"speculative_max_batch": 64, "max_num_batched_tokens": 24},
    "preempted-recompute": {"speculative_max_batch": 64, "num_blocks": TINY_POOL},
    "preempted-swap": {"speculative_max_batch": 64, "num_blocks": TINY_POOL, "preemption_mode": "swap"},
}


@pytest.mark.parametrize(
    ("method", "serving_name"),
    [("ngram", name) for name in SERVINGS] + [("suffix", "batched"), ("suffix", "preempted-swap")],
)
def test_all_at_once_gives_the_reference(runner, prompts, reference, method: str, serving_name: str) -> None:
    policy = SERVINGS[serving_name]
    served = serve_in_process(runner, _greedy(prompts), speculative=method, **policy)
    assert _tokens(served) == reference
    assert served.scheduler is not None
    stats = served.scheduler.stats()
    assert stats.draft_tokens_accepted > 0
    if "num_blocks" in policy:
        assert stats.num_preemptions > 0
        assert (stats.num_swap_outs > 0) == (policy.get("preemption_mode") == "swap")


def test_seeded_samples_with_n_3_are_those_of_speculation_off(runner, prompts) -> None:
    copies = {rid: request for rid, request in prompts.items() if rid.startswith("copy")}
    copies = dict(list(copies.items())[:2])
    requests = {
        rid: (ids, SamplingParams(temperature=0.8, top_p=0.9, seed=77, n=3, max_tokens=n, ignore_eos=True, logprobs=1))
        for rid, (ids, n) in copies.items()
    }
    off = serve_in_process(runner, requests)
    on = serve_in_process(runner, requests, speculative="ngram", speculative_max_batch=64)
    assert on.tokens == off.tokens
    assert len(on.tokens) == 3 * 2
    # Bit for bit: on the CPU a verified position's logits are plain decoding's (the cpu attention
    # backend and the row-fixed GEMMs are batch-invariant), so are their logprobs.
    assert on.logprobs == off.logprobs
    assert {key: len(lps) for key, lps in on.logprobs.items()} == {key: len(t) for key, t in on.tokens.items()}
    assert on.scheduler is not None and on.scheduler.stats().draft_tokens_accepted > 0


@pytest.fixture(scope="module")
def ngram_server() -> Iterator[ServeProcess]:
    """`kvserve serve --speculative ngram` at the default real-model configuration, for the tests below."""
    with serving([*REAL_MODEL_ARGS, "--speculative", "ngram"], http=True, name="ngram") as server:
        yield server


def test_the_served_process_gives_the_reference_text(prompts, reference, encoder, ngram_server) -> None:
    rid = next(r for r in prompts if r.startswith("copy"))
    ids, max_tokens = prompts[rid]
    client = sdk(ngram_server)
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt=ids, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == encoder._get().decode(reference[rid])
    assert completion.usage.model_extra["speculative"]["accepted_tokens"] > 0


def test_json_schema_answers_stay_valid_and_equal_speculation_off(ngram_server, real_model_server) -> None:
    """The structured-output tests' 12 person descriptions under their schema: drafts are checked
    against the grammar at every position, and the JSON is speculation off's (the shared
    default-configuration server), and valid."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    requests = [dict(messages=person_prompt(p), max_tokens=200, temperature=0, response_format=fmt) for p in PEOPLE]
    answers = {"ngram": ask_all(ngram_server, requests), "off": ask_all(real_model_server, requests)}
    for on, off in zip(answers["ngram"], answers["off"], strict=True):
        text = on.choices[0].message.content
        assert text == off.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
    assert sum(r.usage.model_extra["speculative"]["accepted_tokens"] for r in answers["ngram"]) > 0
