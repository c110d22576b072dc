"""The `kvserve` console script: one argparse tree, one module per subcommand.

Each module in `COMMANDS` exposes `register(subparsers)`, which adds its parser and sets
`func` to a callable taking the parsed namespace and returning an exit code. Modules are
imported when the parser is built, so heavy imports (torch, grpc) belong inside each
command's `run` function, not at module top level: `kvserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from kvserve.config.flags import HelpFormatter

COMMANDS = (
    "kvserve.commands.serve",
    "kvserve.commands.scheduler",
    "kvserve.commands.executor",
    "kvserve.commands.generate",
    "kvserve.commands.chat",
    "kvserve.commands.stats",
    "kvserve.commands.router",
    "kvserve.commands.kv_plan",
    "kvserve.commands.convert",
    "kvserve.commands.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="Serve a language model to many concurrent clients with a paged, prefix-cached KV store.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvserve {importlib.metadata.version('kvserve')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
