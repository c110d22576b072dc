"""The prefix cache's disk tier (`kvserve.executor.kv_tier`): a bounded, content-addressed, crash-safe store.

Every bad file must come back as a miss (counted, logged once, never loaded, never raised), every
write failure must leave a read-only store that still reads, and a writer killed mid-write must leave
nothing a restart would load. No server: the store is a library, tested on its own directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvserve.executor.kv_tier import block_file, block_layout
from kvserve.executor.kv_tier.block_file import HEADER, BadBlock, Verdict
from kvserve.executor.kv_tier.disk_store import DiskBlockStore

FP = "llama|float32|block_size=16|tp=1"
BLOCK = 4096
"""A small payload: what a block holds does not matter to the store, only that it comes back intact."""
FILE = HEADER.size + BLOCK
WAIT_S = 60.0
"""Generous: bounds a stuck writer, never paces a passing test."""


def payload(key: int, size: int = BLOCK) -> bytes:
    """Distinct, reproducible bytes for `key` (so a file swapped for another key's is told apart)."""
    digest = hashlib.sha256(key.to_bytes(8, "little")).digest()
    return (digest * (size // len(digest) + 1))[:size]


def blocks_dir(root: Path, fingerprint: str = FP) -> Path:
    return block_layout.fingerprint_dir(root, block_file.fingerprint_digest(fingerprint))


def path_of(root: Path, key: int, fingerprint: str = FP) -> Path:
    return block_layout.block_path(blocks_dir(root, fingerprint), key)


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{block_file.TEMP_SUFFIX}"))


def filled(root: Path, keys: list[int]) -> None:
    """A directory holding `keys`, written by a store that is closed again."""
    with DiskBlockStore(root, 1 << 30, FP) as store:
        for key in keys:
            store.put(key, payload(key))
        store.flush(WAIT_S)
        assert store.stats.stores == len(keys)


def warnings_about(logs: list[MutableMapping[str, Any]], reason: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry.get("reason") == reason]


def os_with(**overrides: Callable[..., Any]) -> types.SimpleNamespace:
    """A stand-in for the `os` module of one kv_tier module, with some calls replaced (fault injection)."""
    namespace = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    for name, function in overrides.items():
        setattr(namespace, name, function)
    return namespace


def unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)]).returncode:
        subprocess.run(["umount", "-l", str(path)])


def chmod_stops_writes(directory: Path) -> bool:
    """Whether a 0o500 directory refuses a new file: not for root (CAP_DAC_OVERRIDE), as in this repo's containers."""
    probe = directory / "probe"
    probe.mkdir(mode=0o500)
    try:
        (probe / "file").touch()
    except PermissionError:
        return True
    else:
        return False
    finally:
        probe.chmod(0o700)
        (probe / "file").unlink(missing_ok=True)
        probe.rmdir()


def can_mount() -> bool:
    """Root in a namespace that may mount (this repository's dev box and CI containers run as root)."""
    return os.geteuid() == 0 and subprocess.run(["mount", "--version"], capture_output=True).returncode == 0


# --- round trip, restart, fingerprints ------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    with DiskBlockStore(tmp_path / "kv", 1 << 30, FP) as store:
        assert store.writable and store.keys() == [] and store.get(1) is None
        keys = [0, 1, 0xFF00_0000_0000_0001, (1 << 64) - 1]
        for key in keys:
            store.put(key, payload(key))
        store.put(7, b"")
        store.flush(WAIT_S)
        assert sorted(store.keys()) == sorted([*keys, 7])
        for key in keys:
            assert store.get(key) == payload(key)
        assert store.get(7) == b""
        stats = store.stats
        assert (stats.stores, stats.hits, stats.misses, stats.dropped) == (5, 5, 1, 0)
        assert stats.num_blocks == 5 and stats.num_bytes == 4 * FILE + HEADER.size == stats.bytes_written
        assert stats.bytes_read == 4 * BLOCK
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            store.put(1 << 64, b"x")
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            store.get(-1)


def test_reopened_directory_lists_its_blocks(tmp_path: Path) -> None:
    """A warm restart: a new store on the directory finds every block by its name, without reading it."""
    root = tmp_path / "kv"
    keys = [3, 0x1234_5678_9ABC_DEF0, 0xAB00_0000_0000_0000]
    filled(root, keys)
    with DiskBlockStore(root, 1 << 30, FP) as store:
        assert sorted(store.keys()) == sorted(keys)
        assert store.stats.num_blocks == 3 and store.stats.num_bytes == 3 * FILE
        assert [store.get(key) for key in keys] == [payload(key) for key in keys]
    unknown = path_of(root, 99).parent / "notes.txt"
    unknown.parent.mkdir(exist_ok=True)
    unknown.write_text("not a block")
    with DiskBlockStore(root, 1 << 30, FP) as store:
        assert sorted(store.keys()) == sorted(keys)
    assert unknown.exists(), "a file the store did not write is never its to delete"


