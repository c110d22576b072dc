"""The `run` of a bench command whose result is one JSON-able report (`bench speculative`, `bench scale-out`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvserve.config.flags import config_from_args


class _JsonFlag(Protocol):
    json: bool


C = TypeVar("C", bound=_JsonFlag)


def run_report_command(
    cls: type[C],
    args: argparse.Namespace,
    bench: Callable[[C, Callable[[str], None]], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """Quiet logs, the config from the flags (with the command line it came from), progress lines
    unless --json, then the report as JSON or as `render`'s text."""
    from kvserve.log_config import configure_logging

    configure_logging(level="WARNING")
    config = config_from_args(cls, args, command_line=shlex.join(["kvserve", *sys.argv[1:]]))
    report = bench(config, (lambda _line: None) if config.json else print)
    print(json.dumps(report, indent=2) if config.json else render(report))
    return 0
