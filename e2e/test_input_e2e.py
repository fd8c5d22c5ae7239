"""Bad input through a real 4-worker server (SPEC 4.1, 6): each answers the SPEC's code
or is served as a request without a session, never a 5xx, and leaves no claim on a
session that nobody legitimately started."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import AsyncIterator

import itsdangerous
import pytest

from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    COUNTER_SECRET,
    CounterSession,
    Http,
    Reply,
    Server,
    eventually,
    raw_exchange,
    session_cookie,
)

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
CAP = 64 * MiB
TEN_KB = "x" * 10 * 1024
TOKEN_HEADER = "x-tether-session-token"
TOKEN_SALT = "tether.session-token"


async def only_legit_claims(server: Server, legit: set[str]) -> None:
    """Every claim names a session this test started (a failed request's claim on an ID
    the router minted is dropped just after its reply, hence the short poll)."""
    try:
        await eventually(lambda: set(server.claims()) <= legit, 5, "only legit claims remain")
    except AssertionError:
        stray = set(server.claims()) - legit
        raise AssertionError(f"claims naming garbage: {sorted(stray)[:5]}") from None


def clean(http: Http) -> None:
    misfits = http.misfits()
    assert not misfits, f"replies outside the SPEC: {misfits[:5]}"


async def seeded(http: Http, name: str) -> CounterSession:
    session = CounterSession(http, f"{name}-{secrets.token_hex(4)}")
    assert (await session.seed()).status == 200
    assert (await session.increment()).json["count"] == 1
    return session


def lost_without_cookie(reply: Reply) -> None:
    """Served as a request without a session: the counter holds none, and a minted ID
    whose request failed is never handed out."""
    assert reply.status == 404 and reply.code == "session_lost", reply
    assert reply.cookie() is None, reply.set_cookies


def token(session_id: str, secret: str = COUNTER_SECRET, salt: str = TOKEN_SALT) -> str:
    """A session token as SPEC 4.1 defines it."""
    serializer = itsdangerous.URLSafeSerializer(secret, salt=salt)
    return str(serializer.dumps({"sid": session_id}))


async def test_cookies_the_router_would_reject_count_as_no_cookie(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        a = await seeded(http, "a")
        # A cookie signed here names the session as the server's own cookie does.
        ours = await http.request("GET", "/count", cookie=session_cookie({"session_id": a.id}))
        assert ours.status == 200 and ours.json["count"] == 1

        assert a.cookie is not None
        signed, _, signature = a.cookie.rpartition(".")
        flipped = ("B" if signature[0] == "A" else "A") + signature[1:]
        unsigned = base64.b64encode(json.dumps({"session_id": a.id}).encode()).decode()
        fifteen_days_ago = int(time.time()) - 15 * 24 * 3600
        rejected = {
            "bad signature": f"{signed}.{flipped}",
            "other secret": session_cookie({"session_id": a.id}, secret="not-the-secret"),
            "past max age": session_cookie({"session_id": a.id}, at=fifteen_days_ago),
            "unsigned": f"session={unsigned}",
            "10 KB of garbage": f"session={TEN_KB}",
        }
        legit = {a.id}
        for why, cookie in rejected.items():
            lost_without_cookie(await http.request("GET", "/count", cookie=cookie))
            # Not read as naming `a`: a seed of another ID is no mismatch.
            other = CounterSession(http, f"b-{secrets.token_hex(4)}")
            reply = await other.seed(cookie=cookie)
            assert reply.status == 200 and reply.json["session_id"] == other.id, (why, reply)
            assert (await other.count()).json["count"] == 0, why
            legit.add(other.id)
        assert (await a.count()).json["count"] == 1
        await only_legit_claims(server, legit)
        clean(http)


async def test_a_token_with_a_bad_signature_counts_as_no_token(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        a = await seeded(http, "a")
        good = {TOKEN_HEADER: token(a.id)}
        for _ in range(8):  # from whichever worker accepts it
            reply = await http.request("GET", "/count", headers=good)
            assert reply.status == 200 and reply.json["count"] == 1, reply
        mismatch = await http.request(
            "POST", "/seed_session", json={"session_id": "someone-else"}, headers=good
        )
        assert mismatch.status == 409 and mismatch.code == "session_mismatch"

        valid = token(a.id)
        rejected = {
            "bad signature": valid[:-2] + ("AA" if not valid.endswith("AA") else "BB"),
            "other secret": token(a.id, secret="not-the-secret"),
            "other salt": token(a.id, salt="not-the-salt"),
            "unsigned": base64.urlsafe_b64encode(json.dumps({"sid": a.id}).encode()).decode(),
            "10 KB of garbage": TEN_KB,
        }
        legit = {a.id}
        for why, value in rejected.items():
            headers = {TOKEN_HEADER: value}
            lost_without_cookie(await http.request("GET", "/count", headers=headers))
            other = CounterSession(http, f"c-{secrets.token_hex(4)}")
            reply = await http.request(
                "POST", "/seed_session", json={"session_id": other.id}, headers=headers
            )
            assert reply.status == 200 and reply.json["session_id"] == other.id, (why, reply)
            legit.add(other.id)
        await only_legit_claims(server, legit)
        clean(http)


BAD_BODIES = [
    b"not json",
    b"{",
    b"",
    b"[1, 2]",
    b'"a string"',
    b"null",
    b'{"session_id": "\xff\xfe"}',
    *(
        json.dumps({"session_id": value}).encode()
        for value in (123, None, ["a"], {"x": 1}, True, "", "x" * 300, "caf\u00e9", "tab\there")
    ),
    b'{"other_field": "x"}',
]


async def test_seed_and_close_bodies_that_fail_validation_get_422(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        a = await seeded(http, "a")
        for route in ("/seed_session", "/close_session"):
            for body in BAD_BODIES:
                for cookie in (None, a.cookie):
                    reply = await http.request("POST", route, body=body, cookie=cookie)
                    assert reply.status == 422 and reply.code == "seed_rejected", (body, reply)
                    assert reply.cookie() is None or cookie is not None, (body, reply)
        assert (await a.count()).json["count"] == 1, "no bad close reached the session"

        longest = CounterSession(http, "y" * 256)
        assert (await longest.seed()).status == 200, "256 characters is a valid ID"
        assert (await longest.count()).json["count"] == 0
        await only_legit_claims(server, {a.id, longest.id})
        clean(http)


async def test_10_kb_header_values_are_served(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        a = await seeded(http, "a")
        junk = {"x-e2e-junk": TEN_KB}
        health = await http.request("GET", "/health", headers=junk)
        assert health.status == 200 and health.json == {"ok": True}
        assert health.cookie() is None, "a route that touches no session gets no cookie"
        for _ in range(8):  # forwarded with its big header from whichever worker accepts it
            reply = await http.request("GET", "/count", cookie=a.cookie, headers=junk)
            assert reply.status == 200 and reply.json["count"] == 1, reply
        b = CounterSession(http, f"b-{secrets.token_hex(4)}")
        reply = await http.request("POST", "/seed_session", json={"session_id": b.id}, headers=junk)
        assert reply.status == 200

        named = {"x-tether-worker": TEN_KB}
        reply = await http.request("GET", "/health", headers=named)
        assert reply.status == 410 and reply.code == "worker_gone", reply
        # Any session ID makes the router ignore the worker header.
        reply = await http.request("GET", "/count", cookie=a.cookie, headers=named)
        assert reply.status == 200 and reply.json["count"] == 1, reply
        await only_legit_claims(server, {a.id, b.id})
        clean(http)


async def test_a_seed_or_close_body_over_64_mib_gets_413(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    host, port = server.host_port
    big = f"big-{secrets.token_hex(4)}"

    def head(path: str, framing: str) -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\n{framing}\r\n\r\n"
        ).encode()

    for path in ("/seed_session", "/close_session"):
        # Declared over the cap: refused before any of the body is sent.
        over = head(path, f"content-length: {CAP + 1}")
        status, _, payload = await raw_exchange(host, port, over)
        assert status == 413 and json.loads(payload)["code"] == "body_too_large", payload

    async def chunked_body() -> AsyncIterator[bytes]:
        start = json.dumps({"session_id": big, "pad": ""})[:-2].encode()
        yield f"{len(start):x}\r\n".encode() + start + b"\r\n"
        chunk = b"x" * MiB
        for _ in range(65):
            yield f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        yield b'2\r\n"}\r\n0\r\n\r\n'

    status, _, payload = await raw_exchange(
        host, port, head("/seed_session", "transfer-encoding: chunked"), chunked_body()
    )
    assert status == 413 and json.loads(payload)["code"] == "body_too_large", payload

    async with Http(server.url) as http:
        # Large bodies under the cap are fine, forwarded or not (SPEC 4.5: a 9 MiB seed).
        pad = "p" * 9 * MiB
        nine = CounterSession(http, f"nine-{secrets.token_hex(4)}")
        reply = await http.request(
            "POST", "/seed_session", body=json.dumps({"session_id": nine.id, "pad": pad}).encode()
        )
        assert reply.status == 200, reply
        nine.cookie = reply.cookie()
        for _ in range(4):
            reply = await http.request(
                "POST",
                "/close_session",
                body=json.dumps({"session_id": nine.id, "pad": pad}).encode(),
                cookie=nine.cookie,
            )
            assert reply.status == 200 and reply.json["closed"] is True, reply
        await only_legit_claims(server, {nine.id})
        assert big not in server.claims()
        clean(http)


async def test_control_routes_without_the_right_token_get_401(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    good = server.token
    async with Http(server.url) as http:
        wrong_headers: list[dict[str, str]] = [
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": f"Bearer {good}x"},
            {"authorization": f"Bearer {good[:-1]}"},
            {"authorization": good},
            {"authorization": f"Basic {good}"},
            {"authorization": "Bearer "},
            {"authorization": f"Bearer {TEN_KB}"},
        ]
        routes = [
            ("GET", "/_tether/status"),
            ("POST", "/_tether/prepare"),
            ("POST", "/_tether/commit"),
            ("POST", "/_tether/resume"),
            ("POST", "/_tether/restore"),
        ]
        for headers in wrong_headers:
            for method, path in routes:
                body = {} if method == "POST" else None
                reply = await http.request(method, path, headers=headers, json=body)
                assert reply.status == 401 and reply.code == "unauthorized", (headers, reply)
        assert (await server.status(http))["expected_workers"] == 4
        assert server.claims() == {}
        clean(http)


@pytest.mark.parametrize("workers", [1, 4])
async def test_a_seed_or_close_naming_another_session_than_its_cookie_gets_409(
    serve: Serve, workers: int
) -> None:
    server = serve(COUNTER_APP, workers)
    async with Http(server.url) as http:
        a = await seeded(http, "a")
        other = f"other-{secrets.token_hex(4)}"
        for _ in range(6):  # from whichever worker accepts it
            for route in ("/seed_session", "/close_session"):
                reply = await http.request(
                    "POST", route, json={"session_id": other}, cookie=a.cookie
                )
                assert reply.status == 409 and reply.code == "session_mismatch", reply
        assert other not in server.claims()
        # Neither request reached the app: `a` is still open, `other` was never fenced.
        assert (await a.count()).json["count"] == 1
        b = CounterSession(http, other)
        assert (await b.seed()).status == 200
        assert (await b.count()).json["count"] == 0
        clean(http)
