"""The passthrough (routing/front.py) in-process: real workers on real sockets, the
receiving one running `FrontProtocol` as `tether serve` does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether.routing.front as front_module
import tether.routing.router as router_module
from tests.routing.apps import session_app
from tests.routing.conftest import Cluster, Node
from tests.routing.test_forward import BOUND
from tests.routing.test_hop import seeded, whoami
from tether.routing.forward import HOP_BY_HOP
from tether.routing.sources import Found, find
from tether.routing.writes import JoinedWrites


def transports(node: Node, private: bool = False) -> list[Any]:
    """The transports uvicorn's protocols write to: of `node`'s public server's open
    connections, or of its private server's."""
    server = node.routing.private._server if private else node.server
    assert server is not None
    return [protocol.transport for protocol in server.server_state.connections]


async def test_a_client_that_says_keep_alive_takes_the_passthrough_and_its_app_sees_no_hop_headers(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "keep-alive")

    direct, _ = await whoami(a, cookies)
    forwarded, forwarded_caller = await whoami(b, cookies)  # httpx says `connection: keep-alive`

    assert b.routing.router.stats.passed_through == 1
    assert forwarded["worker"] == a.id
    assert forwarded["client"] == forwarded_caller
    assert "connection" in direct["headers"]  # (the direct one is not forwarded)
    assert forwarded["headers"] == [h for h in direct["headers"] if h.encode() not in HOP_BY_HOP]


async def test_the_passthrough_and_the_private_server_write_through_joined_writes(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "joined")

    async with b.client(cookies=cookies) as client:  # one kept-alive connection
        reply = await client.get("/touch")
        assert reply.status_code == 200 and reply.json()["worker"] == a.id
        assert b.routing.router.stats.passed_through == 1
        fronts, privates = transports(b), transports(a, private=True)

    assert fronts and all(isinstance(t, JoinedWrites) for t in fronts)
    assert privates and all(isinstance(t, JoinedWrites) for t in privates)


async def test_a_request_the_passthrough_leaves_to_this_worker_has_its_head_read_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(b, "here")
    reads: list[object] = []

    def counted(kind: Any, scope: Any) -> Found:
        reads.append(scope)
        return find(kind, scope)

    monkeypatch.setattr(router_module, "find", counted)
    monkeypatch.setattr(front_module, "find", counted)
    seen, _ = await whoami(b, cookies)

    assert seen["worker"] == b.id
    assert b.routing.router.stats.passed_through == 0
    assert len(reads) == 1, "the router used what the passthrough read"


async def test_a_request_whose_kept_link_closed_unread_is_served_once_on_a_new_connection(
    cluster: Cluster,
) -> None:
    """The holder's keep-alive timer fires as a request arrives on the link the passthrough
    kept: the link closes with the request unread and unanswered, so the passthrough sends
    it again the copying way, SPEC 4.5's one retry, on a new connection (not on the
    forwarder's pooled one, which the holder closes too); the handler runs once for it,
    and it is counted once."""
    a = await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "resent")
    private = a.routing.private
    assert private is not None and private._server is not None
    async with b.client() as client:  # copied (it names a worker, not a session): pooled
        named = await client.get("/whoami", headers={"x-tether-worker": a.id})
        assert (named.status_code, named.json()["worker"]) == (200, a.id)
    closed_unread: list[object] = []

    def timer_fires(protocol: Any) -> None:
        closed_unread.append(protocol)
        protocol.timeout_keep_alive_handler()  # (uvicorn's own close of an idle connection)

    async with b.client(cookies=cookies) as client:  # one kept-alive connection
        first = await client.get("/touch")
        assert (first.status_code, first.json()["n"]) == (200, 1)
        assert b.routing.router.stats.passed_through == 1
        kept: list[Any] = list(private._server.server_state.connections)
        assert len(kept) == 2  # the passthrough's link and the forwarder's connection
        for protocol in kept:
            protocol.data_received = lambda data, protocol=protocol: timer_fires(protocol)
        second = await client.get("/touch")

    assert second.status_code == 200, second.text
    assert (second.json()["n"], second.json()["worker"]) == (2, a.id), "run twice, or lost"
    assert len(closed_unread) == 1, "sent again on a pooled connection, not a new one"
    stats = b.routing.router.stats
    assert (stats.passed_through, stats.forwarded) == (1, 3)
    assert private.connections_accepted == 3


def cookie_header(cookies: Any) -> str:
    return "; ".join(f"{name}={value}" for name, value in cookies.items())


