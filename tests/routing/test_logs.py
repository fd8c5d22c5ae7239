"""The access line (routing/logs.py): built without structlog's chain under JSON, with
what that chain would have written, in each process that configures logging."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from datetime import datetime
from typing import Any

LINES = """
    import structlog
    from tether.routing import logs
    logs.configure_logging({fmt!r}, {level!r}, worker_id="w-7")
    {bind}
    logs.access_line("GET", '/items/"quoted"\\u00e9', 201, "s-1", 0.00025)
    logs._structlog_access_line("GET", '/items/"quoted"\\u00e9', 201, "s-1", 250)
    logs.access_line("POST", "/seed", 503, None, 0.0015)
"""


def lines(fmt: str, level: str = "info", bind: str = "") -> list[str]:
    script = textwrap.dedent(LINES).format(fmt=fmt, level=level, bind=bind)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def unstamped(line: str) -> str:
    return re.sub(r'"timestamp": "[^"]*"', "", line)


def test_the_json_access_line_carries_what_structlogs_chain_would_write() -> None:
    written = lines("json")
    fast, chained, second = (json.loads(line) for line in written)
    stamp: dict[str, Any] = {"timestamp": None}
    assert {**fast, **stamp} == {**chained, **stamp}
    assert unstamped(written[0]) == unstamped(written[1]), "written alike, to the character"
    assert fast["path"] == '/items/"quoted"\u00e9' and fast["worker_id"] == "w-7"
    times = [datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")) for r in (fast, chained)]
    assert fast["timestamp"].endswith("Z") and abs((times[1] - times[0]).total_seconds()) < 1
    assert second["session_id"] is None and second["status"] == 503


def test_fields_bound_later_appear_as_the_chain_orders_and_renders_them() -> None:
    # An app may bind its own fields (a request ID) in the request's context.
    bind = ("structlog.contextvars.bind_contextvars(zeta=1, request_id='r-1', alpha=None, "
            "when=object())")
    written = lines("json", bind=bind)
    fast = json.loads(written[0])
    assert fast["request_id"] == "r-1" and fast["zeta"] == 1 and "object" in fast["when"]
    assert unstamped(written[0]) == unstamped(written[1]), "as the chain writes them"


def test_a_bound_field_named_like_the_lines_own_goes_through_the_chain() -> None:
    written = lines("json", bind="structlog.contextvars.bind_contextvars(level='x', path='/p')")
    assert unstamped(written[0]) == unstamped(written[1])
    assert json.loads(written[0])["path"] == '/items/"quoted"\u00e9'


def test_no_access_line_is_written_below_the_level_configured() -> None:
    assert lines("json", "warning") == []


def test_the_console_access_line_goes_through_structlog() -> None:
    fast, chained, _ = lines("console")
    assert "request" in fast and "/items/" in fast and "w-7" in fast
    assert fast.split(" ", 1)[1] == chained.split(" ", 1)[1], "all but the time alike"


def test_ms_is_written_as_structlogs_json_writes_the_float() -> None:
    from tether.routing.logs import _ms

    samples = [*range(0, 20_000), *range(10**6, 10**6 + 3000), 10**9 + 1, 123_456_789_012, 10**15]
    assert [_ms(m) for m in samples] == [repr(m / 1000) for m in samples]
