"""Prefix-cache namespaces: which requests may share KV blocks.

A namespace is derived on the server from the model identity and the caller's tenant;
the client's `cache_salt` can only subdivide its own tenant's space. Two tenants
therefore never match each other's prefixes, so cache-hit timing cannot leak prompts
across tenants. Without `--auth-token-file` every caller is the tenant "anonymous"
(`tenant_from_metadata`); with it, the servicer maps the bearer token to its tenant
(`kvserve.scheduler.server.auth.TokenTable`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

ANONYMOUS_TENANT = "anonymous"


def tenant_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The tenant of a call when no token table is configured: everyone is anonymous."""
    del metadata
    return ANONYMOUS_TENANT


def prefix_namespace(model_id: str, tenant: str, cache_salt: str = "") -> str:
    """A short, stable id for (model, tenant, salt); length-prefixed so no two triples collide."""
    digest = hashlib.sha256()
    for part in (model_id, tenant, cache_salt):
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()[:32]
