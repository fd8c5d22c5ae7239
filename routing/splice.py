"""Links to other workers' private sockets for the passthrough (front.py): plain
non-blocking sockets on the event loop, a request's bytes written once, the reply's bytes
handed on as they arrive, parsed only to find where the reply ends.

A link is connected synchronously (a Unix socket connects at once or not at all), so a
request never waits on a connect here: a holder that does not take the connection at
once is left to the router's forwarder (forward.py), which knows how to wait and retry.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Protocol

import httptools

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
    """One connection to a worker's private socket."""

    __slots__ = (
        "closed", "complete", "final", "got_bytes", "idle_since", "keep_alive", "loop",
        "parser", "path", "paused", "pool", "reader", "reused", "sock", "status",
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
        # Watched for as long as it is open: an idle link that turns readable was closed.
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, request: bytes, reader: Reader) -> bool:
        """Write the whole request and wait for its reply; False if the socket would not
        take all of it at once (the link is then closed)."""
        self.status, self.final, self.complete, self.keep_alive = 0, False, False, False
        self.got_bytes = False
        try:
            sent = self.sock.send(request)
        except OSError:
            sent = -1
        if sent != len(request):
            self.close()
            return False
        self.reader = reader
        return True

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
        self.pool.forget(self)
        self.sock.close()

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
        except httptools.HttpParserError:
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
    """Idle links by private socket path."""

    def __init__(self) -> None:
        self._idle: dict[str, list[Link]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self, path: str) -> Link | None:
        """An idle link to `path`, else a new one; None if none connects at once."""
        idle = self._idle.get(path)
        now = time.monotonic()
        while idle:
            link = idle.pop()
            if now - link.idle_since <= IDLE_S:
                link.reused = True
                return link
            link.close()  # (idle is the pool's own list: close's forget finds it gone)
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

    def put(self, link: Link) -> None:
        """A link whose reply is complete and that the private server keeps open."""
        link.idle_since = time.monotonic()
        self._idle.setdefault(link.path, []).append(link)

    def forget(self, link: Link) -> None:
        """A link that closed: no longer idle."""
        idle = self._idle.get(link.path)
        if idle and link in idle:
            idle.remove(link)

    def discard(self, path: str) -> None:
        for link in self._idle.pop(path, []):
            link.close()

    def close(self) -> None:
        for path in list(self._idle):
            self.discard(path)

