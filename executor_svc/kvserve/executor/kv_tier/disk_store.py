"""The disk tier of the prefix cache: KV blocks by key in a local directory, bounded, LRU, crash-safe.

Why: a block the device pool evicts, or a prefix a restarted executor would recompute, is read back
from here instead. The store knows nothing of tensors: a block is `bytes` (the real executor's K/V of
every layer, the fake executor's token slots) under an unsigned 64-bit key that the scheduler already
chains from the model, the tenant's namespace and the tokens, so equal keys mean equal content.

Threads: the executor's main thread calls `put`, `get` and `keys`; one writer thread writes. `put`
only queues (no I/O, never blocks: a full queue drops the block and counts it), because the main
thread's time is the step's. `get` reads synchronously, since its caller needs the bytes now. One
lock guards the index (key -> file size, least recently used first) and the counters; no file I/O
happens under it.

Failure is never fatal: the store is a cache. A bad file is a miss (counted, logged once per reason,
deleted when it is ours); a write that fails (read-only directory, full disk) turns the store
read-only; a directory that cannot be created or listed gives an empty, disabled store. File format:
`block_file`; directory layout, start-up scan and lock: `block_layout`; the LRU index: `block_index`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvserve.executor.kv_tier import block_file, block_layout
from kvserve.executor.kv_tier.block_file import BadBlock, Verdict
from kvserve.executor.kv_tier.block_index import BlockIndex
from kvserve.executor.kv_tier.block_writer import BlockWriter

log = structlog.get_logger(__name__)

_KEY_LIMIT = 1 << 64


@dataclass(slots=True)
class DiskStoreStats:
    """Counters since the store opened, read by the metrics. A bad file counts as a miss as well."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    foreign: int = 0
    stores: int = 0
    store_failures: int = 0
    dropped: int = 0
    """Blocks `put` did not write: the queue was full, the store not writable, or a block too big."""
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    num_blocks: int = 0
    num_bytes: int = 0


def _check_key(key: int) -> None:
    if not 0 <= key < _KEY_LIMIT:
        raise ValueError(f"a block key is an unsigned 64-bit integer, got {key}")


