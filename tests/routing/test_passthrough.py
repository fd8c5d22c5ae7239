"""The passthrough (routing/front.py) in-process: real workers on real sockets, the
receiving one running `FrontProtocol` as `tether serve` does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

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
