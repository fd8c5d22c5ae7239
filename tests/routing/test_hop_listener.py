"""The hop listener between hosts on real sockets: a `PrivateServer` on TCP 127.0.0.1 port
0 serves only requests signed for its worker; the forwarder and the relay reach it at
`tcp://127.0.0.1:PORT` and sign what they send. Nothing is mocked."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.routing.test_forward import BOUND, Recorder, direct_scope
from tether.routing.forward import ClaimantUnavailable, Forwarder
from tether.routing.hop import (
    HOP_HEADER,
    hop_value,
    signed_hop_value,
    take_hop,
    take_signature,
)
from tether.routing.hopsign import HopSigner, HopVerifier, sign
from tether.routing.private import PrivateServer
from tether.routing.relay import Relays
from tether.routing.types import WorkerId

SECRET = b"s" * 32
WORKER = WorkerId("a" * 32)
OTHER = WorkerId("b" * 32)
CHUNK = 64 * 1024
CALLER: dict[str, Any] = {
    "scheme": "https",
    "client": ("203.0.113.9", 4242),
    "server": ("198.51.100.1", 8443),
    "root_path": "/api",
}


class Holder:
    """The holder's side of the hop, as the router's private entry is: takes the hop
    header, then runs a small app; counts every request that reaches it."""

    def __init__(self) -> None:
        self.calls = 0
        self.app = Starlette(
            routes=[
                # Matched below the root path the caller's hop header restores.
                Route("/whoami", self.whoami),
                Route("/stream", self.stream),
                WebSocketRoute("/ws", self.echo),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        take_hop(scope)
        await self.app(scope, receive, send)

    async def whoami(self, request: Request) -> Response:
        scope = request.scope
        return JSONResponse(
            {
                "scheme": scope["scheme"],
                "client": scope["client"],
                "server": scope["server"],
                "root_path": scope["root_path"],
                "headers": [name.decode() for name, _ in scope["headers"]],
            }
        )

    async def stream(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for index in range(4):
                yield bytes([65 + index]) * CHUNK
                await asyncio.sleep(0.01)

        return StreamingResponse(chunks())

    async def echo(self, websocket: WebSocket) -> None:
        await websocket.accept()
        text = await websocket.receive_text()
        client = websocket.scope["client"]
        await websocket.send_text(json.dumps({"echo": text, "client": client}))
        await websocket.close(4001, "done")


@pytest.fixture
async def listener() -> AsyncIterator[tuple[Holder, PrivateServer]]:
    holder = Holder()
    private = PrivateServer.tcp(
        holder, "127.0.0.1", 0, HopVerifier(SECRET), WORKER, timeout_graceful_shutdown=2
    )
    await private.start()
    try:
        yield holder, private
    finally:
        await private.stop()


@pytest.fixture
async def forwarder() -> AsyncIterator[Forwarder]:
    forwarder = Forwarder(signer=HopSigner(SECRET))
    try:
        yield forwarder
    finally:
        await forwarder.close()


async def exchange(port: int, request: bytes) -> bytes:
    """Write `request` on a new connection and read the reply until the listener closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(BOUND):
            return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


async def raw(port: int, hop: bytes | None, path: bytes = b"/api/whoami") -> tuple[int, Any]:
    """One request on a new connection, the hop header (if any) last; status and body."""
    request = b"GET %s HTTP/1.1\r\nhost: holder\r\nconnection: close\r\n" % path
    if hop is not None:
        request += HOP_HEADER + b": " + hop + b"\r\n"
    head, _, body = (await exchange(port, request + b"\r\n")).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def signature(
    path: str = "/api/whoami", target: WorkerId = WORKER, secret: bytes = SECRET, age: float = 0
) -> str:
    return sign(secret, "GET", path, target, now=time.time() - age)


def with_caller(signature: str) -> bytes:
    return signed_hop_value(signature, hop_value(CALLER))


# 0. the header


