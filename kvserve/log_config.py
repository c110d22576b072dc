"""structlog set-up shared by every kvserve process.

JSON lines when stderr is not a terminal (services under compose, CI, log shippers);
coloured console lines when a person is watching. Bind `request_id` with
`structlog.contextvars.bind_contextvars` (or `log.bind`) so every line about a request carries it.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None, json: bool | None = None, *, process: str | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process.

    `level` defaults to $KVSERVE_LOG_LEVEL or INFO; `json` defaults to "stderr is not a tty".
    `process` (e.g. "scheduler", "executor") is added to every line, and `replica` where
    $KVSERVE_REPLICA names one (`kvserve serve --data-parallel-size N`).
    """
    from kvserve.config.defaults import REPLICA_ENV

    level_name = (level or os.environ.get("KVSERVE_LOG_LEVEL") or "INFO").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    if json is None:
        json = not sys.stderr.isatty()
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if process:
        processors.append(_add_field("process", process))
    replica = os.environ.get(REPLICA_ENV)
    if replica:
        processors.append(_add_field("replica", int(replica) if replica.isdigit() else replica))
    processors.append(structlog.processors.StackInfoRenderer())
    processors.append(structlog.processors.format_exc_info)
    processors.append(structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def _add_field(key: str, value: object) -> structlog.typing.Processor:
    def processor(_logger, _method, event_dict):
        event_dict.setdefault(key, value)
        return event_dict

    return processor
