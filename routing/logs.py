"""structlog set-up, run in each worker after it starts (spawned workers start bare)."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["console", "json"]


def default_format() -> LogFormat:
    return "console" if sys.stderr.isatty() else "json"


def configure_logging(log_format: LogFormat | None = None, **bound: str) -> None:
    """Log through structlog to stderr, console on a terminal and JSON otherwise."""
    renderer: structlog.types.Processor
    if (log_format or default_format()) == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        # One write per record: workers share stderr, and a record split over two
        # writes (text, then newline) interleaves with another worker's.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    if bound:
        structlog.contextvars.bind_contextvars(**bound)
