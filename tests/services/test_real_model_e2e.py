"""`kvserve serve` on the real default model (CPU): health, a greedy chat answer, batching == alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Give me a synonym for happy.",
    "What is the largest planet?",
    "Translate 'hello' to Spanish.",
    "What color is the sky?",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Name a famous painter.",
    "What is the speed of light?",
    "Tell me a fun fact about cats.",
    "What language is spoken in Brazil?",
]
MAX_TOKENS = 12


def _chat(question: str, max_tokens: int = MAX_TOKENS) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content=question)]),
        sampling=api_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )


async def _text(stub: api_pb2_grpc.KVServeStub, request: api_pb2.GenerateRequest) -> tuple[str, list[int], int]:
    text, ids, reason = "", [], 0
    async for chunk in stub.Generate(request, timeout=600):
        text += chunk.text
        ids.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return text, ids, reason


def test_real_model_serves_chat_and_batches_like_alone(real_model_server) -> None:
    server = real_model_server

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            # Tokyo, not Paris: the default's Q4_1 x Q8 arithmetic (llama.cpp's) answers France with
            # "L'Étoile, la Marseillaise...", as llama-server does on the same GGUF.
            answer, _, reason = await _text(stub, _chat("What is the capital of Japan?", 32))
            alone = [await _text(stub, _chat(q)) for q in QUESTIONS]
            together = await asyncio.gather(*(_text(stub, _chat(q)) for q in QUESTIONS))
            return answer, reason, alone, together

    answer, reason, alone, together = asyncio.run(scenario())
    assert "Tokyo" in answer, answer
    assert reason in (api_pb2.FINISH_REASON_EOS, api_pb2.FINISH_REASON_LENGTH)
    for question, single, batched in zip(QUESTIONS, alone, together):
        assert batched == single, question
        assert single[0].strip()
