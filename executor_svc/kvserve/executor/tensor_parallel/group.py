"""The process groups of one tensor-parallel executor, and the collectives its forward pass calls.

Two groups over the same ranks:
- the **compute** group (nccl on CUDA, gloo on CPU) carries the all-reduces and the logits gather,
  with `--tp-timeout-s`: a rank that stops answering fails the collective within that time;
- the **control** group (always gloo: plans are bytes in host memory) carries the plan broadcast
  and the start-up agreements (every rank loaded, the KV pool). Followers wait on it between steps
  for as long as the server idles, and ranks load their weights at their own pace, so its timeout
  is long; a rank that dies closes its connections, which fails a pending operation at once.
The rendezvous itself waits up to `RENDEZVOUS_TIMEOUT` for every rank to join (ranks on other
hosts may be started minutes apart).

Every failure of a collective raises `RankLostError`: the group cannot continue (the ranks may be
mid-step at different places), so its owners end the process and the supervisor restarts the group.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager

import structlog
import torch
import torch.distributed as dist

from kvserve.executor.tensor_parallel.config import RankPlace

log = structlog.get_logger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=365)
"""Followers block on the control group while the server idles, for however long that is."""
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


class RankLostError(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or the group was torn down."""


class TensorParallelGroup:
    """This process's membership of the group, from rendezvous to teardown."""

    def __init__(self, place: RankPlace, backend: str, device: str, timeout_s: float) -> None:
        self.rank = place.rank
        self.size = place.world_size
        with self._collective("rendezvous"):
            dist.init_process_group(
                backend,
                init_method=f"tcp://{place.master_addr}:{place.master_port}",
                rank=place.rank,
                world_size=place.world_size,
                timeout=RENDEZVOUS_TIMEOUT,
            )
            self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            self._compute = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        log.info("tensor-parallel group joined", rank=self.rank, size=self.size, backend=backend, device=device)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        with self._collective("all_reduce"):
            dist.all_reduce(tensor, group=self._compute)
        return tensor

    def gather_columns(self, shard: torch.Tensor, width: int) -> torch.Tensor | None:
        """Rank 0: every rank's `shard` [rows, w] side by side, cut to `width` columns; others: None."""
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(self.size)] if self.is_leader else None
        with self._collective("gather"):
            dist.gather(shard, parts, dst=0, group=self._compute)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :width]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (KV pool sizes: the scheduler plans with the smallest)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        with self._collective("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._control)
        return int(tensor.item())

    def wait_for_all(self) -> None:
        """Return once every rank got here (after loading: the first compute collective then finds every
        rank ready, instead of timing out on the slowest loader)."""
        with self._collective("barrier"):
            dist.barrier(group=self._control)

    def broadcast_control(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` (CPU) into every rank's `tensor` of the same shape, over the control group."""
        with self._collective("broadcast"):
            dist.broadcast(tensor, src=0, group=self._control)

    def destroy(self) -> None:
        """Leave the group (process exit would too; this releases the sockets at once)."""
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the peers may be gone already: nothing is left to release
            log.debug("tensor-parallel group teardown", error=str(exc))

    @contextmanager
    def _collective(self, op: str) -> Iterator[None]:
        try:
            yield
        except RankLostError:
            raise
        except Exception as exc:
            raise RankLostError(f"tensor-parallel {op} failed on rank {self.rank}: {exc}") from exc
