"""The fake executor's KV cache: one slot per token instead of K/V tensors, plus block ownership.

Slots live where a real cache would put the token's K/V
(`block_table[pos // block_size] * block_size + pos % block_size`), and swaps and copies
move them exactly as they would move K/V, so reading a context back through a block
table exposes a wrong table, a stale prefix hit or a bad copy/swap. A slot holds the
token id; in strict mode it holds (token id, position), which also catches a token
that sits at the wrong offset, and the block moves get the stricter checks below.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvserve.protos.step import PlanError

EMPTY_SLOT = -1
Slot = int | tuple[int, int]
"""A token id, or (token id, position) in strict mode; EMPTY_SLOT where nothing was written."""


class ShadowKV:
    """Device and CPU swap slots, and how many live block tables hold each device block."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int, *, strict: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.strict = strict
        # Plain lists: a decode step touches one slot per sequence, where Python indexing
        # beats numpy's per-call overhead by an order of magnitude.
        self.kv: list[Slot] = []
        self.cpu_kv: list[Slot] = []
        self.block_refs: list[int] = []
        self.cpu_filled: list[bool] = []
        """Strict mode: CPU blocks a swap-out filled and no swap-in has consumed yet."""
        self.reset()

    def reset(self) -> None:
        """Every slot becomes garbage and no block is held, as after a real executor restart."""
        bs = self.block_size
        self.block_refs = [0] * self.num_blocks
        self.kv = [EMPTY_SLOT] * (self.num_blocks * bs)
        self.cpu_kv = [EMPTY_SLOT] * (self.num_cpu_blocks * bs)
        self.cpu_filled = [False] * self.num_cpu_blocks

    # --- block ownership -----------------------------------------------------------

    def hold(self, blocks: list[int]) -> None:
        refs = self.block_refs
        for block in blocks:
            refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        refs = self.block_refs
        for block in blocks:
            refs[block] -= 1

    def check_block(self, block: int, what: str) -> None:
        self._check_range(block, False, what)

    def _check_range(self, block: int, cpu: bool, what: str) -> None:
        count, space = (self.num_cpu_blocks, "CPU") if cpu else (self.num_blocks, "device")
        if not 0 <= block < count:
            raise PlanError(f"{what}: {space} block {block} is outside [0, {count})")

    # --- block moves: swap-out, swap-in, copies -------------------------------------

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs."""
        self._move(pairs, "swap_out", from_cpu=False, to_cpu=True)
        for _device, cpu in pairs:
            self.cpu_filled[cpu] = True

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs, into blocks no live sequence holds."""
        self._move(pairs, "swap_in", from_cpu=True, to_cpu=False)
        for cpu, _device in pairs:
            self.cpu_filled[cpu] = False

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) device blocks, into blocks no live sequence holds."""
        self._move(pairs, "copy", from_cpu=False, to_cpu=False)

    def _move(self, pairs: list[tuple[int, int]], what: str, *, from_cpu: bool, to_cpu: bool) -> None:
        """Whole-block moves as one batch: every block is checked and read before any is written."""
        refs = self.block_refs
        for src, dst in pairs:
            self._check_range(src, from_cpu, what)
            self._check_range(dst, to_cpu, what)
            if not to_cpu and refs[dst]:
                raise PlanError(f"{what}: block {dst} belongs to {refs[dst]} live sequence(s) and would be overwritten")
            if self.strict and from_cpu and not self.cpu_filled[src]:
                raise PlanError(f"{what}: CPU block {src} holds nothing (never swapped out, or swapped in already)")
        if self.strict:
            targets = [dst for _src, dst in pairs]
            if len(set(targets)) != len(targets):
                raise PlanError(f"{what}: {pairs} writes a block twice")
            if from_cpu == to_cpu and set(targets) & {src for src, _dst in pairs}:
                raise PlanError(f"{what}: {pairs} writes a block that another move reads")
        source = self.cpu_kv if from_cpu else self.kv
        target = self.cpu_kv if to_cpu else self.kv
        bs = self.block_size
        contents = [source[src * bs : (src + 1) * bs] for src, _dst in pairs]
        for (_src, dst), content in zip(pairs, contents):
            target[dst * bs : (dst + 1) * bs] = content

    # --- the disk tier: a block's slots as bytes --------------------------------------

    @property
    def block_payload_bytes(self) -> int:
        """The bytes `block_bytes` returns: two int64s per slot."""
        return self.block_size * 16

    def block_bytes(self, block: int) -> bytes:
        """Device block `block`'s slots, as (token id, position) int64 pairs (position -1 outside strict mode)."""
        self._check_range(block, False, "store_blocks")
        bs = self.block_size
        values = array("q")
        for value in self.kv[block * bs : (block + 1) * bs]:
            values.extend(value if isinstance(value, tuple) else (value, -1))
        return values.tobytes()

    def load_block(self, block: int, payload: bytes) -> bool:
        """Fill device block `block` from `block_bytes`' payload; False (nothing written) when it does not fit."""
        self._check_range(block, False, "load_blocks")
        if self.block_refs[block]:
            raise PlanError(f"load_blocks: block {block} belongs to {self.block_refs[block]} live sequence(s)")
        values = array("q")
        if len(payload) != 2 * self.block_size * values.itemsize:
            return False
        values.frombytes(payload)
        pairs = zip(values[0::2], values[1::2], strict=True)
        slots: list[Slot] = [(token, pos) if pos >= 0 else token for token, pos in pairs]
        bs = self.block_size
        self.kv[block * bs : (block + 1) * bs] = slots
        return True

    # --- slots ----------------------------------------------------------------------

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def check_covered(self, table: list[int], end: int, what: str) -> None:
        if end > len(table) * self.block_size:
            raise PlanError(
                f"{what}: position {end - 1} is beyond its block table ({len(table)} blocks of {self.block_size})"
            )

    def write(self, table: list[int], tokens: list[int], start: int, end: int, what: str) -> None:
        """Store tokens[start:end] at their slots; never into a block other sequences hold too."""
        self.check_covered(table, end, what)
        bs = self.block_size
        refs = self.block_refs
        for index in range(start // bs, (end - 1) // bs + 1):
            if refs[table[index]] > 1:
                raise PlanError(
                    f"{what}: writes positions into block {table[index]}, which "
                    f"{refs[table[index]]} sequences share (missing copy-on-write)"
                )
        kv = self.kv
        for slot, value in zip(self.slots(table, start, end), self._values(tokens, start, end)):
            kv[slot] = value

    def read_tokens(self, table: list[int], start: int, end: int) -> list[int]:
        """The token ids at positions [start, end) read back through `table` (positions dropped)."""
        kv = self.kv
        held = [kv[slot] for slot in self.slots(table, start, end)]
        return [value[0] if isinstance(value, tuple) else value for value in held]

    def compare(self, table: list[int], tokens: list[int], start: int, end: int, what: str, role: str) -> list[int]:
        """tokens[start:end], after checking that the slots hold exactly them; PlanError if not."""
        kv = self.kv
        stored = [kv[slot] for slot in self.slots(table, start, end)]
        expected = self._values(tokens, start, end)
        if stored != expected:
            offset = next(i for i, (a, b) in enumerate(zip(stored, expected)) if a != b)
            pos = start + offset
            raise PlanError(
                f"{what}: KV at position {pos} (block {table[pos // self.block_size]}) holds "
                f"{_describe(stored[offset])} but the {role} token is {tokens[pos]} at position {pos}: "
                "wrong block table, stale prefix hit or bad copy/swap"
            )
        return tokens[start:end]

    def _values(self, tokens: list[int], start: int, end: int) -> Sequence[Slot]:
        if self.strict:
            return list(zip(tokens[start:end], range(start, end)))
        return tokens[start:end]


def _describe(held: Slot) -> str:
    if held == EMPTY_SLOT:
        return "nothing"
    if isinstance(held, tuple):
        return f"token {held[0]} of position {held[1]}"
    return f"token {held}"
