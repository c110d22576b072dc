"""The engine view: one bounded JSON snapshot of the block pool, the prefix tree, the queues and the last steps.

The web page draws it (`http/ui_routes.py` streams it). Built on the engine's loop between
steps from the scheduler's read-only view, so it reads a consistent state without locks.

- **Bounded.** Every list has a cap in `kvserve.config.defaults` (`UI_*`), so an update stays
  under `UI_MAX_EVENT_BYTES` whatever the load: past `UI_MAX_CELLS` blocks a grid cell stands
  for several, hover names go to the largest requests, the tree shows its largest subtrees.
  `fit_event` then checks the encoded size, and sheds the named requests and the tree before
  it could ever pass the bound.
- **Tenant-blind.** A viewer sees token text, request ids and ref counts only in its own
  tenant's namespaces; everything else is an anonymous occupied cell ('o'), and subtrees of
  other tenants are left out. An admin viewer sees everything. A namespace whose tenant the
  engine no longer remembers is shown to admins only.
- **Cheap.** Cells are built in a bytearray from the pool's cached blocks and the sequences'
  block tables (O(blocks in use)), grouped with C-level `max` over slices; the tree walk is
  iterative, O(nodes of the visible namespaces).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.config import defaults
from kvserve.scheduler.core import PrefixNode, SchedulerView, Sequence
from kvserve.scheduler.server.observability.step_history import StepHistory
from kvserve.scheduler.server.security.namespaces import NamespaceOwners, client_request_id, tenant_of_scoped_id

VIEW_VERSION = 1

# Cell codes in priority order: a grouped cell shows its most telling block (max), then becomes a letter.
_FREE, _CACHED, _OTHER, _RUNNING, _SHARED = range(5)
_LETTERS = bytes.maketrans(bytes(range(5)), b"fcors")
_SWAPPED_LETTERS = bytes.maketrans(b"\x00\x01", b"fw")


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is watching: their tenant, and whether they may see every tenant."""

    tenant: str
    admin: bool = False

    def sees_request(self, scoped_id: str) -> bool:
        return self.admin or tenant_of_scoped_id(scoped_id) == self.tenant

    def sees_namespace(self, namespace: str, owners: NamespaceOwners) -> bool:
        return self.admin or owners.tenant_of(namespace) == self.tenant


@dataclass(frozen=True, slots=True)
class EngineSources:
    """What a snapshot reads, all owned by the engine's loop."""

    view: SchedulerView
    history: StepHistory
    owners: NamespaceOwners
    decode: Callable[[list[int]], str]
    executor_state: str
    now_wall: float
    now_monotonic: float


def build_view(src: EngineSources, viewer: Viewer) -> dict[str, Any]:
    """The snapshot `viewer` may see (the JSON schema the page reads, version VIEW_VERSION)."""
    view = src.view
    seqs = (*view.running, *view.waiting, *view.swapped)
    return {
        "v": VIEW_VERSION,
        "time": round(src.now_wall, 3),
        "step": view.step_id,
        "executor": src.executor_state,
        "viewer": {"tenant": viewer.tenant, "admin": viewer.admin},
        "pool": _pool(view, seqs, src.owners, viewer),
        "cpu": _cpu(view),
        "disk": _disk(view),
        "tree": _tree(view, src, viewer),
        "queues": {"running": len(view.running), "waiting": len(view.waiting), "swapped": len(view.swapped)},
        "steps": [[round(s.time, 3), s.prefill_tokens, s.decode_rows] for s in src.history.steps],
        "series": [
            [second, tokens, None if rate is None else round(rate, 3)] for second, tokens, rate in src.history.series()
        ],
    }


