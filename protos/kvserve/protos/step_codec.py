"""Convert the step contract (`kvserve.protos.step` dataclasses) to and from its protobuf form.

This runs twice per step on each side, so it avoids per-sequence protobuf objects on
the hot path: cached sequences and outputs travel as parallel packed arrays (see
`executor_link.proto`), filled with one `extend` per column and read back with one
`list()` per column. Only new sequences, which are rare, get a message each. `ExecutorInfo`
and `SamplingParams` mirror their messages field for field and convert through one
table each (`message_fields.py`).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from itertools import accumulate, chain
from operator import attrgetter
from typing import TypeVar

from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.message_fields import field_table
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

__all__ = [
    "PROTOCOL_VERSION",
    "decode_info",
    "decode_plan",
    "decode_result",
    "decode_sampling",
    "encode_info",
    "encode_plan",
    "encode_result",
    "encode_sampling",
]

T = TypeVar("T")


PROTOCOL_VERSION = 8
"""Sent in every Handshake; bump it when a change to executor_link.proto breaks old peers."""

_seq_id = attrgetter("seq_id")
_num_computed = attrgetter("num_computed_tokens")
_num_scheduled = attrgetter("num_scheduled_tokens")
_new_token_ids = attrgetter("new_token_ids")
_new_block_ids = attrgetter("new_block_ids")
_draft_token_ids = attrgetter("draft_token_ids")
_token_id = attrgetter("token_id")


# --- ExecutorInfo ----------------------------------------------------------------


_INFO = field_table(ExecutorInfo, pb.ExecutorInfo)
_SAMPLING = field_table(SamplingParams, pb.StepSamplingParams)


def encode_info(info: ExecutorInfo, out: pb.ExecutorInfo | None = None) -> pb.ExecutorInfo:
    return _INFO.fill(info, pb.ExecutorInfo() if out is None else out)


def decode_info(msg: pb.ExecutorInfo) -> ExecutorInfo:
    return typing.cast(ExecutorInfo, _INFO.build(msg))


# --- SamplingParams --------------------------------------------------------------


def encode_sampling(params: SamplingParams, out: pb.StepSamplingParams) -> None:
    _SAMPLING.fill(params, out)


def decode_sampling(msg: pb.StepSamplingParams) -> SamplingParams:
    return typing.cast(SamplingParams, _SAMPLING.build(msg))


# --- StepPlan --------------------------------------------------------------------


def encode_plan(plan: StepPlan, out: pb.StepPlan | None = None) -> pb.StepPlan:
    """Fill `out` (e.g. an envelope's `plan` field) or a new message from `plan`."""
    msg = pb.StepPlan() if out is None else out
    msg.step_id = plan.step_id
    for seq in plan.new_seqs:
        m = msg.new_seqs.add()
        m.seq_id = seq.seq_id
        m.token_ids.extend(seq.token_ids)
        m.prompt_len = seq.prompt_len
        m.num_computed_tokens = seq.num_computed_tokens
        m.num_scheduled_tokens = seq.num_scheduled_tokens
        m.block_table.extend(seq.block_table)
        encode_sampling(seq.sampling, m.sampling)
        m.seed = seq.seed
        m.lora_name = seq.lora_name
    cached = plan.known_seqs
    if cached:
        c = msg.known_seqs
        c.seq_ids.extend(map(_seq_id, cached))
        c.num_computed_tokens.extend(map(_num_computed, cached))
        c.num_scheduled_tokens.extend(map(_num_scheduled, cached))
        token_lists = list(map(_new_token_ids, cached))
        c.new_token_counts.extend(map(len, token_lists))
        c.new_token_ids.extend(chain.from_iterable(token_lists))
        block_lists = list(map(_new_block_ids, cached))
        if any(block_lists):
            c.new_block_counts.extend(map(len, block_lists))
            c.new_block_ids.extend(chain.from_iterable(block_lists))
        draft_lists = list(map(_draft_token_ids, cached))
        if any(draft_lists):
            c.draft_counts.extend(map(len, draft_lists))
            c.draft_token_ids.extend(chain.from_iterable(draft_lists))
    _encode_pairs(plan.copies, msg.copies)
    _encode_pairs(plan.swap_out, msg.swap_out)
    _encode_pairs(plan.swap_in, msg.swap_in)
    msg.drop_seq_ids.extend(plan.drop_seq_ids)
    if plan.trims:
        msg.trim_seq_ids.extend([seq_id for seq_id, _ in plan.trims])
        msg.trim_block_counts.extend([count for _, count in plan.trims])
    if plan.draft_requests:
        msg.draft_request_seq_ids.extend([seq_id for seq_id, _ in plan.draft_requests])
        msg.draft_request_counts.extend([count for _, count in plan.draft_requests])
    if plan.mask_seq_ids:
        msg.mask_seq_ids.extend(plan.mask_seq_ids)
        msg.token_masks = plan.token_masks
    if plan.store_blocks:
        msg.store_blocks.extend([block for block, _ in plan.store_blocks])
        msg.store_keys.extend([key for _, key in plan.store_blocks])
    if plan.load_blocks:
        msg.load_blocks.extend([block for block, _ in plan.load_blocks])
        msg.load_keys.extend([key for _, key in plan.load_blocks])
    return msg


def decode_plan(msg: pb.StepPlan) -> StepPlan:
    new_seqs = [
        NewSequence(
            seq_id=m.seq_id,
            token_ids=list(m.token_ids),
            prompt_len=m.prompt_len,
            num_computed_tokens=m.num_computed_tokens,
            num_scheduled_tokens=m.num_scheduled_tokens,
            block_table=list(m.block_table),
            sampling=decode_sampling(m.sampling),
            seed=m.seed,
            lora_name=m.lora_name,
        )
        for m in msg.new_seqs
    ]
    mask_seq_ids = list(msg.mask_seq_ids)
    c = msg.known_seqs
    seq_ids = c.seq_ids[:]
    n = len(seq_ids)
    new_tokens = _split(c.new_token_ids[:], c.new_token_counts[:], n, "new_token")
    if c.new_block_counts:
        new_blocks = _split(c.new_block_ids[:], c.new_block_counts[:], n, "new_block")
    else:
        new_blocks = [[] for _ in range(n)]
    columns = [
        seq_ids,
        new_tokens,
        _column(c.num_computed_tokens, n, "num_computed_tokens"),
        _column(c.num_scheduled_tokens, n, "num_scheduled_tokens"),
        new_blocks,
    ]
    if c.draft_counts:
        columns.append(_split(c.draft_token_ids[:], c.draft_counts[:], n, "draft"))
    known_seqs = list(map(KnownSequence, *columns))
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=new_seqs,
        known_seqs=known_seqs,
        copies=_decode_pairs(msg.copies),
        swap_out=_decode_pairs(msg.swap_out),
        swap_in=_decode_pairs(msg.swap_in),
        drop_seq_ids=list(msg.drop_seq_ids),
        trims=list(zip(msg.trim_seq_ids, msg.trim_block_counts, strict=True)),
        draft_requests=list(zip(msg.draft_request_seq_ids, msg.draft_request_counts, strict=True)),
        mask_seq_ids=mask_seq_ids,
        token_masks=_token_masks(msg.token_masks, len(mask_seq_ids)),
        store_blocks=list(zip(msg.store_blocks, msg.store_keys, strict=True)),
        load_blocks=list(zip(msg.load_blocks, msg.load_keys, strict=True)),
    )


