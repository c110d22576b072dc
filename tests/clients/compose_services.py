"""Run a compose file's services as local processes: read, check, localize, start, probe, stop.

There is no Docker engine here, so `localize` turns each service into a local process the
way compose would start it, changing only what a container provides:
- service hostnames in endpoints (`tcp://scheduler:50052`, `http://replica-a:8000`, also
  inside `URL=ENDPOINT` values) become 127.0.0.1;
- every port a service's command listens on (gRPC, HTTP, link, KV events, metrics) becomes
  one free port of that service, the same wherever it appears: the commands, the published
  ports (locally published = target) and the healthchecks, since other servers run on this
  machine at the same time. Ports are per service: two containers may both listen on 8000,
  and `http://replica-b:8000` then means replica-b's free port, a bare port a service's own;
- volume targets (/cache) become temporary folders, and the image's WORKDIR (/app) the
  repository; the model-cache folder gets a symlink to the already-converted default model;
- `kvserve` and `python` are this interpreter; the executor (`kvserve executor`, or the child
  of `kvserve serve`) runs on the CPU (`--device cpu`, slow) or as the fake executor instead
  of on the GPU.
`check_compose` checks without running anything that the file's ports, links, router workers
and healthchecks agree. Used by tests/clients/test_compose_services.py and
test_compose_replicas.py (docker-compose.replicas.yml), and test_compose.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from kvserve.cli import build_parser
from kvserve.link.endpoint import is_loopback_host
from kvserve.scheduler.server.http.browser_policy import BrowserPolicy
from kvserve.scheduler.server.security.bind_policy import BindSecurity, InsecureBindError, check_bind
from kvserve.testing.ports import free_ports
from kvserve.testing.waiting import WaitTimedOut, wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
IMAGE_WORKDIR = "/app"
LOOPBACK = "127.0.0.1"
PORT_FLAGS = frozenset({"--port", "--http-port", "--metrics-port"})
ENDPOINT = re.compile(r"^(?P<scheme>[a-z]+)://(?P<host>[^:/]+):(?P<port>\d+)(?P<rest>.*)$")
ENDPOINTS = re.compile(r"(?P<scheme>[a-z]+)://(?P<host>[^:/=\s]+):(?P<port>\d+)")
"""Each endpoint inside an argument, so both of `http://replica-a:8000=tcp://replica-a:5557`."""
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)")
DURATION_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
HEALTHY_CAP_S = 240.0
"""Longest wait for a healthcheck to pass (the executor's start_period allows a 10-minute first conversion)."""
CHECK_TIMEOUT_FLOOR_S = 10.0
"""A healthcheck attempt gets at least this long: other tests load these cores at the same time."""


class ComposeError(AssertionError):
    """The compose file does not hang together, or a service did not come up, answer or stop."""


# --- reading the file ---------------------------------------------------------------------


def load_compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def seconds(value: str | int | float | None, default: float) -> float:
    """A compose duration ("1m30s", "40s") in seconds."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return float(value)
    parts = DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ComposeError(f"unreadable duration {value!r}")
    return sum(float(n) * DURATION_S[u] for n, u in parts)


@dataclass(frozen=True)
class Published:
    host_ip: str
    published: int
    target: int


def published_ports(service: dict) -> list[Published]:
    """`ports` in the short ("127.0.0.1:8000:8000") or the long (target/published/host_ip) syntax."""
    found = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            target = int(entry["target"])
            found.append(Published(str(entry.get("host_ip", "0.0.0.0")), int(entry.get("published", target)), target))
            continue
        parts = str(entry).split("/", 1)[0].split(":")
        host_ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        target = int(parts[-1])
        found.append(Published(host_ip, int(parts[-2] or target) if len(parts) > 1 else target, target))
    return found


def kvserve_args(command: list[str]) -> argparse.Namespace | None:
    """The `kvserve` CLI's parse of a command (so defaults count), None for other programs."""
    return build_parser().parse_args(command[1:]) if command[:1] == ["kvserve"] else None


def endpoint_port(endpoint: str) -> int | None:
    match = ENDPOINT.match(endpoint)
    return int(match["port"]) if match else None


def listens(command: list[str]) -> dict[str, int]:
    """The tcp ports a `kvserve scheduler`/`serve`/`router` command binds, by role."""
    args = kvserve_args(command)
    if args is not None and args.command == "router":  # vllm-router: its API and its Prometheus port
        return {"http": args.port, "metrics": args.metrics_port}
    if args is None or args.command not in ("scheduler", "serve"):
        return {}
    ports = {"grpc": args.port}
    if args.http_port:
        ports["http"] = args.http_port
    if args.metrics_port:
        ports["metrics"] = args.metrics_port
    if (link := endpoint_port(args.link)) is not None:
        ports["link"] = link
    for role in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        if (port := endpoint_port(getattr(args, role, None) or "")) is not None:
            ports[role.removesuffix("_endpoint")] = port
    return ports


def _bare_port(command: list[str], i: int) -> bool:
    """Whether argument i is a port by itself: after a port flag, or a positional number."""
    arg, previous = command[i], command[i - 1] if i else ""
    if not arg.isdigit():
        return False
    return previous in PORT_FLAGS or (i > 1 and not previous.startswith("-"))


def ports_in(command: list[str]) -> list[tuple[int, int]]:
    """(index, port) for each port an argument names: after a port flag, in an endpoint (each one of
    a `URL=ENDPOINT` value), or positional."""
    found = []
    for i, arg in enumerate(command):
        if _bare_port(command, i):
            found.append((i, int(arg)))
        else:
            found += [(i, int(match["port"])) for match in ENDPOINTS.finditer(arg)]
    return found


def check_compose(compose: dict) -> list[str]:
    """What does not hang together: a listener the bind policy refuses, an insecure one published off
    loopback, a port published or probed that the service does not use, a link to the wrong service or port."""
    services = compose["services"]
    problems = []
    for name, service in services.items():
        args = kvserve_args(service["command"])
        used = set(listens(service["command"]).values())
        if args is not None and args.command in ("scheduler", "serve"):
            problems += [f"{name}: {p}" for p in _api_problems(args, published_ports(service))]
        if args is not None and args.command == "executor":
            problems += [f"{name}: {p}" for p in _link_problems(args.endpoint, service, services)]
            used.add(endpoint_port(args.endpoint) or 0)
        if args is not None and args.command == "router":
            problems += [f"{name}: {p}" for p in _router_problems(args, service, services)]
        for port in published_ports(service):
            if port.target not in used:
                problems.append(f"{name}: publishes target {port.target}, but its command listens on {sorted(used)}")
        test = service.get("healthcheck", {}).get("test")
        if not test or test[0] not in ("CMD", "CMD-SHELL"):
            problems.append(f"{name}: no healthcheck command")
            continue
        for _, port in ports_in(test[1:]):
            if port not in used:
                problems.append(f"{name}: healthcheck probes port {port}, but the service uses {sorted(used)}")
    return problems


def _api_problems(args, published: list[Published]) -> list[str]:
    problems = []
    for host in {args.host, args.http_host or args.host}:
        security = BindSecurity(host, args.auth_token_file is not None, args.tls_cert is not None)
        try:
            check_bind(dataclasses.replace(security, allow_insecure_remote=args.allow_insecure_remote))
        except InsecureBindError as exc:
            problems.append(f"the command would exit: {exc}")
    if args.allow_insecure_remote and args.auth_token_file is None:
        problems += [
            f"--allow-insecure-remote with port {port.target} published on {port.host_ip}: "
            "publish on 127.0.0.1 or require --auth-token-file"
            for port in published
            if not is_loopback_host(port.host_ip)
        ]
    return problems


def _link_problems(endpoint: str, service: dict, services: dict) -> list[str]:
    match = ENDPOINT.match(endpoint)
    peer = services.get(match["host"]) if match else None
    if peer is None:
        return [f"--link {endpoint} names no service of this file"]
    problems = []
    peer_link = listens(peer["command"]).get("link")
    if peer_link != int(match["port"]):
        problems.append(f"--link port {match['port']} but {match['host']} binds its link on {peer_link}")
    if not set(service.get("networks", [])) & set(peer.get("networks", [])):
        problems.append(f"shares no network with {match['host']}")
    if match["host"] not in service.get("depends_on", {}):
        problems.append(f"does not depend_on {match['host']}")
    return problems


def _router_problems(args, service: dict, services: dict) -> list[str]:
    """vllm-router authenticates nobody; each worker is a service of the file whose HTTP API and KV
    events are where the router looks, reachable, started first, and accepting the router's Host."""
    problems = [
        f"publishes the router's port {port.target} on {port.host_ip}: vllm-router checks no token, "
        "publish on 127.0.0.1 (an authenticating proxy in front for more)"
        for port in published_ports(service)
        if not is_loopback_host(port.host_ip)
    ]
    for url in args.worker_url:
        match = ENDPOINT.match(url)
        worker = services.get(match["host"]) if match else None
        if worker is None:
            problems.append(f"--worker-url {url} names no service of this file")
            continue
        host, ports, worker_args = match["host"], listens(worker["command"]), kvserve_args(worker["command"])
        if ports.get("http") != int(match["port"]):
            problems.append(f"--worker-url {url} but {host} serves HTTP on {ports.get('http')}")
        if not set(service.get("networks", [])) & set(worker.get("networks", [])):
            problems.append(f"shares no network with {host}")
        if host not in service.get("depends_on", {}):
            problems.append(f"does not depend_on {host}")
        if worker_args is not None and worker_args.command in ("scheduler", "serve"):
            policy = BrowserPolicy(
                auth=worker_args.auth_token_file is not None,
                listen_host=worker_args.http_host or worker_args.host,
                allowed_hosts=tuple(worker_args.allowed_hosts),
            )
            if not policy.host_allowed(f"{host}:{match['port']}"):
                problems.append(f"{host} refuses the router's requests (Host: {host}): give it --allowed-hosts {host}")
    for pair in args.kv_events:
        url, _, endpoint = pair.partition("=")
        worker, events = ENDPOINT.match(url), ENDPOINT.match(endpoint)
        if worker is None or events is None or worker["host"] != events["host"]:
            problems.append(f"--kv-events {pair}: not the worker's own host")
            continue
        bound = listens(services[events["host"]]["command"]).get("kv_events") if events["host"] in services else None
        if bound != int(events["port"]):
            problems.append(f"--kv-events {pair} but {events['host']} publishes KV events on {bound}")
    return problems


# --- running it ------------------------------------------------------------------------------


def localize(compose: dict, scratch: Path, *, executor: str) -> tuple[dict, dict[int, int]]:
    """A copy of the services as local processes (see the module doc) and the port map it used, by
    container port; for a file where no two services listen on the same port (else localize_services)."""
    services, service_ports = localize_services(compose, scratch, executor=executor)
    port_map: dict[int, int] = {}
    for (name, port), local in service_ports.items():
        if port_map.setdefault(port, local) != local:
            raise ComposeError(f"two services listen on {port} ({name} and another): use localize_services")
    return services, port_map


def localize_services(compose: dict, scratch: Path, *, executor: str) -> tuple[dict, dict[tuple[str, int], int]]:
    """A copy of the services as local processes (see the module doc) and the port map it used:
    (service, container port) -> local port."""
    services = copy.deepcopy(compose["services"])
    wanted = sorted({(n, p) for n, s in services.items() for p in listens(s["command"]).values()})
    port_map = dict(zip(wanted, free_ports(len(wanted), "0.0.0.0"), strict=True))
    paths = {IMAGE_WORKDIR: str(ROOT)}
    for service in services.values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            paths[target] = str(scratch / source)
            (scratch / source).mkdir(parents=True, exist_ok=True)

    def local_port(name: str, host: str | None, port: int) -> int:
        """A port named by service `name`: the named service's (a hostname of this file), else its
        own, else the one service's that listens on it (the executor's healthcheck names the link)."""
        if host in services:
            return port_map.get((host, port), port)
        if (name, port) in port_map:
            return port_map[(name, port)]
        owners = [local for (_, p), local in port_map.items() if p == port]
        return owners[0] if len(owners) == 1 else port

    def rewrite(name: str, argv: list[str]) -> list[str]:
        argv = list(argv)

        def endpoint(match: re.Match) -> str:
            host = LOOPBACK if match["host"] in services else match["host"]
            return f"{match['scheme']}://{host}:{local_port(name, match['host'], int(match['port']))}"

        for i, arg in enumerate(argv):
            argv[i] = str(local_port(name, None, int(arg))) if _bare_port(argv, i) else ENDPOINTS.sub(endpoint, arg)
        for i, arg in enumerate(argv):
            for inside, outside in paths.items():
                if arg == inside or arg.startswith(inside + "/"):
                    argv[i] = outside + arg[len(inside) :]
        program = {"kvserve": [sys.executable, "-m", "kvserve"], "python": [sys.executable]}
        return [*program.get(argv[0], argv[:1]), *argv[1:]]

    for name, service in services.items():
        command = service["command"]
        if command[:2] == ["kvserve", "executor"]:
            service.pop("deploy", None)  # no GPU: the same model on the CPU, or the fake executor
            command = [*command, "--device", "cpu"] if executor == "cpu" else [*command, "--executor", "fake"]
        elif command[:2] == ["kvserve", "serve"]:  # its executor child, likewise
            service.pop("deploy", None)
            extra = ["--device", "cpu"] if executor == "cpu" else ["--executor", "fake"]
            command = [*command, *extra]
        service["command"] = rewrite(name, command)
        service["environment"] = {k: paths.get(str(v), str(v)) for k, v in service.get("environment", {}).items()}
        test = service["healthcheck"]["test"]
        service["healthcheck"]["test"] = [test[0], *rewrite(name, test[1:])] if test[0] == "CMD" else test
        service["ports"] = [
            Published(p.host_ip, port_map[(name, p.target)], port_map[(name, p.target)])
            for p in published_ports(service)
        ]
    return services, port_map


def start_order(services: dict) -> list[str]:
    """Dependencies first, as compose starts them."""
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n, s in services.items() if n not in order and set(s.get("depends_on", {})) <= set(order)]
        if not ready:
            raise ComposeError("depends_on has a cycle")
        order.extend(sorted(ready))
    return order


