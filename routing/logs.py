"""structlog set-up, run in each worker after it starts (spawned workers start bare) and
in the main process. Standard-library loggers (uvicorn's, the app's) are rendered by the
same processors, so one format holds for every line."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from json.encoder import encode_basestring_ascii as _string
from typing import Any, Literal, TextIO

import structlog

LogFormat = Literal["console", "json"]
TRACE = 5
LOG_LEVELS: dict[str, int] = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": TRACE,
}
_HANDLER_NAME = "tether"
_UVICORN_STARTUP = ("Started server process", "Waiting for application startup",
                    "Application startup complete")


def _not_uvicorn_startup(record: logging.LogRecord) -> bool:
    """uvicorn's start-up lines say what tether's `worker_registered` says; below debug
    they would only add lines, and a start-up failure must print one."""
    return not (isinstance(record.msg, str) and record.msg.startswith(_UVICORN_STARTUP))


_chosen: LogFormat | None = None
_access_log = structlog.get_logger("tether.router")


_LINE_KEYS = frozenset({"method", "path", "status", "session_id", "ms", "event", "level",
                        "timestamp"})
"""An access line's own keys: a context field of one of these names is placed by the
chain's own rules, so such a line goes through the chain."""


class _JsonAccessLines:
    """Access lines under the JSON format, formatted here as structlog's chain writes
    every other line (the same keys in the same order, the context's fields as structlog
    orders and renders them, an ISO UTC timestamp): the chain costs about as much as the
    rest of a request the receiving worker passes through (routing/front.py), and these
    lines are its only per-request log."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # (not a file: written through)
            self._fd = None
        self._render = structlog.processors.JSONRenderer()
        self._context: dict[str, Any] | None = None
        self._tail = ""
        self._second = -1
        self._second_text = ""

    def __call__(
        self, method: str, path: str, status: int, session_id: str | None, micros: int
    ) -> None:
        context = structlog.contextvars.get_contextvars()  # (an app may bind its own)
        if context != self._context:
            if not _LINE_KEYS.isdisjoint(context):
                _structlog_access_line(method, path, status, session_id, micros)
                return
            fields = str(self._render(None, "", dict(context)))[1:-1]
            fields = f", {fields}" if fields else ""
            self._tail = f', "event": "request"{fields}, "level": "info", "timestamp": "'
            self._context = context
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        fraction = int((now - second) * 1e6)
        stamp = f".{fraction:06d}" if fraction else ""  # (as isoformat leaves it out)
        session = "null" if session_id is None else _string(session_id)
        line = (
            f'{{"method": {_string(method)}, "path": {_string(path)}, "status": {status}, '
            f'"session_id": {session}, "ms": {_ms(micros)}{self._tail}{self._second_text}'
            f'{stamp}Z"}}\n'
        )
        if self._fd is None:
            self._stream.write(line)
            self._stream.flush()
            return
        # Straight to the descriptor: every other writer of the stream flushes each line.
        data = line.encode()
        while data:
            data = data[os.write(self._fd, data) :]


def _ms(micros: int) -> str:
    """`micros / 1000` as `repr` writes that float (as structlog's JSON does), without
    formatting a float: digits to the microsecond, trailing zeros dropped but one."""
    whole, part = divmod(micros, 1000)
    if not part:
        return f"{whole}.0"
    return f"{whole}.{part:03d}".rstrip("0")


def _structlog_access_line(
    method: str, path: str, status: int, session_id: str | None, micros: int
) -> None:
    _access_log.info("request", method=method, path=path, status=status,
                     session_id=session_id, ms=micros / 1000)


def _no_access_line(
    method: str, path: str, status: int, session_id: str | None, micros: int
) -> None:
    """Below the level configured: access lines are info."""


_access_line = _structlog_access_line


def access_line(
    method: str, path: str, status: int, session_id: str | None, seconds: float
) -> None:
    """The one access log line of a request (SPEC 9), in the format configured: `ms`
    is the time it took, to the microsecond."""
    _access_line(method, path, status, session_id, round(seconds * 1e6))


def default_format() -> LogFormat:
    return "console" if sys.stderr.isatty() else "json"


def say(line: str, event: str, *, error: bool = False, **fields: Any) -> None:
    """A line for the operator (the URL served, a start-up failure): as is on a console,
    one JSON object (`message` holding the line) under the JSON format, so every line on
    stdout and stderr parses. Errors go to stderr, the rest to stdout."""
    stream = sys.stderr if error else sys.stdout
    if (_chosen or default_format()) == "json":
        record = {"event": event, "level": "error" if error else "info", "message": line,
                  **fields}
        stream.write(json.dumps(record) + "\n")
    else:
        stream.write(line + "\n")
    stream.flush()


def configure_logging(
    log_format: LogFormat | None = None, level: str | None = None, **bound: str
) -> None:
    """Log through structlog to stderr, console on a terminal and JSON otherwise, at
    `level` (uvicorn's names; default info), uvicorn's own loggers included."""
    renderer: structlog.types.Processor
    if (log_format or default_format()) == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    global _chosen, _access_line
    _chosen = log_format or default_format()
    threshold = LOG_LEVELS[level or "info"]
    if threshold > logging.INFO:
        _access_line = _no_access_line
    elif _chosen == "json":
        _access_line = _JsonAccessLines(sys.stderr)
    else:
        _access_line = _structlog_access_line
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        # (structlog knows no level under debug: at trace, tether's own lines are debug's)
        wrapper_class=structlog.make_filtering_bound_logger(max(threshold, logging.DEBUG)),
        # One write per record: workers share stderr, and a record split over two
        # writes (text, then newline) interleaves with another worker's.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(threshold, logging.INFO))  # other libraries' debug lines stay out
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(threshold)
    startup = logging.getLogger("uvicorn.error")
    startup.removeFilter(_not_uvicorn_startup)
    if threshold > logging.DEBUG:
        startup.addFilter(_not_uvicorn_startup)
    structlog.contextvars.clear_contextvars()
    if bound:
        structlog.contextvars.bind_contextvars(**bound)
