"""Connection handoff: the receiving worker passes a client's connection itself to the
worker of this host that holds the session its first request names, with the bytes it
already read (SCM_RIGHTS); the holder serves the connection as if it had accepted it,
sees the caller's real address, and nothing is copied after.

Only a connection's first request moves it, and a connection moves once: a later request
on it for a session another worker holds takes the passthrough or the copying path from
the worker that has it (front.py). A connection that keeps one session (an agent's, a
kernel client's, an MCP client's) is then served with no hop at all; a load balancer's
pool of mixed sessions costs one move per connection, not one per request (moving on
every request was measured slower than copying: docs/architecture.md).

A move is acknowledged. Each worker listens on `w/<id>.handoff` (0600, in the 0700
runtime directory), a Unix seqpacket socket; each other worker keeps one connection to
it. A move is one message: its number and the request's bytes, with the connection's
descriptor. The holder answers each with its number and whether it took the connection,
before it serves a byte of it. The sender keeps its own descriptor, and stops reading
it, until that answer: taken, it drops the descriptor. Refused (the holder could not
receive the descriptor: out of them, say), the channel closing with the move unanswered
(the holder crashed, or stopped with it queued), or no answer within MOVE_TIMEOUT_S (its
loop is stuck): it serves the request itself the copying way, whose 410 and 503 rules
answer it (SPEC 4.5). A move is answered or given back, never both: a holder that cannot
send its answer does not take the connection, and a sender shuts its channel for
reading before it gives the unanswered moves back, so no answer can arrive after. A send
that does not go through at once (the holder's queue full, its socket not bound yet or
gone) leaves the request to the passthrough.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
from collections.abc import Callable
from typing import Protocol

import structlog

__all__ = ["MAX_REQUEST", "MOVE_TIMEOUT_S", "HandoffReceiver", "Handoffs", "Mover"]

log = structlog.get_logger("tether.handoff")

_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)  # (AF_UNIX: `--uds`)
MAX_REQUEST = 1 << 16
"""The largest request a move carries."""
_NUMBER = struct.Struct("<Q")
"""A move's number, which leads its message."""
_ANSWER = struct.Struct("<Q?")
"""The holder's answer to a move: its number, and whether it took the connection."""
_LARGEST = _NUMBER.size + MAX_REQUEST + 1  # (one byte more tells a longer message)
MOVE_TIMEOUT_S = 5.0
"""How long a sender waits for a holder's answer to a move (as the forwarder waits for a
connection to it) before it takes its moves back."""
_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNREFUSED})
"""A send's errors that say the holder's side of the channel is closed."""


class Mover(Protocol):
    """The sender's side of one connection being moved, told how its move ended."""

    def moved(self) -> None:
        """The holder took the connection: drop this worker's descriptor of it."""

    def kept(self) -> None:
        """The holder did not take it: serve its request here."""


class _Channel:
    """One sender's connection to one holder's handoff socket, with its moves that are
    not answered yet."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, timeout: float
    ) -> None:
        self.sock = sock
        self.loop = loop
        self.timeout = timeout
        self.pending: dict[int, tuple[Mover, float]] = {}
        """Each unanswered move's mover and when it was sent, oldest first."""
        self._next = 0
        self._deadline: asyncio.TimerHandle | None = None
        self.closed = False
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, connection: int, data: bytes, mover: Mover) -> bool:
        number = self._next
        try:
            socket.send_fds(self.sock, [_NUMBER.pack(number), data], [connection])
        except OSError as error:
            if error.errno in _GONE:
                self.close()  # it went away (a new socket is tried next time)
            return False  # (its queue full, say: it is busy, the passthrough takes this one)
        self._next = number + 1
        self.pending[number] = (mover, self.loop.time())
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.timeout, self._expire)
        return True

    def _readable(self) -> None:
        if not self._answer_all():
            self.close()

    def _answer_all(self) -> bool:
        """Tell the movers of every answer that is here; False once the holder closed
        its side. (With a move of ours unread, the holder's close reads as a reset first,
        and its answers come after.)"""
        reset = False
        while True:
            try:
                message = self.sock.recv(_ANSWER.size + 1)
            except BlockingIOError:
                return not reset
            except ConnectionResetError:
                reset = True
                continue
            except OSError:
                return False
            if len(message) != _ANSWER.size:
                return False
            number, taken = _ANSWER.unpack(message)
            mover, _ = self.pending.pop(number, (None, 0.0))
            if mover is None:
                continue
            if taken:
                mover.moved()
            else:
                mover.kept()

    def _expire(self) -> None:
        """A holder that answers no move within the timeout (its loop stuck, or it is
        stopped) gets none: its channel closes, and its moves go back."""
        self._deadline = None
        if not self.pending:
            return
        _, sent = next(iter(self.pending.values()))
        left = sent + self.timeout - self.loop.time()
        if left > 0:
            self._deadline = self.loop.call_later(left, self._expire)
            return
        log.warning("handoff_unanswered", moves=len(self.pending), after_s=self.timeout)
        self.close()

    def close(self) -> None:
        """Close the channel and give every move the holder has not answered back to its
        connection. Shut for reading first: from then on the holder cannot answer (it
        gets EPIPE, and does not take the move), so a move is either answered here or
        given back, never both."""
        if self.closed:
            return
        self.closed = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        try:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RD)
            self._answer_all()
        finally:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            pending, self.pending = self.pending, {}
            for mover, _ in pending.values():
                try:
                    mover.kept()
                except Exception:
                    log.exception("handoff_take_back_failed")


