"""`kvserve bench executor -tp 2` end to end: a two-rank group on a tiny random Llama reports each
decode batch's plan broadcast, and leaves no rank behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvserve.config import defaults
from kvserve.testing.tiny_checkpoints import SHARDABLE, write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _tiny_llama(tmp_path: Path) -> Path:
    """12 query and 6 KV heads: two ranks take 6 and 3 each."""
    return write_tiny_checkpoint(tmp_path / "llama", "llama", **SHARDABLE)


def _ranks_of(pid: int) -> list[int]:
    """Live `executor_svc` processes that rank 0 `pid` started: they carry its pid in their environment,
    which still names it after they are orphaned (a parent-pid check would not)."""
    marker = f"{defaults.EXECUTOR_PARENT_PID_ENV}={pid}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        if b"kvserve.executor" in cmdline and marker in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


def test_bench_executor_tp2_reports_the_plan_broadcast_and_stops_its_ranks(tmp_path):
    model = _tiny_llama(tmp_path)
    argv = [
        *("bench", "executor", "--model", str(model), "--device", "cpu", "--dtype", "float32", "-tp", "2"),
        *("--batches", "4", "--steps", "2", "--prefill-batches", "1", "--prefill-len", "16", "--prompt-len", "16"),
        "--json",
    ]
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvserve", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        stdout, stderr = bench.communicate(timeout=180)
    finally:
        bench.kill()
    assert bench.returncode == 0, stderr
    report = json.loads(stdout)
    assert report["tensor_parallel_size"] == 2
    (decode,) = [r for r in report["results"] if r["phase"] == "decode"]
    assert decode["batch"] == 4
    assert decode["step_s"] > 0
    assert decode["broadcast_s"] > 0 and decode["decode_plan_s"] > 0 and decode["plan_bytes"] > 0
    assert 0 < decode["limit_fraction"] < 1 and report["copy_bandwidth"] > 0
    assert report["weight_bytes"] > 0 and report["kv_bytes_per_seq"] > 0
    (prefill,) = [r for r in report["results"] if r["phase"] == "prefill"]
    assert prefill["broadcast_s"] is None
    assert _ranks_of(bench.pid) == []