@dataclass
class Running:
    name: str
    service: dict
    process: subprocess.Popen
    log_path: Path

    def env(self) -> dict[str, str]:
        return service_env(self.service)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def service_env(service: dict) -> dict[str, str]:
    """This machine's environment with the service's `environment` on top, as a container gets it."""
    return {**os.environ, "KVSERVE_LOG_LEVEL": "INFO", **service["environment"]}


def start(name: str, service: dict, log_dir: Path) -> Running:
    """The service's command as a process of its own session, its output in log_dir/NAME.log."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            service["command"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=service_env(service),
            cwd=ROOT,
        )
    return Running(name, service, process, log_path)


def run_healthcheck(test: list[str], env: dict[str, str], timeout_s: float) -> int:
    """One attempt of a compose healthcheck `test`: its exit status (a timeout counts as 1)."""
    argv = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:]
    try:
        return subprocess.run(argv, env=env, timeout=timeout_s, capture_output=True, cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        return 1


def wait_healthy(running: Running) -> None:
    """Run the healthcheck until it exits 0, for as long as compose would (start_period + retries), capped."""
    check = running.service["healthcheck"]
    interval, timeout = seconds(check.get("interval"), 30.0), seconds(check.get("timeout"), 30.0)
    budget = seconds(check.get("start_period"), 0.0) + check.get("retries", 3) * (interval + timeout)

    def passed() -> bool:
        if running.process.poll() is not None:
            raise ComposeError(f"{running.name} exited with {running.process.returncode}:\n{running.log_tail()}")
        return run_healthcheck(check["test"], running.env(), max(timeout, CHECK_TIMEOUT_FLOOR_S)) == 0

    try:
        wait_until(passed, min(budget, HEALTHY_CAP_S), f"{running.name}'s healthcheck", interval_s=min(interval, 0.5))
    except WaitTimedOut:
        raise ComposeError(f"{running.name}: healthcheck {check['test']} never passed:\n{running.log_tail()}") from None


def wait_ready(grpc_target: str, http_url: str, timeout_s: float = 120.0) -> None:
    """Readiness as the compose file documents it: `kvserve stats --health-only` exits 0 and /ready is 200."""
    host, port = grpc_target.rsplit(":", 1)
    probe = [sys.executable, "-m", "kvserve", "stats", "--health-only", "--host", host, "--port", port]

    def ready() -> bool:
        if subprocess.run(probe, capture_output=True, timeout=60).returncode != 0:
            return False
        try:
            return httpx.get(f"{http_url}/ready", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout_s, "kvserve stats --health-only and GET /ready", interval_s=0.2)
    except WaitTimedOut:
        raise ComposeError(f"not ready after {timeout_s:g}s (kvserve stats --health-only, GET /ready)") from None


def stop(running: Running) -> None:
    """SIGTERM, then require exit 0 within the service's stop_grace_period (compose's default: 10 s)."""
    grace = seconds(running.service.get("stop_grace_period"), 10.0)
    running.process.send_signal(signal.SIGTERM)
    try:
        code = running.process.wait(grace)
    except subprocess.TimeoutExpired:
        raise ComposeError(f"{running.name} still running {grace:g}s after SIGTERM:\n{running.log_tail()}") from None
    if code != 0:
        raise ComposeError(f"{running.name} exited with {code} on SIGTERM:\n{running.log_tail()}")


def start_healthy(services: dict, log_dir: Path, started: list[Running]) -> dict[str, Running]:
    """Every service started in dependency order, each healthy before its dependents start (as
    `depends_on: service_healthy` makes compose do); `started` collects them for teardown."""
    for name in start_order(services):
        started.append(start(name, services[name], log_dir))
        wait_healthy(started[-1])
    return {r.name: r for r in started}


def kill_all(processes: list[Running]) -> None:
    """SIGKILL each process group (teardown, whatever state it is in)."""
    for running in processes:
        try:
            os.killpg(running.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        running.process.wait(10)


def published_address(running: Running, target: int) -> tuple[str, int]:
    """Where a client on the host reaches the (localized) service's port `target`, as compose publishes it."""
    ports = [p for p in running.service["ports"] if p.target == target]
    if not ports:
        raise ComposeError(f"{running.name} does not publish port {target}")
    return ports[0].host_ip, ports[0].published


def dockerfile_cmd() -> list[str]:
    (cmd,) = re.findall(r"^CMD (\[.*\])$", DOCKERFILE.read_text(), re.M)
    return json.loads(cmd)
