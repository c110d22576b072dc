"""How a tensor-parallel executor is configured, and where one rank learns its place.

A group of ranks on one host is started by rank 0 itself (`kvserve.executor.tensor_parallel.launcher`).
Ranks started by something else (torchrun, a job scheduler, one `kvserve executor` per node) find
their rank in the usual torch.distributed environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvserve.config.flags import flag

BACKENDS = ("gloo", "nccl")


class TensorParallelSetupError(ValueError):
    """The tensor-parallel flags or environment contradict each other (exit code 2 at start)."""


_GROUP = "tensor parallelism"


@dataclass(slots=True)
class TensorParallelConfig:
    """The `--tensor-parallel-size` family of `kvserve executor` flags."""

    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "executor ranks the model is sharded across, one process each (attention heads, MLP columns and "
            "vocabulary split; the KV cache holds each rank's heads)",
            aliases=("-tp",),
            metavar="N",
            group=_GROUP,
        ),
    )
    tp_backend: str = field(
        default="auto",
        metadata=flag(
            "torch.distributed backend of the model's collectives: gloo, nccl, or auto (nccl on cuda, gloo on cpu)",
            choices=("auto", *BACKENDS),
            group=_GROUP,
        ),
    )
    tp_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "a collective that waits longer than this for a rank ends the whole group, which is then restarted "
            "(a rank that died is noticed at once)",
            group=_GROUP,
        ),
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.tp_backend != "auto" and self.tp_backend not in BACKENDS:
            raise ValueError(f"--tp-backend must be auto, gloo or nccl, got {self.tp_backend!r}")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"--tp-timeout-s must be positive, got {self.tp_timeout_s}")


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One rank's place in its group and how to reach the group's rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Ranks on this host, which share its cores (CPU threads per rank)."""
    master_addr: str
    master_port: int
    launched_by_leader: bool
    """Started by rank 0 of the same host (which watches it), not by an outside launcher."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


SPAWNED_ENV = "KVSERVE_TP_SPAWNED"
"""Set by rank 0 in the environment of the ranks it starts."""


def place_from_env(size: int, env: Mapping[str, str] | None = None) -> RankPlace | None:
    """This process's place when the environment names one (`RANK` and `WORLD_SIZE`); None: it does not,
    and this process is rank 0 of a group it starts itself."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world_size = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if world_size != size:
        raise TensorParallelSetupError(f"WORLD_SIZE={world_size} in the environment, but --tensor-parallel-size {size}")
    if not 0 <= rank < world_size:
        raise TensorParallelSetupError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise TensorParallelSetupError(
                f"RANK and WORLD_SIZE are set but {name} is not (see docs/tensor-parallel.md)"
            )
    return RankPlace(
        rank=rank,
        world_size=world_size,
        local_rank=_env_int(env, "LOCAL_RANK", rank),
        local_world_size=_env_int(env, "LOCAL_WORLD_SIZE", world_size),
        master_addr=env["MASTER_ADDR"],
        master_port=_env_int(env, "MASTER_PORT"),
        launched_by_leader=env.get(SPAWNED_ENV) == "1",
    )


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TensorParallelSetupError(f"{name}={value!r} in the environment is not an integer") from None


def check_rank_device(device: str) -> None:
    """Each rank takes `cuda:LOCAL_RANK`: a --device naming one GPU would put every rank on it."""
    if device.startswith("cuda:"):
        raise TensorParallelSetupError(
            f"--device {device} with --tensor-parallel-size: use --device cuda (or auto), and each rank takes "
            "cuda:LOCAL_RANK; pick the GPUs with CUDA_VISIBLE_DEVICES"
        )


def resolve_backend(config: TensorParallelConfig, device: str) -> str:
    """auto: nccl on CUDA (collectives on device memory), gloo on CPU."""
    if config.tp_backend != "auto":
        return config.tp_backend
    return "nccl" if device.startswith("cuda") else "gloo"