class DiskBlockStore:
    """Blocks of one `fingerprint` under `directory`, at most `capacity_bytes` of files (headers too)."""

    def __init__(self, directory: Path, capacity_bytes: int, fingerprint: str, *, queue_blocks: int = 256) -> None:
        if capacity_bytes < 0 or queue_blocks < 1:
            raise ValueError(f"capacity_bytes ≥ 0 and queue_blocks ≥ 1, got {capacity_bytes} and {queue_blocks}")
        self.capacity_bytes = capacity_bytes
        self.stats = DiskStoreStats()
        self.writable = False
        """False once degraded (read-only directory, full disk), or when another store writes here."""
        self._digest = block_file.fingerprint_digest(fingerprint)
        self._dir = block_layout.fingerprint_dir(Path(directory), self._digest)
        self._lock = threading.Lock()
        self._index = BlockIndex()
        self._logged: set[str] = set()
        self._evicted: list[int] = []
        """Keys evicted for room since `take_evicted` (the scheduler stops planning their loads)."""
        self._lock_fd: int | None = None
        self._writer: BlockWriter | None = None
        self._open(Path(directory))
        if self.writable:
            self._writer = BlockWriter(self._store, self._writer_crashed, queue_blocks)

    def _open(self, directory: Path) -> None:
        """Create and claim the directory, then index what is there; each failure costs only what it must."""
        try:
            block_layout.make_private_dir(directory)
            block_layout.make_private_dir(self._dir)
        except OSError as e:
            log.warning("KV disk store disabled: cannot create its directory", path=str(self._dir), error=str(e))
            return
        try:
            self._lock_fd = block_layout.claim(self._dir)
        except OSError as e:
            log.warning("KV disk store is read-only: cannot write its directory", path=str(self._dir), error=str(e))
        else:
            if self._lock_fd is None:
                log.warning("KV disk store is read-only: another store writes this directory", path=str(self._dir))
        try:
            found = block_layout.scan(self._dir, remove_temps=self._lock_fd is not None)
        except OSError as e:
            log.warning("KV disk store disabled: cannot list its directory", path=str(self._dir), error=str(e))
            self._release_lock()
            return
        for block in found:
            self._index.add(block.key, block.size)
        self._mirror()
        self.writable = self._lock_fd is not None
        if self.writable:
            try:
                self._evict(self._take_lru(0))
            except OSError as e:
                self._degrade(e)

    # --- the main thread ----------------------------------------------------------------------------

    def keys(self) -> list[int]:
        """Every block stored now, least recently used first (the executor's handshake lists them)."""
        with self._lock:
            return self._index.keys()

    def holds(self, key: int) -> bool:
        """Whether block `key` is stored or queued for its write (no file is read: it may still fail its checks)."""
        if self._writer is not None and self._writer.queued(key) is not None:
            return True
        with self._lock:
            return key in self._index

    def take_evicted(self) -> list[int]:
        """The keys evicted for room since the last call."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def put(self, key: int, payload: bytes) -> None:
        """Queue block `key` for the writer thread; never blocks, never does I/O, never raises on I/O.

        A key already stored is not rewritten (equal keys mean equal content): it only becomes the
        most recently used. Dropped and counted when the queue is full or the store is not writable.
        """
        _check_key(key)
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                return
            fits = block_file.HEADER.size + len(payload) <= self.capacity_bytes
            if not (self.writable and fits and self._writer is not None and self._writer.submit(key, payload)):
                self.stats.dropped += 1

    def get(self, key: int) -> bytes | None:
        """Block `key`'s payload, fully verified; None on a miss or a bad file. Never raises on I/O."""
        _check_key(key)
        queued = self._writer.queued(key) if self._writer is not None else None
        with self._lock:
            stored = key in self._index
            if queued is not None:
                self.stats.hits += 1
            elif not stored:
                self.stats.misses += 1
        if queued is not None:
            return queued  # not on disk yet: its write is still queued
        if not stored:
            return None
        path = block_layout.block_path(self._dir, key)
        try:
            payload = block_file.read_block(path, self._digest, key, touch=self.writable)
        except FileNotFoundError:
            self._forget(key)
            self._count_miss()
            return None
        except BadBlock as bad:
            if bad.verdict is Verdict.CORRUPT and self.writable:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._reject(key, bad.verdict, bad.reason, path)
            return None
        except OSError as e:
            self._reject(key, Verdict.CORRUPT, f"unreadable ({e.strerror})", path)
            return None
        with self._lock:
            self._index.touch(key)
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
        return payload

    def _count_miss(self) -> None:
        with self._lock:
            self.stats.misses += 1

    def _reject(self, key: int, verdict: Verdict, reason: str, path: Path) -> None:
        """A bad file: out of the index, counted, and logged once per reason (no traceback: not a bug)."""
        self._forget(key)
        with self._lock:
            self.stats.misses += 1
            if verdict is Verdict.CORRUPT:
                self.stats.corrupt += 1
            else:
                self.stats.foreign += 1
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning(
                "KV disk store: a block file failed verification and was not loaded (logged once per reason)",
                verdict=verdict.value,
                reason=reason,
                path=str(path),
                deleted=verdict is Verdict.CORRUPT and self.writable,
            )

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued block is written or dropped; TimeoutError after `timeout_s`."""
        if self._writer is not None:
            self._writer.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes, stop the writer thread and release the directory. Never raises."""
        try:
            self.flush(timeout_s)
        except TimeoutError as e:
            log.warning("KV disk store closed with writes still queued: they are dropped", error=str(e))
        with self._lock:
            self.writable = False
        if self._writer is not None:
            self._writer.stop(timeout_s)
        self._release_lock()

    def __enter__(self) -> DiskBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the index and the files ----------------------------------------------------------------------

    def _mirror(self) -> None:
        """Copy the index's size into the counters (lock held)."""
        self.stats.num_blocks = len(self._index)
        self.stats.num_bytes = self._index.num_bytes

    def _forget(self, key: int) -> None:
        with self._lock:
            self._index.remove(key)
            self._mirror()

    def _take_lru(self, size: int) -> list[int]:
        """Out of the index, the least recently used blocks that must go for `size` more bytes to fit
        (lock held); the caller deletes their files, outside the lock."""
        victims = self._index.take_lru(size, self.capacity_bytes)
        self.stats.evictions += len(victims)
        self._evicted.extend(victims)
        self._mirror()
        return victims

    def _evict(self, victims: list[int]) -> None:
        for key in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(block_layout.block_path(self._dir, key))

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- the writer thread --------------------------------------------------------------------------

    def _writer_crashed(self) -> None:
        """A bug in `_store`: stop writing (the executor goes on), as a failed write would."""
        with self._lock:
            self.writable = False
            self.stats.store_failures += 1

    def _store(self, key: int, payload: bytes) -> None:
        size = block_file.HEADER.size + len(payload)
        with self._lock:
            if not self.writable:
                self.stats.dropped += 1
                return
            victims = self._take_lru(size)
        path = block_layout.block_path(self._dir, key)
        try:
            self._evict(victims)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.parent, block_layout.DIR_MODE)
                os.chmod(path.parent, block_layout.DIR_MODE)
            written = block_file.write_block(path, self._digest, key, payload)
        except OSError as e:
            self._degrade(e)
            return
        with self._lock:
            self._index.add(key, written)
            self._mirror()
            self.stats.stores += 1
            self.stats.bytes_written += written

    def _degrade(self, error: OSError) -> None:
        """Stop writing for good: a read-only directory or a full disk will not heal by retrying every
        block, and the blocks already there stay readable. The queue drains as drops."""
        with self._lock:
            self.writable = False
            self.stats.store_failures += 1
        log.warning(
            "KV disk store is now read-only: a write failed",
            path=str(self._dir),
            errno=error.errno,
            error=error.strerror or str(error),
        )
