"""Links to other workers for the passthrough (front.py): plain non-blocking sockets on
the event loop, a request's bytes written once, the reply's bytes handed on as they
arrive, parsed only to find where the reply ends.

A link to a private socket of this host is connected synchronously (a Unix socket
connects at once or not at all), so a request never waits on a connect there: a holder
that does not take the connection at once is left to the router's forwarder
(forward.py), which knows how to wait and retry. A link to another host's hop listener
(TCP) is connected by the task that already waits for the claim store's answer
(`Links.connect`), and kept alive like the others.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Protocol

import httptools

from tether.routing.forward import ClaimantGone, ClaimantUnavailable, tcp_endpoint

__all__ = ["Link", "Links", "Reader"]

IDLE_S = 15.0
"""Idle links older than this are closed when next looked at (the private server keeps
its side 75 s, so this side always closes first)."""
_READ_SIZE = 1 << 16  # (a bigger buffer is allocated by mmap on every read)


class Reader(Protocol):
    """Who takes a link's reply (front.py's passthrough)."""

    def reply(self, data: bytes, link: Link) -> None:
        """Bytes of the reply, as they arrived; `link.complete` once it has all of it."""

    def lost(self, link: Link) -> None:
        """The link closed or failed before the reply was complete."""


class Link:
    """One connection to a worker's private socket, or to another host's worker's hop
    listener."""

    __slots__ = (
        "closed", "complete", "final", "got_bytes", "idle_since", "keep_alive", "loop",
        "parser", "path", "paused", "pool", "reader", "reused", "sock", "status", "unsent",
    )

    def __init__(
        self, sock: socket.socket, path: str, loop: asyncio.AbstractEventLoop, pool: Links
    ) -> None:
        self.sock = sock
        self.path = path
        self.loop = loop
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.reader: Reader | None = None
        self.idle_since = 0.0
        self.status = 0
        self.final = False
        self.complete = False
        self.keep_alive = False
        self.closed = False
        self.paused = False
        self.reused = False
        """The current request went on a link kept from an earlier one."""
        self.got_bytes = False
        """The current request's reply has begun to arrive (perhaps unparseable)."""
        self.unsent = b""
        """What the socket has not taken yet of a request it took in part."""
        pool.opened(self)
        # Watched for as long as it is open: an idle link that turns readable was closed.
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, request: bytes, reader: Reader) -> bool:
        """Write the request and wait for its reply; False if the socket took none of it
        (the link is then closed, and the request may go another way). Once it took a
        byte, the request is this link's: the rest is written as the socket takes it,
        and a failure is a lost reply (`Reader.lost`), never a second sending."""
        self.status, self.final, self.complete, self.keep_alive = 0, False, False, False
        self.got_bytes = False
        try:
            sent = self.sock.send(request)
        except OSError:
            sent = 0
        if sent <= 0:
            self.close()
            return False
        self.reader = reader
        if sent < len(request):  # (a socket of a full buffer: a slow or far peer)
            self.unsent = request[sent:]
            self.loop.add_writer(self.sock.fileno(), self._writable)
        return True

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.fail()
            return
        self.unsent = self.unsent[sent:]
        if not self.unsent:
            self.loop.remove_writer(self.sock.fileno())

    def pause(self) -> None:
        """Stop reading the reply (the client is not taking it as fast)."""
        if not self.paused and not self.closed:
            self.paused = True
            self.loop.remove_reader(self.sock.fileno())

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.reader = None
        if not self.paused:
            self.loop.remove_reader(self.sock.fileno())
        if self.unsent:
            self.unsent = b""
            self.loop.remove_writer(self.sock.fileno())
        self.pool.forget(self)
        self.sock.close()

    def fail(self) -> None:
        """Close the link as if its peer had: a reply it waits for is lost."""
        reader = self.reader
        self.close()
        if reader is not None:
            reader.lost(self)

    def _readable(self) -> None:
        reader = self.reader
        try:
            data = self.sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if reader is None or not data:  # (an idle link never gets bytes, only its end)
            self.close()
            if reader is not None:
                reader.lost(self)
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            # (a 101: no request sent here asks to switch protocols) the reply is lost
            self.close()
            reader.lost(self)
            return
        if self.complete:
            self.reader = None
        reader.reply(data, self)

    # httptools callbacks

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200:  # not an interim reply (103 Early Hints), which passes through
            self.final = True
            self.status = status
            self.keep_alive = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        if self.final:
            self.complete = True


