"""The passthrough (routing/front.py): a request another worker of this host holds the
session of goes there as bytes, and where it cannot, the router forwards it by copying;
either way it reaches its holder and comes back right (SPEC 4.2, 4.5, 11)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
from typing import Any

import pytest

from e2e.conftest import Serve
from e2e.harness import COUNTER_APP, Connection, Http, Server, eventually

pytestmark = pytest.mark.e2e

APP = "e2e.apps.echo:app"


class Raw:
    """A kept-alive connection that reads replies as bytes (duplicate headers and all)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.port: int = writer.get_extra_info("sockname")[1]

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def reply(self) -> tuple[int, list[tuple[str, str]], Any]:
        async with asyncio.timeout(15):
            head = await self.reader.readuntil(b"\r\n\r\n")
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = [
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(":") for line in lines if line)
            ]
            size = int(dict(headers)["content-length"])
            body = json.loads(await self.reader.readexactly(size))
        return int(status_line.split()[1]), headers, body

    async def close(self) -> None:
        self.writer.transport.abort()


def echo_lines(server: Server) -> list[dict[str, Any]]:
    """The access lines of `/echo` requests logged so far."""
    return [r for r in server.logs() if r.get("event") == "request" and r.get("path") == "/echo"]


def get(path: str, cookie: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: tether\r\ncookie: {cookie}\r\n\r\n".encode()


async def seed(server: Server, session_id: str) -> tuple[str, str]:
    """Seed a session; its cookie and its holder."""
    async with Http(server.url) as http:
        reply = await http.request("POST", "/seed_session", json={"session_id": session_id})
        assert reply.status == 200, reply
        cookie = reply.cookie()
        assert cookie is not None
        return cookie, reply.json["worker"]


async def workers(server: Server) -> dict[str, dict[str, Any]]:
    async with Http(server.url) as http:
        return {w["id"]: w for w in (await server.status(http))["workers"]}


async def raw_on(
    server: Server, lines: dict[str, dict[str, Any]], worker: str,
    tls: ssl.SSLContext | None = None, stay: bool = True,
) -> Raw:
    """A kept-alive connection that `worker` accepted; with `stay`, its first request was
    one of no session, so that it stays there (a connection moves to a session's holder
    only on its first request: routing/handoff.py)."""
    host, port = server.host_port
    pids = [line["pid"] for line in lines.values()]
    for _ in range(60):
        reader, writer = await asyncio.open_connection(host, port, ssl=tls)
        if await Connection(reader, writer).owner(pids) == lines[worker]["pid"]:
            raw = Raw(reader, writer)
            if stay:
                raw.write(b"GET /slow?s=0 HTTP/1.1\r\nhost: tether\r\n\r\n")
                status, _, seen = await raw.reply()
                assert (status, seen["worker"]) == (200, worker), seen
            return raw
        writer.transport.abort()
    raise AssertionError(f"no connection landed on worker {worker}")


async def across(
    server: Server, session_id: str, tls: ssl.SSLContext | None = None, stay: bool = True
) -> tuple[str, str, str, Raw]:
    """Seed a session on a 2-worker server: its cookie, its holder, the other worker, and
    a kept-alive connection the other worker accepted (`stay`: see `raw_on`)."""
    cookie, holder = await seed(server, session_id)
    lines = await workers(server)
    (other,) = [w for w in lines if w != holder]
    return cookie, holder, other, await raw_on(server, lines, other, tls, stay)


async def echoes(raw: Raw, cookie: str, times: int) -> list[dict[str, Any]]:
    """`GET /echo` `times` over `raw`: what the app saw each time, once each reply is
    checked to be 200 with the caller's own address and one `date` and `server`."""
    seen_all = []
    for _ in range(times):
        raw.write(get("/echo", cookie))
        status, headers, seen = await raw.reply()
        assert status == 200, seen
        assert seen["client"] == ["127.0.0.1", raw.port], "the caller's own address"
        names = [name for name, _ in headers]
        assert names.count("date") == 1 and names.count("server") == 1, headers
        seen_all.append(seen)
    return seen_all


async def test_a_connections_first_request_moves_it_to_the_holder_which_serves_the_rest(
    serve: Serve,
) -> None:
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "moved", stay=False)
    before = await workers(server)
    try:
        seen = await echoes(raw, cookie, 4)
    finally:
        await raw.close()
    assert {(s["worker"], s["session_id"]) for s in seen} == {(holder, "moved")}
    after = await workers(server)
    assert after[other]["handed_off"] - before[other]["handed_off"] == 1
    assert after[other]["forwarded"] - before[other]["forwarded"] == 1
    assert after[other]["passed_through"] == after[holder]["handed_off"] == 0
    assert after[holder]["served_forwarded"] - before[holder]["served_forwarded"] == 1
    lines_logged = await eventually(
        lambda: echo_lines(server) if len(echo_lines(server)) >= 4 else None, 10,
        "the access lines are written")
    assert [r["worker_id"] for r in lines_logged] == [holder] * 4, "by the holder, once each"


