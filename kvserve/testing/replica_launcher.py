"""Run `kvserve serve --data-parallel-size N` as a real subprocess, for tests and `bench scale-out`.

The replica set's processes (its replicas, their executors, the router) each run in a session
of their own and die with their parent (PR_SET_PDEATHSIG), and teardown also SIGKILLs every
pid the set logged as started, so nothing outlives a failed run. Its JSON log lines (one
file, every process) give the pids; the router's `/workers` gives its view of the replicas.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.child_python import python_module
from kvserve.testing.ports import free_port_range, free_ports
from kvserve.testing.server_launcher import pid_alive
from kvserve.testing.waiting import wait_until

READY_LINE = "replicas behind vllm-router"
"""In the set's `kvserve: serving N replicas behind vllm-router ...` line, printed once all are in rotation."""


def metric_total(http_url: str, sample: str) -> float:
    """The sum of one Prometheus sample over all its labels, from a replica's own `/metrics`
    (e.g. `kvserve:request_success_total`): what it served, whatever the router says."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(http_url + "/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == sample)


@dataclass
class ReplicaSetProcess:
    process: subprocess.Popen
    url: str
    """The router: the set's OpenAI-compatible HTTP API."""
    replica_urls: list[str]
    """Each replica's own HTTP API (loopback), in replica order."""
    log_path: Path

    def events(self, event: str) -> list[dict]:
        return [e for e in self._log() if e.get("event") == event]

    def started_pids(self) -> list[int]:
        """Every process the set started: replicas, their executors, the router."""
        return [e["pid"] for e in self._log() if str(e.get("event", "")).endswith("_started") and "pid" in e]

    def replica_pids(self, index: int) -> list[int]:
        """Every scheduler pid replica `index` has had, in start order."""
        return [e["pid"] for e in self.events("replica_started") if e.get("replica") == index]

    def get_json(self, url: str) -> dict:
        response = httpx.get(url, timeout=10)
        assert response.status_code == 200, f"GET {url}: {response.status_code} {response.text[:500]}"
        return response.json()

    def model(self, timeout_s: float = 60.0) -> str:
        """The served model's id, as the router's /v1/models passes it on from a replica.

        The router answers 503 while it holds no worker in rotation (seen once on a loaded 2-core
        machine just after start-up), so this waits for its first 200."""
        answers: list[httpx.Response] = []

        def answered() -> bool:
            answers.append(httpx.get(self.url + "/v1/models", timeout=10))
            return answers[-1].status_code == 200

        wait_until(answered, timeout_s, lambda: f"the router's /v1/models: {answers[-1].text[:500]}")
        return answers[-1].json()["data"][0]["id"]

    def workers(self) -> dict[str, bool]:
        """The router's view: each replica URL and whether it is in rotation."""
        return {w["url"]: w["is_healthy"] for w in self.get_json(self.url + "/workers")["workers"]}

    def loads(self) -> list[int]:
        """Each replica's running + waiting requests, from its own /get_load."""
        return [self.get_json(url + "/get_load")["load"] for url in self.replica_urls]

    def log_tail(self, chars: int = 4000, plain_lines: int = 30) -> str:
        """The log's last `chars`, after its last `plain_lines` lines that are not JSON: the router's own
        output and any crash report, which the replicas' JSON lines would push out of a tail."""
        text = self.log_path.read_text(errors="replace")
        plain = [line for line in text.splitlines() if not line.startswith("{")][-plain_lines:]
        return "lines that are not JSON:\n" + "\n".join(plain) + "\n--- the log's tail:\n" + text[-chars:]

    def _log(self) -> list[dict]:
        """The JSON log lines of every process in the set (the router's own lines are not JSON)."""
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
        return events


@contextlib.contextmanager
def serving_replicas(
    args: Sequence[str], log_dir: Path, *, replicas: int = 2, timeout_s: float = 180.0, name: str = "replicas"
) -> Iterator[ReplicaSetProcess]:
    """`kvserve serve -dp REPLICAS ARGS` on free loopback ports, until every replica is in the
    router's rotation; stopped with SIGTERM (then SIGKILL of everything it started) at the end."""
    base = free_port_range(3 * replicas)[0]
    taken = range(base, base + 3 * replicas)
    http_port, metrics_port = [port for port in free_ports(2 + 3 * replicas) if port not in taken][:2]
    argv = python_module("kvserve", "serve", "--data-parallel-size", str(replicas), "--port", "0")
    argv += ["--http-port", str(http_port), "--replica-ports-from", str(base)]
    argv += ["--router-metrics-port", str(metrics_port), *args]
    log_path = log_dir / f"{name}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    replica_set = ReplicaSetProcess(
        process,
        f"http://127.0.0.1:{http_port}",
        [f"http://127.0.0.1:{base + i}" for i in range(replicas)],
        log_path,
    )
    try:
        wait_until(
            lambda: process.poll() is not None or READY_LINE in log_path.read_text(errors="replace"),
            timeout_s,
            lambda: f"{name} to serve:\n{replica_set.log_tail()}",
        )
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{replica_set.log_tail()}")
        yield replica_set
    finally:
        started = replica_set.started_pids()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for pid in started:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def serving_router(args: Sequence[str], log_path: Path | None = None, timeout_s: float = 120.0) -> Iterator[str]:
    """`kvserve router ARGS` (its `--worker-url`s, policy, ...) on free loopback ports, until its
    `/readiness` answers 200 (every replica passed a health check); its URL. Stopped at the end."""
    port, metrics_port = free_ports(2)
    argv = python_module("kvserve", "router", "--port", str(port), "--metrics-port", str(metrics_port), *args)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(log_path.open("w")) if log_path is not None else subprocess.DEVNULL
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"kvserve router exited with {process.returncode} (log: {log_path})")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/readiness", timeout=5).status_code == 200
        return False

    try:
        wait_until(ready, timeout_s, f"the router on {url} to be ready", interval_s=0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
