from __future__ import annotations

from kvserve.scheduler.server.security.namespaces import (
    ANONYMOUS_TENANT,
    namespace_lora,
    prefix_namespace,
    tenant_from_metadata,
)


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


def test_each_lora_adapter_has_its_own_namespace_and_names_it() -> None:
    base = prefix_namespace("m", "t", "s")
    alpha, beta = prefix_namespace("m", "t", "s", "alpha", 1), prefix_namespace("m", "t", "s", "beta", 2)
    assert len({base, alpha, beta}) == 3, "the same tokens under two adapters never share KV"
    assert alpha == prefix_namespace("m", "t", "s", "alpha", 1), "the same adapter does"
    assert prefix_namespace("m", "t2", "s", "alpha", 1) != alpha and prefix_namespace("m", "t", "", "alpha", 1) != alpha
    assert prefix_namespace("m", "t", "s", "alpha", 3) != alpha, "nor does another adapter loaded under its name"
    assert base == prefix_namespace("m", "t", "s", ""), "the base model's namespaces are as before adapters"
    assert [namespace_lora(ns) for ns in (base, alpha, beta)] == [(0, ""), (1, "alpha"), (2, "beta")]
    assert namespace_lora(prefix_namespace("m", "t", "", "a+b/c", 12)) == (12, "a+b/c")