@pytest.mark.parametrize(
    "caller",
    [CALLER, {**CALLER, "root_path": ""}, {"client": None, "server": None, "root_path": ""}],
)
def test_the_signature_comes_off_first_and_leaves_the_caller_for_take_hop(
    caller: dict[str, Any],
) -> None:
    value = signed_hop_value("1700000000.nonce.mac", hop_value(caller))
    # websockets' parser strips the trailing space of an empty root path from a handshake's.
    for sent in (value, value.removesuffix(b" ")):
        scope: dict[str, Any] = {"headers": [(b"host", b"h"), (HOP_HEADER, sent)]}

        assert take_signature(scope) == "1700000000.nonce.mac"
        take_hop(scope)

        assert scope == {"scheme": "http", **caller, "headers": [(b"host", b"h")]}


def test_a_signature_alone_leaves_no_caller_and_take_hop_takes_only_its_header() -> None:
    scope: dict[str, Any] = {"headers": [(HOP_HEADER, b"forged"), (HOP_HEADER, b"1.n.mac")]}

    assert take_signature(scope) == "1.n.mac"
    take_hop(scope)

    assert scope == {"headers": [(HOP_HEADER, b"forged")]}  # the router strips the rest
    assert take_signature({"headers": [(b"host", b"h")]}) is None


# 1. what the listener refuses


INVALID: dict[str, tuple[Callable[[], bytes | None], str]] = {
    "none": (lambda: None, "missing"),
    "unsigned": (lambda: hop_value(CALLER), "malformed"),  # a same-host hop header
    "wrong-secret": (lambda: with_caller(signature(secret=b"z" * 32)), "bad signature"),
    "other-worker": (lambda: with_caller(signature(target=OTHER)), "bad signature"),
    "other-path": (lambda: with_caller(signature(path="/api/other")), "bad signature"),
    # The time is whole seconds: these are 31 to 32 s old, and 31 to 32 s ahead.
    "old": (lambda: with_caller(signature(age=31)), "too old"),
    "future": (lambda: with_caller(signature(age=-32)), "from the future"),
    "malformed": (lambda: b"1700000000.nonce.cafe " + hop_value(CALLER), "malformed"),
}


@pytest.mark.parametrize("case", list(INVALID))
async def test_a_request_without_a_valid_signature_for_this_worker_gets_401_not_the_app(
    listener: tuple[Holder, PrivateServer], case: str
) -> None:
    holder, private = listener
    make, reason = INVALID[case]

    status, body = await raw(private.port, make())

    assert (status, body) == (401, {"code": "hop_unauthorized", "detail": reason})
    assert holder.calls == 0


async def test_a_signed_request_is_served_once_and_its_replay_gets_401(
    listener: tuple[Holder, PrivateServer],
) -> None:
    holder, private = listener
    hop = with_caller(signature())

    status, first = await raw(private.port, hop)
    replay = await raw(private.port, hop)

    assert status == 200
    assert first["client"] == list(CALLER["client"])
    assert replay == (401, {"code": "hop_unauthorized", "detail": "replayed"})
    assert holder.calls == 1


async def test_a_signature_in_a_hop_header_that_is_not_the_last_header_is_missing(
    listener: tuple[Holder, PrivateServer],
) -> None:
    holder, private = listener

    reply = await exchange(
        private.port,
        b"GET /api/whoami HTTP/1.1\r\nhost: holder\r\n"
        + HOP_HEADER + b": " + with_caller(signature())
        + b"\r\nconnection: close\r\n\r\n",
    )

    assert reply.startswith(b"HTTP/1.1 401 ")
    assert reply.endswith(b'{"code":"hop_unauthorized","detail":"missing"}')
    assert holder.calls == 0


