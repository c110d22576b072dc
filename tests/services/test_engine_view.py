"""The engine view's snapshot: what each viewer sees of the pool and the tree, and that it stays bounded."""

from __future__ import annotations

import json

from kvserve.config import defaults
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.server.engine_view.snapshot import (
    EngineSources,
    Viewer,
    build_view,
    encode_event,
    fit_event,
)
from kvserve.scheduler.server.observability.step_history import StepHistory
from kvserve.scheduler.server.security.namespaces import NamespaceOwners, scoped_request_id
from tests.scheduler.harness import Harness

BLOCK = 4
SYSTEM = list(range(1, 4 * BLOCK + 1))
"""A 'system prompt' of four full blocks that two requests share."""


def _decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _sources(h: Harness, owners: NamespaceOwners, history: StepHistory | None = None) -> EngineSources:
    return EngineSources(
        view=h.scheduler.view(),
        history=history or StepHistory(),
        owners=owners,
        decode=_decode,
        executor_state="ready",
        now_wall=1_000.0,
        now_monotonic=1e12,
    )


def _add(h: Harness, owners: NamespaceOwners, tenant: str, request_id: str, prompt: list[int], **sampling) -> None:
    namespace = f"ns-{tenant}"
    owners.note(namespace, tenant)
    h.add(scoped_request_id(tenant, request_id), prompt, namespace=namespace, **sampling)


def _harness(num_blocks: int = 64) -> Harness:
    return Harness(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_model_len=256))


def test_a_tenant_sees_its_own_requests_and_text_and_only_anonymous_cells_of_others() -> None:
    h, owners = _harness(), NamespaceOwners()
    _add(h, owners, "alice", "a1", [*SYSTEM, 50, 51], max_tokens=30, ignore_eos=True)
    _add(h, owners, "bob", "b1", [*range(100, 100 + 3 * BLOCK), 7], max_tokens=30, ignore_eos=True)
    for _ in range(3):
        h.step()
    alice = build_view(_sources(h, owners), Viewer("alice"))
    bob = build_view(_sources(h, owners), Viewer("bob"))
    admin = build_view(_sources(h, owners), Viewer("root", admin=True))

    assert [o["id"] for o in alice["pool"]["owners"]] == ["a1"], "ids without the tenant scope, own only"
    assert [o["id"] for o in bob["pool"]["owners"]] == ["b1"]
    assert {o["id"] for o in admin["pool"]["owners"]} == {"alice/a1", "bob/b1"}
    # Both hold blocks: each tenant sees the other's as 'o' and never as its own states.
    for snapshot in (alice, bob):
        cells = snapshot["pool"]["cells"]
        assert cells.count("o") > 0 and cells.count("r") > 0
    assert "o" not in admin["pool"]["cells"]
    a_cells = {c for o in alice["pool"]["owners"] for first, n in o["runs"] for c in range(first, first + n)}
    assert all(alice["pool"]["cells"][c] == "r" for c in a_cells)
    assert all(bob["pool"]["cells"][c] == "o" for c in a_cells)
    h.run()  # both finish: their full blocks stay cached in the tree
    alice = build_view(_sources(h, owners), Viewer("alice"))
    text = json.dumps(alice)
    assert "t1 t2" in text and "t100" not in text, "alice's tree shows her tokens, never bob's"
    assert alice["pool"]["cells"].count("c") > 0 and alice["pool"]["cells"].count("o") > 0
    assert json.dumps(build_view(_sources(h, owners), Viewer("carol"))["tree"]["subtrees"]) == "[]"


