from __future__ import annotations

from kvserve.scheduler.server.security.namespaces import ANONYMOUS_TENANT, prefix_namespace, tenant_from_metadata


def test_namespace_separates_model_tenant_and_salt() -> None:
    base = prefix_namespace("m", "t", "")
    assert base == prefix_namespace("m", "t", "")
    others = {prefix_namespace("m2", "t", ""), prefix_namespace("m", "t2", ""), prefix_namespace("m", "t", "s")}
    assert base not in others and len(others) == 3


def test_namespace_parts_cannot_be_shifted_into_each_other() -> None:
    assert prefix_namespace("m", "ab", "c") != prefix_namespace("m", "a", "bc")
    assert prefix_namespace("m", "a\x1fb", "") != prefix_namespace("m", "a", "b")


def test_without_auth_every_caller_is_anonymous() -> None:
    assert tenant_from_metadata([("authorization", "Bearer x")]) == ANONYMOUS_TENANT
    assert tenant_from_metadata(None) == ANONYMOUS_TENANT