async def test_a_valid_signature_over_the_nonce_cap_gets_503_with_retry_after() -> None:
    holder = Holder()
    private = PrivateServer.tcp(
        holder, "127.0.0.1", 0, HopVerifier(SECRET, max_nonces=1), WORKER
    )
    await private.start()
    try:
        assert (await raw(private.port, with_caller(signature())))[0] == 200
        reply = await exchange(
            private.port,
            b"GET /api/whoami HTTP/1.1\r\nhost: holder\r\nconnection: close\r\n"
            + HOP_HEADER + b": " + with_caller(signature()) + b"\r\n\r\n",
        )
    finally:
        await private.stop()

    assert reply.startswith(b"HTTP/1.1 503 ")
    assert b"\r\nretry-after: 1\r\n" in reply
    assert reply.endswith(b'{"code":"claimant_unavailable","detail":"nonce memory full"}')
    assert holder.calls == 1


async def test_a_websocket_handshake_without_a_signature_is_refused_401(
    listener: tuple[Holder, PrivateServer],
) -> None:
    holder, private = listener

    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://127.0.0.1:{private.port}/ws"):
            pass

    response = refused.value.response
    assert response.status_code == 401
    assert json.loads(response.body or b"") == {"code": "hop_unauthorized", "detail": "missing"}
    assert holder.calls == 0


# 2. the listener itself


async def test_the_listener_binds_port_0_and_says_where_it_listens(
    listener: tuple[Holder, PrivateServer],
) -> None:
    private = listener[1]

    assert private.port != 0
    assert private.address == f"tcp://127.0.0.1:{private.port}"
    assert private.path == ""


async def test_a_stopped_listener_can_bind_its_port_again_at_once() -> None:
    holder = Holder()
    private = PrivateServer.tcp(holder, "127.0.0.1", 0, HopVerifier(SECRET), WORKER)
    await private.start()
    try:
        # The listener closes the connection first, so its side waits in TIME_WAIT.
        assert (await raw(private.port, with_caller(signature())))[0] == 200
        port = private.port
        await private.stop()
        await private.start()  # SO_REUSEADDR: the same port, despite TIME_WAIT

        assert private.port == port
        assert (await raw(private.port, with_caller(signature())))[0] == 200
    finally:
        await private.stop()


# 3. the forwarder reaching it


async def test_a_signed_forward_to_a_tcp_address_is_served_with_its_caller_restored(
    listener: tuple[Holder, PrivateServer], forwarder: Forwarder
) -> None:
    holder, private = listener
    io = Recorder()

    await forwarder.forward(
        private.address, direct_scope("/api/whoami"), io.receive, io.send,
        hop=hop_value(CALLER), target=WORKER,
    )

    assert io.status == 200
    seen = json.loads(io.body_bytes)
    assert seen["scheme"] == "https"
    assert seen["client"] == list(CALLER["client"])
    assert seen["server"] == list(CALLER["server"])
    assert seen["root_path"] == "/api"
    assert HOP_HEADER.decode() not in seen["headers"]
    assert holder.calls == 1


async def test_a_streamed_reply_over_tcp_arrives_intact_chunk_by_chunk(
    listener: tuple[Holder, PrivateServer], forwarder: Forwarder
) -> None:
    io = Recorder()

    await forwarder.forward(
        listener[1].address, direct_scope("/api/stream"), io.receive, io.send,
        hop=hop_value(CALLER), target=WORKER,
    )

    expected = b"".join(bytes([65 + index]) * CHUNK for index in range(4))
    assert io.status == 200
    assert all(name != b"content-length" for name, _ in io.sent[0]["headers"])
    assert len(io.sent) > 4  # the head, then the chunks as they came
    assert hashlib.sha256(io.body_bytes).digest() == hashlib.sha256(expected).digest()


async def test_sequential_forwards_share_one_connection_each_signed_afresh(
    listener: tuple[Holder, PrivateServer], forwarder: Forwarder
) -> None:
    holder, private = listener
    for _ in range(3):
        io = Recorder()
        await forwarder.forward(
            private.address, direct_scope("/api/whoami"), io.receive, io.send,
            hop=hop_value(CALLER), target=WORKER,
        )
        assert io.status == 200

    assert private.connections_accepted == 1
    assert holder.calls == 3


