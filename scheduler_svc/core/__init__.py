"""The pure scheduling core: requests, KV blocks, the prefix tree and continuous batching.

No I/O, no asyncio, no grpc, no zmq, no torch: the service around it (`scheduler_svc.server`)
drives it one `schedule()`/`update()` pair per step.
"""
