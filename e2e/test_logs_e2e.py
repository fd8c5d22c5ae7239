"""Logs an operator can run on (SPEC 9): under `--log-format json` every line on stdout
and stderr is one JSON object, uvicorn's error lines and tracebacks included, and every
phase change is logged with its duration and what it moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.conftest import Serve
from e2e.harness import Http

pytestmark = pytest.mark.e2e

APP = "e2e.apps.echo:app"


async def test_a_route_that_raises_logs_only_json_lines_on_both_streams(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve(APP, 2, "--checkpoint-root", str(tmp_path), "--name", "logs")
    auth = {"authorization": f"Bearer {server.token}"}
    async with Http(server.url) as http:
        seed = await http.request("POST", "/seed_session", json={"session_id": "boom"})
        for _ in range(6):  # some land on the other worker and are forwarded to the holder
            reply = await http.request("GET", "/boom", cookie=seed.cookie())
            assert reply.status == 500
        for route in ("prepare", "commit", "resume"):
            reply = await http.request("POST", f"/_tether/{route}", headers=auth,
                                       json={"checkpoint_id": "c1"})
            assert reply.status == 200, reply
    server.terminate()
    assert await server.exit_code() == 0
    stdout = server.stdout_path.read_text()
    stderr = server.stderr()
    records = []
    for stream, text in (("stdout", stdout), ("stderr", stderr)):
        for line in text.splitlines():
            if line.strip():
                record = json.loads(line)  # fails on any line that is not JSON
                assert isinstance(record, dict), (stream, line)
                records.append(record)
    failures = [r for r in records if "the route failed on purpose" in r.get("exception", "")]
    assert len(failures) == 6, "each failure logged once, its traceback a field"
    assert all("Traceback" in r["exception"] for r in failures)
    phases = {r["event"]: r for r in records if str(r.get("event")).startswith("checkpoint_")}
    assert {"checkpoint_prepared", "checkpoint_committed", "checkpoint_resumed"} <= set(phases)
    committed = phases["checkpoint_committed"]
    assert committed["records"] == {"sessions": 0, "episodes": 0}
    assert committed["bytes"] > 0 and committed["workers"] == 2
    assert committed["seconds"] >= 0 and phases["checkpoint_resumed"]["paused_s"] >= 0
    serving = [r for r in records if r.get("event") == "tether_serving"]
    assert serving and serving[0]["url"] == server.url
