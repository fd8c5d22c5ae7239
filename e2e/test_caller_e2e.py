"""A forwarded request keeps its caller, and a login that rotates the session ID keeps
its session, through a real `tether serve` at 4 workers with an unmodified FastAPI app
(issue 11, points 4 and 5; SPEC 4.3, 8)."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from e2e.conftest import Serve
from e2e.harness import Http, Reply, bounded

pytestmark = pytest.mark.e2e

APP = "e2e.apps.accounts:app"
WORKERS = 4
PROXY = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.9"}


async def seed(http: Http, session_id: str) -> tuple[str, str]:
    """Seed a session; its cookie and the worker that holds it."""
    reply = await http.request("POST", "/seed_session", json={"session_id": session_id})
    assert reply.status == 200, reply
    cookie = reply.cookie()
    assert cookie is not None, reply
    return cookie, reply.json["worker"]


async def callers_seen(
    http: Http, sessions: int, calls: int, headers: dict[str, str] | None = None
) -> list[tuple[str, Reply]]:
    """`calls` whoami requests for each of `sessions` seeded sessions, each on a new
    connection: (holder, reply) pairs."""
    run = secrets.token_hex(4)
    seeded = await bounded(seed(http, f"who-{run}-{i}") for i in range(sessions))

    async def ask(cookie: str, holder: str) -> tuple[str, Reply]:
        return holder, await http.request("GET", "/whoami", cookie=cookie, headers=headers)

    return await bounded(ask(cookie, holder) for cookie, holder in seeded for _ in range(calls))


def forwarded(status: dict[str, Any]) -> int:
    return sum(worker["forwarded"] for worker in status["workers"])


async def test_fastapi_handler_reading_request_client_host_answers_200_with_the_caller(
    serve: Serve,
) -> None:
    trust = ("--proxy-headers", "--forwarded-allow-ips", "127.0.0.1")
    server = serve(APP, WORKERS, "--sessions", "cookie", *trust)
    async with Http(server.url) as http:
        before = forwarded(await server.status(http))
        plain = await callers_seen(http, sessions=10, calls=4)
        middle = forwarded(await server.status(http))
        proxied = await callers_seen(http, sessions=10, calls=4, headers=PROXY)
        after = forwarded(await server.status(http))

    wrong = [r for holder, r in plain if r.status != 200 or r.json["worker"] != holder]
    assert not wrong, f"{len(wrong)} of {len(plain)} requests went wrong, e.g. {wrong[:3]}"
    assert {r.json["host"] for _, r in plain} == {"127.0.0.1"}
    assert all(r.json["port"] > 0 for _, r in plain)
    assert {r.json["url_for"] for _, r in plain} == {f"{server.url}/whoami"}
    assert middle > before, "no request was forwarded: the test proves nothing"

    wrong = [r for holder, r in proxied if r.status != 200 or r.json["worker"] != holder]
    assert not wrong, f"{len(wrong)} of {len(proxied)} proxied requests went wrong: {wrong[:3]}"
    https = f"https://{server.url.removeprefix('http://')}/whoami"
    assert {r.json["url_for"] for _, r in proxied} == {https}
    assert {r.json["scheme"] for _, r in proxied} == {"https"}
    assert {r.json["host"] for _, r in proxied} == {"203.0.113.9"}
    assert after > middle


async def test_forwarded_request_under_root_path_builds_the_same_urls(serve: Serve) -> None:
    server = serve(APP, WORKERS, "--sessions", "cookie", "--root-path", "/api")
    async with Http(server.url) as http:
        seen = await callers_seen(http, sessions=10, calls=4)
        status = await server.status(http)  # the control API, below the root path too

    assert forwarded(status) > 0, "no request was forwarded: the test proves nothing"
    wrong = [r for holder, r in seen if r.status != 200 or r.json["worker"] != holder]
    assert not wrong, f"{len(wrong)} of {len(seen)} requests went wrong, e.g. {wrong[:3]}"
    assert {r.json["root_path"] for _, r in seen} == {"/api"}
    assert {r.json["url_for"] for _, r in seen} == {f"{server.url}/api/whoami"}


async def test_login_that_rotates_the_session_id_keeps_100_of_100_sessions(serve: Serve) -> None:
    server = serve(APP, WORKERS, "--sessions", "cookie")
    run = secrets.token_hex(4)
    calls = 4

    async def session(index: int) -> list[str]:
        """Seed, log in, then `calls` increments with the new cookie; what went wrong."""
        cookie, holder = await seed(http, f"login-{run}-{index}")
        login = await http.request("POST", "/login", cookie=cookie)
        cookies = [c for c in login.set_cookies if c.startswith("session=")]
        if login.status != 200 or len(cookies) != 1 or login.json["worker"] != holder:
            return [f"login: {login!r}, cookies {cookies}"]
        new = login.json["session_id"]
        rotated = login.cookie()
        problems = []
        for count in range(1, calls + 1):
            reply = await http.request("POST", "/increment", cookie=rotated)
            expected = {"session_id": new, "count": count, "worker": holder}
            if reply.status != 200 or reply.json != expected:
                problems.append(f"call {count}: {reply!r}, expected {expected}")
        return problems

    async with Http(server.url) as http:
        results = await bounded(session(i) for i in range(100))
        status = await server.status(http)

    wrong = [problems for problems in results if problems]
    assert not wrong, f"{len(wrong)} of 100 sessions went wrong, e.g. {wrong[:3]}"
    assert forwarded(status) > 0
