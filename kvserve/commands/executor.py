"""`kvserve executor`: run the executor process alone, connected to a scheduler's link.

The flags, the configs built from them and the run itself live in executor_svc.entry
(shared with `python -m executor_svc`, which `kvserve serve` supervises); this module
only hangs them into the `kvserve` parser.
"""

from __future__ import annotations

import argparse

from protos.config_flags import HelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    from executor_svc.entry import DESCRIPTION, EPILOG, add_arguments, run

    parser = subparsers.add_parser(
        "executor",
        help="run an executor that registers with a scheduler's link",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
