"""`--kv-events-endpoint`: the engine's KV events on a ZeroMQ PUB socket, with a replay socket, as vLLM publishes them.

Each step's events (`KvEventRecorder.take`) leave as one `KVEventBatch` in a three-frame
message `(topic, seq, payload)` (`kvserve.protos.kv_events`). PUB never blocks the engine: a
subscriber that falls past the high-water mark loses messages, sees the gap in `seq`, and asks
the ROUTER socket at `--kv-events-replay-endpoint` for everything from the first it missed: a
DEALER sends `[b"", seq]` and gets `[b"", seq, payload]` per batch kept, then `[b"", -1, b""]`
(vLLM's replay protocol; the last `KV_EVENTS_REPLAY_BATCHES` batches are kept).

The events carry token ids, so the sockets bind on loopback unless `--kv-events-allow-remote`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import structlog
import zmq
import zmq.asyncio

from kvserve.link.endpoint import LinkEndpointError, check_endpoint
from kvserve.protos.kv_events import END_SEQ, KVEventBatch, decode_seq, encode_seq
from kvserve.scheduler.server.observability.kv_event_recorder import KvEventRecorder

log = structlog.get_logger(__name__)

KV_EVENTS_REPLAY_BATCHES = 10_000
KV_EVENTS_HWM = 100_000


class KvEventsConfigError(ValueError):
    """A KV-events endpoint is malformed or not allowed (exit code 2 at start)."""


def kv_event_publisher(
    endpoint: str | None, replay_endpoint: str | None, topic: str, *, allow_remote: bool
) -> KvEventPublisher | None:
    """The publisher the options ask for, bound (None: `--kv-events-endpoint` not given)."""
    if endpoint is None:
        if replay_endpoint is not None:
            raise KvEventsConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    check_kv_events_endpoint(endpoint, allow_remote=allow_remote, flag="--kv-events-endpoint")
    if replay_endpoint is not None:
        check_kv_events_endpoint(replay_endpoint, allow_remote=allow_remote, flag="--kv-events-replay-endpoint")
    return KvEventPublisher(endpoint, replay_endpoint, topic)


def check_kv_events_endpoint(endpoint: str, *, allow_remote: bool, flag: str) -> None:
    """The link's endpoint check, worded for the KV events: their sockets stay on loopback too."""
    try:
        check_endpoint(
            endpoint,
            allow_remote=allow_remote,
            name=flag,
            remote_hint="KV events carry token ids; pass --kv-events-allow-remote to publish them on a private network",
        )
    except LinkEndpointError as exc:
        raise KvEventsConfigError(str(exc)) from None


class KvEventPublisher:
    """The PUB socket, the replay ROUTER and the replay buffer. Bound at start, before any executor
    exists (a taken port is a start-up error); `attach` then gives it the tree's recorder."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self._recorder: KvEventRecorder | None = None
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(KV_EVENTS_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None  # before the binds: close() reads it if one fails
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise KvEventsConfigError(f"KV events: cannot bind {endpoint} / {replay_endpoint}: {exc}") from exc
        self._topic = topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=KV_EVENTS_REPLAY_BATCHES)
        self._next_seq = 0
        log.info("kv_events_publishing", endpoint=endpoint, replay=replay_endpoint, topic=topic)

    def attach(self, recorder: KvEventRecorder) -> None:
        """Start publishing what `recorder` (the scheduler's tree listener) records, and answering replays."""
        self._recorder = recorder
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replays(self._replay))

    def flush(self) -> None:
        """Publish the events recorded since the last flush as one batch (nothing when there are none)."""
        events = self._recorder.take() if self._recorder is not None else []
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # past the high-water mark: the subscriber replays
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    async def _serve_replays(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            identity, _, start = frames
            first = decode_seq(start)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart((identity, b"", encode_seq(seq), payload))
            await replay.send_multipart((identity, b"", encode_seq(END_SEQ), b""))

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
