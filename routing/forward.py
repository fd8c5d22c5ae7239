"""The forwarding hop: a lean HTTP/1.1 passthrough client over Unix sockets or TCP.

A worker that receives a request for a session another worker holds hands the raw ASGI
scope, `receive` and `send` to `Forwarder.forward`, which writes the request to the
claimant's private socket unchanged (less hop-by-hop headers) and moves the reply back
as raw ASGI messages, chunk by chunk. It parses with httptools on an `asyncio.Protocol`:
no Starlette `Request`, no aiohttp, since this runs on every forwarded request.

A claimant's address is its Unix socket's path (a worker of this host) or
`tcp://host:port`, the hop listener of a worker of another host (SPEC 12), which serves
only requests signed for it: there the hop header starts with a fresh signature
(hopsign.py, made by the forwarder's `signer`), and TCP_NODELAY is set. Everything else
is the same on both: one pool per address, streaming, the one retry.

Errors::

    ClaimantGone          the claimant is known dead: its socket path is missing, or
                          the connection to it was refused (raised before anything was
                          sent); never over TCP, where the live set alone says who is dead
    ClaimantUnavailable   any other failure to reach it before its first reply byte, a
                          refused TCP connection included (raised before anything was sent)
    ConnectionResetError  the claimant's connection broke after the reply began; the
                          receiving server then aborts the client connection
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable, Iterable
from urllib.parse import quote, urlsplit

import httptools
from starlette.types import Receive, Scope, Send

from tether.routing.hop import HOP_HEADER, signed_hop_value
from tether.routing.hopsign import request_target
from tether.routing.types import WorkerId

__all__ = [
    "TCP", "ClaimantGone", "ClaimantUnavailable", "Forwarder", "Signer", "connect", "tcp_endpoint",
]

TCP = "tcp://"
"""How the address of a worker of another host starts (`tcp://host:port`)."""
Signer = Callable[[str, str, WorkerId], str]
"""Signs a hop between hosts: (method, request target, target worker) -> signature."""

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# The receiving server answers `expect: 100-continue` when the body is first read; passed
# on, it would make the claimant send an interim 100 reply too. A client's copy of the
# hop header is never passed on: only the forwarder writes it (hop.py).
_NOT_FORWARDED = HOP_BY_HOP | {b"expect", HOP_HEADER}
_CONNECTION_TOKENS = frozenset({b"close", b"keep-alive", b"upgrade", b""})

_RETRY_LIMIT = 1 << 20  # body bytes kept so a dead kept-alive connection can be retried
_READ_LIMIT = 1 << 18  # reply bytes buffered before we stop reading the claimant
_JOIN_LIMIT = 1 << 16  # smaller writes are joined into one buffer
_WATCH_AFTER_S = 0.02  # how long a reply may take before the client is watched


class ClaimantGone(Exception):
    """The claimant is known dead: its socket path is missing or refuses connections."""


class ClaimantUnavailable(Exception):
    """The claimant could not be reached, or its connection died before any reply byte."""


@functools.lru_cache(maxsize=1024)
def tcp_endpoint(address: str) -> tuple[str, int]:
    """The host and port of a `tcp://host:port` address (parsed once per address)."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path:
        raise ValueError(f"not a tcp://host:port address: {address!r}")
    return parts.hostname, port


async def connect(
    loop: asyncio.AbstractEventLoop,
    protocol: asyncio.Protocol,
    address: str,
    connect_timeout: float,
) -> None:
    """Connect `protocol` to the claimant at `address` (a socket path or `tcp://host:port`)
    within `connect_timeout` s; raises `ClaimantGone` or `ClaimantUnavailable` (see the
    module docstring)."""
    tcp = address.startswith(TCP)
    endpoint = tcp_endpoint(address) if tcp else None
    try:
        async with asyncio.timeout(connect_timeout):
            if endpoint is None:
                await loop.create_unix_connection(lambda: protocol, address)
            else:
                transport, _ = await loop.create_connection(lambda: protocol, *endpoint)
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        if tcp:
            # Nobody listens there now: the worker restarts, or died and its host has not
            # said so yet. Only the live set makes it dead (SPEC 12).
            raise ClaimantUnavailable(f"{address} refused the connection") from exc
        raise ClaimantGone(f"no claimant listens at {address}") from exc
    except OSError as exc:  # includes TimeoutError
        raise ClaimantUnavailable(f"cannot connect to {address}: {exc!r}") from exc


