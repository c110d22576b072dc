"""At most `--max-loras` adapters resident on the device, in stacked slot tensors; the rest on the host.

Why: on a GPU, device memory goes to the KV cache; an executor serving many fine-tunes keeps them
all in host memory and only those steps use on the device. Each fused matrix of each layer has one
[max_loras, widest, in] tensor for A and one for B; a slot is an index into them. An adapter a step
needs takes a free slot, or the slot of the least recently used adapter that step does not need (a
copy from host memory, counted in `loads`). A step that names more adapters than there are slots
runs the ones left over from a copy made for that step alone (on the CPU, from the host tensors
themselves), and the log says so: the scheduler does not yet bound the adapters of a step, and
failing the step would fail every request in it.

Two layouts, one per kind of device:

- On a GPU, B is stacked as the fused block-diagonal [max_loras, widest, out] the torch path
  multiplies, and a resident adapter is views of its slot.
- On the CPU, the stacks are what the C++ kernel reads (`SlotStacks`: B packed without its zero
  blocks, `LoraMatrix.packed_b`, and each slot's ranks and scaling): one call multiplies every slotted
  row of a step by its slot's pair. A resident adapter is a `SlottedAdapter`: its host matrices (what
  the torch path, where the kernels are not loaded, multiplies) and where its slot is.

Either way a row computes with the same values in the same layout, so its bits do not depend on the
slot it found its adapter in, or on whether it found one (tests/executor/test_lora_batches.py).
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
import torch

from kvserve.executor.lora.adapter import FUSED, LoraAdapter, LoraMatrix

log = structlog.get_logger(__name__)

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page (x86-64, and arm64 with 4 KB base pages)."""


def host_zeros(count: int) -> torch.Tensor:
    """`count` zeroed float32s in host memory, on 2 MB pages where Linux gives them to a region that asks
    (transparent huge pages in their `madvise` mode, the common default), else on whatever torch allocates.

    Why: a decode step reads the slots' tensors from DRAM (the base model's weights pass through the
    caches between two products): 20 MB at batch 1, 160 MB at batch 32 over eight rank-16 adapters.
    On 4 KB pages every page of that costs a TLB miss, in a VM a two-level page walk; on 2 MB pages
    the kernel's time at batch 32 went from 18 to 12.5 ms on the Zen 4 VM."""
    size = count * 4
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(count)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed by the kernel
    region.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    return torch.frombuffer(region, dtype=torch.float32, count=count, offset=start)  # keeps `region` mapped


@dataclass(frozen=True, slots=True)
class StackedMatrix:
    """One fused matrix of one layer in every slot, as `kvserve.kernels.cpu_ops.lora_add` reads it."""

    a: torch.Tensor
    """[capacity, widest, in] float32: each slot's A rows."""
    b: torch.Tensor
    """[capacity, floats] float32: each slot's B blocks, packed (`LoraMatrix.packed_b`)."""
    ranks: torch.Tensor
    """[capacity, projections] int32: each slot's rows per projection (zeros: its adapter does not
    target this matrix, or no adapter holds the slot)."""
    columns: tuple[int, ...]
    """The projections' column boundaries; () where some adapter's matrix has no projection layout
    (one block: every row against every column)."""


LayerEntries = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
"""One source's `a`, `b`, `ranks` and `columns` for a layer's products, in the order of
`kvserve.kernels.cpu_ops.LayerLora.PRODUCTS` (`step_deltas.layer_entries`)."""


@dataclass(frozen=True, slots=True)
class SlotStacks:
    """The CPU kernel's slot tensors, updated in place as adapters come and go."""

    layers: list[dict[str, StackedMatrix]]
    """Per layer, the fused matrices some adapter targets."""
    scaling: torch.Tensor
    """[capacity] float32: each slot's adapter's scaling."""
    layer_entries: dict[int, LayerEntries] = field(default_factory=dict)
    """Per layer, the fused decoder layer's operands of these slots (`step_deltas.KernelLoraStep.layer_lora`),
    built once: every tensor in them is updated in place."""


@dataclass(frozen=True, slots=True)
class SlottedAdapter(LoraAdapter):
    """An adapter resident in slot `slot` of the CPU kernel's `stacks` (its `layers`: the host matrices)."""

    stacks: SlotStacks
    slot: int


