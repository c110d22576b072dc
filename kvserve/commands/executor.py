"""`kvserve executor`: run the executor process alone, connected to a scheduler's link.

The flags, the configs built from them and the run itself live in kvserve.executor.entry
(shared with `python -m kvserve.executor`, which `kvserve serve` supervises); this module
only hangs them into the `kvserve` parser.
"""

from __future__ import annotations

import argparse

from kvserve.config.flags import HelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.executor.entry import DESCRIPTION, EPILOG, add_arguments, run

    parser = subparsers.add_parser(
        "executor",
        help="run an executor that registers with a scheduler's link",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
