"""At most `--max-loras` adapters resident on the device, in stacked slot tensors; the rest on the host.

Why: on a GPU, device memory goes to the KV cache; an executor serving many fine-tunes keeps them
all in host memory and only those steps use on the device. Each fused matrix of each layer has one
[max_loras, widest, in] tensor for A and one [max_loras, widest, out] for B transposed; a slot is an
index into them. An adapter a step needs takes a free slot, or the slot of the least recently used
adapter that step does not need (a copy from host memory, counted in `loads`). A step that names
more adapters than there are slots runs the ones left over from a copy made for that step alone
(on the CPU, from the host tensors themselves), and the log says so: the scheduler does not yet
bound the adapters of a step, and failing the step would fail every request in it.

Either way a row computes with a [width, in] and a [width, out] matrix of the same layout and values,
so its bits do not depend on the slot it found its adapter in, or on whether it found one
(tests/executor/test_lora_batches.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import structlog
import torch

from kvserve.executor.lora.adapter import FUSED, LoraAdapter, LoraMatrix

log = structlog.get_logger(__name__)


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
        self._a: list[dict[str, torch.Tensor]] = []
        self._b_t: list[dict[str, torch.Tensor]] = []
        for layer in range(num_layers):
            a, b_t = {}, {}
            for fused in FUSED:
                present = [ad.layers[layer][fused] for ad in self.adapters if fused in ad.layers[layer]]
                if present:
                    widest = max(m.width for m in present)
                    a[fused] = torch.zeros(capacity, widest, present[0].a.shape[1], device=device)
                    b_t[fused] = torch.zeros(capacity, widest, present[0].b_t.shape[1], device=device)
            self._a.append(a)
            self._b_t.append(b_t)
        self._resident: OrderedDict[int, int] = OrderedDict()
        """Adapter index -> slot, least recently used first."""
        self._views: dict[int, LoraAdapter] = {}
        """Each resident adapter as views of its slot."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in (*self._a, *self._b_t) for t in layer.values())

    def acquire(self, needed: Sequence[int]) -> dict[int, LoraAdapter]:
        """Each of `needed` (adapter indices, distinct) on the device for this step, as slot views or,
        past the slots, a step's own copy."""
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
        layers = []
        for layer, matrices in enumerate(adapter.layers):
            views = {}
            for fused, matrix in matrices.items():
                width = matrix.width
                a = self._a[layer][fused][slot, :width]
                b_t = self._b_t[layer][fused][slot, :width]
                a.copy_(matrix.a, non_blocking=True)
                b_t.copy_(matrix.b_t, non_blocking=True)
                views[fused] = LoraMatrix(a, b_t)
            layers.append(views)
        self.loads += 1
        self._resident[index] = slot
        self._views[index] = LoraAdapter(adapter.name, adapter.rank, adapter.scaling, layers)
        log.debug("LoRA adapter swapped in", adapter=adapter.name, slot=slot, loads=self.loads)
        return self._views[index]
