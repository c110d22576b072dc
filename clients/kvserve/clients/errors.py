"""The one exception the clients raise for a failed RPC, so callers catch a single type."""

from __future__ import annotations

import grpc


class KVServeError(Exception):
    """A call ended with a non-OK gRPC status. `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> KVServeError:
        """Convert the error of a sync or asyncio call (both expose code() and details())."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error))
