"""uvicorn's flags through `tether serve` (SPEC 8), each with uvicorn's effect at 2 workers,
on requests the receiving worker serves and on requests it forwards to the holder.

Each test seeds one session, then sends `GET /echo` with its cookie on a new connection
every time, so about half land on the other worker and are forwarded; every reply is the
holder's, and must show the flag's effect.
"""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import Serve
from e2e.harness import Connection, Http, Reply, Server, eventually

pytestmark = pytest.mark.e2e

APP = "e2e.apps.echo:app"
ECHOES = 12


async def seeded_echoes(
    server: Server, count: int = ECHOES, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Seed a session, then `count` echoes with its cookie; each on a new connection.
    Asserts they all reached the seed's worker and some were forwarded to it."""
    async with Http(server.url) as http:
        seed = await http.request("POST", "/seed_session", json={"session_id": "flags"},
                                  headers=headers)
        assert seed.status == 200, seed
        cookie = seed.cookie()
        assert cookie is not None
        replies: list[Reply] = []
        forwarded = 0
        # The kernel deals connections out unevenly: go on until one was forwarded.
        while len(replies) < count or (not forwarded and len(replies) < 10 * count):
            replies += [await http.request("GET", "/echo", cookie=cookie, headers=headers)
                        for _ in range(count)]
            status = await server.status(http)
            forwarded = sum(w["forwarded"] for w in status["workers"])
    assert all(reply.status == 200 for reply in replies), replies
    seen = [reply.json for reply in replies]
    assert {s["worker"] for s in seen} == {seed.json["worker"]}, "every echo on the holder"
    assert forwarded > 0, "some echoes landed on the other worker and were forwarded"
    return [seed.json, *seen]


async def test_root_path_is_the_same_on_local_and_forwarded_requests(serve: Serve) -> None:
    server = serve(APP, 2, "--root-path", "/api")
    for seen in await seeded_echoes(server):
        assert seen["root_path"] == "/api"
        assert seen["path"].startswith("/api/")
        assert seen["url_for"] == f"{server.url}/api/echo"


async def test_proxy_headers_from_an_allowed_address_set_scheme_and_client(
    serve: Serve,
) -> None:
    server = serve(APP, 2, "--proxy-headers", "--forwarded-allow-ips", "127.0.0.1")
    proxied = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.7"}
    for seen in await seeded_echoes(server, headers=proxied):
        assert seen["scheme"] == "https"
        assert seen["client"][0] == "203.0.113.7"
        assert seen["url_for"].startswith("https://")


async def test_no_proxy_headers_keeps_the_connecting_address(serve: Serve) -> None:
    server = serve(APP, 2, "--no-proxy-headers")
    proxied = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.7"}
    for seen in await seeded_echoes(server, headers=proxied):
        assert seen["scheme"] == "http"
        assert seen["client"][0] == "127.0.0.1"




async def test_tls_serves_https_and_forwarded_requests_see_https(
    serve: Serve, certificate: tuple[str, str]
) -> None:
    key, cert = certificate
    server = serve(APP, 2, "--ssl-keyfile", key, "--ssl-certfile", cert)
    assert server.url.startswith("https://")
    for seen in await seeded_echoes(server):
        assert seen["scheme"] == "https"
        assert seen["url_for"].startswith("https://")


async def test_uds_serves_on_a_unix_socket_that_is_removed_at_exit(serve: Serve) -> None:
    with tempfile.TemporaryDirectory(prefix="te-uds-", dir="/tmp") as directory:
        path = os.path.join(directory, "s.sock")
        server = serve(APP, 2, "--uds", path)
        assert server.url == f"unix:{path}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666, "as uvicorn makes it"
        for seen in await seeded_echoes(server):
            assert seen["session_id"] == "flags"
        server.terminate()
        assert await server.exit_code() == 0
        assert path not in {e.path for e in os.scandir(directory)}


async def test_timeout_graceful_shutdown_lets_a_25_s_request_finish(
    serve: Serve, tmp_path: Path
) -> None:
    """A 25 s request survives SIGTERM with --timeout-graceful-shutdown 30, on the worker
    that holds its session and on the one that forwards it there."""
    markers = tmp_path / "markers"
    markers.mkdir()
    server = serve(APP, 2, "--timeout-graceful-shutdown", "30",
                   env={"TETHER_E2E_MARKERS": str(markers)})
    async with Http(server.url) as http:
        seed = await http.request("POST", "/seed_session", json={"session_id": "slow"})
        cookie = seed.cookie()
        assert cookie is not None
        pids = [w["pid"] for w in (await server.status(http))["workers"]]
    host, port = server.host_port
    on = await one_connection_on_each(host, port, pids)
    try:
        for connection in on.values():
            connection.send("GET", "/slow?s=25", headers={"cookie": cookie})
        await eventually(lambda: len(os.listdir(markers)) == 2, 20, "both requests started")
        server.terminate()
        replies = await asyncio.gather(*(c.reply(within=60) for c in on.values()))
    finally:
        for connection in on.values():
            await connection.close()
    assert [reply.status for reply in replies] == [200, 200], replies
    assert await server.exit_code() == 0


async def one_connection_on_each(host: str, port: int, pids: list[int]) -> dict[int, Connection]:
    """A kept-alive connection accepted by each worker (others are closed)."""
    found: dict[int, Connection] = {}
    for _ in range(50):
        connection = await Connection.open(host, port)
        owner = await connection.owner(pids)
        if owner in found:
            await connection.close()
        else:
            found[owner] = connection
        if len(found) == len(pids):
            return found
    raise AssertionError(f"no connection landed on every worker of {pids}")


async def test_limit_concurrency_answers_503_above_the_limit(serve: Serve) -> None:
    server = serve(APP, 2, "--limit-concurrency", "2")
    async with Http(server.url, limit=40) as http:
        alone = await http.request("GET", "/slow?s=0")
        crowd = await asyncio.gather(*(http.request("GET", "/slow?s=1") for _ in range(20)))
    assert alone.status == 200, "one connection at a time is under the limit"
    statuses = [reply.status for reply in crowd]
    assert 503 in statuses, statuses


async def test_factory_flag_calls_the_factory(serve: Serve) -> None:
    server = serve("e2e.apps.echo:create_app", 2, "--factory")
    await seeded_echoes(server)
    assert not [r for r in server.logs() if r.get("event") == "app_factory_detected"]


async def test_a_factory_without_the_flag_is_detected_and_served(serve: Serve) -> None:
    server = serve("e2e.apps.echo:create_app", 2)
    await seeded_echoes(server)
    assert [r for r in server.logs() if r.get("event") == "app_factory_detected"]


async def test_env_file_reaches_the_app(serve: Serve, tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("ECHO_FROM_ENV_FILE=from-the-file\n")
    server = serve(APP, 2, "--env-file", str(env_file))
    for seen in await seeded_echoes(server):
        assert seen["env"] == "from-the-file"


async def test_app_dir_is_where_the_module_is_imported_from(serve: Serve) -> None:
    server = serve("echo:app", 2, "--app-dir", "e2e/apps")
    await seeded_echoes(server)


async def test_no_access_log_writes_no_request_lines(serve: Serve) -> None:
    logged = serve(APP, 2)
    quiet = serve(APP, 2, "--no-access-log")
    await seeded_echoes(logged)
    await seeded_echoes(quiet)
    assert [r for r in logged.logs() if r.get("event") == "request"]
    assert not [r for r in quiet.logs() if r.get("event") == "request"]


async def test_log_level_warning_writes_no_info_lines(serve: Serve) -> None:
    server = serve(APP, 2, "--log-level", "warning")
    await seeded_echoes(server)
    levels = {r.get("level") for r in server.logs()}
    assert levels <= {"warning", "error", "critical"}, levels


async def test_log_level_trace_serves_and_writes_uvicorns_trace_lines(serve: Serve) -> None:
    """uvicorn's lowest level, under debug (structlog has none: tether's own lines are
    filtered at debug's): the server starts (it once failed to) and uvicorn's trace lines
    are written."""
    server = serve(APP, 2, "--log-level", "trace")
    await seeded_echoes(server)
    assert "trace" in {r.get("level") for r in server.logs()}


async def test_flags_can_come_from_tether_variables(serve: Serve) -> None:
    server = serve(APP, 2, env={"TETHER_ROOT_PATH": "/from-env", "TETHER_ACCESS_LOG": "0"})
    for seen in await seeded_echoes(server):
        assert seen["root_path"] == "/from-env"
    assert not [r for r in server.logs() if r.get("event") == "request"]
