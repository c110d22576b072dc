"""The executor's resident-memory figure follows what the process really holds."""

from __future__ import annotations

from kvserve.executor.process_memory import MIB, resident_bytes


def test_resident_bytes_grows_with_touched_memory() -> None:
    before = resident_bytes()
    block = bytearray(256 * MIB)  # zero-filled, so every page is touched
    after = resident_bytes()
    assert before > 0
    assert after - before >= 200 * MIB, (before, after)
    del block
