"""What the engine view and `kvserve:prompt_tokens_total` count as prompt and as decode in a step."""

from __future__ import annotations

from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import KnownSequence, NewSequence, StepPlan
from kvserve.scheduler.server.observability.step_history import step_composition


def _new(seq_id: int, scheduled: int) -> NewSequence:
    return NewSequence(
        seq_id=seq_id,
        token_ids=list(range(scheduled)),
        prompt_len=scheduled,
        num_computed_tokens=0,
        num_scheduled_tokens=scheduled,
        block_table=[seq_id],
        sampling=SamplingParams(),
        seed=0,
    )


def _known(seq_id: int, scheduled: int, drafts: int = 0) -> KnownSequence:
    return KnownSequence(
        seq_id=seq_id,
        new_token_ids=[],
        num_computed_tokens=64,
        num_scheduled_tokens=scheduled,
        draft_token_ids=list(range(drafts)),
    )


def test_verified_drafts_are_decode_rows_and_chunks_are_prompt() -> None:
    plan = StepPlan(
        step_id=1,
        new_seqs=[_new(1, 30)],
        known_seqs=[
            _known(2, 1),  # plain decode
            _known(3, 6, drafts=5),  # its token and 5 drafts to verify
            _known(4, 16),  # the next chunk of a long prompt
        ],
    )
    assert step_composition(plan) == (30 + 16, 1 + 6)


def test_an_empty_plan_is_nothing() -> None:
    assert step_composition(StepPlan(step_id=2)) == (0, 0)
