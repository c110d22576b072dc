"""Write-behind for the disk store: a bounded queue of blocks and the one thread that writes them.

Why: `put` runs on the executor's main thread, whose time is the step's, so it only hands the block
over; a full queue (the disk slower than the evictions) refuses it at once rather than wait. One
thread is enough: the disk, not the CPU, bounds the rate, and a single writer keeps the eviction
order and the byte bound simple.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class BlockWriter:
    """Calls `write(key, payload)` on its thread for each block submitted, in order, at most
    `queue_blocks` waiting. `write` must not raise; if it does (a bug), the error is logged with its
    traceback and `on_crash` is called, and the thread goes on with the next block."""

    def __init__(self, write: Callable[[int, bytes], None], on_crash: Callable[[], None], queue_blocks: int) -> None:
        self._write = write
        self._on_crash = on_crash
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._idle = threading.Condition()
        self._pending: dict[int, bytes] = {}
        """Blocks queued or being written: submitted again, one is not queued twice; flush waits for none;
        `queued` reads them (a block evicted from the pool may be wanted back before it is on disk)."""
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, key: int, payload: bytes) -> bool:
        """Queue block `key` unless it already is; False when the queue is full. Never blocks."""
        with self._idle:
            if key in self._pending:
                return True
            try:
                self._queue.put_nowait((key, payload))
            except queue.Full:
                return False
            self._pending[key] = payload
            return True

    def queued(self, key: int) -> bytes | None:
        """Block `key`'s payload while it waits for (or is in) its write; None otherwise."""
        with self._idle:
            return self._pending.get(key)

    def flush(self, timeout_s: float) -> None:
        """Wait until every block submitted is written or dropped; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{len(self._pending)} KV block writes still queued after {timeout_s:g} s")
                self._idle.wait(remaining)

    def stop(self, timeout_s: float) -> None:
        """Stop the thread after the blocks already queued (the caller flushes first to wait for them)."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, payload = item
            try:
                self._write(key, payload)
            except Exception:
                log.exception("KV disk store: the block writer failed")
                self._on_crash()
            finally:
                with self._idle:
                    self._pending.pop(key, None)
                    self._idle.notify_all()
