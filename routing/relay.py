"""The WebSocket relay: a client's WebSocket carried to the worker that holds its session.

A handshake for a session another worker holds is relayed over that worker's private
socket as a WebSocket (SPEC 4.8). `Relays.relay` writes the client's handshake there
(its headers unchanged, less hop-by-hop and handshake headers, with the hop header last),
hands the holder's accept (subprotocol, headers) or its denial response to the client,
then moves messages both ways, text and binary, in order, until either side closes; the
close's code and reason reach the other side.

The holder's side is our own lean client: an `asyncio.Protocol` on the Unix socket (or,
for a holder on another host, on TCP to its `tcp://host:port` hop listener, the
handshake's hop header then starting with a signature, as in `forward.py`) that
writes the handshake itself (so the `host` header and the header order stay the
client's), reads the reply head with httptools, and frames messages with the
`websockets` library's sans-I/O codec (no tasks, queues or timers of its own).

Back-pressure, both ways: a message from the holder is handed to the client's `send`
(which uvicorn holds while the client's socket buffer is full), and at most
`READ_LIMIT` bytes of them wait here before the holder's socket is no longer read, so a
client that does not read stops the holder's `send` instead of growing this worker. A
client's message is read only once the holder's socket took the previous one.

Errors (those of the HTTP hop, `forward.py`)::

    ClaimantGone          the holder is known dead: its socket path is missing, or it
                          refused the connection (raised before anything was sent);
                          never over TCP
    ClaimantUnavailable   any other failure to reach it before its reply head, a refused
                          TCP connection included (raised before anything was sent)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
from collections import deque
from collections.abc import Awaitable
from typing import Any
from urllib.parse import quote

import httptools
import structlog
from starlette.types import Message, Receive, Scope, Send
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import Protocol, Side, State

from tether.routing.forward import (
    HOP_BY_HOP,
    TCP,
    ClaimantUnavailable,
    Signer,
    connect,
)
from tether.routing.hop import HOP_HEADER, signed_hop_value
from tether.routing.hopsign import request_target
from tether.routing.types import WorkerId

__all__ = ["Relays", "send_denial"]

log = structlog.get_logger("tether.relay")

READ_LIMIT = 1 << 18
"""Bytes of the holder's messages waiting for the client before the holder is not read."""
CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
"""How long a closing handshake may take before the connection is dropped."""
DENIAL_EXTENSION = "websocket.http.response"
GONE_CLOSE_CODE_BASE = 4000
"""Where a server cannot send a denial response, the WebSocket is accepted and closed
with 4000 + the status (4410 for `session_gone`)."""
HOLDER_LOST = (1011, "the session's worker closed the connection")
"""The close the client gets when the holder's connection breaks without a close frame."""
HOLDER_SILENT = (1011, "the session's worker stopped answering")
"""The close the client gets when the holder answers no ping within the ping timeout."""
PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
"""uvicorn's defaults for `--ws-ping-interval` and `--ws-ping-timeout`, which the relay
applies to the holder's side as uvicorn applies them to the client's."""
STOPPING = (1001, "the worker is stopping")

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_HANDSHAKE = frozenset(
    {b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions"}
)
# The handshake is ours (the public server negotiated the client's): extensions and the
# key are the hop's own. A client's copy of the hop header is never passed on (hop.py).
_NOT_RELAYED = HOP_BY_HOP | _HANDSHAKE | {HOP_HEADER, b"content-length"}
_CONNECTION_TOKENS = frozenset({b"close", b"keep-alive", b"upgrade", b""})
# What of the holder's accept is the hop's, not the app's.
_NOT_RETURNED = HOP_BY_HOP | {
    b"sec-websocket-accept",
    b"sec-websocket-extensions",
    b"sec-websocket-protocol",
    b"content-length",
    b"date",
    b"server",
}
_SENDABLE = frozenset(range(3000, 5000)) | {1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010,
                                             1011, 1012, 1013, 1014}
"""Close codes a close frame may carry (RFC 6455 7.4; 1005 and 1006 only report)."""


def _handshake(scope: Scope, key: bytes, hop: bytes | None) -> bytes:
    """The relayed handshake request: the client's target and headers, our upgrade."""
    dropped = _NOT_RELAYED
    for name, value in scope["headers"]:
        if name == b"connection":
            # Headers the client named in `connection` are hop-by-hop too.
            extra = {token.strip().lower() for token in value.split(b",")}
            if not extra <= _CONNECTION_TOKENS:
                dropped = dropped | extra
    target = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    parts = [b"GET ", target]
    query = scope.get("query_string")
    if query:
        parts += (b"?", query)
    parts.append(b" HTTP/1.1\r\n")
    for name, value in scope["headers"]:
        if name not in dropped:
            parts += (name, b": ", value, b"\r\n")
    parts += (
        b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n",
        b"sec-websocket-key: ", key, b"\r\n",
    )
    if hop is not None:
        parts += (HOP_HEADER, b": ", hop, b"\r\n")  # last: the private side pops it
    parts.append(b"\r\n")
    return b"".join(parts)


def _accept_key(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + _GUID).digest())


