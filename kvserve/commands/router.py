"""`kvserve router`: vLLM's router (`vllm-router`, from PyPI) in front of kvserve replicas, with kvserve's defaults.

kvserve grows no router of its own: this command builds the `vllm-router` command line and
execs it. What the router asks of a worker, kvserve's HTTP API serves: `/health` (its health
checks), the OpenAI routes, `/tokenize` (which `kv_aware` calls to count a request's prefix
in tokens), `/get_load` (`power_of_two`) and, with `--kv-events-endpoint` on each replica,
vLLM's KV events, which `kv_aware` reads to know which replica holds which prefix.

Policies, as measured with vllm-router 0.1.17 (docs/scale-out.md): `kv_aware` (the default)
routes a chat or completion to the replica whose prefix cache holds most of its prompt;
`cache_aware` keeps affinity only for token-id prompts, not text or chat; `consistent_hash`
keeps a session on one replica by its `x-session-id` header; `round_robin` and
`power_of_two` only balance.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args
from kvserve.replicas.router_command import ROUTER_MISSING, RouterConfig, RouterConfigError, find_router, router_command


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run vLLM's router (vllm-router) in front of kvserve replicas",
        description="Fronts `kvserve serve` replicas (on this host or others) with vllm-router from PyPI,\n"
        "on one OpenAI-compatible HTTP port. kv_aware (the default) reads each replica's KV\n"
        "events (start replicas with --kv-events-endpoint) and sends a request to the replica\n"
        "that holds most of its prefix. See docs/scale-out.md.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, RouterConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(RouterConfig, args)
    executable = find_router()
    if executable is None:
        print(f"kvserve: {ROUTER_MISSING}", file=sys.stderr)
        return 2
    try:
        command = router_command(config, executable)
    except RouterConfigError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    print(f"kvserve: routing {len(config.worker_url)} replicas with {config.policy} on {config.host}:{config.port}")
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # pragma: no cover - execv does not return