async def test_both_ends_of_a_tcp_hop_set_tcp_nodelay(
    listener: tuple[Holder, PrivateServer], forwarder: Forwarder
) -> None:
    """Without it a reply's head and body, written apart, wait for a delayed ACK."""
    private = listener[1]
    io = Recorder()
    await forwarder.forward(
        private.address, direct_scope("/api/whoami"), io.receive, io.send,
        hop=hop_value(CALLER), target=WORKER,
    )
    assert io.status == 200

    assert private._server is not None
    (served,) = private._server.server_state.connections
    (pooled,) = forwarder._pools[private.address]
    for transport in (served.transport, pooled.transport):
        sock = transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_a_forward_signed_for_another_worker_gets_the_listeners_401(
    listener: tuple[Holder, PrivateServer], forwarder: Forwarder
) -> None:
    holder, private = listener
    io = Recorder()

    await forwarder.forward(
        private.address, direct_scope("/api/whoami"), io.receive, io.send,
        hop=hop_value(CALLER), target=OTHER,
    )

    assert io.status == 401
    assert json.loads(io.body_bytes)["code"] == "hop_unauthorized"
    assert holder.calls == 0


async def test_a_retried_request_is_signed_with_a_fresh_nonce(forwarder: Forwarder) -> None:
    """The first connection answers one request, then closes on the second unanswered."""
    hops: list[str] = []
    accepted = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        first_connection = accepted == 1
        try:
            for answered in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                hops.append(head.split(HOP_HEADER + b": ")[1].split(b"\r\n")[0].decode())
                if first_connection and answered == 1:
                    return  # close before the reply's first byte
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        for _ in range(2):
            io = Recorder()
            await forwarder.forward(
                address, direct_scope("/api/whoami"), io.receive, io.send,
                hop=hop_value(CALLER), target=WORKER,
            )
            assert (io.status, io.body_bytes) == (200, b"ok")
        await forwarder.close()
    finally:
        server.close()
        await server.wait_closed()

    check = HopVerifier(SECRET)
    signatures = [hop.split(" ", 1)[0] for hop in hops]
    assert len(set(signatures)) == 3
    for value in signatures:
        assert check.check(value, "GET", "/api/whoami", WORKER) is None


