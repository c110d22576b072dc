"""The JSON body of a request, read with a size limit and parsed without ever raising a 500.

The body is read chunk by chunk and refused (413) as soon as it passes
`--max-request-bytes`, so an oversize or endless upload is never buffered whole. A body
that is not a JSON object is a 400 naming what was wrong; no traceback is logged for it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from kvserve.scheduler.server.http.browser_policy import require_json_content_type
from kvserve.scheduler.server.http.errors import ApiError, bad_field
from kvserve.scheduler.server.http.json_fields import json_type


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the {limit}-byte limit", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """At most `limit` bytes; ApiError 413 beyond, by Content-Length at once or while streaming."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 415 unless sent as application/json (browser_policy.py), 400 for
    invalid JSON (with its position) or another JSON type."""
    require_json_content_type(request)
    body = await read_body(request, limit)
    if not body.strip():
        raise bad_field(None, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise bad_field(
            None, f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", code="invalid_json"
        ) from None
    except (ValueError, RecursionError) as exc:  # bad UTF-8, or nesting too deep to parse
        raise bad_field(None, f"the body is not valid JSON: {type(exc).__name__}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_field(None, f"the body must be a JSON object, got {json_type(data)}", code="invalid_json")
    return data
