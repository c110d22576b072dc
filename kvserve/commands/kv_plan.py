"""`kvserve kv-plan`: how many KV blocks, tokens and concurrent sequences a memory budget buys,
and what each block size `--block-size` accepts would cost in internal fragmentation."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.config import defaults

if TYPE_CHECKING:
    from kvserve.scheduler.core import KvPlan

DEFAULT_KV_MEMORY_GB = 4.0
DEFAULT_AVG_CONTEXT = 1024
JSON_KEYS = ("bytes_per_token", "block_bytes", "num_blocks", "token_capacity", "max_concurrency", "by_block_size")
BY_BLOCK_SIZE_KEYS = ("block_size", "num_blocks", "max_concurrency", "fragmentation_pct")
"""The figures of each `by_block_size` entry (one per kvserve.config.defaults.BLOCK_SIZES)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter
    from kvserve.protos.kv_geometry import DTYPE_BYTES

    parser = subparsers.add_parser(
        "kv-plan",
        help="size the paged KV cache for a model and a memory budget",
        description="Capacity planner. bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes;\n"
        "blocks = floor(memory / (bytes/token x block size)). A table compares every block\n"
        "size the server accepts at --avg-context; fragmentation = tail waste / KV held,\n"
        "the tail waste being block size / 2 tokens per sequence on average.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "config",
        nargs="?",
        default=argparse.SUPPRESS,
        help="a Hugging Face config.json or model directory (default: the built-in model)",
    )
    parser.add_argument(
        "--kv-memory-gb", type=float, default=DEFAULT_KV_MEMORY_GB, help="memory for the KV cache in GiB (2^30 bytes)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        choices=defaults.BLOCK_SIZES,
        default=defaults.BLOCK_SIZE,
        help="tokens per KV block (as `kvserve serve --block-size`)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float16", help="KV element type")
    parser.add_argument(
        "--avg-context",
        type=int,
        default=DEFAULT_AVG_CONTEXT,
        help="average tokens per sequence (prompt + output), for concurrency and waste",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def load_config(path: str | None) -> dict:
    if path is None:
        from kvserve.executor.weights.model_store import ensure_model_dir

        path = str(ensure_model_dir())
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    return json.loads(config_path.read_text())


def run(args: argparse.Namespace) -> int:
    from kvserve.protos.kv_geometry import GIB, KvGeometry
    from kvserve.scheduler.core import plan_kv

    try:
        geometry = KvGeometry.from_hf_config(load_config(getattr(args, "config", None)))
        memory = int(args.kv_memory_gb * GIB)
        plans = {size: plan_kv(geometry, memory, size, args.dtype, args.avg_context) for size in defaults.BLOCK_SIZES}
        plan = plans[args.block_size]
    except (OSError, ValueError) as exc:
        print(f"kvserve kv-plan: {exc}")
        return 2
    if args.json:
        by_size = [{key: getattr(p, key) for key in BY_BLOCK_SIZE_KEYS} for p in plans.values()]
        print(json.dumps({**asdict(plan), "by_block_size": by_size}))
        return 0
    print(
        f"model: {geometry.num_layers} layers, {geometry.num_kv_heads} KV heads, head_dim {geometry.head_dim}, "
        f"{args.dtype}"
    )
    print(f"bytes per token:      {plan.bytes_per_token:,}")
    print(f"bytes per block:      {plan.block_bytes:,}  ({plan.block_size} tokens)")
    print(f"blocks:               {plan.num_blocks:,}  in {args.kv_memory_gb:g} GiB")
    print(f"token capacity:       {plan.token_capacity:,}")
    print(f"concurrency:          {plan.max_concurrency:,} sequences of {plan.avg_context:,} tokens")
    print(
        f"fragmentation bound:  {plan.fragmentation_pct:.2f}% "
        f"(average tail waste {plan.block_size / 2:g} tokens per sequence)"
    )
    print()
    print(block_size_table(list(plans.values()), args.block_size))
    return 0


def block_size_table(plans: list[KvPlan], selected: int) -> str:
    """Blocks, concurrency and fragmentation of each plan (one per block size), in aligned columns."""
    rows = [("block size", "blocks", "concurrency", "fragmentation")]
    rows += [
        (str(p.block_size), f"{p.num_blocks:,}", f"{p.max_concurrency:,}", f"{p.fragmentation_pct:.2f}%") for p in plans
    ]
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    marks = [""] + ["  <- --block-size" if p.block_size == selected else "" for p in plans]
    lines = [f"by block size, at {plans[0].avg_context:,} tokens per sequence:"]
    for row, mark in zip(rows, marks, strict=True):
        lines.append("  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) + mark)
    return "\n".join(lines)
