"""The WebSocket relay on real in-process workers: a handshake for another worker's
session is carried to it over its private socket, messages and closes both ways."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Close

from e2e.harness import eventually
from tests.routing.conftest import Cluster, Node
from tests.routing.ws_apps import FLOOD_MESSAGE, websocket_app
from tether.routing.kinds import SessionKind
from tether.routing.relay import READ_LIMIT
from tether.routing.types import SessionId


def ws_url(node: Node, path: str = "/ws") -> str:
    return node.url.replace("http://", "ws://", 1) + path


async def seed(node: Node, session_id: str) -> str:
    """Seed a session on `node` over HTTP; return its `cookie` header."""
    async with node.client() as client:
        reply = await client.post("/seed_session", json={"session_id": session_id})
    assert reply.status_code == 200, reply.text
    return f"session={reply.cookies['session']}"


async def two(cluster: Cluster, **options: Any) -> tuple[Node, Node]:
    return (await cluster.add(websocket_app(**options)),
            await cluster.add(websocket_app(**options)))


def close_of(ws: ClientConnection) -> Close | None:
    return ws.protocol.close_rcvd


async def test_a_websocket_landing_on_another_worker_is_relayed_to_the_sessions_holder(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "s-1")
    async with connect(ws_url(b), additional_headers={"cookie": cookie}) as ws:
        replies = []
        for _ in range(3):
            await ws.send("n")
            replies.append(json.loads(await ws.recv()))
    assert [(r["count"], r["worker"]) for r in replies] == [(1, a.id), (2, a.id), (3, a.id)]
    assert a.app.state.counts == {"s-1": 3}
    assert b.app.state.counts == {}
    assert b.routing.router.stats.forwarded == 1
    assert a.routing.router.stats.served_forwarded == 1


async def test_text_and_binary_messages_pass_unchanged_and_in_order_both_ways(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "order")
    sent: list[str | bytes] = []
    for index in range(200):
        if index % 3 == 0:
            sent.append(bytes([index % 256]) * (index * 37 % 5000 + 1))
        else:
            sent.append(f"m{index} ünïcødé ✓")
    sent.append(b"\x00" * (3 << 20))  # one large binary message, several MiB
    async with connect(ws_url(b), additional_headers={"cookie": cookie}, max_size=None) as ws:

        async def writer() -> None:
            for message in sent:
                await ws.send(message)

        writing = asyncio.create_task(writer())
        got: list[str | bytes] = [await ws.recv() for _ in sent]
        await writing
    assert [m for m in got if isinstance(m, bytes)] == [m for m in sent if isinstance(m, bytes)]
    texts = [json.loads(m) for m in got if isinstance(m, str)]
    assert [t["text"] for t in texts] == [m for m in sent if isinstance(m, str)]
    assert [t["count"] for t in texts] == list(range(1, len(texts) + 1))
    # In order across both kinds: each reply is where its message was.
    assert [isinstance(m, bytes) for m in got] == [isinstance(m, bytes) for m in sent]


async def test_the_holders_accept_brings_its_subprotocol_and_headers_to_the_client(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "proto")
    heads = []
    for node in (a, b):  # direct, then relayed
        async with connect(
            ws_url(node, "/protocols"), additional_headers={"cookie": cookie},
            subprotocols=["chat.v1", "chat.v2"],
        ) as ws:
            assert ws.subprotocol == "chat.v2"
            assert ws.response is not None
            assert ws.response.headers["x-accepted-by"] == a.id
            assert json.loads(await ws.recv()) == {"worker": a.id}
            heads.append(sorted(name.lower() for name, _ in ws.response.headers.raw_items()))
    # The same header lines as a direct accept: the hop's handshake stays on the hop.
    assert heads[1] == heads[0]


async def test_the_holders_denial_response_reaches_the_client(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "denied")
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(b, "/deny"), additional_headers={"cookie": cookie}):
            pass
    response = refused.value.response
    assert response.status_code == 403
    assert response.headers["x-why"] == "policy"
    assert json.loads(response.body) == {"denied": True}


async def test_a_close_code_and_reason_from_the_app_reach_the_client(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "app-close")
    async with connect(ws_url(b), additional_headers={"cookie": cookie}) as ws:
        await ws.send("close:4000:the app is done")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert close_of(ws) == Close(4000, "the app is done")


async def test_a_close_code_and_reason_from_the_client_reach_the_app(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "client-close")
    async with connect(ws_url(b), additional_headers={"cookie": cookie}) as ws:
        await ws.send("n")
        await ws.recv()
        await ws.close(4001, "the client is done")
    await eventually(lambda: "client-close" in a.app.state.closes, 10, "the app sees the close")
    assert a.app.state.closes["client-close"] == (4001, "the client is done")
    await eventually(lambda: len(b.routing.relays) == 0, 10, "the relay ends")


async def test_a_client_that_drops_its_connection_closes_the_holders_side(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "dropped")
    ws = await connect(ws_url(b), additional_headers={"cookie": cookie})
    await ws.send("n")
    await ws.recv()
    ws.transport.abort()  # no close frame: the connection just ends
    await ws.wait_closed()
    await eventually(lambda: "dropped" in a.app.state.closes, 10, "the app sees the drop")
    code, _ = a.app.state.closes["dropped"]
    assert code in (1005, 1006)  # an end without a close frame, as a direct client's
    await eventually(lambda: len(b.routing.relays) == 0, 10, "the relay ends")


async def test_a_handshake_for_a_session_whose_worker_is_gone_is_refused_with_410(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "orphan")
    await cluster.kill(a)
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(b), additional_headers={"cookie": cookie}):
            pass
    assert refused.value.response.status_code == 410
    assert json.loads(refused.value.response.body)["code"] == "session_gone"
    assert b.routing.router.stats.refused["gone"] == 1


async def test_a_handshake_whose_holders_socket_is_missing_is_refused_with_410(
    cluster: Cluster,
) -> None:
    """Still in the live set, but its socket path is gone: known dead (SPEC 4.5)."""
    a, b = await two(cluster)
    cookie = await seed(a, "no-socket")
    assert a.routing.private is not None
    await a.routing.private.stop()
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(b), additional_headers={"cookie": cookie}):
            pass
    assert refused.value.response.status_code == 410


async def test_the_holder_sees_the_caller_and_no_hop_header(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "who")
    async with connect(
        ws_url(b, "/whoami?x=1"),
        additional_headers={"cookie": cookie, "x-tether-hop": "http 6.6.6.6 1 h 2 /evil"},
    ) as ws:
        seen = json.loads(await ws.recv())
        local = ws.local_address
    assert seen["worker"] == a.id
    assert seen["client"] == [local[0], local[1]]
    assert seen["scheme"] == "ws"
    assert (seen["path"], seen["query"]) == ("/whoami", "x=1")
    assert seen["host"] == b.url.removeprefix("http://")  # the client's own host header
    assert "x-tether-hop" not in seen["headers"]


async def test_a_worker_header_relays_a_handshake_that_names_no_session(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    async with connect(ws_url(b, "/whoami"), additional_headers={"x-tether-worker": a.id}) as ws:
        seen = json.loads(await ws.recv())
    assert seen["worker"] == a.id
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(b, "/whoami"), additional_headers={"x-tether-worker": "f" * 32}):
            pass
    assert refused.value.response.status_code == 410
    assert json.loads(refused.value.response.body)["code"] == "worker_gone"


async def test_a_stopping_worker_closes_its_relays_on_both_sides(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "stopping")
    async with connect(ws_url(b), additional_headers={"cookie": cookie}) as ws:
        await ws.send("n")
        await ws.recv()
        assert b.routing.relays is not None and len(b.routing.relays) == 1
        await b.routing.relays.close()
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert close_of(ws) == Close(1001, "the worker is stopping")
    await eventually(lambda: "stopping" in a.app.state.closes, 10, "the holder's side closes")
    assert a.app.state.closes["stopping"][0] == 1001
    assert len(b.routing.relays) == 0


async def test_a_holder_that_stops_closes_the_client_with_its_close(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "holder-stops")
    async with connect(ws_url(b), additional_headers={"cookie": cookie}) as ws:
        await ws.send("n")
        await ws.recv()
        assert a.routing.private is not None
        await a.routing.private.stop()  # uvicorn closes its WebSockets with 1012
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        closed = close_of(ws)
        assert closed is not None and closed.code == 1012


async def idle_reader(node: Node, path: str, cookie: str) -> asyncio.StreamWriter:
    """A WebSocket client that completes its handshake and then reads nothing, with a
    small receive buffer, so what it is sent stays with the servers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    host, port = node.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        f"GET {path} HTTP/1.1\r\nhost: t\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"cookie: {cookie}\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101"), head
    writer.transport.pause_reading()
    return writer


