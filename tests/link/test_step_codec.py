"""kvserve.protos.step_codec: every StepPlan / StepResult / ExecutorInfo survives the wire unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import defaults
from kvserve.protos import step_codec
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import (
    ExecutorInfo,
    KnownSequence,
    NewSequence,
    SampledToken,
    StepPlan,
    StepResult,
    TokenLogprob,
)

ids = st.integers(min_value=0, max_value=2**62)
small = st.integers(min_value=0, max_value=100_000)
token_lists = st.lists(st.integers(min_value=0, max_value=200_000), max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)

sampling_params = st.builds(
    SamplingParams,
    temperature=finite,
    top_k=st.integers(-1, 1000),
    top_p=finite,
    min_p=finite,
    repetition_penalty=finite,
    presence_penalty=finite,
    frequency_penalty=finite,
    seed=st.none() | st.integers(0, defaults.MAX_SEED),
    n=st.integers(1, 16),
    max_tokens=small,
    min_tokens=small,
    stop_token_ids=st.lists(small, max_size=5).map(tuple),
    stop=st.lists(st.text(max_size=10), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
)
new_sequences = st.builds(
    NewSequence,
    seq_id=ids,
    token_ids=token_lists,
    prompt_len=small,
    num_computed_tokens=small,
    num_scheduled_tokens=small,
    block_table=st.lists(small, max_size=20),
    sampling=sampling_params,
    seed=st.integers(0, defaults.MAX_SEED),
)
cached_sequences = st.builds(
    KnownSequence,
    seq_id=ids,
    new_token_ids=token_lists,
    num_computed_tokens=small,
    num_scheduled_tokens=small,
    new_block_ids=st.lists(small, max_size=4),
)
pairs = st.lists(st.tuples(small, small), max_size=6)
plans = st.builds(
    StepPlan,
    step_id=ids,
    new_seqs=st.lists(new_sequences, max_size=4),
    known_seqs=st.lists(cached_sequences, max_size=30),
    copies=pairs,
    swap_out=pairs,
    swap_in=pairs,
    drop_seq_ids=st.lists(ids, max_size=8),
)
outputs = st.builds(
    SampledToken,
    seq_id=ids,
    token_id=small,
    logprob=st.none() | finite,
    top_logprobs=st.lists(st.builds(TokenLogprob, token_id=small, logprob=finite), max_size=5),
)
results = st.builds(StepResult, step_id=ids, outputs=st.lists(outputs, max_size=30), execute_time_s=finite)


def _wire_plan(plan: StepPlan) -> StepPlan:
    envelope = pb.SchedulerMessage()
    step_codec.encode_plan(plan, envelope.plan)
    return step_codec.decode_plan(pb.SchedulerMessage.FromString(envelope.SerializeToString()).plan)


def _wire_result(result: StepResult) -> StepResult:
    envelope = pb.ExecutorMessage()
    step_codec.encode_result(result, envelope.result)
    return step_codec.decode_result(pb.ExecutorMessage.FromString(envelope.SerializeToString()).result)


@settings(max_examples=150, deadline=None)
@given(plans)
def test_plan_round_trip(plan: StepPlan) -> None:
    assert _wire_plan(plan) == plan


@settings(max_examples=150, deadline=None)
@given(results)
def test_result_round_trip(result: StepResult) -> None:
    decoded = _wire_result(result)
    assert decoded == result


@settings(max_examples=50, deadline=None)
@given(
    st.builds(
        ExecutorInfo,
        model_id=st.text(),
        num_blocks=small,
        block_size=small,
        num_cpu_blocks=small,
        vocab_size=small,
        max_model_len=small,
        eos_token_ids=st.lists(small, max_size=3),
        tokenizer_path=st.text(),
        executor_kind=st.sampled_from(["torch", "fake"]),
        device=st.text(),
        dtype=st.text(),
        attention_backend=st.text(),
    )
)
def test_info_round_trip(info: ExecutorInfo) -> None:
    data = step_codec.encode_info(info).SerializeToString()
    assert step_codec.decode_info(pb.ExecutorInfo.FromString(data)) == info


def test_seed_none_and_logprobs_none_stay_none() -> None:
    """proto3 scalars default to 0: `optional` must keep None distinct from 0."""
    for seed, logprobs in ((None, None), (0, 0)):
        params = SamplingParams(seed=seed, logprobs=logprobs)
        plan = StepPlan(1, new_seqs=[NewSequence(1, [1, 2], 2, 0, 2, [0], params, 0)])
        decoded = _wire_plan(plan).new_seqs[0].sampling
        assert decoded.seed == seed and decoded.logprobs == logprobs


def test_inconsistent_columns_are_rejected() -> None:
    msg = pb.StepPlan()
    msg.known_seqs.seq_ids.extend([1, 2])
    msg.known_seqs.num_computed_tokens.extend([3, 4])
    msg.known_seqs.num_scheduled_tokens.extend([1, 1])
    msg.known_seqs.new_token_counts.extend([1, 1])
    msg.known_seqs.new_token_ids.extend([7])  # one token promised twice
    with pytest.raises(ValueError, match="new_token"):
        step_codec.decode_plan(msg)
    result = pb.StepResult(seq_ids=[1, 2], token_ids=[5])
    with pytest.raises(ValueError, match="token_ids"):
        step_codec.decode_result(result)


@given(st.lists(ids, max_size=6, unique=True), st.integers(1, 4), st.randoms(use_true_random=False))
def test_token_masks_round_trip(seq_ids: list[int], words: int, rng) -> None:
    masks = rng.randbytes(4 * words * len(seq_ids))
    plan = StepPlan(step_id=1, mask_seq_ids=seq_ids, token_masks=masks)
    back = _wire_plan(plan)
    assert back.mask_seq_ids == seq_ids and back.token_masks == masks
    assert back.mask_row_bytes == (4 * words if seq_ids else 0)


def test_token_masks_of_uneven_rows_are_rejected() -> None:
    with pytest.raises(ValueError, match="whole uint32 words"):
        step_codec.decode_plan(pb.StepPlan(mask_seq_ids=[1, 2], token_masks=b"\xff" * 12))
    with pytest.raises(ValueError, match="without mask_seq_ids"):
        step_codec.decode_plan(pb.StepPlan(token_masks=b"\xff" * 4))


def decode_step_plan(num_seqs: int) -> StepPlan:
    return StepPlan(
        step_id=7,
        known_seqs=[KnownSequence(i, [1000 + i], 500 + i, 1, [i] if i % 16 == 0 else []) for i in range(num_seqs)],
    )


def test_a_256_sequence_decode_step_is_a_few_bytes_a_sequence_on_the_wire() -> None:
    """The link carries every step, so a decode plan and its result are columns, not a message per
    sequence: about 9 and 4 bytes a sequence (measured 2,228 and 916 bytes at 256), where a message
    per sequence would take 13 or more and 8. The check is on bytes, not time: the codec's speed is measured by
    `python -m tests.link.measure_link` (docs/benchmarks.md, "Executor link")."""
    plan = decode_step_plan(256)
    result = StepResult(7, [SampledToken(i, 2000 + i) for i in range(256)], 0.01)
    plan_wire, result_wire = pb.SchedulerMessage(), pb.ExecutorMessage()
    step_codec.encode_plan(plan, plan_wire.plan)
    step_codec.encode_result(result, result_wire.result)
    assert len(plan_wire.SerializeToString()) < 12 * 256 and len(result_wire.SerializeToString()) < 6 * 256
    assert _wire_plan(plan) == plan and _wire_result(result) == result
