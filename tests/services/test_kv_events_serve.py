"""`kvserve serve --kv-events-endpoint` over real ZeroMQ sockets: live batches, a replayed gap, an executor kill -9.

The subscriber is the one of test_kv_events.py (vLLM's schema, decoded with msgpack). It
drops one batch on purpose and fills the gap from the replay socket; what it rebuilds must
equal what a second subscriber rebuilds from a replay of everything, before and after the
executor is killed (which must come through as AllBlocksCleared).
"""

from __future__ import annotations

import os
import signal

import msgpack
import pytest
import zmq

from kvserve.protos.kv_events import END_SEQ, decode_seq, encode_seq
from kvserve.testing.ports import free_ports
from kvserve.testing.waiting import wait_until
from tests.http.http_clients import FAKE_ARGS, sdk
from tests.services.test_kv_events import Subscriber

pytestmark = pytest.mark.timeout(180)

SYSTEM = "You are the keeper of a very long and very repetitive system prompt. " * 8


class Stream:
    """A SUB socket that applies batches in `seq` order, asking the replay socket for any gap."""

    def __init__(self, ctx: zmq.Context, pub: str, replay: str, drop: int | None = None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.replay_endpoint = replay
        self.ctx = ctx
        self.state = Subscriber()
        self.next_seq = 0
        self.kinds: list[str] = []
        self.drop = drop
        self.replayed = 0

    def poll(self) -> None:
        while self.sub.poll(50):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = decode_seq(seq_bytes)
            if seq == self.drop:
                self.drop = None
                continue  # lost on purpose: the next batch shows the gap
            if seq > self.next_seq:
                self.replay(self.next_seq, until=seq)
            if seq == self.next_seq:
                self.apply(seq, payload)

    def replay(self, first: int, until: int | None = None) -> None:
        # DEALER with an empty delimiter frame: the replay answers one request with many messages,
        # which a REQ socket would refuse after the first.
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", encode_seq(first)))
        while True:
            _, seq_bytes, payload = req.recv_multipart()
            seq = decode_seq(seq_bytes)
            if seq == END_SEQ:
                break
            if seq == self.next_seq and (until is None or seq < until):
                self.apply(seq, payload)
                self.replayed += 1
        req.close(linger=0)

    def apply(self, seq: int, payload: bytes) -> None:
        self.state.apply(payload)
        self.kinds.extend(e["type"] for e in msgpack.unpackb(payload)[1])
        self.next_seq = seq + 1


def test_live_events_a_replayed_gap_and_an_executor_kill(http_serve_factory) -> None:
    pub_port, replay_port = free_ports(2)
    pub, replay = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    server = http_serve_factory([*FAKE_ARGS, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay])
    ctx = zmq.Context()
    live = Stream(ctx, pub, replay, drop=1)
    client = sdk(server)

    def chat(question: str) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        client.chat.completions.create(model="fake:smollm2-135m-instruct", messages=messages, max_tokens=8)

    try:
        for i in range(4):
            chat(f"Question number {i}?")
        wait_until(lambda: (live.poll(), live.next_seq >= 4)[1], 30, "four batches, one of them replayed")
        assert live.replayed >= 1, "the dropped batch came back through the replay socket"
        assert live.state.blocks and "BlockStored" in live.kinds
        full = Stream(ctx, pub, replay)
        full.replay(0)
        assert full.state.blocks == live.state.blocks

        os.kill(server.executor_pids()[-1], signal.SIGKILL)
        wait_until(lambda: (live.poll(), "AllBlocksCleared" in live.kinds)[1], 60, "AllBlocksCleared after kill -9")
        assert not live.state.blocks
        chat("And after the restart?")
        wait_until(lambda: (live.poll(), bool(live.state.blocks))[1], 60, "blocks stored by the new executor")
        again = Stream(ctx, pub, replay)
        again.replay(0)
        assert again.state.blocks == live.state.blocks
    finally:
        ctx.destroy(linger=0)


def test_a_remote_endpoint_needs_its_flag(http_serve_factory) -> None:
    server = http_serve_factory([*FAKE_ARGS, "--kv-events-endpoint", "tcp://0.0.0.0:5557"], wait=False)
    assert server.process.wait(timeout=60) == 2
    assert "--kv-events-allow-remote" in server.log_text()