async def test_requests_on_a_connection_another_worker_accepted_pass_through_to_the_holder(
    serve: Serve,
) -> None:
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "through")
    try:
        seen = await echoes(raw, cookie, 5)
    finally:
        await raw.close()
    assert {(s["worker"], s["session_id"]) for s in seen} == {(holder, "through")}
    after = await workers(server)
    assert after[other]["passed_through"] == 5
    assert after[other]["forwarded"] == 5
    assert after[holder]["served_forwarded"] == 5
    lines_logged = await eventually(
        lambda: echo_lines(server) if len(echo_lines(server)) >= 5 else None, 10,
        "the access lines are written")
    assert [r["worker_id"] for r in lines_logged] == [other] * 5, "once each, where received"
    assert all(r["session_id"] == "through" and r["status"] == 200 for r in lines_logged)


async def test_a_connection_serves_its_own_workers_sessions_and_passes_the_others_through(
    serve: Serve,
) -> None:
    server = serve(APP, 2)
    seeded = [await seed(server, f"turn-{index}") for index in range(12)]
    holders = {holder for _, holder in seeded}
    assert len(holders) == 2, "sessions landed on both workers"
    lines = await workers(server)
    here = next(iter(holders))
    raw = await raw_on(server, lines, here)
    try:
        for _ in range(2):
            for cookie, holder in seeded:
                raw.write(get("/echo", cookie))
                status, _, seen = await raw.reply()
                assert (status, seen["worker"]) == (200, holder)
    finally:
        await raw.close()
    after = await workers(server)
    elsewhere = sum(1 for _, holder in seeded if holder != here)
    assert after[here]["passed_through"] == 2 * elsewhere


async def test_requests_the_passthrough_cannot_take_are_forwarded_by_copying_and_reach_the_holder(
    serve: Serve,
) -> None:
    """Two requests in one write (pipelined), a head in two writes, and a `forwarded`
    header: each goes the router's way, and each still reaches its holder."""
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "copied")
    try:
        raw.write(get("/echo?n=1", cookie) + get("/echo?n=2", cookie))
        for _ in range(2):
            status, _, seen = await raw.reply()
            assert (status, seen["worker"]) == (200, holder)
        request = get("/echo?n=3", cookie)
        raw.write(request[:20])
        await asyncio.sleep(0.05)
        raw.write(request[20:])
        status, _, seen = await raw.reply()
        assert (status, seen["worker"]) == (200, holder)
        proxied = b"\r\nforwarded: for=10.1.2.3\r\n\r\n"
        raw.write(get("/echo?n=4", cookie).replace(b"\r\n\r\n", proxied))
        status, _, seen = await raw.reply()
        assert (status, seen["worker"], seen["client"]) == (200, holder, ["127.0.0.1", raw.port])
    finally:
        await raw.close()
    after = await workers(server)
    assert after[other]["passed_through"] == 0
    assert after[other]["forwarded"] == 4
    lines_logged = await eventually(
        lambda: echo_lines(server) if len(echo_lines(server)) >= 4 else None, 10,
        "the access lines are written")
    assert [r["worker_id"] for r in lines_logged] == [other] * 4, "once each, where received"


async def test_a_head_httptools_refuses_is_answered_400_where_it_landed_and_closed(
    serve: Serve,
) -> None:
    """The passthrough reads heads with the holder's own parser (front.py `HeadReader`):
    one it refuses never leaves the worker that received it, which answers 400 and closes
    the connection, as the holder would."""
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "refused")
    lines = await workers(server)
    direct = await raw_on(server, lines, holder)
    try:
        for connection in (raw, direct):
            bad = get("/echo", cookie).replace(b"\r\n\r\n", b"\r\nbad name : x\r\n\r\n")
            connection.write(bad)
            async with asyncio.timeout(15):
                head = await connection.reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 400 "), head
                await connection.reader.read()  # the body, up to the end: a kept-alive
                assert connection.reader.at_eof()  # connection would time out here
    finally:
        await raw.close()
        await direct.close()
    after = (await workers(server))[other]
    assert (after["passed_through"], after["forwarded"]) == (0, 0)


