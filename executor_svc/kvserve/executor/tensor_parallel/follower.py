"""Ranks 1 … N−1: run every message rank 0 broadcasts, in order, until the group ends.

A follower holds the same sequence table and block operations as rank 0 (every rank applies the
same plan) and its own heads' KV cache. Its forward pass takes part in the collectives and returns
no logits; rank 0 samples. A plan refused before the forward (a `PlanError`, a swap without swap
space) is refused on rank 0 too, by the same checks on the same plan, so it is logged and the ranks
stay in step. A failed collective, or any failure inside the forward pass (`ModelRunner._forward`),
ends the process: the ranks may no longer be at the same collective.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import structlog

from kvserve.executor.link_worker import PARENT_CHECK_S, ExitReason
from kvserve.executor.protocol import Executor
from kvserve.executor.tensor_parallel.group import RankLostError
from kvserve.executor.tensor_parallel.plan_channel import MessageKind, PlanChannel

log = structlog.get_logger(__name__)


def watch_leader(parent_pid: int) -> None:
    """Exit once rank 0 (our parent) is gone; started before anything else, so that a rank 0 that
    dies while the group forms leaves no rank behind either."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="tp-parent-watch", daemon=True).start()


def serve_follower(runner: Executor, channel: PlanChannel) -> int:
    """Run rank 0's messages until it ends the group; returns the process exit code."""
    log.info("tensor-parallel rank ready", rank=channel.group.rank, pid=os.getpid())
    try:
        while True:
            kind, data = channel.receive()
            if kind is MessageKind.SHUTDOWN:
                return int(ExitReason.SHUTDOWN)
            if kind is MessageKind.RESET:
                runner.reset()
                continue
            plan = channel.decode_plan(data)
            try:
                runner.execute(plan)
            except RankLostError:
                raise
            except Exception as exc:
                log.error("step failed", step_id=plan.step_id, error=str(exc), traceback=traceback.format_exc())
    except RankLostError as exc:
        log.error("tensor-parallel group lost; exiting", rank=channel.group.rank, error=str(exc))
        return int(ExitReason.RANK_LOST)
    finally:
        runner.close()


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0 started this rank: once it is gone, so is the group, whatever this rank is blocked in."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    log.error("rank 0 is gone; exiting", parent_pid=parent_pid)
    os._exit(int(ExitReason.RANK_LOST))