def encode_event(snapshot: dict[str, Any]) -> bytes:
    """One compact JSON line (the SSE `data:` of an update)."""
    return json.dumps(snapshot, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def fit_event(snapshot: dict[str, Any], limit: int = defaults.UI_MAX_EVENT_BYTES) -> bytes:
    """The encoded snapshot under `limit` bytes: named requests, then tree edges, are halved until it fits."""
    data = encode_event(snapshot)
    pool, tree = snapshot["pool"], snapshot["tree"]
    while len(data) > limit and (pool["owners"] or tree["subtrees"]):
        if pool["owners"]:
            keep = len(pool["owners"]) // 2
            pool["owners_omitted"] += len(pool["owners"]) - keep
            pool["owners"] = pool["owners"][:keep]
        else:
            keep = len(tree["subtrees"]) // 2
            tree["omitted"] += len(tree["subtrees"]) - keep
            tree["subtrees"] = tree["subtrees"][:keep]
        data = encode_event(snapshot)
    return data


# --- the block pool ------------------------------------------------------------------


def _pool(view: SchedulerView, seqs: Iterable[Sequence], owners: NamespaceOwners, viewer: Viewer) -> dict[str, Any]:
    pool, tree = view.pool, view.tree
    num_blocks = pool.num_blocks
    per_cell = _blocks_per_cell(num_blocks)
    codes = bytearray(num_blocks)  # _FREE
    visible: dict[str, bool] = {}  # namespace -> whether the viewer sees it (few namespaces, many blocks)
    for block in pool.cached_blocks_lru():
        node = tree.node_of(block)
        if node is None:
            codes[block] = _OTHER
            continue
        sees = visible.get(node.namespace)
        if sees is None:
            sees = visible[node.namespace] = viewer.sees_namespace(node.namespace, owners)
        codes[block] = _CACHED if sees else _OTHER
    refs = pool.ref_counts
    tables: dict[str, set[int]] = {}
    for seq in seqs:
        if not seq.block_table:
            continue
        if viewer.sees_request(seq.request.request_id):
            tables.setdefault(seq.request.request_id, set()).update(seq.block_table)
            for block in seq.block_table:
                codes[block] = _SHARED if refs[block] > 1 else _RUNNING
        else:
            for block in seq.block_table:
                codes[block] = max(codes[block], _OTHER)
    cells = _grouped(codes, per_cell)
    shared = [[cell, _max_ref(refs, cell, per_cell)] for cell, code in enumerate(cells) if code == _SHARED][
        : defaults.UI_MAX_OWNER_RUNS
    ]
    named, omitted = _owners(view, tables, per_cell, viewer)
    return {
        "num_blocks": num_blocks,
        "block_size": view.block_size,
        "blocks_per_cell": per_cell,
        "cells": cells.translate(_LETTERS).decode("ascii"),
        "refs": shared,
        "owners": named,
        "owners_omitted": omitted,
    }


def _disk(view: SchedulerView) -> dict[str, int | str] | None:
    """The prefix cache's tiers below the pool in totals (None without): a pool-wide figure, like `num_blocks`."""
    disk = view.disk
    if disk is None:
        return None
    return {
        "blocks": disk.blocks_on_disk,
        "loaded": disk.loaded_blocks,
        "stored": disk.stored_blocks,
        "failed": disk.failed_loads,
        "host_loaded": disk.host_loaded_blocks,
        "tiers": "+".join(disk.media),
    }


def _blocks_per_cell(num_blocks: int) -> int:
    """Blocks each grid cell stands for: 1 up to UI_MAX_CELLS blocks, then enough to stay within it."""
    return max(1, -(-num_blocks // defaults.UI_MAX_CELLS))


def _grouped(codes: bytearray, per_cell: int) -> bytearray:
    """One code per cell: the highest (most telling) of its blocks', by C-level max over slices."""
    if per_cell == 1:
        return codes
    return bytearray(max(codes[i : i + per_cell]) for i in range(0, len(codes), per_cell))


def _max_ref(refs: list[int], cell: int, per_cell: int) -> int:
    start = cell * per_cell
    return max(refs[start : start + per_cell])


def _owners(
    view: SchedulerView, tables: dict[str, set[int]], per_cell: int, viewer: Viewer
) -> tuple[list[dict[str, Any]], int]:
    """The largest visible requests with their cells as [first, count] runs, within the caps."""
    largest = sorted(tables.items(), key=lambda item: len(item[1]), reverse=True)
    named: list[dict[str, Any]] = []
    runs_left = defaults.UI_MAX_OWNER_RUNS
    for request_id, blocks in largest[: defaults.UI_MAX_OWNERS]:
        runs = _runs(sorted({block // per_cell for block in blocks}))
        if len(runs) > runs_left:
            break
        runs_left -= len(runs)
        request = view.requests.get(request_id)
        seqs = request.seqs if request is not None else []
        named.append(
            {
                "id": request_id if viewer.admin else client_request_id(request_id),
                "state": seqs[0].status.value if seqs else "finished",
                "prompt_tokens": len(request.prompt_token_ids) if request is not None else 0,
                "output_tokens": sum(len(s.token_ids) - s.prompt_len for s in seqs),
                "runs": runs,
            }
        )
    return named, len(largest) - len(named)


def _runs(cells: list[int]) -> list[list[int]]:
    """Sorted cell indices as [first, count] runs of consecutive cells."""
    runs: list[list[int]] = []
    for cell in cells:
        if runs and runs[-1][0] + runs[-1][1] == cell:
            runs[-1][1] += 1
        else:
            runs.append([cell, 1])
    return runs


def _cpu(view: SchedulerView) -> dict[str, Any]:
    """Swap space as cells: which CPU blocks hold a swapped-out sequence (no names: it is never hovered)."""
    cpu = view.cpu
    used = bytearray(b"\x01") * cpu.num_blocks
    for block in cpu.free_blocks():
        used[block] = 0
    used = _grouped(used, _blocks_per_cell(cpu.num_blocks))
    return {"num_blocks": cpu.num_blocks, "cells": used.translate(_SWAPPED_LETTERS).decode("ascii")}


# --- the prefix tree -------------------------------------------------------------------


def _tree(view: SchedulerView, src: EngineSources, viewer: Viewer) -> dict[str, Any]:
    """The largest visible subtrees, chains of single children drawn as one edge, biggest branches first."""
    tree = view.tree
    roots = [tree.root(ns) for ns in tree.namespaces() if viewer.sees_namespace(ns, src.owners)]
    sizes = _subtree_sizes(roots)
    nodes = sum(blocks for blocks, _ in (sizes[id(r)] for r in roots)) - len(roots)  # roots hold no block
    order = 0
    heap: list[tuple[int, int, PrefixNode, list[dict[str, Any]]]] = []
    top: list[dict[str, Any]] = []
    for root in roots:
        for child in root.children.values():
            heap.append((-sizes[id(child)][0], order := order + 1, child, top))
    heapq.heapify(heap)
    total_top = len(heap)
    for _ in range(defaults.UI_MAX_TREE_NODES):
        if not heap:
            break
        _, _, node, siblings = heapq.heappop(heap)
        edge, end = _edge(node, sizes, src)
        siblings.append(edge)
        branches = sorted(end.children.values(), key=lambda c: sizes[id(c)][0], reverse=True)
        for child in branches[: defaults.UI_MAX_TREE_CHILDREN]:
            heapq.heappush(heap, (-sizes[id(child)][0], order := order + 1, child, edge["children"]))
    return {"nodes": nodes, "subtrees": top, "omitted": total_top - len(top)}


def _subtree_sizes(roots: list[PrefixNode]) -> dict[int, tuple[int, float]]:
    """id(node) -> (blocks in its subtree, itself included; the latest use in it), without recursion.

    One pre-order walk, then the nodes in reverse, each adding itself into its parent: every
    node's descendants come after it in pre-order, so each is complete before it is read."""
    order: list[PrefixNode] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    blocks: dict[int, int] = {}
    last: dict[int, float] = {}
    for node in reversed(order):
        key = id(node)
        mine = blocks[key] = blocks.get(key, 0) + 1
        latest = last[key] = max(last.get(key, 0.0), node.last_used)
        parent = node.parent
        if parent is not None:
            pkey = id(parent)
            blocks[pkey] = blocks.get(pkey, 0) + mine
            if latest > last.get(pkey, 0.0):
                last[pkey] = latest
    return {key: (count, last[key]) for key, count in blocks.items()}


def _edge(
    node: PrefixNode, sizes: dict[int, tuple[int, float]], src: EngineSources
) -> tuple[dict[str, Any], PrefixNode]:
    """`node` and its chain of only children as one edge, and the chain's last node (where it branches)."""
    tokens: list[int] = list(node.key)
    count = len(node.key)
    end = node
    while len(end.children) == 1:
        end = next(iter(end.children.values()))
        count += len(end.key)
        if len(tokens) < defaults.UI_EDGE_TOKENS:
            tokens.extend(end.key)
    blocks, last = sizes[id(node)]
    return {
        "text": _edge_text(src.decode(tokens[: defaults.UI_EDGE_TOKENS]), cut=count > defaults.UI_EDGE_TOKENS),
        "tokens": count,
        "blocks": blocks,
        "hits": node.hits,
        "last_used_s": round(max(0.0, src.now_monotonic - last), 1),
        "children": [],
    }, end


def _edge_text(text: str, *, cut: bool) -> str:
    """Printable, one line, at most UI_EDGE_CHARS: newlines and tabs become visible marks."""
    text = text[: defaults.UI_EDGE_CHARS + 1].replace("\n", "⏎").replace("\t", "⇥")
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else "�" for ch in text)
    if len(text) > defaults.UI_EDGE_CHARS:
        return text[: defaults.UI_EDGE_CHARS - 1] + "…"
    return text + "…" if cut else text
