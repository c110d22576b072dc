"""KV events: a subscriber written from vLLM's documented schema rebuilds the set of cached full blocks.

The subscriber here decodes with `msgpack` (not the msgspec structs that encode them) and knows
only what vLLM documents: a batch is the array `[ts, events, data_parallel_rank]`; each event a
map tagged `type`: `BlockStored` with `block_hashes`, `parent_block_hash`, `token_ids` and
`block_size`, `BlockRemoved` with `block_hashes`, and `AllBlocksCleared`. What it rebuilds
must equal the tree's full blocks, hashed independently from the tree's own structure, after
every step of a random workload with evictions and executor resets.
"""

from __future__ import annotations

import random

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.protos.kv_events import KVEventBatch, block_hash
from kvserve.scheduler.core.request import RequestRejected
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.server.observability.kv_event_publisher import KvEventPublisher, KvEventsConfigError
from kvserve.scheduler.server.observability.kv_event_recorder import KvEventRecorder
from kvserve.scheduler.server.security.namespaces import namespace_lora, prefix_namespace
from kvserve.testing.ports import free_ports
from tests.scheduler.harness import Harness, strict_executor

ENCODER = msgspec.msgpack.Encoder()


class Subscriber:
    """What a KV-aware router keeps per worker: the hashes of the blocks it has cached."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.parents: dict[int, int | None] = {}

    def apply(self, payload: bytes) -> None:
        ts, events, _data_parallel_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                parent, hashes = event["parent_block_hash"], event["block_hashes"]
                assert parent is None or parent in self.blocks, "a chain extends a block already announced"
                assert len(event["token_ids"]) == event["block_size"] * len(hashes) and event["medium"] == "GPU"
                for digest in hashes:
                    self.blocks.add(digest)
                    self.parents[digest] = parent
                    parent = digest
            elif kind == "BlockRemoved":
                for digest in event["block_hashes"]:
                    self.blocks.remove(digest)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
            else:  # pragma: no cover - the schema has three kinds
                raise AssertionError(f"unknown event {kind}")


def tree_full_blocks(h: Harness) -> set[int]:
    """Every full block of the tree, hashed from the tree itself: root to leaf, namespace as the seed."""
    view = h.scheduler.view()
    out: set[int] = set()
    stack = [(view.tree.root(ns), None) for ns in view.tree.namespaces()]
    while stack:
        node, parent_hash = stack.pop()
        for child in node.children.values():
            if len(child.key) != view.block_size:
                continue  # a partial tail block: a leaf, never an event
            digest = block_hash(parent_hash, child.namespace, child.key)
            out.add(digest)
            stack.append((child, digest))
    return out


def publish(recorder: KvEventRecorder, subscriber: Subscriber) -> None:
    events = recorder.take()
    if events:
        subscriber.apply(ENCODER.encode(KVEventBatch(ts=1.5, events=events)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 30))
def test_the_subscriber_rebuilds_the_trees_full_blocks_through_evictions_and_resets(
    seed: int, block_size: int, num_blocks: int
) -> None:
    rng = random.Random(seed)
    h = Harness(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=24), check=False)
    recorder = KvEventRecorder(block_size)
    h.scheduler.set_prefix_listener(recorder)
    subscriber = Subscriber()
    for op in range(60):
        choice = rng.random()
        if choice < 0.35:
            stem = [1, 2, 1, 2, 1, 2][: rng.randrange(0, 7)]
            prompt = stem + [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            try:
                h.add(f"r{op}", prompt, max_tokens=rng.randrange(1, 6), namespace=rng.choice(["ns-a", "ns-b"]))
            except RequestRejected:
                pass
        elif choice < 0.95:
            h.step()
        else:  # the executor is replaced: its KV (and so the tree) is gone
            h.collect(h.scheduler.reset_executor())
            h.executor = strict_executor(num_blocks, block_size)
        publish(recorder, subscriber)
        assert subscriber.blocks == tree_full_blocks(h) == recorder.cached_hashes()
    h.run()
    publish(recorder, subscriber)
    assert subscriber.blocks == tree_full_blocks(h)


def test_the_same_tokens_under_two_tenants_hash_apart() -> None:
    tokens = list(range(16))
    alice, bob = "namespace-of-alice", "namespace-of-bob"
    assert block_hash(None, alice, tokens) != block_hash(None, bob, tokens)
    assert block_hash(None, alice, tokens) == block_hash(None, alice, tokens)
    first = block_hash(None, alice, tokens)
    assert block_hash(first, alice, tokens) != first, "the chain: the same block after another prefix differs"


def test_one_request_makes_one_chained_block_stored() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64))
    recorder = KvEventRecorder(4)
    h.scheduler.set_prefix_listener(recorder)
    h.add("r", list(range(1, 14)), max_tokens=1, namespace="ns")
    h.run()
    batch = msgpack.unpackb(ENCODER.encode(KVEventBatch(ts=1.0, events=recorder.take())))
    assert len(batch) == 3 and batch[2] is None, "[ts, events, data_parallel_rank]"
    stored = [e for e in batch[1] if e["type"] == "BlockStored"]
    assert len(stored) == 1
    event = stored[0]
    assert event["parent_block_hash"] is None and event["block_size"] == 4 and len(event["block_hashes"]) == 3
    assert event["token_ids"] == list(range(1, 13))
    assert (event["lora_id"], event["medium"], event["lora_name"]) == (None, "GPU", None)


def test_a_block_stored_under_a_lora_adapter_names_it_as_vllm_does() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64), loras=("alpha", "beta"))
    recorder = KvEventRecorder(4, namespace_lora)
    h.scheduler.set_prefix_listener(recorder)
    prompt = list(range(1, 14))
    for i, lora in enumerate(("beta", "", "alpha")):
        namespace = prefix_namespace("m", "t", "", lora, {"": 0, "alpha": 1, "beta": 2}[lora])
        h.add(f"r{i}", prompt, max_tokens=1, namespace=namespace, lora_name=lora)
        h.run()
    events = msgpack.unpackb(ENCODER.encode(KVEventBatch(ts=1.0, events=recorder.take())))[1]
    stored = [(e["lora_name"], e["lora_id"], tuple(e["block_hashes"])) for e in events if e["type"] == "BlockStored"]
    assert [(name, lora_id) for name, lora_id, _ in stored] == [("beta", 2), (None, None), ("alpha", 1)]
    assert len({hashes for _, _, hashes in stored}) == 3, "the same tokens hash apart under each adapter"


@pytest.mark.parametrize("taken", ["pub", "replay"])
def test_a_taken_port_is_a_config_error_naming_it(taken: str) -> None:
    """A port another process holds (a replica's KV-event port, say) fails the start with a message, not a traceback."""
    pub_port, replay_port = free_ports(2)
    holder = zmq.Context.instance().socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{pub_port if taken == 'pub' else replay_port}")
    try:
        with pytest.raises(KvEventsConfigError, match="KV events: cannot bind"):
            KvEventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    finally:
        holder.close(linger=0)


def test_blocks_below_the_pool_are_announced_under_their_medium_and_removed_when_the_tier_lets_go() -> None:
    """With a host-memory tier of three blocks, a 3-block prompt's blocks are stored under `GPU` and again
    under `CPU` with the same hashes; a second prompt's stores push the first's out of host memory, which
    a `BlockRemoved` under `CPU` says, while the pool (`GPU`) still holds them."""
    config = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64)
    h = Harness(config, kv_host_gb=3 * 4 * 16 / 2**30)  # three blocks of the fake's 16-byte slots
    recorder = KvEventRecorder(4)
    h.scheduler.set_prefix_listener(recorder)
    h.add("first", list(range(1, 14)), max_tokens=1, namespace="ns")
    h.run()
    events = msgpack.unpackb(ENCODER.encode(KVEventBatch(ts=1.0, events=recorder.take())))[1]
    stored = {e["medium"]: e["block_hashes"] for e in events if e["type"] == "BlockStored"}
    assert set(stored) == {"GPU", "CPU"} and len(stored["GPU"]) == 3 and stored["CPU"] == stored["GPU"], events
    h.add("second", list(range(30, 43)), max_tokens=1, namespace="ns")
    h.run()
    h.add("third", [50], max_tokens=1, namespace="ns")  # a step after the evictions reports them
    h.run()
    events = msgpack.unpackb(ENCODER.encode(KVEventBatch(ts=2.0, events=recorder.take())))[1]
    removed = [hash_ for e in events if e["type"] == "BlockRemoved" for hash_ in e["block_hashes"]]
    assert set(stored["CPU"]) <= set(removed) and all(
        e["medium"] == "CPU" for e in events if e["type"] == "BlockRemoved"
    ), events
    assert set(stored["GPU"]) <= recorder.cached_hashes(), "the pool still holds them"