def test_fingerprints_do_not_meet_and_a_copied_file_is_foreign(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    filled(root, [1, 2])
    with DiskBlockStore(root, 1 << 30, "another model") as other:
        assert other.keys() == [] and other.get(1) is None
    copied = path_of(root, 1, "another model")
    copied.parent.mkdir(parents=True)
    copied.write_bytes(path_of(root, 1).read_bytes())
    with capture_logs() as logs, DiskBlockStore(root, 1 << 30, "another model") as other:
        assert other.keys() == [1]
        assert other.get(1) is None
        assert other.keys() == [] and other.stats.foreign == 1 and other.stats.corrupt == 0
        assert other.get(1) is None and other.stats.foreign == 1, "out of the index: not read twice"
    assert copied.exists(), "a foreign file is left alone"
    [warning] = warnings_about(logs, "fingerprint")
    assert warning["verdict"] == "foreign" and warning["log_level"] == "warning" and "exc_info" not in warning


# --- bad files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "reason"),
    [
        (0, "truncated header"),
        (HEADER.size - 1, "truncated header"),
        (HEADER.size, "length"),
        (HEADER.size + BLOCK // 2, "length"),
        (FILE - 1, "length"),
    ],
)
def test_truncated_file_is_corrupt_and_deleted(tmp_path: Path, keep: int, reason: str) -> None:
    root = tmp_path / "kv"
    filled(root, [1, 2, 3])
    for key in (1, 2):
        with open(path_of(root, key), "r+b") as f:
            f.truncate(keep)
    with capture_logs() as logs, DiskBlockStore(root, 1 << 30, FP) as store:
        assert store.get(1) is None and store.get(2) is None
        assert store.get(3) == payload(3)
        assert (store.stats.corrupt, store.stats.foreign, store.stats.hits, store.stats.misses) == (2, 0, 1, 2)
        assert store.keys() == [3] and store.stats.num_bytes == FILE
    assert not path_of(root, 1).exists() and not path_of(root, 2).exists()
    assert len(warnings_about(logs, reason)) == 1, "logged once per kind, however many files"


def test_trailing_bytes_are_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    filled(root, [1])
    with open(path_of(root, 1), "ab") as f:
        f.write(b"\0")
    with DiskBlockStore(root, 1 << 30, FP) as store:
        assert store.get(1) is None and store.stats.corrupt == 1


@pytest.mark.parametrize(("offset", "reason"), [(HEADER.size + 1000, "payload checksum"), (20, "header checksum")])
def test_flipped_byte_is_corrupt_and_deleted(tmp_path: Path, offset: int, reason: str) -> None:
    root = tmp_path / "kv"
    filled(root, [5])
    path = path_of(root, 5)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with capture_logs() as logs, DiskBlockStore(root, 1 << 30, FP) as store:
        assert store.get(5) is None
        assert store.stats.corrupt == 1 and store.keys() == []
    assert not path.exists()
    [warning] = warnings_about(logs, reason)
    assert warning["verdict"] == "corrupt" and warning["deleted"] is True


def test_every_header_byte_is_verified(tmp_path: Path) -> None:
    """The format itself: one flipped bit anywhere in the header is caught, as corrupt (never foreign)."""
    digest = block_file.fingerprint_digest(FP)
    path = tmp_path / "block.kvb"
    block_file.write_block(path, digest, 42, payload(42))
    good = path.read_bytes()
    assert block_file.read_block(path, digest, 42, touch=False) == payload(42)
    for offset in range(HEADER.size):
        for bit in (0x01, 0x80):
            data = bytearray(good)
            data[offset] ^= bit
            path.write_bytes(bytes(data))
            with pytest.raises(BadBlock) as caught:
                block_file.read_block(path, digest, 42, touch=False)
            assert caught.value.verdict is Verdict.CORRUPT, (offset, bit, caught.value.reason)


def test_another_keys_content_under_this_name_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    filled(root, [1, 2])
    os.replace(path_of(root, 1), path_of(root, 2))
    with capture_logs() as logs, DiskBlockStore(root, 1 << 30, FP) as store:
        assert store.keys() == [2]
        assert store.get(2) is None, "key 1's payload must never be served as key 2's"
        assert store.stats.corrupt == 1
    assert len(warnings_about(logs, "key")) == 1
    # The same under a running store: the file changes under its index.
    filled(root, [1, 2])
    with DiskBlockStore(root, 1 << 30, FP) as store:
        os.replace(path_of(root, 1), path_of(root, 2))
        assert store.get(2) is None and store.get(1) is None
        assert (store.stats.corrupt, store.stats.misses) == (1, 2), "a vanished file is a plain miss"
        assert store.keys() == []


# --- kill -9 mid-write ----------------------------------------------------------------------------------

CHILD = r"""
import hashlib, os, sys, threading, types
from pathlib import Path
from kvserve.executor.kv_tier import block_file
from kvserve.executor.kv_tier.disk_store import DiskBlockStore

root, mode, size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def payload(key):
    digest = hashlib.sha256(key.to_bytes(8, "little")).digest()
    return (digest * (size // len(digest) + 1))[:size]

store = DiskBlockStore(root, 1 << 40, sys.argv[4], queue_blocks=4)
if mode == "paused":
    # After five blocks, the sixth's payload is half written when the writer stops, and says so.
    real_write = os.write
    def write(fd, data):
        if len(data) >= size and store.stats.stores >= 5:
            real_write(fd, bytes(data[: len(data) // 2]))
            print("mid-write", flush=True)
            threading.Event().wait()
        return real_write(fd, data)
    fake_os = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
    fake_os.write = write
    block_file.os = fake_os
key = 0
while True:
    key += 1
    store.put(key, payload(key))
    if mode == "paused" and key == 6:
        threading.Event().wait()
    store.flush(600)
    if key == 5 and mode == "running":
        print("ready", flush=True)
"""


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else f"(nothing in {timeout_s:g} s)"


@pytest.mark.parametrize("mode", ["paused", "running"])
def test_kill_9_mid_write_leaves_only_whole_blocks(tmp_path: Path, mode: str) -> None:
    """`paused`: killed while a payload is half written, for certain. `running`: killed wherever a
    writer busy with 1 MiB blocks happens to be. Either way the restart loads only whole blocks."""
    root = tmp_path / "kv"
    size = 1 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode, str(size), FP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line(proc, WAIT_S)
        left = temp_files(root)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=WAIT_S)
    assert line == ("mid-write" if mode == "paused" else "ready"), stderr
    assert proc.returncode == -signal.SIGKILL, stderr
    if mode == "paused":
        assert len(left) == 1 and 0 < left[0].stat().st_size < HEADER.size + size, "the sixth block was mid-write"
    with DiskBlockStore(root, 1 << 40, FP) as store:
        assert temp_files(root) == [], "the start removes what the killed writer left"
        keys = store.keys()
        if mode == "paused":
            assert sorted(keys) == [1, 2, 3, 4, 5]
        assert len(keys) >= 5
        for key in keys:
            assert store.get(key) == payload(key, size), key
        assert store.stats.corrupt == 0