async def test_under_a_root_path_a_passed_through_request_sees_what_a_direct_one_sees(
    serve: Serve,
) -> None:
    server = serve(APP, 2, "--root-path", "/api")
    cookie, holder = await seed(server, "rooted")
    lines = await workers(server)
    seen_by = {}
    for worker in lines:
        raw = await raw_on(server, lines, worker)
        try:
            raw.write(get("/echo", cookie))
            status, _, seen = await raw.reply()
        finally:
            await raw.close()
        assert (status, seen["worker"]) == (200, holder)
        seen_by[worker] = {key: seen[key] for key in ("path", "root_path", "url_for")}
    assert seen_by[holder] == {"path": "/api/echo", "root_path": "/api",
                               "url_for": "http://tether/api/echo"}
    (other,) = [w for w in lines if w != holder]
    assert seen_by[other] == seen_by[holder]
    assert (await workers(server))[other]["passed_through"] == 1


async def test_a_request_that_arrives_inside_another_requests_unfinished_head_is_not_passed(
    serve: Serve,
) -> None:
    """Bytes that look like a whole request but arrive while uvicorn's parser is inside
    another request's head belong to that head: the passthrough must not take them."""
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "inside")
    try:
        raw.write(b"GET /echo?first HTTP/1.1\r\nhost: tether\r\nx-pad: ")
        await asyncio.sleep(0.1)
        raw.write(get("/echo?second", cookie))  # the rest of the first head
        status, _, seen = await raw.reply()
        assert (status, seen["worker"]) == (200, holder)
    finally:
        await raw.close()
    after = await workers(server)
    assert after[other]["passed_through"] == 0
    assert after[other]["forwarded"] == 1


async def test_under_tls_requests_of_another_workers_session_are_forwarded_by_copying(
    serve: Serve, certificate: tuple[str, str]
) -> None:
    key, cert = certificate
    server = serve(APP, 2, "--ssl-keyfile", key, "--ssl-certfile", cert)
    tls = ssl.create_default_context()
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE
    cookie, holder, other, raw = await across(server, "tls", tls)
    try:
        for _ in range(3):
            raw.write(get("/echo", cookie))
            status, _, seen = await raw.reply()
            assert (status, seen["worker"], seen["scheme"]) == (200, holder, "https")
    finally:
        await raw.close()
    after = await workers(server)
    assert after[other]["forwarded"] == 3
    assert after[other]["passed_through"] == 0


async def test_a_passed_through_request_whose_holder_is_killed_is_answered_410_or_503(
    serve: Serve,
) -> None:
    server = serve(APP, 2)
    cookie, holder, _, raw = await across(server, "doomed")
    pid = (await workers(server))[holder]["pid"]
    try:
        raw.write(get("/slow?s=30", cookie))
        await asyncio.sleep(0.5)  # (the holder sleeps in the handler)
        os.kill(pid, signal.SIGKILL)
        status, _, body = await raw.reply()
        assert (status, body["code"]) in {(410, "session_gone"), (503, "claimant_unavailable")}
    finally:
        await raw.close()


async def test_a_connection_whose_holder_is_killed_with_its_move_queued_is_answered_410_or_503(
    serve: Serve,
) -> None:
    """The holder is stopped, so the move waits in its socket's queue unread; it is then
    killed. The worker that received the connection kept it until an answer, and answers
    the request as the copying path does when a holder is gone (routing/handoff.py)."""
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "queued", stay=False)
    pid = (await workers(server))[holder]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        raw.write(get("/echo", cookie))
        await asyncio.sleep(0.5)  # (the move is sent; nobody reads it)
        os.kill(pid, signal.SIGKILL)
        status, _, body = await raw.reply()
        assert (status, body["code"]) in {(410, "session_gone"), (503, "claimant_unavailable")}
    finally:
        with contextlib.suppress(ProcessLookupError):  # (killed already, unless it failed)
            os.kill(pid, signal.SIGKILL)
        await raw.close()
    moved = (await workers(server))[other]
    # Given back, then copied: had the move never been sent, the passthrough would have
    # taken it (passed_through 1).
    assert (moved["handed_off"], moved["forwarded"], moved["passed_through"]) == (0, 1, 0)