async def test_a_client_that_does_not_read_stops_the_holder_instead_of_filling_the_relay(
    cluster: Cluster,
) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "flood")
    assert b.routing.relays is not None
    relays = b.routing.relays
    writer = await idle_reader(b, "/flood", cookie)
    try:
        await eventually(lambda: a.app.state.sent.get("flood", 0) > 0, 10, "the flood starts")
        peak = 0
        seen: list[int] = []

        def stalled() -> bool:
            nonlocal peak
            peak = max(peak, relays.buffered())
            seen.append(a.app.state.sent["flood"])
            # the holder sent nothing more for ~0.5 s: everything on the way is full
            return len(seen) > 10 and seen[-1] == seen[-11]

        await eventually(stalled, 30, "the holder's send blocks", every=0.05)
        # Socket buffers on both hops, the relay's READ_LIMIT and a message or two: a few
        # MiB, where an unbounded relay would have taken the holder's whole output.
        assert seen[-1] < 16 << 20, seen[-1]
        assert 0 < peak <= READ_LIMIT + 2 * FLOOD_MESSAGE, peak
        assert len(relays) == 1
    finally:
        writer.transport.abort()
    await eventually(lambda: len(relays) == 0, 10, "the relay ends with its client")


async def test_a_slow_reader_gets_every_message_of_a_flood_in_order(cluster: Cluster) -> None:
    a, b = await two(cluster)
    cookie = await seed(a, "slow")
    total = 0
    async with connect(ws_url(b, "/flood"), additional_headers={"cookie": cookie},
                       max_size=None) as ws:
        while total < 16 << 20:
            message = await ws.recv()
            assert message == b"x" * FLOOD_MESSAGE
            total += len(message)