class _Connection(asyncio.Protocol):
    """One connection to a claimant; httptools callbacks fill in the current reply."""

    __slots__ = (
        "body_sent",
        "buffered",
        "chunks",
        "client_gone",
        "closed",
        "complete",
        "drain_waiter",
        "finished",
        "framed",
        "got_bytes",
        "head",
        "headers",
        "idle_since",
        "in_use",
        "informational",
        "keep_alive",
        "loop",
        "lost_waiter",
        "parser",
        "pool",
        "reading_paused",
        "status",
        "transport",
        "waiter",
        "watcher",
        "write_paused",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.in_use = True
        self.pool: list[_Connection] | None = None  # the pool that holds it while idle
        self.idle_since = 0.0
        self.write_paused = False
        self.reading_paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.drain_waiter: asyncio.Future[None] | None = None
        self.lost_waiter: asyncio.Future[None] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.begin(False)

    def begin(self, head: bool) -> None:
        """Reset the reply state for a new request (`head`: the request is a HEAD)."""
        self.head = head
        self.got_bytes = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.informational = False
        self.framed = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.body_sent = False
        self.client_gone = False
        self.finished = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if not self.in_use:
            # A claimant never speaks first; bytes on an idle connection make it unusable.
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            # (a 101: a forwarded request never asks to switch protocols) the reply is lost
            self.transport.abort()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pool = self.pool
        if pool is not None:
            self.pool = None
            pool.remove(self)
        for waiter in (self.waiter, self.drain_waiter, self.lost_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in HOP_BY_HOP:
            if name == b"transfer-encoding":
                self.framed = True
            return
        if name == b"content-length":
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            # An interim reply (103 Early Hints): not passed on; the final reply follows.
            self.informational = True
            self.headers = []
            self.framed = False
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if self.head:
            # httptools cannot be told that a HEAD reply has no body, so a fresh parser
            # takes the next reply on this connection.
            self.complete = True
            self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _READ_LIMIT and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True

    # used by the forwarder

    async def wait(self) -> None:
        """Until the parser or the transport reports something."""
        waiter = self.waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    async def drain(self) -> None:
        """Until the transport's write buffer is below its high-water mark, or closed."""
        if self.closed or not self.write_paused:
            return
        waiter = self.drain_waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.drain_waiter = None

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            if not self.closed:
                self.transport.resume_reading()

    def usable(self) -> bool:
        return not self.closed and not self.transport.is_closing()

    def watch(self, receive: Receive) -> None:
        """Start watching the client for a disconnect (a timer calls this)."""
        if not self.finished and not self.closed:
            self.watcher = self.loop.create_task(_watch_disconnect(receive, self))

    def unwatch(self) -> None:
        watcher = self.watcher
        if watcher is not None:
            self.watcher = None
            watcher.cancel()


async def _watch_disconnect(receive: Receive, conn: _Connection) -> None:
    """Close the claimant's connection when the client goes away before the reply ends.

    Body messages (a router's replayed body, a body the claimant did not read) are
    skipped; uvicorn also reports `http.disconnect` once the reply is complete, which the
    `finished` flag tells apart.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    _client_left(conn)


def _client_left(conn: _Connection) -> None:
    """The client went away: unless its reply had ended, the claimant's connection is
    closed, which tells the claimant's handler."""
    if not conn.finished:
        conn.client_gone = True
        conn.transport.abort()


async def _send_rest(receive: Receive, conn: _Connection, chunked: bool) -> None:
    """The rest of a request body whose reply began before it ended (the claimant may
    read on while it replies, as a streaming echo does), sent on as it comes, until the
    reply ends; then, or once the body is whole, the client is watched for a disconnect
    as `_watch_disconnect` does. A connection whose body was not sent whole is never
    reused."""
    more = True
    while more:
        if conn.write_paused:
            await conn.drain()
        if conn.closed or conn.complete:
            return  # the reply ended: the rest is not wanted
        message = await receive()
        if message["type"] != "http.request":
            _client_left(conn)
            return
        if conn.closed or conn.complete:
            return
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if chunk:
            _write_chunk(conn.transport, chunk, chunked)
    if chunked:
        conn.transport.write(b"0\r\n\r\n")
    conn.body_sent = True
    await _watch_disconnect(receive, conn)


def _write_chunk(transport: asyncio.Transport, chunk: bytes, chunked: bool) -> None:
    if not chunked:
        transport.write(chunk)
    elif len(chunk) < _JOIN_LIMIT:
        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    else:
        transport.write(b"%x\r\n" % len(chunk))
        transport.write(chunk)
        transport.write(b"\r\n")


def _head_parts(scope: Scope, dropped: frozenset[bytes]) -> tuple[list[bytes], int, bytes | None]:
    """The request line and forwarded header lines, without the closing blank line.

    Returns the parts, the index of the first content-length value in them (or -1), and
    the value of the `connection` header (or None).
    """
    target = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    query = scope.get("query_string")
    parts = [scope["method"].encode("ascii"), b" ", target]
    if query:
        parts.append(b"?")
        parts.append(query)
    parts.append(b" HTTP/1.1\r\n")
    length_at = -1
    connection = None
    for name, value in scope["headers"]:
        if name in dropped:
            if name == b"connection":
                connection = value
            continue
        if name == b"content-length":
            if length_at >= 0:
                continue
            length_at = len(parts) + 2
        parts += (name, b": ", value, b"\r\n")
    return parts, length_at, connection


class Forwarder:
    """One connection pool per claimant address; no connection limit; connect timeout only.

    There is no read or total timeout: a reply may stream for as long as the client keeps
    its connection. Pooled connections idle longer than `idle_timeout`, or closed by the
    claimant, are dropped when next checked out. `signer` signs requests to `tcp://`
    addresses (a worker with a hop secret has one; without it only socket paths work).
    """

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        idle_timeout: float = 15.0,
        signer: Signer | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.signer = signer
        self.forwarded: int = 0
        self._pools: dict[str, list[_Connection]] = {}
        self._busy: dict[str, set[_Connection]] = {}
        """The connections a request is using, by claimant address."""
        self._gone: frozenset[str] = frozenset()
        self._closed = False

    async def forward(
        self,
        address: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes | None = None,
        hop: bytes | None = None,
        target: WorkerId | None = None,
        fresh: bool = False,
    ) -> None:
        """Forward one http request to the claimant at `address` (a socket path or
        `tcp://host:port`) and stream its reply; `fresh`: on a new connection, with no
        retry (it is one already: the passthrough's kept link closed unanswered).

        `body`, if given, is the whole request body, already read by the caller; `receive`
        is then only watched for the client's disconnect. `hop`, if given, is sent as the
        request's last header, `x-tether-hop` (hop.py). To a `tcp://` address that header
        also carries a signature for worker `target`, which must then be given. Raises
        `ClaimantGone` or `ClaimantUnavailable` before anything was sent to `send`;
        returns quietly if the client disconnects.
        """
        self.forwarded += 1
        caller = hop
        signed = address.startswith(TCP)
        if signed:
            hop = self._sign(scope, target, caller)
        parts, length_at, connection = _head_parts(scope, _NOT_FORWARDED)
        if connection is not None:
            # Headers named in `connection` are hop-by-hop too (rare, so a second pass).
            extra = {token.strip().lower() for token in connection.split(b",")}
            if not extra <= _CONNECTION_TOKENS:
                parts, length_at, _ = _head_parts(scope, _NOT_FORWARDED | extra)

        streaming = False
        if body is None:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before anything was forwarded
            body = message.get("body", b"")
            streaming = message.get("more_body", False)
        chunked = False
        if not streaming:
            size = b"%d" % len(body)
            if length_at >= 0:
                parts[length_at] = size
            elif body:
                parts += (b"content-length: ", size, b"\r\n")
        elif length_at < 0:
            chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        if hop is not None:
            parts += (HOP_HEADER, b": ", hop, b"\r\n")  # last: the private side pops it
        parts.append(b"\r\n")
        head = b"".join(parts)

        # Body chunks already read from `receive` while streaming, kept for one retry.
        recorded: list[bytes] | None = [body] if streaming else None
        recorded_size = len(body)
        more = streaming
        retried = fresh
        is_head = scope["method"] == "HEAD"
        loop = asyncio.get_running_loop()

        while True:
            if address in self._gone:
                raise ClaimantGone(f"the claimant at {address} is dead")
            conn = None if retried else self._checkout(address, loop)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(address, loop)
            busy = self._busy.setdefault(address, set())
            busy.add(conn)
            conn.begin(is_head)
            transport = conn.transport
            timer: asyncio.TimerHandle | None = None
            started = False
            reusable = False
            try:
                # The request.
                if not streaming:
                    if len(body) < _JOIN_LIMIT:
                        transport.write(head + body)
                    else:
                        transport.write(head)
                        transport.write(body)
                    conn.body_sent = True
                else:
                    transport.write(head)
                    if recorded is not None:
                        for chunk in recorded:
                            if chunk:
                                _write_chunk(transport, chunk, chunked)
                    while more:
                        if conn.write_paused:
                            await conn.drain()
                        if conn.closed:
                            break  # the claimant failed before the body ended
                        if conn.got_bytes:
                            # It answers before the body ended, and may go on reading it:
                            # the rest goes on beside the reply.
                            conn.watcher = loop.create_task(_send_rest(receive, conn, chunked))
                            break
                        message = await receive()
                        if message["type"] != "http.request":
                            return  # the client left; closing the connection tells the claimant
                        chunk = message.get("body", b"")
                        more = message.get("more_body", False)
                        if recorded is not None:
                            recorded_size += len(chunk)
                            if recorded_size > _RETRY_LIMIT:
                                recorded = None
                            else:
                                recorded.append(chunk)
                        if chunk:
                            _write_chunk(transport, chunk, chunked)
                    if not more:
                        if chunked:
                            transport.write(b"0\r\n\r\n")
                        conn.body_sent = True

                # The reply. Most replies end within a millisecond, so the client is only
                # watched for a disconnect once one has not: a task per request would add
                # about 5 us of CPU and an event-loop pass to every forwarded request.
                if conn.watcher is None:
                    timer = loop.call_later(_WATCH_AFTER_S, conn.watch, receive)
                while True:
                    if conn.client_gone:
                        return
                    if not started:
                        if not conn.status:
                            if conn.closed:
                                break  # died before the reply began: retry or give up below
                            await conn.wait()
                            continue
                        started = True
                        await send(
                            {
                                "type": "http.response.start",
                                "status": conn.status,
                                "headers": conn.headers,
                            }
                        )
                        continue
                    chunks = conn.chunks
                    if chunks:
                        conn.chunks = []
                        conn.buffered = 0
                        last = len(chunks) - 1 if conn.complete else -1
                        if last >= 0:
                            conn.finished = True
                        for index, chunk in enumerate(chunks):
                            await send(
                                {
                                    "type": "http.response.body",
                                    "body": chunk,
                                    "more_body": index != last,
                                }
                            )
                        if last >= 0:
                            break
                        conn.resume_reading()
                    elif conn.complete:
                        conn.finished = True
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        break
                    elif conn.closed:
                        if conn.framed or conn.client_gone:
                            if conn.client_gone:
                                return
                            raise ConnectionResetError(
                                f"the claimant at {address} closed the connection mid-reply"
                            )
                        # A reply without content-length or chunking ends at EOF.
                        conn.finished = True
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        return
                    else:
                        await conn.wait()
                if started:
                    reusable = conn.keep_alive and conn.body_sent and conn.usable()
                    return
            finally:
                busy.discard(conn)
                if timer is not None:
                    timer.cancel()
                conn.unwatch()
                if reusable:
                    self._release(address, conn)
                elif not conn.closed:
                    conn.transport.abort()
            # The connection died before the reply's first byte.
            if (
                reused
                and not retried
                and not conn.got_bytes
                and (not streaming or recorded is not None)
            ):
                retried = True
                if signed:
                    # A fresh nonce: the listener may have seen (and remembered) the first.
                    parts[-3] = self._sign(scope, target, caller)
                    head = b"".join(parts)
                continue
            if address in self._gone:
                raise ClaimantGone(f"the claimant at {address} died while it had the request")
            raise ClaimantUnavailable(f"the claimant at {address} closed the connection")

    def _sign(self, scope: Scope, target: WorkerId | None, hop: bytes | None) -> bytes:
        if self.signer is None or target is None:
            raise ValueError("a hop to another host needs the forwarder's signer and a target")
        signature = self.signer(scope["method"], request_target(scope), target)
        return signed_hop_value(signature, hop)

    def set_gone(self, addresses: Iterable[str]) -> None:
        """The addresses of claimants known dead (another host's, whose host stopped
        answering, perhaps paused): a request waiting on one ends (410 before its reply
        began, a cut reply after), and none is sent to one again."""
        gone = frozenset(addresses)
        for address in gone - self._gone:
            self.discard(address)
            for conn in list(self._busy.get(address, ())):
                conn.transport.abort()
        self._gone = gone

    def discard(self, address: str) -> None:
        """Close the pooled connections to a claimant, e.g. when it died."""
        pool = self._pools.pop(address, None)
        if pool:
            for conn in pool:
                conn.pool = None
                conn.transport.abort()

    async def close(self) -> None:
        """Close every pooled connection; connections in use close when their reply ends."""
        self._closed = True
        conns = [conn for pool in self._pools.values() for conn in pool]
        self._pools.clear()
        waiters = []
        for conn in conns:
            conn.pool = None
            if not conn.closed:
                waiter = conn.lost_waiter = conn.loop.create_future()
                waiters.append(waiter)
                conn.transport.close()
        if waiters:
            await asyncio.gather(*waiters)

    def _checkout(self, address: str, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        pool = self._pools.get(address)
        if not pool:
            return None
        now = loop.time()
        while pool:
            conn = pool.pop()
            conn.pool = None
            if conn.usable() and now - conn.idle_since <= self.idle_timeout:
                conn.in_use = True
                return conn
            conn.transport.abort()
        return None

    def _release(self, address: str, conn: _Connection) -> None:
        if self._closed:
            conn.transport.close()
            return
        conn.in_use = False
        conn.resume_reading()
        now = conn.idle_since = conn.loop.time()
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = []
        # The oldest idle connections are at the bottom; drop those past the idle timeout.
        while pool and now - pool[0].idle_since > self.idle_timeout:
            stale = pool.pop(0)
            stale.pool = None
            stale.transport.abort()
        conn.pool = pool
        pool.append(conn)

    async def _connect(self, address: str, loop: asyncio.AbstractEventLoop) -> _Connection:
        conn = _Connection(loop)
        try:
            await connect(loop, conn, address, self.connect_timeout)
        except ClaimantGone:
            self.discard(address)
            raise
        return conn