def close_code(code: int | None) -> int:
    """The code a close frame can carry for a close reported as `code`."""
    if code is None or code == 1005:
        return 1000  # a close without a status: ASGI cannot ask for an empty close frame
    return code if code in _SENDABLE else 1011


async def send_denial(
    scope: Scope,
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    reason: str,
) -> None:
    """Refuse a handshake with an HTTP response (the ASGI denial response), or, where the
    server cannot send one, accept it and close it with 4000 + `status` and `reason`."""
    if DENIAL_EXTENSION in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": GONE_CLOSE_CODE_BASE + status,
                "reason": reason.encode()[:123].decode("utf-8", "ignore")})


class _Holder(asyncio.Protocol):
    """One relayed WebSocket's connection to the holder's private socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.codec = Protocol(Side.CLIENT, state=State.OPEN, max_size=None)
        # The reply head, then a denial's body (httptools callbacks).
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False
        self.upgraded = False
        # Messages from the holder (and their sizes), waiting for the client; None: the end.
        self.inbox: deque[tuple[Message, int] | None] = deque()
        self.buffered = 0
        self.fragments: list[bytes] = []
        self.fragment_opcode = Opcode.BINARY
        self.closed = False
        """The holder sent its close frame, or the connection broke: nothing more comes."""
        self.close: tuple[int, str] | None = None
        """The holder's close (code, reason), once its close frame arrived."""
        self.lost = False
        self.reading_paused = False
        self.write_paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.drain_waiter: asyncio.Future[None] | None = None
        self.lost_waiter: asyncio.Future[None] | None = None
        self.silent = False
        """The holder answered no ping in time (so the relay dropped it)."""
        self._ping_interval: float | None = None
        self._ping_timeout: float | None = None
        self._ping: bytes | None = None
        self._ping_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:
            self._frames(data)
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.parser = None
            self.upgraded = self.status == 101
            self._wake()
            rest = data[upgrade.args[0]:]
            if rest and self.upgraded:
                self._frames(rest)
            return
        except httptools.HttpParserError:
            self.transport.abort()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        self._end(None)
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

    # httptools callbacks (the reply head and a denial's body)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # Frames

    def _frames(self, data: bytes) -> None:
        codec = self.codec
        codec.receive_data(data)
        for frame in codec.events_received():
            if not isinstance(frame, Frame):
                continue  # no handshake events: the codec starts open
            opcode = frame.opcode
            if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
                if frame.fin:
                    self._push(opcode, bytes(frame.data))
                else:
                    self.fragment_opcode = opcode
                    self.fragments = [bytes(frame.data)]
            elif opcode is Opcode.CONT:
                self.fragments.append(bytes(frame.data))
                if frame.fin:
                    data, self.fragments = b"".join(self.fragments), []
                    self._push(self.fragment_opcode, data)
            elif opcode is Opcode.CLOSE:
                rcvd = codec.close_rcvd
                assert rcvd is not None
                self._end((int(rcvd.code), rcvd.reason))
            elif opcode is Opcode.PONG and self._ping is not None and frame.data == self._ping:
                self._ping = None
                self._arm(self._ping_interval, self._send_ping)
        self._flush()
        if codec.parser_exc is not None:
            self._end(None)  # the codec failed the connection (its close frame is written)
            self.transport.close()

    def _push(self, opcode: Opcode, data: bytes) -> None:
        if self.closed:
            return
        message: Message
        if opcode is Opcode.TEXT:
            try:
                message = {"type": "websocket.send", "text": data.decode()}
            except UnicodeDecodeError:
                self.codec.fail(CloseCode.INVALID_DATA, "invalid UTF-8")
                self._end(None)
                return
        else:
            message = {"type": "websocket.send", "bytes": data}
        self.inbox.append((message, len(data)))
        self.buffered += len(data)
        if self.buffered > READ_LIMIT and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def _end(self, close: tuple[int, str] | None) -> None:
        if not self.closed:
            self.closed = True
            self.close = close
            self.inbox.append(None)
            self._wake()

    def _flush(self) -> None:
        for chunk in self.codec.data_to_send():
            if chunk:
                self.transport.write(chunk)
            elif not self.transport.is_closing():
                self.transport.close()  # the codec's end of stream

    # Keepalive: a holder that hangs (its host stopped, or cut off without a reset) would
    # otherwise hold the client's WebSocket open forever.

    def keep_alive(self, interval: float | None, timeout: float | None) -> None:
        """Ping the holder every `interval` s and drop it if a ping goes unanswered for
        `timeout` s (None: never), as uvicorn's `--ws-ping-*` do for a client."""
        self._ping_interval, self._ping_timeout = interval, timeout
        self._arm(interval, self._send_ping)

    def _arm(self, delay: float | None, callback: Any) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        if delay is not None and not self.lost:
            self._ping_timer = self.loop.call_later(delay, callback)

    def _send_ping(self) -> None:
        self._ping_timer = None
        if self.lost or self.codec.state is not State.OPEN:
            return
        self._ping = os.urandom(4)
        self.codec.send_ping(self._ping)
        self._flush()
        self._arm(self._ping_timeout, self._unanswered)

    def _unanswered(self) -> None:
        self._ping_timer = None
        if self.lost:
            return
        if self.reading_paused:  # its pong waits behind what the client has not read
            self._arm(self._ping_timeout, self._unanswered)
            return
        log.warning("websocket_holder_silent", after_s=self._ping_timeout)
        self.silent = True
        self.transport.abort()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # Used by the relay

    def waiting(self) -> asyncio.Future[None]:
        """A future the parser or the transport completes when it reports something."""
        waiter = self.waiter = self.loop.create_future()
        return waiter

    async def next_message(self) -> Message | None:
        """The holder's next message, or None once it closed (see `close`)."""
        while not self.inbox:
            try:
                await self.waiting()
            finally:
                self.waiter = None
        item = self.inbox.popleft()
        if item is None:
            self.inbox.append(None)  # the end stays the end
            return None
        message, size = item
        self.buffered -= size
        if self.reading_paused and self.buffered <= READ_LIMIT // 2 and not self.lost:
            self.reading_paused = False
            self.transport.resume_reading()
            if self._ping is not None:  # its pong may still be far behind: a whole timeout
                self._arm(self._ping_timeout, self._unanswered)
        return message

    async def send(self, message: Message) -> None:
        """Write a client's message to the holder, once the socket took the previous one."""
        if self.lost or self.codec.state is not State.OPEN:
            return  # closing: what the client sends after a close is dropped
        text = message.get("text")
        if text is not None:
            self.codec.send_text(text.encode())
        else:
            self.codec.send_binary(message.get("bytes") or b"")
        self._flush()
        if self.write_paused and not self.lost:
            waiter = self.drain_waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self.drain_waiter = None

    async def shut(self, code: int | None, reason: str, within: float) -> None:
        """Close the holder's side with `code` and `reason` (1005: a close frame without a
        status; None: drop the connection, as the client's did), and wait up to `within` s
        for its closing handshake."""
        if self.lost:
            return
        if code is None:
            self.transport.abort()
            return
        if self.codec.state is State.OPEN:
            if code == 1005:
                self.codec.send_close()  # a close frame without a status, as the client's
            else:
                self.codec.send_close(code, reason)
            self._flush()
        waiter = self.lost_waiter = self.loop.create_future()
        try:
            await asyncio.wait_for(waiter, within)
        except TimeoutError:
            self.transport.abort()
        finally:
            self.lost_waiter = None

    def write_buffer(self) -> int:
        return 0 if self.lost else self.transport.get_write_buffer_size()


