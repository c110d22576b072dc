"""Prefix-cache namespaces: which requests may share KV blocks.

A namespace is derived on the server from the model identity, the LoRA adapter the request
runs under and the caller's tenant; the client's `cache_salt` can only subdivide its own
tenant's space. The same tokens under two adapters have different KV, so an adapter's
requests share blocks only with requests under that same adapter (and the base model's with
the base model's); the adapter's id and name end its namespaces (`namespace_lora`), so the KV
events can name it, and an adapter loaded later under a name another had (another id) never
matches the first one's blocks. Two tenants therefore never match each other's prefixes, so
cache-hit timing cannot leak prompts across tenants. Without `--auth-token-file` every caller is the tenant "anonymous"
(`tenant_from_metadata`); with it, the servicer maps the bearer token to its tenant
(`kvserve.scheduler.server.security.auth.TokenTable`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

ANONYMOUS_TENANT = "anonymous"


def tenant_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The tenant of a call when no token table is configured: everyone is anonymous."""
    del metadata
    return ANONYMOUS_TENANT


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The engine-wide id of a client's request: tenants may reuse ids and only abort their own."""
    return f"{tenant}/{request_id}"


def tenant_of_scoped_id(scoped_id: str) -> str:
    """The tenant a `scoped_request_id` names (tenant names hold no `/`)."""
    return scoped_id.split("/", 1)[0]


def client_request_id(scoped_id: str) -> str:
    """The id the client gave, as its own tenant knows it."""
    return scoped_id.split("/", 1)[-1]


_DIGEST_CHARS = 32
_LORA_SEPARATOR = "+"


def prefix_namespace(model_id: str, tenant: str, cache_salt: str = "", lora_name: str = "", lora_id: int = 0) -> str:
    """A short, stable id for (model, tenant, salt) and, under a LoRA adapter, the adapter (its name and
    id): a digest of the parts, length-prefixed so no two tuples collide, followed for an adapter by
    `+ID+NAME`."""
    digest = hashlib.sha256()
    parts = (model_id, tenant, cache_salt, lora_name, str(lora_id)) if lora_name else (model_id, tenant, cache_salt)
    for part in parts:
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    namespace = digest.hexdigest()[:_DIGEST_CHARS]
    return f"{namespace}{_LORA_SEPARATOR}{lora_id}{_LORA_SEPARATOR}{lora_name}" if lora_name else namespace


def namespace_lora(namespace: str) -> tuple[int, str]:
    """The LoRA adapter of a `prefix_namespace`: its id and name ((0, ""): the base model)."""
    adapter = namespace[_DIGEST_CHARS:]
    if not adapter.startswith(_LORA_SEPARATOR):
        return 0, ""
    lora_id, _, name = adapter[1:].partition(_LORA_SEPARATOR)
    return int(lora_id), name


class NamespaceOwners:
    """namespace -> tenant for the namespaces recently used, newest last (`MAX_NAMESPACE_OWNERS` at most).

    A namespace is a one-way hash, so the engine view cannot tell whose a cached block is
    without this record. A namespace that fell out of it belongs to nobody the view knows,
    and is shown to no tenant (only to an admin): forgetting fails closed.
    """

    MAX_NAMESPACE_OWNERS = 4096

    def __init__(self) -> None:
        self._owners: OrderedDict[str, str] = OrderedDict()

    def note(self, namespace: str, tenant: str) -> None:
        self._owners[namespace] = tenant
        self._owners.move_to_end(namespace)
        if len(self._owners) > self.MAX_NAMESPACE_OWNERS:
            self._owners.popitem(last=False)

    def tenant_of(self, namespace: str) -> str | None:
        return self._owners.get(namespace)
