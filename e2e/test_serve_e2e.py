"""`tether serve` as a process group: its stops, its failures and its logs (SPEC 3, 8, 9).

The JSON-log format tests come last: `pytest -x` then runs everything else first."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from e2e.apps.slow import MARKERS_ENV
from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    CounterSession,
    Http,
    alive,
    bounded,
    eventually,
    failed,
    run_episode,
    run_tether,
)

pytestmark = pytest.mark.e2e


async def test_each_request_is_logged_once_by_the_worker_that_received_it(
    serve: Serve,
) -> None:
    server = serve(COUNTER_APP, 4)
    run = secrets.token_hex(4)
    async with Http(server.url) as http:
        sessions = [CounterSession(http, f"log-{run}-{i}") for i in range(50)]

        async def four_requests(session: CounterSession) -> list[int]:
            return [
                (await session.seed()).status,
                (await session.increment()).status,
                (await session.count()).status,
                (await session.close()).status,
            ]

        statuses = await bounded(four_requests(s) for s in sessions)
        assert all(s == [200] * 4 for s in statuses), statuses
        workers = (await server.status(http))["workers"]
    forwarded = sum(w["forwarded"] for w in workers)
    assert forwarded > 0, "no request was forwarded, so nothing checks double logging"

    server.terminate()  # a graceful stop flushes every worker's log
    assert await server.exit_code() == 0

    records = server.logs()
    ours = {s.id for s in sessions}
    requests = [r for r in records if r.get("event") == "request" and r.get("session_id") in ours]
    seen = Counter((r["method"], r["path"], r["session_id"]) for r in requests)
    expected = {
        (method, path, session_id)
        for session_id in ours
        for method, path in (
            ("POST", "/seed_session"),
            ("POST", "/increment"),
            ("GET", "/count"),
            ("POST", "/close_session"),
        )
    }
    assert set(seen) == expected
    twice = {key: n for key, n in seen.items() if n != 1}
    assert not twice, f"requests logged more than once: {list(twice.items())[:5]}"
    assert all(r["status"] == 200 and r.get("worker_id") for r in requests), requests[:3]


async def test_sigterm_lets_requests_in_flight_finish_then_leaves_nothing(
    serve: Serve, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    server = serve("e2e.apps.slow:app", 4, env={MARKERS_ENV: str(markers)})
    async with Http(server.url) as http, asyncio.TaskGroup() as group:
        in_flight = group.create_task(bounded(http.request("GET", "/slow") for _ in range(20)))
        await eventually(lambda: len(os.listdir(markers)) == 20, 20, "20 requests arrive")
        server.terminate()
    replies = in_flight.result()
    assert [r.status for r in replies] == [200] * 20, replies
    assert all(r.json["ok"] is True for r in replies)
    assert await server.exit_code() == 0
    await server.group_gone()
    assert not server.runtime_dir.exists(), "the runtime directory is removed at exit"


def test_cookie_preset_on_an_app_without_session_middleware_exits_with_a_clear_error() -> None:
    result = run_tether("serve", "e2e.apps.plain:app", "--sessions", "cookie", "--port", "0")
    assert result.returncode != 0
    assert "SessionMiddleware" in result.stderr, result.stderr
    assert "tether serving" not in result.stdout


async def test_sigkill_of_the_main_process_makes_every_worker_exit_within_5_s(
    serve: Serve,
) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        session = CounterSession(http, f"orphan-{secrets.token_hex(4)}")
        assert (await session.seed()).status == 200
        pids = [w["pid"] for w in (await server.status(http))["workers"]]
    assert len(pids) == 4 and all(alive(pid) for pid in pids)
    assert set(pids) <= set(server.group())

    server.kill()
    killed_at = time.monotonic()
    await eventually(
        lambda: not any(alive(pid) for pid in pids), 5, "every worker of the killed server exits"
    )
    assert time.monotonic() - killed_at < 5
    assert await server.exit_code() == -signal.SIGKILL
    await server.group_gone(within=1)


def not_log_records(text: str) -> list[str]:
    """The lines of `text` that are not exactly one JSON log record."""
    bad = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "event" not in record:
            bad.append(line)
    return bad


async def test_with_json_logs_stderr_holds_nothing_but_json_records(serve: Serve) -> None:
    server = serve(COUNTER_APP, 2)
    async with Http(server.url) as http:
        session = CounterSession(http, f"json-{secrets.token_hex(4)}")
        assert (await session.seed()).status == 200
        assert (await session.close()).status == 200
    server.terminate()
    assert await server.exit_code() == 0

    text = server.stderr()
    assert [r for r in server.logs() if r.get("event") == "serving"]
    other = [line for line in text.splitlines() if not line.startswith("{")]
    assert not other, f"{len(other)} stderr lines are not JSON: {other[:3]}"


async def test_log_lines_of_concurrent_workers_never_interleave(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    run = secrets.token_hex(4)
    async with Http(server.url) as http:
        sessions = [CounterSession(http, f"lines-{run}-{i}") for i in range(200)]
        episodes = await bounded(run_episode(s, increments=2) for s in sessions)
    assert not failed(episodes)
    server.terminate()
    assert await server.exit_code() == 0

    records = [line for line in server.stderr().splitlines() if line.startswith("{")]
    assert len(records) > 1200
    broken = not_log_records("\n".join(records))
    assert not broken, f"{len(broken)} log lines are not one JSON record each: {broken[:2]}"