async def closing_request(b: Node, here: str, there: str) -> tuple[bytes, Any]:
    """On a new connection to `b`, a request of b's own session (cookie `here`), so that
    the connection stays (it moves only on a first request of another worker's session),
    then one of another worker's (`there`) saying `connection: close`, which takes the
    passthrough: the second reply's head and body, read to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(b.url.rsplit(":", 1)[1]))
    try:
        writer.write(f"GET /whoami HTTP/1.1\r\nhost: t\r\ncookie: {here}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length))["worker"] == b.id
        writer.write(f"GET /whoami HTTP/1.1\r\nhost: t\r\ncookie: {there}\r\n"
                     "Connection: close\r\n\r\n".encode())
        reply = await asyncio.wait_for(reader.read(), BOUND)  # to its end: closed
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, json.loads(body)


async def test_a_request_saying_connection_close_keeps_the_link_and_closes_its_connection(
    cluster: Cluster,
) -> None:
    """A client's `connection: close` is not sent on (it is hop-by-hop): the holder keeps
    the link for the next request, another connection's, while the reply says close and
    the client's connection closes after it, as uvicorn's own would."""
    a = await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    there, here = cookie_header(await seeded(a, "far")), cookie_header(await seeded(b, "near"))
    private = a.routing.private
    assert private is not None
    accepted = private.connections_accepted
    for _ in range(3):
        head, seen = await closing_request(b, here, there)
        assert head.startswith(b"HTTP/1.1 200 "), (head, seen)
        assert b"\r\nconnection: close" in head.lower(), head
        assert seen["worker"] == a.id and "connection" not in seen["headers"], seen
    assert b.routing.router.stats.passed_through == 3
    assert private.connections_accepted - accepted == 1, "one link for the three"


async def test_a_request_saying_close_whose_link_fails_unread_is_refused_and_closed(
    cluster: Cluster, short_tmp: Path
) -> None:
    """A new link its holder's socket closes before reading it (no retry: it may have been
    read) is answered 503 as copying would, and for a client that said `connection:
    close` that reply says close and its connection closes after it."""
    a = await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    there, here = cookie_header(await seeded(a, "far")), cookie_header(await seeded(b, "near"))

    async def closes_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    dying = str(short_tmp / "dying.sock")
    server = await asyncio.start_unix_server(closes_at_once, dying)
    assert b.routing.passthrough is not None
    b.routing.passthrough._paths[a.id] = dying  # a's socket, as if its worker were dying
    try:
        head, seen = await closing_request(b, here, there)
    finally:
        server.close()
        await server.wait_closed()
    assert head.startswith(b"HTTP/1.1 503 "), (head, seen)
    assert seen["code"] == "claimant_unavailable"
    assert b"\r\nconnection: close" in head.lower(), head


async def read_reply(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One reply with a content-length: its head and its body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await asyncio.wait_for(reader.readexactly(length), BOUND)


async def test_a_request_followed_by_a_stray_blank_line_lets_no_later_bytes_onto_its_link(
    cluster: Cluster,
) -> None:
    """httptools skips a blank line after a whole request. The next request of the same
    head must not be read as one whose body is that much longer, or the bytes of the
    request pipelined after it would go to the holder as the start of the link's next
    request: that one (the client's own, or another connection's) would be answered 400."""
    a = await cluster.add(session_app())
    b = await cluster.add(session_app(), front=True)
    there, here = cookie_header(await seeded(a, "far")), cookie_header(await seeded(b, "near"))
    posted = f"POST /touch HTTP/1.1\r\nhost: t\r\ncookie: {there}\r\ncontent-length: 3\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", int(b.url.rsplit(":", 1)[1]))
    try:
        # b's own session first: the connection stays with b, and later requests pass through.
        writer.write(f"GET /whoami HTTP/1.1\r\nhost: t\r\ncookie: {here}\r\n\r\n".encode())
        assert json.loads((await read_reply(reader))[1])["worker"] == b.id
        writer.write(posted.encode() + b"abc\r\n")
        replies = [await read_reply(reader)]
        writer.write(posted.encode() + b"abcGE")  # the next request's first bytes come along
        await asyncio.sleep(0.05)
        writer.write(f"T /touch HTTP/1.1\r\nhost: t\r\ncookie: {there}\r\n\r\n".encode())
        replies += [await read_reply(reader), await read_reply(reader)]
        writer.write(f"GET /touch HTTP/1.1\r\nhost: t\r\ncookie: {there}\r\n\r\n".encode())
        replies.append(await read_reply(reader))  # passed through
    finally:
        writer.close()
        await writer.wait_closed()

    assert [head.split(b"\r\n")[0] for head, _ in replies] == [b"HTTP/1.1 200 OK"] * 4, replies
    seen = [json.loads(body) for _, body in replies]
    assert [one["n"] for one in seen] == [1, 2, 3, 4]
    assert {one["worker"] for one in seen} == {a.id}
    assert b.routing.router.stats.passed_through >= 1


def switching_app() -> Any:
    """`session_app` with a route whose handler answers 101 to any request."""
    app = session_app()

    async def switch(request: Request) -> Response:
        return Response(status_code=101, headers={"upgrade": "x", "connection": "upgrade"})

    app.router.routes.append(Route("/switch", switch))
    return app


async def test_a_holders_101_to_a_request_that_asked_no_upgrade_is_answered_503_at_once(
    cluster: Cluster,
) -> None:
    """No request sent on a link or a forwarder's connection asks to switch protocols, so
    a 101 from the app is a reply the hop cannot carry: either way the client is
    answered 503 at once (the copying way's parser and the passthrough's both raise
    `HttpParserUpgrade`, which once left the passthrough's client waiting for the
    holder's keep-alive to end)."""
    a = await cluster.add(switching_app())
    b = await cluster.add(switching_app(), front=True)
    there, here = cookie_header(await seeded(a, "far")), cookie_header(await seeded(b, "near"))
    reader, writer = await asyncio.open_connection("127.0.0.1", int(b.url.rsplit(":", 1)[1]))
    try:
        writer.write(f"GET /whoami HTTP/1.1\r\nhost: t\r\ncookie: {here}\r\n\r\n".encode())
        assert json.loads((await read_reply(reader))[1])["worker"] == b.id
        writer.write(f"GET /switch HTTP/1.1\r\nhost: t\r\ncookie: {there}\r\n\r\n".encode())
        spliced = await read_reply(reader)
    finally:
        writer.close()
        await writer.wait_closed()
    async with b.client() as client:  # naming the worker: the copying way
        copied = await client.get("/switch", headers={"x-tether-worker": a.id})

    assert b.routing.router.stats.passed_through == 1
    assert spliced[0].startswith(b"HTTP/1.1 503 "), spliced
    assert json.loads(spliced[1])["code"] == "claimant_unavailable"
    assert copied.status_code == 503, copied.text
    assert copied.json()["code"] == "claimant_unavailable"