class Handoffs:
    """The sending side: one channel per holder's handoff socket."""

    def __init__(
        self, path_of: Callable[[str], str], move_timeout: float = MOVE_TIMEOUT_S
    ) -> None:
        """`path_of`: a worker's handoff socket; `move_timeout`: how long a move waits
        for its answer before it is taken back."""
        self.path_of = path_of
        self.move_timeout = move_timeout
        self._channels: dict[str, _Channel] = {}

    def send(self, worker: str, connection: int, data: bytes, mover: Mover) -> bool:
        """Start moving the connection whose descriptor is `connection`, and the request
        `data` read from it, to `worker`; `mover` is told how it ended. False (nothing
        sent, `mover` never told) if that cannot be done at once."""
        channel = self._channels.get(worker)
        if channel is None or channel.closed:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.setblocking(False)
            try:
                sock.connect(self.path_of(worker))
            except OSError:
                sock.close()
                return False
            channel = self._channels[worker] = _Channel(
                sock, asyncio.get_running_loop(), self.move_timeout
            )
        return channel.send(connection, data, mover)

    def close(self) -> None:
        """Close every channel (once the public server's connections are closed)."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class HandoffReceiver:
    """The holder's side: takes connections other workers pass here and serves each with
    the protocol `serve` makes for it from the bytes already read."""

    def __init__(self, path: str, serve: Callable[[bytes], asyncio.Protocol]) -> None:
        self.path = path
        self.serve = serve
        self.taken = 0
        """Connections handed here and served."""
        self._listener: socket.socket | None = None
        self._channels: set[socket.socket] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Bind the socket (0600) and take connections on the running loop."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)  # (the directory is 0700: nobody connected before)
            sock.listen(128)
            sock.setblocking(False)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(sock.fileno(), self._accept)
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self._listener = sock

    async def stop(self) -> None:
        """Take no more connections: those already sent here are taken and served, later
        ones go back to their senders (who see the channel close). Those handed here are
        the server's to close."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        assert self._loop is not None
        self._loop.remove_reader(listener.fileno())
        self._accept_from(listener)
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for channel in list(self._channels):
            self._readable(channel)
            self._close(channel)
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _accept(self) -> None:
        if self._listener is not None:
            self._accept_from(self._listener)

    def _accept_from(self, listener: socket.socket) -> None:
        assert self._loop is not None
        while True:
            try:
                channel, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError:  # (a descriptor limit reached, say): its sender retries later
                log.exception("handoff_accept_failed")
                return
            channel.setblocking(False)
            self._channels.add(channel)
            self._loop.add_reader(channel.fileno(), self._readable, channel)

    def _close(self, channel: socket.socket) -> None:
        if channel in self._channels:
            self._channels.discard(channel)
            assert self._loop is not None
            self._loop.remove_reader(channel.fileno())
            channel.close()

    def _readable(self, channel: socket.socket) -> None:
        while channel in self._channels:
            try:
                data, fds, flags, _ = socket.recv_fds(
                    channel, _LARGEST, 1, socket.MSG_CMSG_CLOEXEC  # (as accepted sockets are)
                )
            except BlockingIOError:
                return
            except OSError:
                log.exception("handoff_receive_failed")
                data, fds, flags = b"", [], 0
            if not data and not fds:  # the sender closed its side
                self._close(channel)
                return
            self._take(channel, data, fds, flags)

    def _take(self, channel: socket.socket, data: bytes, fds: list[int], flags: int) -> None:
        connection = self._connection(data, fds, flags)
        if len(data) < _NUMBER.size:
            if connection is not None:
                connection.close()
            self._close(channel)  # not a move at all: nothing to answer
            return
        (number,) = _NUMBER.unpack_from(data)
        try:
            channel.send(_ANSWER.pack(number, connection is not None))
        except OSError:  # (its queue full, or it is gone): it takes its moves back
            if connection is not None:
                connection.close()
            self._close(channel)
            return
        if connection is None:
            return
        assert self._loop is not None
        task = self._loop.create_task(
            self._connect(connection, data[_NUMBER.size :]), name="tether-handoff"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _connection(self, data: bytes, fds: list[int], flags: int) -> socket.socket | None:
        """The client connection a move's message carries; None (its descriptors closed)
        for a message that is not one request and one stream connection."""
        request_size = len(data) - _NUMBER.size
        if (
            len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC)
            or not 0 < request_size <= MAX_REQUEST
        ):
            for fd in fds:
                os.close(fd)
            log.warning("handoff_refused", reason="not one connection and one request",
                        descriptors=len(fds), size=request_size)
            return None
        try:
            connection = socket.socket(fileno=fds[0])
        except OSError:  # not a socket at all
            os.close(fds[0])
            log.warning("handoff_refused", reason="not a socket")
            return None
        if connection.type != socket.SOCK_STREAM or connection.family not in _FAMILIES:
            connection.close()
            log.warning("handoff_refused", reason="not a stream connection")
            return None
        return connection

    async def _connect(self, connection: socket.socket, data: bytes) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(lambda: self.serve(data), connection)
        except Exception:  # (the sender dropped its descriptor: unanswered, as in a crash)
            connection.close()
            log.exception("handoff_failed")
            return
        self.taken += 1
