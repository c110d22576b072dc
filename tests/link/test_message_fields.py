"""One table per dataclass/message pair: every field crosses, and optional fields keep None."""

from __future__ import annotations

import dataclasses

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.message_fields import copy_fields, field_table
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import ExecutorInfo

INFO = ExecutorInfo(
    model_id="m",
    num_blocks=7,
    block_size=16,
    num_cpu_blocks=3,
    vocab_size=99,
    max_model_len=512,
    eos_token_ids=[2, 5],
    tokenizer_path="/tok",
    executor_kind="fake",
    device="cuda:1",
    dtype="bfloat16",
    attention_backend="triton",
)


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_wire_messages_carry_every_contract_field() -> None:
    # A field added to the dataclass but not to executor_link.proto would silently stay behind.
    assert {name for name, _, _ in field_table(ExecutorInfo, pb.ExecutorInfo).fields} == _names(ExecutorInfo)
    assert {name for name, _, _ in field_table(SamplingParams, pb.StepSamplingParams).fields} == _names(SamplingParams)


def test_round_trips_keep_values_sequence_types_and_unset_optionals() -> None:
    table = field_table(ExecutorInfo, pb.ExecutorInfo)
    assert table.build(table.fill(INFO, pb.ExecutorInfo())) == INFO
    sampling = field_table(SamplingParams, pb.StepSamplingParams)
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=0, logprobs=0, stop=("x",), stop_token_ids=(4, 9), n=2),
        SamplingParams(logit_bias=((3, -100.0), (7, 2.5), (11, 0.25))),
    ):
        decoded = sampling.build(sampling.fill(params, pb.StepSamplingParams()))
        assert decoded == params and isinstance(decoded.stop_token_ids, tuple)
    unset = sampling.fill(SamplingParams(seed=None, logprobs=None), pb.StepSamplingParams())
    assert not unset.HasField("seed") and not unset.HasField("logprobs")


def test_copy_fields_leaves_out_what_the_message_does_not_have() -> None:
    response = copy_fields(INFO, api_pb2.ModelInfoResponse, has_chat_template=True)
    assert response.model_id == "m" and list(response.eos_token_ids) == [2, 5] and response.has_chat_template
    assert "tokenizer_path" not in api_pb2.ModelInfoResponse.DESCRIPTOR.fields_by_name  # a server path stays inside