# --- capacity and LRU -----------------------------------------------------------------------------------


def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with DiskBlockStore(root, 3 * FILE + 100, FP) as store:
        for key in (1, 2, 3):
            store.put(key, payload(key))
        store.flush(WAIT_S)
        assert store.get(1) == payload(1)  # 1 is now the most recently used
        store.put(4, payload(4))
        store.flush(WAIT_S)
        assert store.keys() == [3, 1, 4] and store.stats.evictions == 1
        store.put(3, payload(3))  # already stored: not rewritten, only used
        store.flush(WAIT_S)
        assert store.stats.stores == 4 and store.keys() == [1, 4, 3]
        store.put(5, payload(5))
        store.flush(WAIT_S)
        assert store.keys() == [4, 3, 5] and store.stats.evictions == 2
        assert store.stats.num_bytes == 3 * FILE <= store.capacity_bytes
        on_disk = list(blocks_dir(root).rglob(f"*{block_file.BLOCK_SUFFIX}"))
        assert sorted(p.name for p in on_disk) == sorted(path_of(root, k).name for k in (3, 4, 5))
        assert sum(p.stat().st_size for p in on_disk) <= store.capacity_bytes
        store.put(6, payload(6, store.capacity_bytes))
        store.flush(WAIT_S)
        assert store.stats.dropped == 1 and store.keys() == [4, 3, 5], "a block larger than the store is dropped"