async def test_bad_ids_in_a_handshake_count_as_no_id_and_it_is_served_where_it_lands(
    cluster: Cluster,
) -> None:
    kind = SessionKind(header="x-session", query_param="sid", token_header=None)
    a = await cluster.add(websocket_app(kind))
    b = await cluster.add(websocket_app(kind))
    good = "g" * 256
    assert a.routing.claims is not None
    await a.routing.claims.claim(SessionId(good))
    bad_handshakes: list[tuple[str, dict[str, str]]] = [
        ("/whoami", {"x-session": "x" * 257}),  # oversize
        ("/whoami", {"x-session": "é"}),  # not printable ASCII
        ("/whoami?sid=" + "y" * 300, {}),
        ("/whoami?sid=%00%01", {}),
        ("/whoami?sid=", {}),
        ("/whoami", {"cookie": "session=forged.cookie.value"}),
    ]
    for path, headers in bad_handshakes:
        async with connect(ws_url(b, path), additional_headers=headers) as ws:
            seen = json.loads(await ws.recv())
        assert (seen["worker"], seen["session_id"]) == (b.id, None), (path, headers)
    # A good ID still goes to its holder.
    async with connect(ws_url(b, "/whoami"), additional_headers={"x-session": good}) as ws:
        seen = json.loads(await ws.recv())
    assert (seen["worker"], seen["session_id"]) == (a.id, good)


async def test_a_handshake_named_by_its_path_reaches_the_sessions_holder(
    cluster: Cluster,
) -> None:
    kind = SessionKind(paths=("/k/{session_id}",), token_header=None, mints=False)
    a = await cluster.add(websocket_app(kind))
    b = await cluster.add(websocket_app(kind))
    assert a.routing.claims is not None
    await a.routing.claims.claim(SessionId("k1"))
    async with connect(ws_url(b, "/k/k1/whoami")) as ws:
        seen = json.loads(await ws.recv())
    assert (seen["worker"], seen["session_id"]) == (a.id, "k1")


async def test_a_raw_handshake_with_control_bytes_in_its_id_header_does_not_crash(
    cluster: Cluster,
) -> None:
    """A header value uvicorn accepts but no client library would send."""
    kind = SessionKind(header="x-session", token_header=None)
    await cluster.add(websocket_app(kind))
    b = await cluster.add(websocket_app(kind))
    host, port = b.url.removeprefix("http://").split(":")
    for value in (b"\x7f\x7f", b"a\x01b", b"\xff" * 10, b"a" * 4000):
        head = (
            b"GET /whoami HTTP/1.1\r\nhost: t\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"x-session: " + value + b"\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head)
            status_line = await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()
            await writer.wait_closed()
        # Served where it landed (101), or refused by uvicorn itself (400): never a 5xx.
        assert status_line.split()[1] in (b"101", b"400"), (value, status_line)
    async with connect(ws_url(b, "/whoami")) as ws:
        assert json.loads(await ws.recv())["worker"] == b.id


async def test_a_single_worker_serves_websockets_itself(cluster: Cluster) -> None:
    node = await cluster.add(websocket_app(), single=True)
    cookie = await seed(node, "alone")
    async with connect(ws_url(node), additional_headers={"cookie": cookie}) as ws:
        await ws.send("n")
        assert json.loads(await ws.recv())["count"] == 1
