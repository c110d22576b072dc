"""Requests the real-model structured-output tests share: a person as a JSON schema, twelve people to
describe, and every chat completion of a list sent at once through the async OpenAI SDK."""

from __future__ import annotations

import asyncio

import openai

from kvserve.testing.server_launcher import ServeProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "neutral"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "hobbies"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired sailor", "a young painter", "a busy doctor", "a curious child", "a famous chef", "a quiet librarian",
    "a marathon runner", "a jazz musician", "a software engineer", "a farmer", "an astronaut", "a gardener",
]  # fmt: skip


def person_prompt(who: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {who} as JSON with name, age, mood and hobbies."}]


def ask_all(server: ServeProcess, requests: list[dict]) -> list:
    """Every chat completion request at once, through the async OpenAI SDK."""

    async def scenario() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = (await client.models.list()).data[0].id
        try:
            return await asyncio.gather(*(client.chat.completions.create(model=model, **r) for r in requests))
        finally:
            await client.close()

    return asyncio.run(scenario())
