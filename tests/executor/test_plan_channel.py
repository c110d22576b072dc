"""The plan broadcast's framing: what rank 0 sends is what every other rank receives, small or large.

The group is replaced by a recorder of the broadcast buffers (in order), which a receiving
channel replays: the framing is tested here, the real gloo broadcast by the tensor-parallel
model and serve tests, and its cost by `python -m kvserve.bench.plan_broadcast` (run below).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from kvserve.bench.plan_broadcast import decode_plan
from kvserve.executor.tensor_parallel.plan_channel import INLINE_BYTES, MessageKind, PlanChannel
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import NewSequence


class _Wire:
    """Stands in for the control group: rank 0's broadcasts are recorded, a receiver's replayed."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.rank = 0

    def broadcast_control(self, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.sent.pop(0))


def _pair() -> tuple[PlanChannel, PlanChannel, _Wire]:
    wire, replay = _Wire(), _Wire()
    replay.rank = 1
    replay.sent = wire.sent
    return PlanChannel(wire), PlanChannel(replay), wire  # type: ignore[arg-type]


def test_a_decode_plan_goes_in_one_broadcast_and_arrives_whole() -> None:
    sender, receiver, wire = _pair()
    plan = decode_plan(256, step=16)
    sender.send_plan(plan)
    assert len(wire.sent) == 1
    kind, data = receiver.receive()
    assert kind is MessageKind.PLAN
    assert receiver.decode_plan(data) == plan


def test_a_plan_larger_than_the_inline_buffer_sends_the_rest_after_it() -> None:
    sender, receiver, wire = _pair()
    prompt = list(range(3 * INLINE_BYTES // 2))  # varints of 1-3 bytes: several times the buffer
    plan = decode_plan(4, step=1)
    plan.new_seqs.append(NewSequence(99, prompt, len(prompt), 0, 16, list(range(200)), SamplingParams(), 7))
    sender.send_plan(plan)
    sender.send(MessageKind.RESET)
    sender.send(MessageKind.SHUTDOWN)
    assert len(wire.sent) == 4
    kind, data = receiver.receive()
    assert kind is MessageKind.PLAN and len(data) > INLINE_BYTES
    assert receiver.decode_plan(data) == plan
    assert receiver.receive() == (MessageKind.RESET, b"")
    assert receiver.receive() == (MessageKind.SHUTDOWN, b"")


def test_the_broadcast_benchmark_measures_a_plan_over_real_gloo_ranks() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.plan_broadcast", "--sequences", "256", "--rounds", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["sequences"] == 256 and report["ranks"] == 2
    assert report["plan_bytes"] > 256  # a token and a position per sequence, at least
    assert report["barrier_and_plan_s"] > 0 and report["encode_s"] > 0 and report["decode_s"] > 0
