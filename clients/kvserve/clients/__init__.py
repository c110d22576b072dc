"""Python clients for the kvserve gRPC API, blocking (`Client`) and asyncio (`AsyncClient`).

They import only grpc, the generated stubs and the standard library, so they can be
vendored into an application without the server's dependencies.

    from kvserve.clients import Client
    with Client() as client:
        for chunk in client.stream("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
"""

from kvserve.clients.async_client import AsyncChunkStream, AsyncClient
from kvserve.clients.channel import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TARGET
from kvserve.clients.errors import KVServeError
from kvserve.clients.sync_client import ChunkStream, Client
from kvserve.clients.types import Chunk, Completion, SpeculativeUsage, TokenLogprobs, ToolCall, Usage

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TARGET",
    "AsyncChunkStream",
    "AsyncClient",
    "Chunk",
    "ChunkStream",
    "Client",
    "Completion",
    "KVServeError",
    "SpeculativeUsage",
    "TokenLogprobs",
    "ToolCall",
    "Usage",
]
