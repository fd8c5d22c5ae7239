"""Forwarding over real sockets.

A claimant Starlette app runs on a `PrivateServer` in a short temp dir; a front ASGI app
that calls `Forwarder.forward` runs on a real uvicorn bound to 127.0.0.1 port 0; httpx is
the client. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from tether.routing.errors import TetherError, send_error
from tether.routing.forward import HOP_BY_HOP, ClaimantGone, ClaimantUnavailable, Forwarder
from tether.routing.private import PrivateServer

BOUND = 10.0  # seconds any coordinated wait may take before the test fails


class Claimant:
    """The app behind the private socket, with events the tests coordinate on."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.first_sent = asyncio.Event()
        self.streams_open = 0
        self.streams_wanted = 0
        self.all_open = asyncio.Event()
        self.app = Starlette(
            routes=[
                Route("/echo/{rest:path}", self.echo, methods=["GET", "POST", "PUT", "HEAD"]),
                Route("/stream", self.stream),
                Route("/cookies", self.cookies),
                Route("/long", self.long),
                Route("/slow", self.slow),
                Route("/hang", self.hang),
                Route("/early", self.early, methods=["POST"]),
                Route("/digest", _Digest(), methods=["POST"]),
            ]
        )

    async def echo(self, request: Request) -> Response:
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "raw_path": request.scope["raw_path"].decode("latin-1"),
                "query_string": request.scope["query_string"].decode("latin-1"),
                "headers": [
                    [name.decode("latin-1"), value.decode("latin-1")]
                    for name, value in request.headers.raw
                ],
                "body_length": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            }
        )

    async def stream(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            self.first_sent.set()
            await self.release.wait()
            yield b"last"

        return StreamingResponse(chunks())

    async def cookies(self, request: Request) -> Response:
        response = PlainTextResponse("ok")
        response.set_cookie("a", "1")
        response.set_cookie("b", "2")
        return response

    async def long(self, request: Request) -> Response:
        """Opens, waits until every wanted stream is open, then streams for about 2 s."""

        async def chunks() -> AsyncIterator[bytes]:
            self.streams_open += 1
            if self.streams_open >= self.streams_wanted:
                self.all_open.set()
            yield b"open;"
            await self.all_open.wait()
            for _ in range(4):
                await asyncio.sleep(0.5)
                yield b"tick;"

        return StreamingResponse(chunks())

    async def slow(self, request: Request) -> Response:
        gap = float(request.query_params["gap"])

        async def chunks() -> AsyncIterator[bytes]:
            for index in range(3):
                yield b"%d;" % index
                await asyncio.sleep(gap)
            yield b"end"

        return StreamingResponse(chunks())

    async def early(self, request: Request) -> Response:
        return PlainTextResponse("too large", status_code=413)

    async def hang(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                yield b"first"
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()

        return StreamingResponse(chunks())


class _Digest:
    """Starts its reply at once, then reads the whole body and ends the reply with its
    length and SHA-256: a streaming processor, which reads on while it replies."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"reading;", "more_body": True})
        digest, size, more = hashlib.sha256(), 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            digest.update(chunk)
            size += len(chunk)
            more = message.get("more_body", False)
        summary = b"%d %s" % (size, digest.hexdigest().encode())
        await send({"type": "http.response.body", "body": summary})


class Front:
    """The receiving worker's side: forwards every request and records what it saw."""

    def __init__(self, forwarder: Forwarder, socket_path: str) -> None:
        self.forwarder = forwarder
        self.socket_path = socket_path
        self.read_body_first = False
        self.scopes: list[Scope] = []
        self.sent: list[Message] = []
        self.outcomes: list[str] = []  # how each forward call ended
        self.url = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        self.scopes.append(scope)

        async def recording_send(message: Message) -> None:
            self.sent.append(message)
            await send(message)

        body: bytes | None = None
        if self.read_body_first:
            chunks = []
            more = True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            body = b"".join(chunks)
        try:
            await self.forwarder.forward(self.socket_path, scope, receive, recording_send, body)
        except ClaimantGone:
            self.outcomes.append("gone")
            await send_error(send, TetherError("session_gone"))
        except ClaimantUnavailable:
            self.outcomes.append("unavailable")
            await send_error(send, TetherError("claimant_unavailable"))
        except BaseException as exc:
            self.outcomes.append(repr(exc))
            raise
        else:
            self.outcomes.append("returned")


@pytest.fixture
async def claimant(short_tmp: Path) -> AsyncIterator[tuple[Claimant, PrivateServer]]:
    state = Claimant()
    # A bounded shutdown, so a failing test cannot hang in teardown.
    private = PrivateServer(state.app, str(short_tmp / "w.sock"), timeout_graceful_shutdown=2)
    await private.start()
    try:
        yield state, private
    finally:
        await private.stop()


@pytest.fixture
async def forwarder() -> AsyncIterator[Forwarder]:
    forwarder = Forwarder()
    try:
        yield forwarder
    finally:
        await forwarder.close()


async def serve_front(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    sock.setblocking(False)
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        http="httptools",
        ws="none",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_until(lambda: server.started or task.done())
    assert server.started
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def stop_front(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    await task


@pytest.fixture
async def front(
    claimant: tuple[Claimant, PrivateServer], forwarder: Forwarder
) -> AsyncIterator[Front]:
    front = Front(forwarder, claimant[1].path)
    server, task, front.url = await serve_front(front)
    try:
        yield front
    finally:
        await forwarder.close()  # pooled connections first, so the claimant stops at once
        await stop_front(server, task)


@pytest.fixture
async def client(front: Front) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=front.url, timeout=30.0, limits=limits) as client:
        yield client


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll a condition with a bound (uvicorn's Server has no startup event to wait on)."""
    async with asyncio.timeout(BOUND):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def forwarded_headers(headers: list[tuple[bytes, bytes]]) -> list[list[str]]:
    return [
        [n.decode("latin-1"), v.decode("latin-1")]
        for n, v in headers
        if n not in HOP_BY_HOP and n != b"expect"
    ]


def direct_scope(path: str = "/echo/x", method: str = "GET") -> Scope:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"claimant")],
    }


class Recorder:
    """A raw ASGI `receive`/`send` pair for calling `forward` directly."""

    def __init__(self, body: bytes = b"") -> None:
        self.body = body
        self.sent: list[Message] = []
        self._read = False
        self._done = asyncio.Event()

    async def receive(self) -> Message:
        if not self._read:
            self._read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._done.set()

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def body_bytes(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


# 1. the request arrives unchanged


@pytest.mark.parametrize("upload", ["content-length", "chunked", "read-by-the-caller"])
async def test_method_path_query_headers_and_a_9_mib_body_arrive_unchanged(
    front: Front, client: httpx.AsyncClient, upload: str
) -> None:
    body = hashlib.sha256(b"seed").digest() * (9 * 1024 * 1024 // 32)
    content: bytes | AsyncIterator[bytes] = body
    if upload == "chunked":

        async def pieces() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 300_000):
                yield body[start : start + 300_000]

        content = pieces()
    front.read_body_first = upload == "read-by-the-caller"
    headers = [
        ("x-repeat", "one"),
        ("x-repeat", "two"),
        ("cookie", "session=abc; other=d%2Fe"),
        ("x-case", "Mixed Value"),
    ]

    reply = await client.put("/echo/a%2Fb/c?a=1&a=2&b=%2F", content=content, headers=headers)

    assert reply.status_code == 200
    seen = reply.json()
    assert seen["method"] == "PUT"
    assert seen["raw_path"] == "/echo/a%2Fb/c"
    assert seen["query_string"] == "a=1&a=2&b=%2F"
    assert seen["body_length"] == len(body)
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
    received = front.scopes[-1]["headers"]
    if upload == "content-length":
        assert seen["headers"] == forwarded_headers(received)
    else:
        # The body's framing may change (chunked, or a content-length for a body in hand);
        # every other header arrives unchanged and in order.
        framing = {"content-length", "transfer-encoding"}
        assert [h for h in seen["headers"] if h[0] not in framing] == [
            h for h in forwarded_headers(received) if h[0] not in framing
        ]
    assert [h[1] for h in seen["headers"] if h[0] == "x-repeat"] == ["one", "two"]
    assert ["cookie", "session=abc; other=d%2Fe"] in seen["headers"]


async def test_hop_by_hop_headers_are_not_forwarded(client: httpx.AsyncClient) -> None:
    reply = await client.get(
        "/echo/x",
        headers={"connection": "keep-alive, x-private", "x-private": "1", "te": "trailers"},
    )

    names = [name for name, _ in reply.json()["headers"]]
    assert not {"connection", "te", "x-private", "keep-alive"} & set(names)
    assert "host" in names


async def test_a_head_request_gets_headers_only_and_keeps_the_connection(
    claimant: tuple[Claimant, PrivateServer], client: httpx.AsyncClient
) -> None:
    head = await client.head("/echo/x")
    get = await client.get("/echo/x")

    assert head.status_code == 200
    assert head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert get.json()["method"] == "GET"
    assert claimant[1].connections_accepted == 1


async def test_a_claimant_that_answers_before_reading_the_body_is_passed_on(
    front: Front, client: httpx.AsyncClient
) -> None:
    reply = await client.post("/early", content=b"x" * (9 * 1024 * 1024))
    again = await client.get("/echo/x")

    assert reply.status_code == 413
    assert reply.text == "too large"
    assert again.status_code == 200
    assert front.outcomes == ["returned", "returned"]


@pytest.mark.parametrize("upload", ["content-length", "chunked"])
async def test_a_claimant_that_replies_while_it_reads_the_body_gets_all_of_it(
    front: Front, client: httpx.AsyncClient, upload: str
) -> None:
    """HTTP/1.1 lets a server begin its reply before the request's body ended and read
    on: the rest of the body goes on beside the reply (it once stopped at the reply's
    first byte, and both sides waited for ever)."""
    body = os.urandom(2 * 1024 * 1024)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]
            await asyncio.sleep(0)

    content: Any = body if upload == "content-length" else chunks()
    reply = await asyncio.wait_for(client.post("/digest", content=content), BOUND)
    again = await client.get("/echo/x")

    assert reply.status_code == 200
    assert reply.text == f"reading;{len(body)} {hashlib.sha256(body).hexdigest()}"
    assert again.status_code == 200
    assert front.outcomes == ["returned", "returned"]


# 2. a streaming reply stays streaming


async def test_a_streaming_reply_arrives_chunk_by_chunk(
    claimant: tuple[Claimant, PrivateServer], front: Front, client: httpx.AsyncClient
) -> None:
    state = claimant[0]
    async with client.stream("GET", "/stream") as reply:
        chunks = reply.aiter_raw()
        first = await anext(chunks)
        # The claimant has not produced its last chunk yet: it waits for this event.
        assert not state.release.is_set()
        state.release.set()
        rest = b"".join([chunk async for chunk in chunks])

    assert first == b"first"
    assert rest == b"last"
    bodies = [m["body"] for m in front.sent if m["type"] == "http.response.body" and m["body"]]
    assert bodies == [b"first", b"last"]
    assert front.sent[-1]["more_body"] is False


# 3. reply headers


async def test_only_the_claimants_set_cookies_and_one_date_and_server_header_come_back(
    claimant: tuple[Claimant, PrivateServer], client: httpx.AsyncClient
) -> None:
    reply = await client.get("/cookies")

    assert reply.headers.get_list("set-cookie") == [
        "a=1; Path=/; SameSite=lax",
        "b=2; Path=/; SameSite=lax",
    ]
    names = [name.lower() for name, _ in reply.headers.raw]
    assert names.count(b"date") == 1
    assert names.count(b"server") == 1
    assert reply.text == "ok"


async def test_the_private_server_adds_no_date_or_server_header(
    claimant: tuple[Claimant, PrivateServer],
) -> None:
    transport = httpx.AsyncHTTPTransport(uds=claimant[1].path)
    async with httpx.AsyncClient(transport=transport, base_url="http://claimant") as direct:
        reply = await direct.get("/cookies")

    names = {name.lower() for name, _ in reply.headers.raw}
    assert b"date" not in names
    assert b"server" not in names
    assert len(reply.headers.get_list("set-cookie")) == 2


# 4. and 5. long streams


async def test_150_concurrent_long_streams_to_one_claimant_all_complete(
    claimant: tuple[Claimant, PrivateServer], client: httpx.AsyncClient
) -> None:
    state, private = claimant
    state.streams_wanted = 150

    async def one() -> bytes:
        reply = await client.get("/long")
        return reply.content

    bodies = await asyncio.gather(*(one() for _ in range(150)))

    assert bodies == [b"open;" + b"tick;" * 4] * 150
    assert private.connections_accepted >= 150


async def test_a_stream_outlasting_every_client_timeout_survives(
    claimant: tuple[Claimant, PrivateServer],
) -> None:
    # Gaps of 2 s between chunks, against a forwarder whose only timeouts are 1 s: neither
    # may act as a read timeout.
    forwarder = Forwarder(connect_timeout=1.0, idle_timeout=1.0)
    front = Front(forwarder, claimant[1].path)
    server, task, front.url = await serve_front(front)
    try:
        async with httpx.AsyncClient(base_url=front.url, timeout=None) as client:
            reply = await client.get("/slow", params={"gap": "2"})
    finally:
        await forwarder.close()
        await stop_front(server, task)

    assert reply.status_code == 200
    assert reply.content == b"0;1;2;end"


# 6. a client that leaves cancels the forwarded request


async def test_a_client_that_disconnects_mid_stream_cancels_the_claimants_handler(
    claimant: tuple[Claimant, PrivateServer], front: Front, client: httpx.AsyncClient
) -> None:
    state = claimant[0]
    async with client.stream("GET", "/hang") as reply:
        assert await anext(reply.aiter_raw()) == b"first"
    # Leaving the block closes the unfinished response's connection.

    async with asyncio.timeout(BOUND):
        await state.cancelled.wait()
    await wait_until(lambda: bool(front.outcomes))
    assert front.outcomes == ["returned"]  # a disconnect is not an error


# 7. a dead claimant


async def test_a_missing_socket_path_is_claimant_gone_before_anything_is_sent(
    short_tmp: Path, forwarder: Forwarder
) -> None:
    io = Recorder()

    with pytest.raises(ClaimantGone):
        await forwarder.forward(str(short_tmp / "nobody.sock"), direct_scope(), io.receive, io.send)

    assert io.sent == []


async def test_a_socket_file_without_a_listener_is_claimant_gone_before_anything_is_sent(
    short_tmp: Path, forwarder: Forwarder
) -> None:
    path = str(short_tmp / "dead.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
    assert os.listdir(short_tmp) == ["dead.sock"]
    io = Recorder()

    with pytest.raises(ClaimantGone):
        await forwarder.forward(path, direct_scope(), io.receive, io.send)

    assert io.sent == []


async def test_a_fresh_connection_closed_before_any_reply_byte_is_claimant_unavailable(
    short_tmp: Path, forwarder: Forwarder
) -> None:
    async def close_after_the_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await writer.wait_closed()

    path = str(short_tmp / "rude.sock")
    server = await asyncio.start_unix_server(close_after_the_request, path)
    io = Recorder()
    try:
        with pytest.raises(ClaimantUnavailable):
            await forwarder.forward(path, direct_scope(), io.receive, io.send)
    finally:
        server.close()
        await server.wait_closed()

    assert io.sent == []


async def test_a_claimant_set_gone_ends_the_request_waiting_on_it_and_takes_no_more(
    short_tmp: Path, forwarder: Forwarder
) -> None:
    heard = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        heard.set()
        await reader.read()  # never answers (a paused host); until the forwarder leaves
        writer.close()
        await writer.wait_closed()

    path = str(short_tmp / "silent.sock")
    server = await asyncio.start_unix_server(silent, path)
    io = Recorder()
    try:
        waiting = asyncio.create_task(forwarder.forward(path, direct_scope(), io.receive, io.send))
        await asyncio.wait_for(heard.wait(), BOUND)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        forwarder.set_gone([path])
        with pytest.raises(ClaimantGone):
            await asyncio.wait_for(waiting, BOUND)
        later = Recorder()
        with pytest.raises(ClaimantGone):
            await forwarder.forward(path, direct_scope(), later.receive, later.send)
        assert later.sent == []
    finally:
        server.close()
        await server.wait_closed()

    assert io.sent == []


# 8. keep-alive


async def test_sequential_forwards_reuse_one_connection(
    claimant: tuple[Claimant, PrivateServer], forwarder: Forwarder
) -> None:
    private = claimant[1]
    for _ in range(3):
        io = Recorder(b"payload")
        await forwarder.forward(private.path, direct_scope(method="POST"), io.receive, io.send)
        assert io.status == 200
        assert json.loads(io.body_bytes)["body_length"] == 7

    assert private.connections_accepted == 1
    assert forwarder.forwarded == 3


async def test_a_pooled_connection_closed_by_the_claimant_is_retried_once_transparently(
    short_tmp: Path, forwarder: Forwarder
) -> None:
    """The first connection answers one request, then closes on the second unanswered."""
    accepted = 0
    requests = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted, requests
        accepted += 1
        first_connection = accepted == 1
        try:
            for answered in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                requests += 1
                if first_connection and answered == 1:
                    return  # close before the reply's first byte
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()
            await writer.wait_closed()

    path = str(short_tmp / "flaky.sock")
    server = await asyncio.start_unix_server(serve, path)
    try:
        for _ in range(2):
            io = Recorder(b"body")
            await forwarder.forward(path, direct_scope(method="POST"), io.receive, io.send)
            assert (io.status, io.body_bytes) == (200, b"ok")
        await forwarder.close()
    finally:
        server.close()
        await server.wait_closed()

    assert accepted == 2
    assert requests == 3


async def test_a_fresh_forward_takes_a_new_connection_though_one_is_pooled(
    claimant: tuple[Claimant, PrivateServer], forwarder: Forwarder
) -> None:
    """What the passthrough resends after its kept link closed unanswered is SPEC 4.5's
    one retry: on a new connection, not on another kept one that may be as stale."""
    private = claimant[1]
    for fresh in (False, True):
        io = Recorder()
        await forwarder.forward(
            private.path, direct_scope(), io.receive, io.send, fresh=fresh
        )
        assert io.status == 200
    assert private.connections_accepted == 2


async def test_a_pooled_connection_to_a_restarted_claimant_is_discarded(
    claimant: tuple[Claimant, PrivateServer], forwarder: Forwarder
) -> None:
    private = claimant[1]
    io = Recorder()
    await forwarder.forward(private.path, direct_scope(), io.receive, io.send)
    await private.stop()  # closes the idle pooled connection from the server side
    await private.start()

    io = Recorder()
    await forwarder.forward(private.path, direct_scope(), io.receive, io.send)

    assert io.status == 200
    assert private.connections_accepted == 2


async def test_a_connection_idle_longer_than_the_idle_timeout_is_not_reused(
    claimant: tuple[Claimant, PrivateServer],
) -> None:
    private = claimant[1]
    forwarder = Forwarder(idle_timeout=0.0)
    try:
        for _ in range(2):
            io = Recorder()
            await forwarder.forward(private.path, direct_scope(), io.receive, io.send)
            assert io.status == 200
    finally:
        await forwarder.close()

    assert private.connections_accepted == 2


async def test_discard_drops_the_pool_of_a_claimant(
    claimant: tuple[Claimant, PrivateServer], forwarder: Forwarder
) -> None:
    private = claimant[1]
    for _ in range(2):
        io = Recorder()
        await forwarder.forward(private.path, direct_scope(), io.receive, io.send)
        forwarder.discard(private.path)

    assert private.connections_accepted == 2


# 9. the private server is quiet


async def test_the_private_server_writes_no_access_log_and_leaves_uvicorns_loggers_alone(
    short_tmp: Path,
) -> None:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    names = ["uvicorn", "uvicorn.access", "uvicorn.error"]

    def snapshot() -> list[tuple[Any, ...]]:
        loggers = [logging.getLogger(name) for name in names]
        return [(list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]

    # Configured as a worker's own uvicorn configures it, so any access line would show.
    access = logging.getLogger("uvicorn.access")
    handler = Collect()
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        before = snapshot()
        state = Claimant()
        private = PrivateServer(state.app, str(short_tmp / "q.sock"))
        await private.start()
        try:
            transport = httpx.AsyncHTTPTransport(uds=private.path)
            async with httpx.AsyncClient(transport=transport, base_url="http://c") as direct:
                assert (await direct.get("/echo/x")).status_code == 200
            assert snapshot() == before
        finally:
            await private.stop()
        assert snapshot() == before
    finally:
        access.removeHandler(handler)
        access.setLevel(level)

    assert records == []
    assert os.listdir(short_tmp) == []


async def test_the_private_socket_file_is_private(
    claimant: tuple[Claimant, PrivateServer],
) -> None:
    assert os.stat(claimant[1].path).st_mode & 0o777 == 0o600


async def test_a_bound_method_app_is_served_as_asgi3(short_tmp: Path) -> None:
    class Entry:
        async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    private = PrivateServer(Entry().serve, str(short_tmp / "m.sock"))
    await private.start()
    try:
        transport = httpx.AsyncHTTPTransport(uds=private.path)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as direct:
            assert (await direct.get("/")).status_code == 204
    finally:
        await private.stop()


async def test_start_on_a_path_in_use_fails_and_leaves_the_other_socket_alone(
    claimant: tuple[Claimant, PrivateServer],
) -> None:
    other = PrivateServer(claimant[0].app, claimant[1].path)

    with pytest.raises(OSError, match="in use"):
        await other.start()

    assert os.stat(claimant[1].path).st_mode & 0o777 == 0o600
    io = Recorder()
    async with asyncio.timeout(BOUND):
        forwarder = Forwarder()
        try:
            await forwarder.forward(claimant[1].path, direct_scope(), io.receive, io.send)
        finally:
            await forwarder.close()
    assert io.status == 200