# --- StepResult ------------------------------------------------------------------


def encode_result(result: StepResult, out: pb.StepResult | None = None) -> pb.StepResult:
    msg = pb.StepResult() if out is None else out
    msg.step_id = result.step_id
    msg.execute_time_s = result.execute_time_s
    outputs = result.outputs
    msg.seq_ids.extend(map(_seq_id, outputs))
    msg.token_ids.extend(map(_token_id, outputs))
    if any(o.logprob is not None or o.top_logprobs for o in outputs):
        msg.has_logprob.extend([o.logprob is not None for o in outputs])
        msg.logprobs.extend([0.0 if o.logprob is None else o.logprob for o in outputs])
        msg.top_counts.extend([len(o.top_logprobs) for o in outputs])
        msg.top_token_ids.extend([t.token_id for o in outputs for t in o.top_logprobs])
        msg.top_logprobs.extend([t.logprob for o in outputs for t in o.top_logprobs])
    if result.proposals:
        msg.proposal_seq_ids.extend([seq_id for seq_id, _ in result.proposals])
        msg.proposal_counts.extend([len(tokens) for _, tokens in result.proposals])
        msg.proposal_token_ids.extend(chain.from_iterable(tokens for _, tokens in result.proposals))
    msg.failed_load_blocks.extend(result.failed_load_blocks)
    msg.disk_load_blocks.extend(result.disk_load_blocks)
    msg.dropped_keys.extend(result.dropped_keys)
    return msg