class Links:
    """Idle links by address: a private socket's path, or another host's hop listener's
    `tcp://host:port`."""

    def __init__(self) -> None:
        self._idle: dict[str, list[Link]] = {}
        self._open: dict[str, set[Link]] = {}
        self._gone: frozenset[str] = frozenset()
        self._loop: asyncio.AbstractEventLoop | None = None

    def idle(self, address: str) -> Link | None:
        """An idle link to `address` kept from an earlier request, if one is fresh."""
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            link = idle.pop()
            if now - link.idle_since <= IDLE_S:
                link.reused = True
                return link
            link.close()  # (idle is the pool's own list: close's forget finds it gone)
        return None

    def get(self, path: str) -> Link | None:
        """An idle link to the private socket `path`, else a new one; None if none
        connects at once."""
        link = self.idle(path)
        if link is not None:
            return link
        loop = self._loop
        if loop is None:  # (made before the loop runs; asking costs a system call)
            loop = self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except OSError:  # gone, or its backlog is full: the forwarder decides
            sock.close()
            return None
        return Link(sock, path, loop, self)

    async def connect(self, address: str) -> Link:
        """A new link to another host's hop listener (`address`, `tcp://host:port`),
        TCP_NODELAY set, each address its name resolves to tried in turn (as the
        forwarder's `connect` does); raises `ClaimantUnavailable` as that would (a
        refused connection included: only the live set says a worker of another host is
        dead), `ClaimantGone` if the live set named it dead meanwhile. The caller bounds
        the wait."""
        loop = asyncio.get_running_loop()
        host, port = tcp_endpoint(address)
        try:
            found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ClaimantUnavailable(f"cannot connect to {address}: {exc!r}") from exc
        error: OSError = OSError(f"{host} resolves to no address")
        for family, kind, proto, _, where in found:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, where)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:  # cancelled: the wait ran out, or the worker stops
                sock.close()
                raise
            if address in self._gone:  # (named dead while it connected): nothing goes there
                sock.close()
                raise ClaimantGone(f"{address} is another host's worker known dead")
            return Link(sock, address, loop, self)
        if isinstance(error, ConnectionRefusedError):
            raise ClaimantUnavailable(f"{address} refused the connection") from error
        raise ClaimantUnavailable(f"cannot connect to {address}: {error!r}") from error

    def put(self, link: Link) -> None:
        """A link whose reply is complete and that its server keeps open."""
        link.idle_since = time.monotonic()
        self._idle.setdefault(link.path, []).append(link)

    def opened(self, link: Link) -> None:
        """A new link (until it closes, `set_gone` can end it)."""
        self._open.setdefault(link.path, set()).add(link)

    def forget(self, link: Link) -> None:
        """A link that closed: no longer idle, nor open."""
        idle = self._idle.get(link.path)
        if idle and link in idle:
            idle.remove(link)
        opened = self._open.get(link.path)
        if opened is not None:
            opened.discard(link)
            if not opened:
                del self._open[link.path]

    def set_gone(self, addresses: frozenset[str]) -> None:
        """The hop listeners of other hosts' workers known dead (the forwarder's
        `set_gone`): a reply one of them owes is lost (the passthrough answers 410
        before it began, cuts it after), and no new link to one is kept."""
        for address in addresses - self._gone:
            for link in list(self._open.get(address, ())):
                link.fail()
        self._gone = addresses

    def discard(self, path: str) -> None:
        for link in self._idle.pop(path, []):
            link.close()

    def close(self) -> None:
        for path in list(self._idle):
            self.discard(path)