class _Relay:
    """One client's WebSocket and its holder's, joined: two pumps, one per direction."""

    def __init__(self, holder: _Holder, receive: Receive, send: Send, close_timeout: float):
        self.holder = holder
        self.receive = receive
        self.send = send
        self.close_timeout = close_timeout
        self.client_gone = False
        self.stopping = False
        self.pumps: tuple[asyncio.Task[None], asyncio.Task[None]] | None = None
        self.finished: asyncio.Future[None] = holder.loop.create_future()

    async def run(self, first: asyncio.Future[Message]) -> None:
        loop = self.holder.loop
        up = loop.create_task(self._up(first), name="tether-ws-up")
        down = loop.create_task(self._down(), name="tether-ws-down")
        self.pumps = (up, down)
        try:
            done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
            # The client left (its close went to the holder), or the holder closed (its
            # close went to the client): the other pump ends once its side reports it.
            if not self.stopping:
                await asyncio.wait((down,) if up in done else (up,), timeout=self.close_timeout)
        finally:
            for pump in (up, down):
                pump.cancel()
            for result in await asyncio.gather(up, down, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("websocket_relay_failed", exc_info=result)
            try:
                if self.stopping:
                    await self._stop_both()
            finally:
                if not self.holder.lost:
                    self.holder.transport.abort()
                self.finished.set_result(None)

    def stop(self) -> None:
        """Close both sides (the worker is stopping)."""
        if not self.stopping:
            self.stopping = True
            for pump in self.pumps or ():
                pump.cancel()

    async def _up(self, first: asyncio.Future[Message]) -> None:
        """The client's messages to the holder; its close (or disconnect) too."""
        message = await first
        while message["type"] == "websocket.receive":
            await self.holder.send(message)
            message = await self.receive()
        if message["type"] != "websocket.disconnect":
            return
        self.client_gone = True
        code: int | None = message.get("code", 1005)
        reason = message.get("reason") or ""
        if code == 1005:
            reason = ""
        elif code not in _SENDABLE:
            code = None  # an abnormal end (1006): the holder's connection drops too
        await self.holder.shut(code, reason, self.close_timeout)

    async def _down(self) -> None:
        """The holder's messages to the client, then its close."""
        holder = self.holder
        while True:
            message = await holder.next_message()
            if message is None:
                break
            if self.client_gone:
                continue
            try:
                await self.send(message)
            except OSError:  # uvicorn's ClientDisconnected: the up pump learns why
                self.client_gone = True
        if self.client_gone:
            return
        if holder.close is not None:
            code, reason = holder.close
        else:
            code, reason = HOLDER_SILENT if holder.silent else HOLDER_LOST
        self.client_gone = True
        with contextlib.suppress(OSError):
            await self.send({"type": "websocket.close", "code": close_code(code),
                             "reason": reason})

    async def _stop_both(self) -> None:
        code, reason = STOPPING
        tasks: list[Awaitable[Any]] = [self.holder.shut(code, reason, self.close_timeout)]
        if not self.client_gone:
            self.client_gone = True
            tasks.append(self.send({"type": "websocket.close", "code": code, "reason": reason}))
        # A client that does not read cannot take a close either: bounded.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.close_timeout):
                await asyncio.gather(*tasks, return_exceptions=True)


class Relays:
    """One worker's relayed WebSockets: opened by `relay`, each running as long as its
    client and holder keep it, all closed by `close` when the worker stops."""

    def __init__(
        self,
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        close_timeout: float = CLOSE_TIMEOUT_S,
        ping_interval: float | None = PING_INTERVAL_S,
        ping_timeout: float | None = PING_TIMEOUT_S,
        signer: Signer | None = None,
    ) -> None:
        """`signer` signs handshakes to `tcp://` addresses (as the forwarder's does);
        `ping_*`: the holder's keepalive (`_Holder.keep_alive`)."""
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.signer = signer
        self.opened = 0
        """Handshakes the holder answered (accepted or denied)."""
        self._open: set[_Relay] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._open)

    def buffered(self) -> int:
        """Bytes this worker holds for its open relays: the holder's messages waiting for
        their clients, and the clients' messages not yet taken by the holders' sockets."""
        return sum(r.holder.buffered + r.holder.write_buffer() for r in self._open)

    async def relay(
        self,
        address: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        hop: bytes | None,
        target: WorkerId | None = None,
    ) -> None:
        """Relay one WebSocket handshake (and then its messages) to the holder listening at
        `address` (a socket path or `tcp://host:port`); `hop`, if given, is sent as the
        handshake's last header, which to a `tcp://` address also carries a signature for
        worker `target` (then required).

        Raises `ClaimantGone` or `ClaimantUnavailable` before anything was sent to `send`;
        returns once both sides closed."""
        message = await receive()
        if message["type"] != "websocket.connect":
            return  # the client left before its handshake was read
        if self._closed:
            raise ClaimantUnavailable("the worker is stopping")
        if address.startswith(TCP):
            if self.signer is None or target is None:
                raise ValueError("a relay to another host needs the signer and a target")
            # GET: the method a handshake is checked as on the hop listener.
            signature = self.signer("GET", request_target(scope), target)
            hop = signed_hop_value(signature, hop)
        loop = asyncio.get_running_loop()
        holder = _Holder(loop)
        await connect(loop, holder, address, self.connect_timeout)
        key = base64.b64encode(os.urandom(16))
        holder.transport.write(_handshake(scope, key, hop))
        # Until the holder answers, the client can only leave.
        first: asyncio.Future[Message] = asyncio.ensure_future(receive())
        try:
            while not (holder.upgraded or holder.complete or holder.lost or first.done()):
                try:
                    await asyncio.wait(
                        (holder.waiting(), first), return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    holder.waiter = None
            if not (holder.upgraded or holder.complete):
                if first.done():
                    return  # the client left first (the finally drops the holder's side)
                raise ClaimantUnavailable(f"the claimant at {address} closed the connection")
            self.opened += 1
            if not holder.upgraded:
                await self._deny(scope, send, holder)
                return
            if _header(holder.headers, b"sec-websocket-accept") != _accept_key(key):
                raise ClaimantUnavailable(f"the claimant at {address} answered a bad key")
            accept: Message = {
                "type": "websocket.accept",
                "headers": [(n, v) for n, v in holder.headers if n not in _NOT_RETURNED],
            }
            subprotocol = _header(holder.headers, b"sec-websocket-protocol")
            if subprotocol is not None:
                accept["subprotocol"] = subprotocol.decode("latin-1")
            try:
                await send(accept)
            except OSError:
                return  # the client is gone
            relay = _Relay(holder, receive, send, self.close_timeout)
            holder.keep_alive(self.ping_interval, self.ping_timeout)
            self._open.add(relay)
            try:
                await relay.run(first)
            finally:
                self._open.discard(relay)
        finally:
            if not first.done():
                first.cancel()
            if not holder.lost:
                holder.transport.abort()

    async def close(self) -> None:
        """Close every open relay, both sides (1001), and wait until they are done."""
        self._closed = True
        relays = list(self._open)
        for relay in relays:
            relay.stop()
        if relays:
            await asyncio.wait([relay.finished for relay in relays])

    async def _deny(self, scope: Scope, send: Send, holder: _Holder) -> None:
        """Pass the holder's denial response on to the client."""
        headers = [(n, v) for n, v in holder.headers if n not in _NOT_RETURNED]
        await send_denial(scope, send, holder.status, headers, b"".join(holder.body),
                          reason=f"denied with {holder.status}")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
