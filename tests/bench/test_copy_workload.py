"""The `copy` workload: editing requests over the shipped texts, rendered with the model's chat template."""

from __future__ import annotations

import pytest

from kvserve.bench import workloads as wl
from kvserve.bench.copy_workload import (
    EXTRA_OUTPUT_TOKENS,
    MAX_PASSAGE_CHARS,
    PROSE_TASKS,
    ModelTextEncoder,
    code_snippets,
    copy_workload,
    passages,
)


@pytest.fixture(scope="module")
def encoder(default_model_dir) -> ModelTextEncoder:
    return ModelTextEncoder(lambda: default_model_dir)


def test_the_shipped_texts_give_passages_and_buggy_functions() -> None:
    prose = passages()
    assert len(prose) >= 20 and all(150 <= len(p) <= MAX_PASSAGE_CHARS for p in prose)
    assert not any(p.startswith("#") for p in prose)
    code = code_snippets()
    assert len(code) == 10 and all(c.startswith(("def ", "class ")) and c.endswith("\n") for c in code)


def test_requests_are_chat_turns_whose_answers_fit_their_passage(encoder: ModelTextEncoder) -> None:
    pairs = len(passages()) * len(PROSE_TASKS) + len(code_snippets())
    workload = copy_workload(pairs, seed=3, encoder=encoder)
    assert workload.name == "copy" and workload.num_requests == pairs
    prompts = [s.turns[0].new_token_ids for s in workload.sessions]
    assert len({tuple(p) for p in prompts}) == pairs  # every (task, passage) pair once
    tasks = {s.session_id.rsplit("-", 1)[1] for s in workload.sessions}
    assert tasks == {*PROSE_TASKS, "code"}
    text = encoder._get().decode(prompts[0], skip_special_tokens=False)
    assert text.count("<|im_start|>user") == 1 and text.endswith("<|im_start|>assistant\n")
    for session in workload.sessions:
        turn = session.turns[0]
        assert EXTRA_OUTPUT_TOKENS < turn.max_tokens < len(turn.new_token_ids)  # the passage is in the prompt


def test_seeded_capped_and_built_through_bench_serve_names(encoder: ModelTextEncoder) -> None:
    a = wl.build("copy", 12, 49152, seed=7, encoder=encoder)
    assert a == wl.build("copy", 12, 49152, seed=7, encoder=encoder)
    assert a != wl.build("copy", 12, 49152, seed=8, encoder=encoder)
    (capped,) = wl.build("copy", 12, 49152, seed=7, max_tokens_cap=20, encoder=encoder)
    assert all(s.turns[0].max_tokens == 20 for s in capped.sessions)
    with pytest.raises(ValueError, match="tokenizer"):
        wl.build("copy", 1, 49152, seed=0)