async def test_a_refused_tcp_connection_is_claimant_unavailable_not_gone(
    forwarder: Forwarder,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed: nobody listens there now
    io = Recorder()

    with pytest.raises(ClaimantUnavailable, match="refused"):
        await forwarder.forward(
            f"tcp://127.0.0.1:{port}", direct_scope(), io.receive, io.send, target=WORKER
        )

    assert io.sent == []


async def test_a_tcp_connection_that_is_never_answered_is_claimant_unavailable_in_time(
) -> None:
    """A host that takes no new connection (its accept queue full, as a blackholed or
    wedged host: the kernel drops the SYN) is `claimant_unavailable` once the connect
    timeout runs out, not a wait without end, and nothing was sent."""
    forwarder = Forwarder(signer=HopSigner(SECRET), connect_timeout=0.5)
    with socket.socket() as full, socket.socket() as queued:
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # one connection waits to be accepted; none ever is
        queued.connect(full.getsockname())
        io = Recorder()
        started = time.monotonic()
        try:
            with pytest.raises(ClaimantUnavailable, match="TimeoutError"):
                await forwarder.forward(
                    f"tcp://127.0.0.1:{full.getsockname()[1]}", direct_scope(), io.receive,
                    io.send, target=WORKER,
                )
        finally:
            await forwarder.close()
    waited = time.monotonic() - started
    assert 0.4 < waited < 0.5 + BOUND, waited
    assert io.sent == []


async def test_a_tcp_address_without_a_signer_or_target_is_a_programming_error(
    forwarder: Forwarder,
) -> None:
    io = Recorder()
    with pytest.raises(ValueError, match="signer"):
        await forwarder.forward("tcp://127.0.0.1:1", direct_scope(), io.receive, io.send)
    unsigned = Forwarder()
    try:
        with pytest.raises(ValueError, match="signer"):
            await unsigned.forward(
                "tcp://127.0.0.1:1", direct_scope(), io.receive, io.send, target=WORKER
            )
    finally:
        await unsigned.close()
    with pytest.raises(ValueError, match="tcp://host:port"):
        await forwarder.forward(
            "tcp://127.0.0.1", direct_scope(), io.receive, io.send, target=WORKER
        )
    assert io.sent == []


# 4. the WebSocket relay reaching it


async def serve(app: Any) -> tuple[uvicorn.Server, socket.socket, str]:
    """A public server for `app` on 127.0.0.1 port 0, WebSockets included."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, http="httptools", ws="websockets-sansio",
        interface="asgi3", timeout_graceful_shutdown=2,
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    return server, sock, f"ws://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def relaying(
    listener: tuple[Holder, PrivateServer],
) -> AsyncIterator[tuple[str, Relays]]:
    """The receiving worker: relays every WebSocket to the listener, signed for WORKER
    with `relays.signer`."""
    relays = Relays(signer=HopSigner(SECRET))
    address = listener[1].address

    async def front(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "websocket"
        await relays.relay(address, scope, receive, send, hop_value(scope), target=WORKER)

    server, sock, url = await serve(front)
    try:
        yield url, relays
    finally:
        await relays.close()
        await server.shutdown(sockets=[sock])


async def test_the_relay_reaches_a_tcp_holder_with_a_signed_handshake(
    listener: tuple[Holder, PrivateServer], relaying: tuple[str, Relays]
) -> None:
    holder = listener[0]
    url, relays = relaying

    async with connect(f"{url}/ws") as ws:
        await ws.send("hello")
        reply = json.loads(await ws.recv())
        caller = list(ws.local_address[:2])
        await ws.wait_closed()

    assert reply == {"echo": "hello", "client": caller}  # the caller, not the relay's socket
    assert ws.protocol.close_rcvd is not None
    assert (ws.protocol.close_rcvd.code, ws.protocol.close_rcvd.reason) == (4001, "done")
    assert holder.calls == 1
    assert relays.opened == 1


async def test_a_relay_signing_with_another_secret_gets_the_listeners_401(
    listener: tuple[Holder, PrivateServer], relaying: tuple[str, Relays]
) -> None:
    holder = listener[0]
    url, relays = relaying
    relays.signer = HopSigner(b"z" * 32)

    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"{url}/ws"):
            pass

    response = refused.value.response
    assert response.status_code == 401
    assert json.loads(response.body or b"") == {
        "code": "hop_unauthorized", "detail": "bad signature",
    }
    assert holder.calls == 0


async def test_a_websocket_on_the_hop_listener_whose_relay_answers_no_ping_is_closed_1011() -> None:
    """A relaying host cut off without a reset answers no ping: the holder's listener
    closes the WebSocket (1011) and its app learns the client left, instead of holding
    it open forever."""
    holder = Holder()
    private = PrivateServer.tcp(
        holder, "127.0.0.1", 0, HopVerifier(SECRET), WORKER, timeout_graceful_shutdown=2,
        ws_ping=(0.2, 0.5),
    )
    await private.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", private.port)
    try:
        hop = signed_hop_value(signature("/ws"), None)
        writer.write(
            b"GET /ws HTTP/1.1\r\nhost: holder\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
            + HOP_HEADER + b": " + hop + b"\r\n\r\n"
        )
        async with asyncio.timeout(BOUND):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        # Read (and never answer) until the listener gives up on this connection.
        received = b""
        async with asyncio.timeout(BOUND):
            while chunk := await reader.read(65536):
                received += chunk
    finally:
        writer.close()
        await private.stop()
    close = b"\x88" + bytes([2 + len(b"keepalive ping timeout")]) + (1011).to_bytes(2, "big")
    assert close in received, received
    assert b"\x89" in received  # (it pinged first)
    assert holder.calls == 1