def test_start_orders_blocks_by_mtime_and_fits_a_smaller_capacity(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    filled(root, [1, 2, 3, 4])
    for age, key in enumerate([3, 1, 4, 2]):  # 2 oldest, 3 newest
        os.utime(path_of(root, key), ns=(0, (1_000 - age) * 10**9))
    with DiskBlockStore(root, 1 << 30, FP) as store:
        assert store.keys() == [2, 4, 1, 3]
    with DiskBlockStore(root, 2 * FILE, FP) as store:
        assert store.keys() == [1, 3] and store.stats.evictions == 2
        assert not path_of(root, 2).exists() and not path_of(root, 4).exists()
        assert store.get(1) == payload(1)
    hit, kept = os.stat(path_of(root, 1)), os.stat(path_of(root, 3))
    assert hit.st_mtime_ns > kept.st_mtime_ns, "a hit counts at the next start"


# --- degrade, never fail ---------------------------------------------------------------------------------


@contextlib.contextmanager
def read_only(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Make `root` unwritable; yields the way used. chmod 0o500 where it stops writes; as root it does
    not, so a read-only bind mount where mounting is allowed, else EROFS injected into the store's
    os.open, os.mkdir, os.unlink and the like."""
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    if chmod_stops_writes(root.parent):
        for d in dirs:
            d.chmod(0o500)
        try:
            yield "chmod 0o500"
        finally:
            for d in dirs:
                d.chmod(0o700)
    elif can_mount() and subprocess.run(["mount", "--bind", str(root), str(root)]).returncode == 0:
        try:
            assert subprocess.run(["mount", "-o", "remount,ro,bind", str(root)]).returncode == 0
            yield "read-only bind mount"
        finally:
            unmount(root)
    else:

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                refuse()
            return os.open(path, flags, *args, **kwargs)

        def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
            if os.path.exists(path):  # as Linux answers on a read-only file system
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
            refuse()

        fake = os_with(open=open_, mkdir=mkdir, chmod=refuse, unlink=refuse, utime=refuse, replace=refuse)
        for module in (block_file, block_layout):
            monkeypatch.setattr(module, "os", fake)
        monkeypatch.setattr("kvserve.executor.kv_tier.disk_store.os", fake)
        try:
            yield "injected EROFS"
        finally:
            monkeypatch.undo()


def test_read_only_directory_degrades_and_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "kv"
    filled(root, [1])
    store = DiskBlockStore(root, 1 << 30, FP)
    with read_only(root, monkeypatch) as how:
        with capture_logs() as logs:
            try:
                assert store.writable
                store.put(2, payload(2))
                store.flush(WAIT_S)
                assert not store.writable, how
                assert (store.stats.store_failures, store.stats.stores) == (1, 0)
                store.put(3, payload(3))
                store.put(5, payload(5))
                assert store.stats.dropped == 2
                assert store.get(1) == payload(1) and store.get(2) is None
                assert temp_files(root) == []
            finally:
                store.close()
        [warning] = [e for e in logs if e["log_level"] == "warning"]
        assert "now read-only" in warning["event"] and "exc_info" not in warning, how
        # A store that starts on the read-only directory reads what is there and never fails.
        with DiskBlockStore(root, 1 << 30, FP) as again:
            assert again.keys() == [1] and again.get(1) == payload(1)
            again.put(4, payload(4))
            again.flush(WAIT_S)
            assert not again.writable and again.get(4) is None, how


@contextlib.contextmanager
def full_disk(directory: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`directory` on a 1 MiB tmpfs, or (`injected`) a write that fails with ENOSPC past ~1 MiB."""
    directory.mkdir()
    if how == "tmpfs":
        mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)]
        if not can_mount() or subprocess.run(mount).returncode:
            pytest.skip("mounting a tmpfs is not permitted here (the injected case covers the path)")
        try:
            yield
        finally:
            unmount(directory)
        return
    written = 0

    def write(fd: int, data: Any) -> int:
        nonlocal written
        if written + len(data) > 1 << 20:
            os.write(fd, bytes(data[: len(data) // 2]))  # part of it lands, as on a real full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += len(data)
        return os.write(fd, data)

    monkeypatch.setattr(block_file, "os", os_with(write=write))
    yield


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_full_disk_degrades_and_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    root = tmp_path / "disk"
    size = 300_000
    with full_disk(root, how, monkeypatch), capture_logs() as logs:
        with DiskBlockStore(root / "kv", 1 << 30, FP) as store:
            for key in range(1, 11):
                store.put(key, payload(key, size))
            store.flush(WAIT_S)
            assert not store.writable
            assert store.stats.store_failures == 1 and 1 <= store.stats.stores <= 3
            assert store.stats.stores + 1 + store.stats.dropped == 10
            assert temp_files(root) == [], "the partial temporary file is removed"
            stored = store.keys()
            assert [store.get(key) for key in stored] == [payload(key, size) for key in stored]
            store.put(99, payload(99))
            assert store.stats.dropped == 10 - store.stats.stores
        [warning] = [e for e in logs if "now read-only" in e["event"]]
        assert warning["errno"] == errno.ENOSPC


def test_directory_that_cannot_be_created_gives_a_disabled_store(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with capture_logs() as logs, DiskBlockStore(tmp_path / "file" / "kv", 1 << 30, FP) as store:
        assert not store.writable and store.keys() == []
        store.put(1, payload(1))
        store.flush(WAIT_S)
        assert store.get(1) is None and store.stats.dropped == 1 and store.stats.misses == 1
    assert [e for e in logs if "disabled" in e["event"]]


def test_a_writer_bug_stops_the_writes_not_the_executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(block_file, "write_block", broken)
    with DiskBlockStore(tmp_path / "kv", 1 << 30, FP) as store:
        store.put(1, payload(1))
        store.put(2, payload(2))
        store.flush(WAIT_S)
        assert not store.writable and store.stats.store_failures == 1 and store.stats.dropped == 1


def test_a_second_store_on_a_directory_only_reads(tmp_path: Path) -> None:
    """Two stores writing one directory would each bound only their own bytes, and a starting one would
    delete the other's write in progress: the one that comes second reads and does not write."""
    root = tmp_path / "kv"
    with DiskBlockStore(root, 1 << 30, FP) as first:
        first.put(1, payload(1))
        first.flush(WAIT_S)
        in_progress = path_of(root, 1).with_name(f".x{block_file.TEMP_SUFFIX}")
        in_progress.write_bytes(b"partial")
        with DiskBlockStore(root, 1 << 30, FP) as second:
            assert not second.writable and second.keys() == [1] and second.get(1) == payload(1)
            second.put(2, payload(2))
            assert second.stats.dropped == 1
        assert in_progress.exists()
    with DiskBlockStore(root, 1 << 30, FP) as third:
        assert third.writable and not in_progress.exists()


# --- privacy and the main thread --------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_directories_are_0700_and_files_0600(tmp_path: Path, umask: int) -> None:
    """Set, not left to the umask: 0o000 would leave group and others in, 0o277 would take the owner's
    write bit away from what mkdir and open create."""
    root = tmp_path / "kv"
    old = os.umask(umask)
    try:
        with DiskBlockStore(root, 1 << 30, FP) as store:
            store.put(0xAB12, payload(1))
            store.flush(WAIT_S)
    finally:
        os.umask(old)
    block = path_of(root, 0xAB12)
    for directory in (root, blocks_dir(root), block.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for file in (block, blocks_dir(root) / ".lock"):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


def hold_the_writer(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every block write waits for `release` once it has begun (`entered`): the writer held in a write."""
    entered, release = threading.Event(), threading.Event()
    real_write = block_file.write_block

    def held_write(*args: Any) -> int:
        entered.set()
        assert release.wait(WAIT_S)
        return real_write(*args)

    monkeypatch.setattr(block_file, "write_block", held_write)
    return entered, release


def test_put_never_blocks_a_full_queue_drops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer is held inside its first write; the queue (2) fills; every put after returns at once."""
    entered, release = hold_the_writer(monkeypatch)
    with DiskBlockStore(tmp_path / "kv", 1 << 30, FP, queue_blocks=2) as store:
        store.put(1, payload(1))
        assert entered.wait(WAIT_S)

        def put_many() -> None:
            for key in range(2, 12):
                store.put(key, payload(key))

        puts = threading.Thread(target=put_many)
        puts.start()
        puts.join(WAIT_S)
        alive = puts.is_alive()
        release.set()
        assert not alive, "put blocked on a full queue"
        assert store.stats.dropped == 8
        store.put(2, payload(2))  # queued already: not twice
        store.flush(WAIT_S)
        assert sorted(store.keys()) == [1, 2, 3] and store.stats.stores == 3 and store.stats.dropped == 8


def test_a_block_still_queued_for_its_write_is_read_from_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool may evict a block and want it back before the writer reached it: `get` finds it queued."""
    entered, release = hold_the_writer(monkeypatch)
    with DiskBlockStore(tmp_path / "kv", 1 << 30, FP) as store:
        store.put(1, payload(1))
        store.put(2, payload(2))
        assert entered.wait(WAIT_S)
        assert store.keys() == [] and store.get(1) == payload(1) and store.get(2) == payload(2)
        release.set()
        store.flush(WAIT_S)
        assert store.get(2) == payload(2) and store.stats.hits == 3 and store.stats.misses == 0
