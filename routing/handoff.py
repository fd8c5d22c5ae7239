"""Connection handoff: the receiving worker passes a client's connection itself to the
worker of this host that holds the session its first request names, with the bytes it
already read (SCM_RIGHTS over a Unix datagram socket); the holder serves the connection
as if it had accepted it, sees the caller's real address, and nothing is copied after.

Only a connection's first request moves it, and a connection moves once: a later request
on it for a session another worker holds takes the passthrough or the copying path from
the worker that has it (front.py). A connection that keeps one session (an agent's, a
kernel client's, an MCP client's) is then served with no hop at all; a load balancer's
pool of mixed sessions costs one move per connection, not one per request (moving on
every request was measured slower than copying: docs/architecture.md).

Each worker binds `w/<id>.handoff` (0600, in the 0700 runtime directory) as a datagram
socket. A message is one whole request's bytes with the connection's descriptor. A send
that does not go through at once (the holder's queue full, its socket not bound yet or
gone) leaves the connection where it is, and its request takes the passthrough. A message
the holder never reads (it died with it queued) closes its connection unanswered, as a
connection in a dead server's listen backlog is reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

import structlog

__all__ = ["MAX_MESSAGE", "HandoffReceiver", "Handoffs"]

log = structlog.get_logger("tether.handoff")

_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)  # (AF_UNIX: `--uds`)
MAX_MESSAGE = (1 << 16) + 1
"""The largest request a handoff carries, and one byte more to tell a longer one."""


class Handoffs:
    """The sending side: one connected datagram socket per holder's handoff socket."""

    def __init__(self, path_of: Callable[[str], str]) -> None:
        """`path_of`: a worker's handoff socket."""
        self.path_of = path_of
        self._sockets: dict[str, socket.socket] = {}

    def send(self, worker: str, connection: int, data: bytes) -> bool:
        """Pass the connection whose descriptor is `connection`, and the request `data`
        read from it, to `worker`; False (nothing sent) if that cannot be done at once."""
        sock = self._sockets.get(worker)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            try:
                sock.connect(self.path_of(worker))
            except OSError:
                sock.close()
                return False
            self._sockets[worker] = sock
        try:
            socket.send_fds(sock, [data], [connection])
        except BlockingIOError:
            return False  # its queue is full: it is busy, the passthrough takes this one
        except OSError:
            del self._sockets[worker]  # it went away (a new socket is tried next time)
            sock.close()
            return False
        return True

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


class HandoffReceiver:
    """The holder's side: takes connections other workers pass here and serves each with
    the protocol `serve` makes for it from the bytes already read."""

    def __init__(self, path: str, serve: Callable[[bytes], asyncio.Protocol]) -> None:
        self.path = path
        self.serve = serve
        self.taken = 0
        """Connections handed here and served."""
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Bind the socket (0600) and take connections on the running loop."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)  # (the directory is 0700: nobody sent before this)
            sock.setblocking(False)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(sock.fileno(), self._readable)
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self._sock = sock

    async def stop(self) -> None:
        """Take no more connections; those already handed here are the server's to close."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        assert self._loop is not None
        self._loop.remove_reader(sock.fileno())
        # Senders connected already get EPIPE from now on (and take the passthrough); what
        # they sent before is served, not dropped.
        sock.shutdown(socket.SHUT_RD)
        self._readable_from(sock)
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _readable(self) -> None:
        if self._sock is not None:
            self._readable_from(self._sock)

    def _readable_from(self, sock: socket.socket) -> None:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(
                    sock, MAX_MESSAGE, 1, socket.MSG_CMSG_CLOEXEC  # (as accepted sockets are)
                )
            except BlockingIOError:
                return
            except OSError:  # (a descriptor limit reached, say): its sender's fd is closed
                log.exception("handoff_receive_failed")
                return
            self._take(data, fds, flags)

    def _take(self, data: bytes, fds: list[int], flags: int) -> None:
        if len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not data:
            for fd in fds:
                os.close(fd)
            log.warning("handoff_refused", reason="not one connection and one request",
                        descriptors=len(fds), size=len(data))
            return
        try:
            connection = socket.socket(fileno=fds[0])
        except OSError:  # not a socket at all
            os.close(fds[0])
            log.warning("handoff_refused", reason="not a socket")
            return
        if connection.type != socket.SOCK_STREAM or connection.family not in _FAMILIES:
            connection.close()
            log.warning("handoff_refused", reason="not a stream connection")
            return
        assert self._loop is not None
        task = self._loop.create_task(self._connect(connection, data), name="tether-handoff")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, connection: socket.socket, data: bytes) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(lambda: self.serve(data), connection)
        except Exception:
            connection.close()
            log.exception("handoff_failed")
            return
        self.taken += 1
