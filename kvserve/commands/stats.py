"""`kvserve stats`: health, model and KV/scheduler statistics of a running server.

`--health-only` makes it a health probe (exit 0 only when SERVING), and `--alive` a
liveness probe (exit 0 whenever the server answers): docker-compose uses the latter so the
executor can start as soon as the scheduler is up, before it can serve. `--router URL` asks a
`kvserve router` over HTTP instead, for its readiness and each replica's health (router_stats.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvserve.commands import router_stats
from kvserve.commands.client_options import add_connection_options, make_client, report_error

EXIT_NOT_SERVING = 3

_STATS_LAYOUT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("KV blocks", ("num_blocks", "blocks_free", "blocks_cached", "blocks_referenced", "kv_usage")),
    ("requests", ("requests_waiting", "requests_running", "requests_swapped", "num_preemptions", "num_swap_outs")),
    ("prefix cache", ("prefix_queried_tokens", "prefix_hit_tokens", "num_evicted_blocks")),
    (
        "tiers below the pool",
        (
            "kv_disk_blocks",
            "kv_disk_loaded_blocks",
            "kv_host_loaded_blocks",
            "kv_disk_stored_blocks",
            "kv_disk_failed_loads",
        ),
    ),
    ("speculative decoding", ("draft_tokens_proposed", "draft_tokens_accepted", "draft_verify_steps")),
    ("executor", ("executor_state", "executor_restarts", "steps")),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "stats",
        help="show server health, model info and KV/scheduler statistics",
        description="Print the grpc.health status, ModelInfo and ServerStats of a running server.\n"
        f"Exit codes: 0 ok; 1 the server could not be reached or failed; "
        f"{EXIT_NOT_SERVING} (--health-only) it answered NOT_SERVING.\n"
        f"With --router URL: 0 the router is ready and every replica healthy; {router_stats.EXIT_DEGRADED} the "
        f"router is not ready or some replica is down; {router_stats.EXIT_UNREACHABLE} the router is unreachable.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: health, model, stats (--router: router, replicas, ok)",
    )
    probe = parser.add_mutually_exclusive_group()
    probe.add_argument(
        "--health-only", action="store_true", help="print only the health status; exit 0 only if SERVING"
    )
    probe.add_argument(
        "--alive",
        action="store_true",
        help="liveness probe: exit 0 if the server answers health checks at all (even NOT_SERVING)",
    )
    probe.add_argument(
        "--router",
        default=None,
        metavar="URL",
        help="ask a `kvserve router` (http://HOST:PORT) instead of a server over gRPC: its readiness, then each "
        "replica's health and load as the router sees them and as the replica answers itself (--timeout: each "
        f"HTTP call's, {router_stats.DEFAULT_TIMEOUT_S:g}s if not given; the other connection options are unused)",
    )
    add_connection_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.router is not None:
        return router_stats.run(args.router, args.timeout, as_json=args.json)
    from kvserve.clients import KVServeError

    try:
        with make_client(args) as client:
            health = client.health()
            if args.health_only or args.alive:
                print(health)
                return 0 if args.alive or health == "SERVING" else EXIT_NOT_SERVING
            model = client.model_info()
            stats = client.server_stats()
    except (KVServeError, OSError) as error:
        return report_error("stats", error)
    if args.json:
        print(json.dumps({"health": health, "model": model, "stats": stats}))
    else:
        print(render(health, model, stats))
    return 0


def render(health: str, model: dict[str, Any], stats: dict[str, Any]) -> str:
    """A compact human-readable report."""
    lines = [
        f"health: {health}",
        f"model: {model.get('model_id')}  executor={model.get('executor_kind')} device={model.get('device')} "
        f"dtype={model.get('dtype')} attention={model.get('attention_backend')}",
        f"  vocab={model.get('vocab_size')} max_model_len={model.get('max_model_len')} "
        f"block_size={model.get('block_size')} num_blocks={model.get('num_blocks')} "
        f"chat_template={'yes' if model.get('has_chat_template') else 'no'}",
    ]
    for title, keys in _STATS_LAYOUT:
        values = "  ".join(f"{key}={_fmt(stats.get(key))}" for key in keys)
        lines.append(f"{title}: {values}")
    queried, hit = stats.get("prefix_queried_tokens") or 0, stats.get("prefix_hit_tokens") or 0
    if queried:
        lines.append(f"prefix hit rate: {hit / queried:.1%}")
    proposed, accepted = stats.get("draft_tokens_proposed") or 0, stats.get("draft_tokens_accepted") or 0
    if proposed:
        verified = stats.get("draft_verify_steps") or 0
        lines.append(
            f"draft acceptance: {accepted / proposed:.1%}  "
            f"({(accepted + verified) / max(verified, 1):.2f} tokens per verifying step)"
        )
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