def decode_result(msg: pb.StepResult) -> StepResult:
    seq_ids = msg.seq_ids[:]
    token_ids = msg.token_ids[:]
    if len(token_ids) != len(seq_ids):
        raise ValueError(f"StepResult: {len(seq_ids)} seq_ids but {len(token_ids)} token_ids")
    if not msg.has_logprob:
        outputs = list(map(SampledToken, seq_ids, token_ids))
    else:
        n = len(seq_ids)
        if len(msg.has_logprob) != n or len(msg.logprobs) != n:
            raise ValueError("StepResult: logprob columns do not match the outputs")
        tops = _split(
            [TokenLogprob(t, lp) for t, lp in zip(msg.top_token_ids, msg.top_logprobs, strict=True)],
            list(msg.top_counts),
            n,
            "top_logprob",
        )
        outputs = [
            SampledToken(s, t, lp if has else None, top)
            for s, t, has, lp, top in zip(seq_ids, token_ids, msg.has_logprob, msg.logprobs, tops)
        ]
    proposals: list[tuple[int, list[int]]] = []
    if msg.proposal_seq_ids:
        proposed = msg.proposal_seq_ids[:]
        tokens = _split(msg.proposal_token_ids[:], msg.proposal_counts[:], len(proposed), "proposal")
        proposals = list(zip(proposed, tokens, strict=True))
    return StepResult(
        step_id=msg.step_id,
        outputs=outputs,
        execute_time_s=msg.execute_time_s,
        proposals=proposals,
        failed_load_blocks=list(msg.failed_load_blocks),
        disk_load_blocks=list(msg.disk_load_blocks),
        dropped_keys=list(msg.dropped_keys),
    )


# --- internals -------------------------------------------------------------------


def _encode_pairs(pairs: list[tuple[int, int]], out: pb.BlockPairs) -> None:
    if pairs:
        out.src.extend([a for a, _ in pairs])
        out.dst.extend([b for _, b in pairs])


def _decode_pairs(msg: pb.BlockPairs) -> list[tuple[int, int]]:
    return list(zip(msg.src, msg.dst, strict=True))


def _token_masks(masks: bytes, rows: int) -> bytes:
    """The mask rows, checked to split evenly into whole uint32 words per sequence."""
    if rows == 0:
        if masks:
            raise ValueError("token_masks sent without mask_seq_ids")
        return b""
    if len(masks) % (4 * rows):
        raise ValueError(f"token_masks has {len(masks)} bytes, not {rows} rows of whole uint32 words")
    return masks


def _column(values: Sequence[T], expected: int, what: str) -> list[T]:
    column = list(values)
    if len(column) != expected:
        raise ValueError(f"{what} has {len(column)} entries, expected {expected}")
    return column


def _split(flat: list, counts: list[int], expected: int, what: str) -> list[list]:
    """Cut `flat` into consecutive runs of `counts[i]` items (the columnar list encoding)."""
    if len(counts) != expected:
        raise ValueError(f"{what}_counts has {len(counts)} entries, expected {expected}")
    if len(flat) == expected and counts.count(1) == expected:
        return [[x] for x in flat]  # the decode step: one new token per sequence
    if not flat:
        if any(counts):
            raise ValueError(f"{what}_counts promise items but none were sent")
        return [[] for _ in counts]
    ends = list(accumulate(counts))
    if ends[-1] != len(flat) or any(c < 0 for c in counts):
        raise ValueError(f"{what}_counts do not add up to the {len(flat)} items sent")
    starts = [0, *ends[:-1]]
    return [flat[a:b] for a, b in zip(starts, ends)]
