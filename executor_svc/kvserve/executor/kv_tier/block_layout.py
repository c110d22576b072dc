"""Where a store's block files live, and what a starting store finds and claims there.

    DIRECTORY/                    the --kv-disk directory (created 0o700 when it does not exist)
      3f2a9c01d4e5b6a7/           sha256(fingerprint)[:16]: one model's blocks, 0o700
        .lock                     held (flock) by the one store writing here
        00/ … ff/                 the key's first two hex digits, 0o700
          00c0ffee12345678.kvb    one block, named by its key in hex, 0o600

Why this shape: a fingerprint (model, dtype, block geometry) that changes never meets the old
blocks, which stay where they were for the model that wrote them; the 256 fan-out directories keep
each directory small (a million blocks is ~4,000 files apiece), so lookups and the start-up scan
stay cheap. The scan reads names and `stat`s only: verification waits for `get`, so a start with a
full directory costs milliseconds, not a read of every payload.

Why the lock: two stores writing one directory would each bound only their own bytes, and a starting
one would delete the temporary file the other is writing. The second one (another replica on the
same model and directory) reads the blocks there and writes none. The kernel drops the lock when a
process dies, so kill -9 never leaves it held.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.executor.kv_tier.block_file import BLOCK_SUFFIX, FILE_MODE, TEMP_SUFFIX

DIR_MODE = 0o700
_LOCK_NAME = ".lock"
_KEY_DIGITS = 16
_FANOUT_DIGITS = 2
_HEX = frozenset("0123456789abcdef")


def fingerprint_dir(directory: Path, digest: bytes) -> Path:
    """The folder of one fingerprint's blocks under the store's directory."""
    return directory / digest.hex()[:16]


def block_path(blocks_dir: Path, key: int) -> Path:
    name = f"{key:0{_KEY_DIGITS}x}"
    return blocks_dir / name[:_FANOUT_DIGITS] / f"{name}{BLOCK_SUFFIX}"


def make_private_dir(path: Path) -> None:
    """Create `path` as 0o700 (chmod after mkdir, so the umask does not matter); its missing parents
    get the default mode, as `mkdir -p` gives them. An existing directory is left as it is."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path)) from None
        return
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, DIR_MODE)
    os.chmod(path, DIR_MODE)


def claim(blocks_dir: Path) -> int | None:
    """An open descriptor holding `blocks_dir`'s lock, or None when another store holds it.

    OSError when the lock file cannot be opened for writing: a read-only or unwritable directory.
    """
    fd = os.open(blocks_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(slots=True)
class FoundBlock:
    """A block file seen by the start-up scan: its key, its size, and its mtime (the LRU order)."""

    key: int
    size: int
    mtime_ns: int


def _parse_key(subdir: str, filename: str) -> int | None:
    stem, suffix = filename[: -len(BLOCK_SUFFIX)], filename[-len(BLOCK_SUFFIX) :]
    if suffix != BLOCK_SUFFIX or len(stem) != _KEY_DIGITS or not set(stem) <= _HEX or stem[:_FANOUT_DIGITS] != subdir:
        return None
    return int(stem, 16)


def scan(blocks_dir: Path, *, remove_temps: bool) -> list[FoundBlock]:
    """The block files under `blocks_dir`, least recently written first; OSError if it cannot be listed.

    Files of other names are ignored (never ours to delete). `remove_temps` deletes temporary files,
    which only a writer killed mid-write leaves behind: pass it only while holding the lock, or this
    would delete another live store's write in progress.
    """
    found: list[FoundBlock] = []
    with os.scandir(blocks_dir) as subdirs:
        fanout = [d for d in subdirs if len(d.name) == _FANOUT_DIGITS and set(d.name) <= _HEX and d.is_dir()]
    for subdir in fanout:
        with os.scandir(subdir.path) as entries:
            for entry in entries:
                if entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX):
                    if remove_temps:
                        with contextlib.suppress(OSError):  # a directory we cannot write: the first write says so
                            os.unlink(entry.path)
                    continue
                key = _parse_key(subdir.name, entry.name)
                if key is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.is_file(follow_symlinks=False):
                    found.append(FoundBlock(key, st.st_size, st.st_mtime_ns))
    found.sort(key=lambda block: block.mtime_ns)
    return found
