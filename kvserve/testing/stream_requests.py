"""Deterministic Generate requests, and reading a whole stream back, for checks against a served kvserve."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc


def greedy_request(key: int, max_tokens: int, *, prompt_len: int = 24, **fields: Any) -> api_pb2.GenerateRequest:
    """A deterministic token-id prompt; greedy with ignore_eos so the length is exact."""
    ids = [(key * 7919 + i * 104729) % 40000 + 100 for i in range(prompt_len)]
    return api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


async def collect(
    stub: api_pb2_grpc.KVServeStub,
    request: api_pb2.GenerateRequest,
    *,
    timeout_s: float = 120.0,
    metadata: Sequence[tuple[str, str]] = (),
) -> tuple[list[int], int]:
    """(token ids, finish reason) of a whole stream."""
    ids: list[int] = []
    reason = 0
    async for chunk in stub.Generate(request, timeout=timeout_s, metadata=tuple(metadata)):
        ids.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return ids, reason