class AdapterSlots:
    """Slot tensors for `capacity` adapters of `adapters` (host copies), on `device`."""

    def __init__(self, adapters: Sequence[LoraAdapter], capacity: int, device: str) -> None:
        self.adapters = list(adapters)
        self.capacity = capacity
        self.device = device
        self.loads = 0
        """Adapters copied into a slot since start-up."""
        self.overflows = 0
        """Adapters a step ran from a copy of its own, all slots being taken by that step's others."""
        num_layers = len(self.adapters[0].layers) if self.adapters else 0
        self.stacks: SlotStacks | None = None
        """The CPU kernel's layout (on the CPU)."""
        self._a: list[dict[str, torch.Tensor]] = []
        self._b_t: list[dict[str, torch.Tensor]] = []
        """The torch path's layout (elsewhere): A and B transposed, block-diagonal, per layer and fused matrix."""
        if device == "cpu":
            self.stacks = SlotStacks(self._kernel_stacks(num_layers), torch.zeros(capacity))
        else:
            for layer in range(num_layers):
                a, b_t = {}, {}
                for fused, present in self._present(layer).items():
                    widest = max(m.width for m in present)
                    a[fused] = torch.zeros(capacity, widest, present[0].a.shape[1], device=device)
                    b_t[fused] = torch.zeros(capacity, widest, present[0].b_t.shape[1], device=device)
                self._a.append(a)
                self._b_t.append(b_t)
        self._resident: OrderedDict[int, int] = OrderedDict()
        """Adapter index -> slot, least recently used first."""
        self._views: dict[int, LoraAdapter] = {}
        """Each resident adapter as the step sees it: views of its slot, or a `SlottedAdapter`."""

    def _present(self, layer: int) -> dict[str, list[LoraMatrix]]:
        """The matrices of `layer` the adapters have, by fused matrix (absent: no adapter targets it)."""
        present: dict[str, list[LoraMatrix]] = {}
        for fused in FUSED:
            matrices = [ad.layers[layer][fused] for ad in self.adapters if fused in ad.layers[layer]]
            if matrices:
                present[fused] = matrices
        return present

    def _kernel_stacks(self, num_layers: int) -> list[dict[str, StackedMatrix]]:
        """Zeroed kernel slot tensors for the fused matrices some adapter targets, per layer: views of one
        block of host memory (`host_zeros`)."""
        layouts = []
        for layer in range(num_layers):
            layout = {}
            for fused, present in self._present(layer).items():
                columns = present[0].columns
                if columns is None or any(m.columns != columns or m.ranks is None for m in present):
                    columns = ()
                a_shape = (self.capacity, max(m.width for m in present), present[0].a.shape[1])
                b_shape = (self.capacity, max(m.packed_b(bool(columns)).numel() for m in present))
                layout[fused] = (a_shape, b_shape, columns)
            layouts.append(layout)
        sizes = [math.prod(shape) for layout in layouts for a, b, _ in layout.values() for shape in (a, b)]
        memory, offset = host_zeros(sum(sizes)), 0
        stacks = []
        for layout in layouts:
            stacked = {}
            for fused, (a_shape, b_shape, columns) in layout.items():
                a = memory[offset : offset + math.prod(a_shape)].view(a_shape)
                offset += a.numel()
                b = memory[offset : offset + math.prod(b_shape)].view(b_shape)
                offset += b.numel()
                ranks = torch.zeros(self.capacity, len(FUSED[fused]) if columns else 1, dtype=torch.int32)
                stacked[fused] = StackedMatrix(a, b, ranks, columns)
            stacks.append(stacked)
        return stacks

    @property
    def nbytes(self) -> int:
        total = sum(t.nbytes for layer in (*self._a, *self._b_t) for t in layer.values())
        if self.stacks is not None:
            total += sum(m.a.nbytes + m.b.nbytes for layer in self.stacks.layers for m in layer.values())
        return total

    def acquire(self, needed: Sequence[int]) -> dict[int, LoraAdapter]:
        """Each of `needed` (adapter indices, distinct) on the device for this step, in its slot (views
        of it on a GPU, a `SlottedAdapter` on the CPU) or, past the slots, a step's own copy."""
        found: dict[int, LoraAdapter] = {}
        for index in needed:
            if index in self._resident:
                self._resident.move_to_end(index)
                found[index] = self._views[index]
        for index in needed:
            if index in found:
                continue
            slot = self._free_slot(keep=needed)
            if slot is None:
                self.overflows += 1
                log.warning(
                    "a step names more LoRA adapters than --max-loras: running one from a copy of its own",
                    adapter=self.adapters[index].name,
                    max_loras=self.capacity,
                    step_adapters=len(needed),
                    overflows=self.overflows,
                )
                found[index] = self.adapters[index].to(self.device)
                continue
            found[index] = self._load(index, slot)
        return found

    def _free_slot(self, keep: Sequence[int]) -> int | None:
        """A slot no adapter holds, else the least recently used one's that is not in `keep`."""
        taken = set(self._resident.values())
        free = next((slot for slot in range(self.capacity) if slot not in taken), None)
        if free is not None:
            return free
        victim = next((index for index in self._resident if index not in keep), None)
        if victim is None:
            return None
        del self._views[victim]
        return self._resident.pop(victim)

    def _load(self, index: int, slot: int) -> LoraAdapter:
        adapter = self.adapters[index]
        self._views[index] = (
            self._load_kernel(adapter, slot) if self.stacks is not None else self._load_views(adapter, slot)
        )
        self.loads += 1
        self._resident[index] = slot
        log.debug("LoRA adapter swapped in", adapter=adapter.name, slot=slot, loads=self.loads)
        return self._views[index]

    def _load_views(self, adapter: LoraAdapter, slot: int) -> LoraAdapter:
        layers = []
        for layer, matrices in enumerate(adapter.layers):
            views = {}
            for fused, matrix in matrices.items():
                width = matrix.width
                a = self._a[layer][fused][slot, :width]
                b_t = self._b_t[layer][fused][slot, :width]
                a.copy_(matrix.a, non_blocking=True)
                b_t.copy_(matrix.b_t, non_blocking=True)
                views[fused] = LoraMatrix(a, b_t, matrix.ranks, matrix.columns)
            layers.append(views)
        return LoraAdapter(adapter.name, adapter.rank, adapter.scaling, layers)

    def _load_kernel(self, adapter: LoraAdapter, slot: int) -> SlottedAdapter:
        assert self.stacks is not None
        for matrices, stacked in zip(adapter.layers, self.stacks.layers, strict=True):
            for fused, stack in stacked.items():
                matrix = matrices.get(fused)
                if matrix is None:
                    stack.ranks[slot] = 0
                    continue
                packed = matrix.packed_b(bool(stack.columns))
                stack.a[slot, : matrix.width] = matrix.a
                stack.b[slot, : packed.numel()] = packed
                by_projection = bool(stack.columns) and matrix.ranks is not None
                stack.ranks[slot] = torch.tensor(matrix.ranks if by_projection else (matrix.width,))
        self.stacks.scaling[slot] = adapter.scaling
        return SlottedAdapter(adapter.name, adapter.rank, adapter.scaling, adapter.layers, self.stacks, slot)