def _post(path: str, cookie: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: tether\r\ncookie: {cookie}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
            ).encode() + data


async def test_the_passthrough_follows_a_session_released_and_claimed_again_by_another_worker(
    serve: Serve,
) -> None:
    # The receiving worker remembers who holds a session it passed through (claims.py,
    # dirwatch.py); once that claim ends and another worker claims the session, the next
    # request must reach the new holder, not the one remembered.
    server = serve(COUNTER_APP, 3, "--close-window", "0.3")
    cookie, first = await seed(server, "moves-on")
    lines = await workers(server)
    receiving, second = [w for w in lines if w != first]
    through = await raw_on(server, lines, receiving, stay=False)
    try:
        through.write(b"GET /health HTTP/1.1\r\nhost: tether\r\n\r\n")  # so it stays there
        assert (await through.reply())[0] == 200
        for _ in range(3):
            through.write(get("/count", cookie))
            status, _, seen = await through.reply()
            assert (status, seen["worker"]) == (200, first), seen
        through.write(_post("/close_session", cookie, {"session_id": "moves-on"}))
        status, _, seen = await through.reply()
        assert (status, seen.get("closed")) == (200, True), seen
        await eventually(lambda: "moves-on" not in server.claims(), 10,
                         "the closed session's claim is gone")

        seeding = await raw_on(server, lines, second, stay=False)
        try:
            seeding.write(_post("/seed_session", cookie, {"session_id": "moves-on"}))
            status, _, seen = await seeding.reply()
            assert (status, seen["worker"]) == (200, second), seen
        finally:
            await seeding.close()
        assert server.claims().get("moves-on") == second

        before = await workers(server)
        through.write(get("/count", cookie))
        status, _, seen = await through.reply()
    finally:
        await through.close()
    assert (status, seen.get("worker"), seen.get("count")) == (200, second, 0), seen
    after = await workers(server)
    assert after[receiving]["passed_through"] - before[receiving]["passed_through"] == 1


def proxied_echo(cookie: str) -> bytes:
    """`GET /echo` as a reverse proxy sends it on for the caller 203.0.113.7 over https."""
    return get("/echo", cookie).replace(
        b"\r\n\r\n", b"\r\nx-forwarded-for: 203.0.113.7\r\nx-forwarded-proto: https\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("flags", "proxied"),
    [((), True), (("--forwarded-allow-ips", "10.9.9.9"), False), (("--no-proxy-headers",), False)],
    ids=["trusted-proxy", "untrusted-proxy", "no-proxy-headers"],
)
async def test_a_request_naming_a_proxys_caller_passes_through_and_sees_that_caller(
    serve: Serve, flags: tuple[str, ...], proxied: bool
) -> None:
    # Behind a reverse proxy every request carries x-forwarded-*: it takes the passthrough,
    # and the app sees the caller uvicorn's proxy headers rules give it (SPEC 8).
    server = serve(APP, 2, *flags)
    cookie, holder, other, raw = await across(server, "proxied")
    before = await workers(server)
    try:
        raw.write(proxied_echo(cookie))
        status, _, seen = await raw.reply()
    finally:
        await raw.close()
    assert (status, seen["worker"]) == (200, holder), seen
    if proxied:
        assert (seen["client"], seen["scheme"]) == (["203.0.113.7", 0], "https")
    else:
        assert (seen["client"], seen["scheme"]) == (["127.0.0.1", raw.port], "http")
    after = await workers(server)
    assert after[other]["passed_through"] - before[other]["passed_through"] == 1


async def test_a_connections_proxied_first_request_moves_it_and_the_holder_sees_the_proxys_caller(
    serve: Serve,
) -> None:
    server = serve(APP, 2)
    cookie, holder, other, raw = await across(server, "proxied-move", stay=False)
    before = await workers(server)
    try:
        for _ in range(2):
            raw.write(proxied_echo(cookie))
            status, _, seen = await raw.reply()
            assert (status, seen["worker"]) == (200, holder), seen
            assert (seen["client"], seen["scheme"]) == (["203.0.113.7", 0], "https")
    finally:
        await raw.close()
    after = await workers(server)
    assert after[other]["handed_off"] - before[other]["handed_off"] == 1
