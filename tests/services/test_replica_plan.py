"""`kvserve serve --data-parallel-size N` planned without processes: each replica's command
line parsed back with the real `kvserve serve` parser, the router's, ports, devices, threads."""

from __future__ import annotations

import argparse

import pytest

from kvserve.cli import build_parser
from kvserve.commands.serve import ServeConfig, child_executor_from_args, serve_argv
from kvserve.config.flags import config_from_args
from kvserve.replicas.replica_plan import (
    DataParallelConfig,
    ReplicaPlanError,
    ReplicaSetPlan,
    plan_replicas,
)
from kvserve.replicas.router_command import router_command
from kvserve.scheduler.server.server_config import ServerConfig


def _plan(argv: list[str], *, gpus: list[str] | None = None, cores: int = 2) -> ReplicaSetPlan:
    args = build_parser().parse_args(["serve", *argv])
    child = child_executor_from_args(args)
    return plan_replicas(
        config_from_args(DataParallelConfig, args),
        config_from_args(ServerConfig, args),
        serve_argv(config_from_args(ServeConfig, args), child),
        child.shape(),
        gpus=gpus or [],
        cores=cores,
    )


def _replica_args(plan: ReplicaSetPlan, i: int) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *plan.replicas[i].serve_args])


def test_each_replica_is_a_whole_serve_on_its_own_ports() -> None:
    plan = _plan(["-dp", "2", "--executor", "fake", "--block-size", "32", "--max-num-seqs", "64"])
    first, second = (_replica_args(plan, i) for i in range(2))
    assert (first.port, second.port) == (50051, 50052), "public gRPC at --port + i"
    assert (first.http_host, first.http_port, second.http_port) == ("127.0.0.1", 8001, 8002)
    assert (
        first.kv_events_endpoint == "tcp://127.0.0.1:8003" and first.kv_events_replay_endpoint == "tcp://127.0.0.1:8004"
    )
    assert second.kv_events_endpoint == "tcp://127.0.0.1:8005"
    for replica in (first, second):
        assert replica.data_parallel_size == 1, "a replica never starts replicas of its own"
        assert (replica.executor, replica.block_size, replica.max_num_seqs) == ("fake", 32, 64)
    assert [r.env["KVSERVE_REPLICA"] for r in plan.replicas] == ["0", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in plan.replicas[0].env


def test_the_router_fronts_them_on_the_public_port_with_their_events() -> None:
    plan = _plan(["-dp", "2", "--http-port", "9000", "--replica-ports-from", "9100", "--block-size", "32"])
    assert plan.router_url == "http://127.0.0.1:9000"
    argv = router_command(plan.router, "vllm-router")
    assert argv[argv.index("--port") + 1] == "9000" and argv[argv.index("--policy") + 1] == "kv_aware"
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == [
        "http://127.0.0.1:9100",
        "http://127.0.0.1:9101",
    ]
    sources = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:9100=tcp://127.0.0.1:9102", "http://127.0.0.1:9101=tcp://127.0.0.1:9104"]
    assert argv[argv.index("--kv-event-block-size") + 1] == "32"


def test_other_policies_publish_no_events_unless_asked() -> None:
    plan = _plan(["-dp", "3", "--router-policy", "round_robin"])
    assert all(r.kv_events_endpoint is None for r in plan.replicas)
    assert "--kv-event-source" not in router_command(plan.router, "vllm-router")
    asked = _plan(["-dp", "2", "--router-policy", "round_robin", "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    assert [r.kv_events_endpoint for r in asked.replicas] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]


def test_cpu_replicas_divide_the_cores_and_gpu_replicas_the_devices() -> None:
    cpu = _plan(["-dp", "2"], cores=16)
    assert _replica_args(cpu, 0).num_threads == 7, "16 cores less one scheduler each, halved"
    assert _replica_args(_plan(["-dp", "2"], cores=2), 1).num_threads == 1
    kept = _plan(["-dp", "2", "--num-threads", "3"], cores=16)
    assert _replica_args(kept, 0).num_threads == 3, "the user's choice stands"
    on_cpu = _plan(["-dp", "2", "--device", "cpu"], gpus=["0", "1"], cores=16)
    assert "CUDA_VISIBLE_DEVICES" not in on_cpu.replicas[0].env, "--device cpu: the cores, not the GPUs"
    assert _replica_args(on_cpu, 0).num_threads == 7
    gpu = _plan(["-dp", "2", "-tp", "2"], gpus=["0", "1", "2", "3"])
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in gpu.replicas] == ["0,1", "2,3"]
    assert _replica_args(gpu, 0).num_threads is None, "no thread split on GPUs"
    with pytest.raises(ReplicaPlanError, match="needs 4 GPUs; 2 visible"):
        _plan(["-dp", "2", "-tp", "2"], gpus=["0", "1"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-dp", "2", "--http-port", "0"], "needs the HTTP API"),
        (["-dp", "0"], "expected 1 or more"),
        (["-dp", "2", "--host", "0.0.0.0"], "refusing to listen on '0.0.0.0' without authentication"),
        (["-dp", "2", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "the router serves plain HTTP"),
        (["-dp", "2", "--link", "tcp://127.0.0.1:0"], "--link 'tcp://127.0.0.1:0'"),
    ],
)
def test_plans_that_cannot_work_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ReplicaPlanError, match=message):
        _plan(argv)


def test_a_shared_link_endpoint_is_offset_per_replica() -> None:
    plan = _plan(["-dp", "2", "--link", "tcp://127.0.0.1:6000"])
    assert [_replica_args(plan, i).link for i in range(2)] == ["tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"]
