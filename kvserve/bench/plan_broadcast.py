"""What sending one StepPlan to the other tensor-parallel ranks costs, measured apart from any model.

`python -m kvserve.bench.plan_broadcast --sequences 256 --ranks 2` starts the other ranks
as processes of this module, joins a gloo group with them (`TensorParallelGroup`, as the executor
does), and times rounds of two kinds, alternating:
- **barrier**: a one-element all-reduce, the floor of one round trip between the ranks;
- **plan**: rank 0 encodes a decode plan of N sequences and broadcasts it (`PlanChannel.send_plan`);
  each other rank receives and decodes it (what it does before its forward); then the same
  all-reduce.
The plan's cost per step is the difference of the two medians: encode, transfer and decode, as the
slowest rank sees them. Rank 0's encode and a rank's decode are reported apart too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.child_python import python_module
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, config_to_argv, flag
from kvserve.executor.tensor_parallel.config import RankPlace
from kvserve.executor.tensor_parallel.group import TensorParallelGroup
from kvserve.executor.tensor_parallel.launcher import local_leader_place
from kvserve.executor.tensor_parallel.plan_channel import MessageKind, PlanChannel
from kvserve.protos import step_codec
from kvserve.protos.step import KnownSequence, StepPlan

CONTEXT = 512
"""Tokens of each sequence's context: sets the block ids' magnitude (their varint size), not the cost much."""


def decode_plan(sequences: int, step: int, block_size: int = 16) -> StepPlan:
    """A steady-state decode step: every sequence one new token, one in `block_size` a new block."""
    known = []
    for i in range(sequences):
        computed = CONTEXT + step
        new_blocks = [i * 64 + computed // block_size] if computed % block_size == 0 else []
        known.append(KnownSequence(i, [1000 + (i * 7 + step) % 40000], computed, 1, new_blocks))
    return StepPlan(step_id=step, known_seqs=known)


@dataclass(frozen=True, slots=True)
class PlanBroadcastConfig:
    """The flags of `python -m kvserve.bench.plan_broadcast` (rank 0 hands them to the other ranks)."""

    ranks: int = field(default=2, metadata=flag("ranks in the group, this process being rank 0"))
    sequences: int = field(default=256, metadata=flag("decode sequences in each plan"))
    rounds: int = field(default=200, metadata=flag("timed rounds of each kind (medians count)"))


def _leader(args: PlanBroadcastConfig) -> dict:
    place = local_leader_place(args.ranks)
    env = {**os.environ, "MASTER_PORT": str(place.master_port)}
    followers = [
        subprocess.Popen(
            python_module("kvserve.bench.plan_broadcast", "--follower", str(rank), *config_to_argv(args)),
            env=env,
        )
        for rank in range(1, args.ranks)
    ]
    group = TensorParallelGroup(place, "gloo", "cpu", timeout_s=60)
    channel = PlanChannel(group)
    token = torch.zeros(1)
    plans = [decode_plan(args.sequences, step) for step in range(args.rounds)]
    barrier, with_plan, encode, encoded = [], [], [], []
    for plan in plans:
        started = time.perf_counter()
        group.all_reduce_(token)
        barrier.append(time.perf_counter() - started)
        started = time.perf_counter()
        encoded.append(channel.send_plan(plan))
        group.all_reduce_(token)
        with_plan.append(time.perf_counter() - started)
        started = time.perf_counter()
        step_codec.encode_plan(plan).SerializeToString()
        encode.append(time.perf_counter() - started)
    group.all_reduce_(token)  # the followers' next barrier round, which the end message then closes
    channel.send(MessageKind.SHUTDOWN)
    decode = statistics.median(decode_times(encoded))
    for process in followers:
        process.wait(30)
    group.destroy()
    return {
        "ranks": args.ranks,
        "sequences": args.sequences,
        "plan_bytes": len(encoded[-1]),
        "barrier_s": statistics.median(barrier),
        "barrier_and_plan_s": statistics.median(with_plan),
        "plan_cost_s": statistics.median(with_plan) - statistics.median(barrier),
        "encode_s": statistics.median(encode),
        "decode_s": decode,
    }


def decode_times(encoded: Sequence[bytes]) -> list[float]:
    """Seconds each plan's bytes take to decode, as every rank but 0 decodes them before its forward."""
    times = []
    for data in encoded:
        started = time.perf_counter()
        PlanChannel.decode_plan(data)
        times.append(time.perf_counter() - started)
    return times


def _follower(rank: int, args: PlanBroadcastConfig) -> None:
    place = RankPlace(rank, args.ranks, rank, args.ranks, "127.0.0.1", int(os.environ["MASTER_PORT"]), True)
    group = TensorParallelGroup(place, "gloo", "cpu", timeout_s=60)
    channel = PlanChannel(group)
    token = torch.zeros(1)
    while True:
        group.all_reduce_(token)
        kind, data = channel.receive()
        if kind is MessageKind.SHUTDOWN:
            break
        channel.decode_plan(data)
        group.all_reduce_(token)
    group.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.plan_broadcast",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_flags(parser, PlanBroadcastConfig)
    parser.add_argument("--follower", type=int, default=None, help=argparse.SUPPRESS)  # set by rank 0 only
    parsed = parser.parse_args(argv)
    config = config_from_args(PlanBroadcastConfig, parsed)
    torch.set_num_threads(1)
    if parsed.follower is not None:
        _follower(parsed.follower, config)
        return 0
    report = _leader(config)
    print(json.dumps(report))
    print(
        f"{report['sequences']} sequences, {report['plan_bytes']} bytes, {report['ranks']} ranks: plan cost "
        f"{1e3 * report['plan_cost_s']:.3f} ms per step (barrier {1e3 * report['barrier_s']:.3f} ms, "
        f"with plan {1e3 * report['barrier_and_plan_s']:.3f} ms); encode {1e3 * report['encode_s']:.3f} ms, "
        f"decode {1e3 * report['decode_s']:.3f} ms",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
