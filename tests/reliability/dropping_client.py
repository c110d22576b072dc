"""A client process that opens streams and reads them until it is killed (never cancels).

    python -m tests.reliability.dropping_client ADDRESS KEY [KEY ...]

Each KEY becomes one long greedy stream (`kvserve.testing.stream_requests.greedy_request`). Once every
stream has delivered its first chunk it prints `READY` and keeps reading; the test then
SIGKILLs it at a random moment, so the server sees connections vanish mid-stream with no
cancel call, exactly like a crashed client or a dropped network.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from kvserve.protos.kvserve.v1 import api_pb2_grpc
from kvserve.testing.stream_requests import greedy_request

DROP_MAX_TOKENS = 4000


async def _read(stub, key: int, first: asyncio.Event) -> None:
    call = stub.Generate(greedy_request(key, DROP_MAX_TOKENS), timeout=300)
    async for _ in call:
        first.set()


async def main(address: str, keys: list[int]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        firsts = [asyncio.Event() for _ in keys]
        tasks = [asyncio.create_task(_read(stub, k, e)) for k, e in zip(keys, firsts)]
        await asyncio.gather(*(e.wait() for e in firsts))
        print("READY", flush=True)
        await asyncio.gather(*tasks)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], [int(k) for k in sys.argv[2:]]))