def test_a_shared_system_prompt_is_one_subtree_whose_hits_grow() -> None:
    h, owners = _harness(), NamespaceOwners()
    _add(h, owners, "anonymous", "first", [*SYSTEM, 60, 61, 62], max_tokens=2)
    h.run()
    before = build_view(_sources(h, owners), Viewer("anonymous"))["tree"]["subtrees"]
    assert len(before) == 1 and before[0]["hits"] == 0
    _add(h, owners, "anonymous", "second", [*SYSTEM, 70, 71, 72], max_tokens=2)
    h.run()
    after = build_view(_sources(h, owners), Viewer("anonymous"))["tree"]["subtrees"]
    assert len(after) == 1, "one shared subtree, not one per request"
    top = after[0]
    assert top["hits"] == 1 and top["text"].startswith("t1 t2 t3")
    assert top["tokens"] == len(SYSTEM), "the shared chain is one edge, up to where the requests differ"
    assert len(top["children"]) == 2
    assert top["blocks"] == 1 + sum(c["blocks"] for c in top["children"]) + (len(SYSTEM) // BLOCK - 1)


def test_shared_blocks_carry_their_ref_counts() -> None:
    h, owners = _harness(), NamespaceOwners()
    _add(h, owners, "anonymous", "n2", SYSTEM + [9], max_tokens=20, n=2, ignore_eos=True, temperature=1.0)
    for _ in range(3):
        h.step()
    pool = build_view(_sources(h, owners), Viewer("anonymous"))["pool"]
    shared = dict(map(tuple, pool["refs"]))
    assert shared and all(ref == 2 for ref in shared.values()), "two completions of one prompt share its blocks"
    assert all(pool["cells"][cell] == "s" for cell in shared)


def test_a_pool_past_the_cell_cap_is_grouped() -> None:
    blocks = defaults.UI_MAX_CELLS * 3 + 5
    h, owners = _harness(num_blocks=blocks), NamespaceOwners()
    _add(h, owners, "anonymous", "r", list(range(1, 40)), max_tokens=4, ignore_eos=True)
    h.step()
    pool = build_view(_sources(h, owners), Viewer("anonymous"))["pool"]
    assert pool["blocks_per_cell"] == 4 and len(pool["cells"]) == -(-blocks // 4) <= defaults.UI_MAX_CELLS
    assert pool["cells"][:3] == "rrr" and set(pool["cells"][3:]) == {"f"}


def test_2000_blocks_and_200_requests_stay_under_the_event_bound() -> None:
    h, owners = _harness(num_blocks=2000), NamespaceOwners()
    history = StepHistory()
    for i in range(200):
        prompt = [*SYSTEM, *range(200 + 7 * i, 200 + 7 * i + 1 + i % 13)]
        _add(h, owners, "anonymous", f"req-{i}", prompt, max_tokens=40, ignore_eos=True)
    for _ in range(12):
        plan = h.step()
        history.record(plan.num_scheduled_tokens, len(plan.known_seqs), 5, 100, 50)
    snapshot = build_view(_sources(h, owners, history), Viewer("anonymous"))
    assert len(snapshot["pool"]["owners"]) == defaults.UI_MAX_OWNERS
    assert snapshot["pool"]["owners_omitted"] == snapshot["queues"]["running"] - defaults.UI_MAX_OWNERS
    size = len(fit_event(snapshot))
    assert size <= defaults.UI_MAX_EVENT_BYTES, size
    assert len(snapshot["tree"]["subtrees"]) >= 1 and len(snapshot["series"]) == defaults.UI_SERIES_SECONDS


def test_fit_event_sheds_names_and_tree_before_passing_the_bound() -> None:
    h, owners = _harness(num_blocks=400), NamespaceOwners()
    for i in range(40):
        _add(h, owners, "anonymous", f"r{i}", [*range(1000 + 50 * i, 1000 + 50 * i + 30)], max_tokens=3)
    h.run()
    for i in range(40):
        _add(h, owners, "anonymous", f"q{i}", [1, 2, 3, 4, 5], max_tokens=30, ignore_eos=True)
    h.step()
    snapshot = build_view(_sources(h, owners), Viewer("anonymous"))
    full = len(encode_event(snapshot))
    limit = full // 2
    data = fit_event(snapshot, limit)
    assert len(data) <= limit < full
    assert json.loads(data)["pool"]["owners_omitted"] > 0


def test_the_series_fills_idle_seconds_and_survives_a_counter_reset() -> None:
    now = [5_000.2]
    history = StepHistory(clock=lambda: now[0])
    history.record(10, 0, 1, queried_total=100, hit_total=40)
    now[0] = 5_002.5
    history.record(0, 3, 3, queried_total=200, hit_total=140)
    now[0] = 5_003.1
    history.record(0, 3, 3, queried_total=10, hit_total=5)  # a new scheduler started its counters over
    points = history.series()
    assert len(points) == defaults.UI_SERIES_SECONDS and points[-1][0] == 5_003
    by_second = {second: (tokens, rate) for second, tokens, rate in points}
    assert by_second[5_000] == (1, 0.4)
    assert by_second[5_001] == (0, None), "an idle second reads no tokens and no rate"
    assert by_second[5_002] == (3, 1.0)
    assert by_second[5_003] == (3, 0.5)
    assert [s.prefill_tokens for s in history.steps] == [10, 0, 0]
