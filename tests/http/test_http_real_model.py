"""The real default model over HTTP: the SDK's greedy answer says Tokyo and equals gRPC's, token for token.

Tokyo, not Paris: the default's Q4_1 x Q8 arithmetic (llama.cpp's) answers France with
"L'Étoile, la Marseillaise...", as llama-server does on the same GGUF.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from tests.http.http_clients import sdk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = "What is the capital of Japan?"
MAX_TOKENS = 32


def test_real_model_http_answer_equals_grpc(real_model_server) -> None:
    server = real_model_server
    client = sdk(server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    text = answer.choices[0].message.content
    assert "Tokyo" in text, text

    request = api_pb2.GenerateRequest(
        chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content=QUESTION)]),
        sampling=api_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    with grpc.insecure_channel(server.address) as channel:
        chunks = list(api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=600))
    grpc_text = "".join(c.text for c in chunks)
    grpc_ids = [t for c in chunks for t in c.token_ids]
    assert text == grpc_text
    assert answer.usage.completion_tokens == len(grpc_ids)
    (usage,) = [c.usage for c in chunks if c.HasField("usage")]
    assert answer.usage.prompt_tokens == usage.prompt_tokens
    tokenized = httpx.post(f"{server.http_url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert tokenized["count"] == answer.usage.prompt_tokens

    streamed = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
