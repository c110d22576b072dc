"""Rank 0 sends every rank the same message: a StepPlan, a reset, or the end of the group.

A message is a protobuf `StepPlan` (the link's own wire format, `protos/kvserve/v1/executor_link.proto`)
broadcast as raw bytes over the control group, in a fixed-size buffer that starts with a (kind,
length) header. No pickle, and no transport of our own: the ranks already share torch.distributed, and gloo's
broadcast is a TCP send that reaches ranks on other hosts as well. Measured in
docs/benchmarks.md ("Tensor parallelism"): encode, broadcast and decode of a 256-sequence decode plan.
"""

from __future__ import annotations

import struct
from enum import IntEnum

import numpy as np
import torch

from kvserve.executor.tensor_parallel.group import TensorParallelGroup
from kvserve.protos import step_codec
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.step import StepPlan

INLINE_BYTES = 32 * 1024
"""One broadcast carries a message of up to this size (less the header); a larger one (a plan with long
new prompts) sends the rest in a second broadcast. A decode plan of 256 sequences is about 2 kB, so
a step costs one broadcast, not two (each about a round trip: 0.3–0.5 ms on loopback gloo)."""
_HEADER = struct.Struct("<qq")
"""(kind, length) at the start of every message."""


class MessageKind(IntEnum):
    """What a message asks every rank to do."""

    PLAN = 1
    RESET = 2
    SHUTDOWN = 3


class PlanChannel:
    """Rank 0's side sends, the other ranks' side receives, in the same order, over the control group."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self._inline = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        self._view = self._inline.numpy()

    # --- rank 0 ----------------------------------------------------------------

    def send_plan(self, plan: StepPlan) -> bytes:
        """Returns the bytes sent (what every other rank decodes)."""
        data = step_codec.encode_plan(plan).SerializeToString()
        self.send(MessageKind.PLAN, data)
        return data

    def send(self, kind: MessageKind, data: bytes = b"") -> None:
        _HEADER.pack_into(self._view.data, 0, int(kind), len(data))
        inline = min(len(data), INLINE_BYTES - _HEADER.size)
        self._view[_HEADER.size : _HEADER.size + inline] = np.frombuffer(data, dtype=np.uint8, count=inline)
        self.group.broadcast_control(self._inline)
        if inline < len(data):
            self.group.broadcast_control(torch.frombuffer(bytearray(data[inline:]), dtype=torch.uint8))

    # --- the other ranks -------------------------------------------------------

    def receive(self) -> tuple[MessageKind, bytes]:
        self.group.broadcast_control(self._inline)
        kind, length = _HEADER.unpack_from(self._view.data, 0)
        inline = min(length, INLINE_BYTES - _HEADER.size)
        data = self._view[_HEADER.size : _HEADER.size + inline].tobytes()
        if inline < length:
            rest = torch.empty(length - inline, dtype=torch.uint8)
            self.group.broadcast_control(rest)
            data += rest.numpy().tobytes()
        return MessageKind(kind), data

    @staticmethod
    def decode_plan(data: bytes) -> StepPlan:
        return step_codec.decode_plan(pb.StepPlan.FromString(data))
