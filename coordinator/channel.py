"""The coordinator channel: framed request/reply over a Unix stream socket.

Either side of a `Channel` may call the other (`request`, `notify`); a `Handler` answers
incoming calls. `ChannelServer` (in the main process) turns each accepted connection
into a `Channel`; `connect` (in a worker) opens one.

Errors::

    TetherError
    └── RemoteError   the peer answered with an error reply: its code, status, detail
    ChannelLost       the connection is gone (the peer vanished, or close() ran)
    TimeoutError      no reply within the call's timeout
    FrameError        (framing) a message that cannot be encoded within the frame limit

Guarantees the coordinator relies on:

- Frames go out in the order they are produced: `StreamWriter.write` is synchronous
  and appends a whole frame to the transport's buffer, so frames cannot interleave and
  no lock is needed; `drain` only waits for buffer space.
- Incoming requests and notifications each get their own task, created in arrival
  order, so their handlers *start* in arrival order (they may finish in any order).
  A reply wakes its caller before any later message's handler starts.
- A malformed frame closes that connection and is logged; it never raises out of the
  reader or the server.
- A reply whose `reply_to` was never sent on this channel is malformed (the connection
  closes). A reply to a call that already timed out or was cancelled is logged and
  ignored: it is the normal outcome of a late answer.
- When the connection is lost, every pending call fails with `ChannelLost` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from tether.coordinator.framing import (
    MAX_FRAME,
    ErrorReply,
    FrameDecoder,
    FrameError,
    Message,
    Notification,
    Reply,
    Request,
    encode_frame,
    parse_message,
)
from tether.routing.errors import TetherError
from tether.routing.tracing import carrier, continued

__all__ = [
    "INTERNAL_ERROR",
    "Channel",
    "ChannelLost",
    "ChannelServer",
    "Handler",
    "RemoteError",
    "connect",
]

Handler = Callable[[str, Any], Awaitable[Any]]
"""Answers one incoming call: `(kind, body) -> reply body`.

Raising `TetherError` sends an error reply with its status, code and detail; any other
exception sends `500 internal_error`. For notifications the result is dropped.
"""

INTERNAL_ERROR = "internal_error"
_READ_SIZE = 64 * 1024

_log = structlog.get_logger()


class ChannelLost(Exception):
    """The channel's connection is gone; the call cannot complete."""


class RemoteError(TetherError):
    """The peer answered a call with an error reply.

    `code`, `status`, `detail` and `extra` are the reply's, so an error crosses the
    process boundary unchanged and `body()` is the same on both sides. `code` may be
    `"internal_error"` (status 500), which the peer sends for an unexpected exception
    and which is not in `routing.errors.ERRORS`.
    """

    def __init__(
        self, status: int, code: str, detail: Any = None, extra: dict[str, Any] | None = None
    ) -> None:
        # The peer's code is only known to be a str: "internal_error" is outside
        # ErrorCode. A non-None detail keeps TetherError from looking the code up.
        super().__init__(code, "" if detail is None else detail)  # type: ignore[arg-type]
        self.detail = detail
        self.extra = dict(extra or {})
        self._status = status

    @property
    def status(self) -> int:
        return self._status


class Channel:
    """One framed connection on which either side may call the other.

    `handler` answers incoming calls; it may be replaced before `start()`.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        *,
        name: str = "",
        max_frame: int = MAX_FRAME,
        default_timeout: float = 30.0,
    ) -> None:
        self.handler = handler
        self.name = name
        self.max_frame = max_frame
        self.default_timeout = default_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder(max_frame)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._last_id = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Channel {self.name!r} {state} pending={len(self._pending)}>"

    @property
    def closed(self) -> bool:
        """True once the channel is closing or closed: no call can be made on it."""
        return self._close_task is not None

    @property
    def pending_calls(self) -> int:
        """Calls sent on this channel that are still waiting for a reply."""
        return len(self._pending)

    def start(self) -> None:
        """Start reading; the reader task belongs to the channel and ends with it."""
        if self._reader_task is not None or self.closed:
            raise RuntimeError(f"{self!r} was already started or closed")
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"{self._label} reader")

    # Every call has a deadline by contract, so the timeout is part of the call itself.
    async def request(
        self,
        kind: str,
        body: Any = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Call the peer and return its reply body.

        Raises `RemoteError` for an error reply, `ChannelLost` if the connection is or
        goes away, `TimeoutError` after `timeout` (default `default_timeout`) seconds,
        and `FrameError` if the request cannot be encoded within the frame limit.
        """
        if self.closed:
            raise ChannelLost(f"{self._label} is closed")
        self._last_id += 1
        call_id = self._last_id
        request = Request(call_id, kind, body, carrier())
        frame = encode_frame(request.to_wire(), max_frame=self.max_frame)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        limit = self.default_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await self._send(frame)
                return await future
        except TimeoutError:
            raise TimeoutError(f"{self._label}: no reply to {kind!r} within {limit}s") from None
        finally:
            self._pending.pop(call_id, None)
            # A write failure raises ChannelLost itself; mark the future's copy as seen.
            if future.done() and not future.cancelled():
                future.exception()

    async def notify(self, kind: str, body: Any = None) -> None:
        """Send a one-way message; raises `ChannelLost` if the connection is gone."""
        if self.closed:
            raise ChannelLost(f"{self._label} is closed")
        await self._send(encode_frame(Notification(kind, body).to_wire(), max_frame=self.max_frame))

    async def close(self) -> None:
        """Close the channel and wait until its tasks and socket are gone. Idempotent.

        Pending calls fail with `ChannelLost` at once. Cancelling the caller does not
        stop the cleanup, which runs in a task of its own.
        """
        await asyncio.shield(self._begin_close("closed locally"))

    async def wait_closed(self) -> None:
        """Return once the channel is closed, whether by `close()` or by losing the peer."""
        await self._closed.wait()

    # -- internals ------------------------------------------------------------------

    @property
    def _label(self) -> str:
        return f"channel {self.name!r}" if self.name else "channel"

    async def _send(self, frame: bytes) -> None:
        if self.closed:
            raise ChannelLost(f"{self._label} is closed")
        self._writer.write(frame)
        self.bytes_sent += len(frame)
        try:
            await self._writer.drain()
        except OSError as exc:  # ConnectionResetError, BrokenPipeError
            self._begin_close(f"write failed: {exc!r}")
            raise ChannelLost(f"{self._label}: peer lost while writing") from exc

    async def _read_loop(self) -> None:
        reason = "peer closed the connection"
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    break
                self.bytes_received += len(data)
                for obj in self._decoder.feed(data):
                    self._dispatch(parse_message(obj))
        except FrameError as exc:
            reason = f"malformed frame: {exc}"
            _log.warning("channel_malformed_frame", channel=self.name, error=str(exc))
        except OSError as exc:
            reason = f"read failed: {exc!r}"
        except Exception as exc:  # a bug here must close the channel, not hang its calls
            reason = f"reader failed: {exc!r}"
            _log.exception("channel_reader_failed", channel=self.name)
        if not self.closed:
            _log.debug("channel_lost", channel=self.name, reason=reason)
        self._begin_close(reason)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Request | Notification):
            kind = message.kind
            task = asyncio.create_task(self._serve(message), name=f"{self._label} {kind}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        future = self._pending.get(message.reply_to)
        if future is None or future.done():
            if not 0 < message.reply_to <= self._last_id:
                raise FrameError(f"reply to request {message.reply_to}, which was never sent")
            _log.info("channel_late_reply_ignored", channel=self.name, reply_to=message.reply_to)
            return
        if isinstance(message, Reply):
            future.set_result(message.body)
        else:
            error = RemoteError(message.status, message.code, message.detail, message.extra)
            future.set_exception(error)

    async def _serve(self, message: Request | Notification) -> None:
        reply: Reply | ErrorReply
        try:
            with continued(message.trace if isinstance(message, Request) else None):
                result = await self.handler(message.kind, message.body)
        except TetherError as exc:
            _log.info(
                "channel_handler_refused", channel=self.name, kind=message.kind, code=exc.code
            )
            if isinstance(message, Notification):
                return
            reply = ErrorReply(message.id, exc.status, exc.code, exc.detail, exc.extra)
        except Exception as exc:
            _log.exception("channel_handler_failed", channel=self.name, kind=message.kind)
            if isinstance(message, Notification):
                return
            reply = ErrorReply(message.id, 500, INTERNAL_ERROR, str(exc))
        else:
            if isinstance(message, Notification):
                return
            reply = Reply(message.id, result)
        try:
            frame = encode_frame(reply.to_wire(), max_frame=self.max_frame)
        except FrameError as exc:
            _log.error("channel_reply_unencodable", channel=self.name, kind=message.kind)
            fallback = ErrorReply(message.id, 500, INTERNAL_ERROR, f"reply cannot be sent: {exc}")
            frame = encode_frame(fallback.to_wire(), max_frame=self.max_frame)
        # The peer may be gone already; then nobody is waiting for this reply.
        with contextlib.suppress(ChannelLost):
            await self._send(frame)

    def _begin_close(self, reason: str) -> asyncio.Task[None]:
        if self._close_task is None:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ChannelLost(f"{self._label} lost: {reason}"))
            self._close_task = asyncio.create_task(
                self._finish_close(), name=f"{self._label} close"
            )
        return self._close_task

    async def _finish_close(self) -> None:
        tasks = [*self._tasks]
        if self._reader_task is not None:
            tasks.append(self._reader_task)
        for task in tasks:
            task.cancel()
        self._writer.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
        self._closed.set()


async def connect(
    path: str | os.PathLike[str],
    handler: Handler,
    *,
    name: str = "",
    max_frame: int = MAX_FRAME,
    default_timeout: float = 30.0,
) -> Channel:
    """Connect to a `ChannelServer` at `path` and return the started channel."""
    reader, writer = await asyncio.open_unix_connection(os.fspath(path))
    channel = Channel(
        reader, writer, handler, name=name, max_frame=max_frame, default_timeout=default_timeout
    )
    channel.start()
    return channel


async def _no_handler(kind: str, body: Any) -> Any:
    raise RuntimeError(f"no handler installed for {kind!r}")


class ChannelServer:
    """Serves a Unix socket (mode 0600); each connection becomes a started `Channel`.

    For each connection, `handler_factory(channel)` runs first, before any message is
    read, so it is the place to create per-connection state and return the handler
    that closes over it. Then the channel starts and `on_channel(channel)` is awaited;
    it may make calls (e.g. a welcome). An exception from either is logged and closes
    that connection only. `on_channel` may also wait for `channel.wait_closed()` to
    clean up after a lost peer; it must return once its channel is closed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler_factory: Callable[[Channel], Handler],
        *,
        on_channel: Callable[[Channel], Awaitable[None]] | None = None,
        name: str = "coordinator",
        max_frame: int = MAX_FRAME,
        default_timeout: float = 30.0,
        backlog: int = 128,
    ) -> None:
        self.path = os.fspath(path)
        self.name = name
        self.max_frame = max_frame
        self.default_timeout = default_timeout
        self._handler_factory = handler_factory
        self._on_channel = on_channel
        self._backlog = backlog
        self._server: asyncio.Server | None = None
        self._inode: int | None = None
        self._closing = False
        self._accepted = 0
        self._channels: set[Channel] = set()
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def channels(self) -> frozenset[Channel]:
        """The channels currently open on this server."""
        return frozenset(self._channels)

    async def start(self) -> None:
        """Bind the socket (0600 before anyone can connect) and start accepting."""
        if self._server is not None or self._closing:
            raise RuntimeError("ChannelServer was already started or closed")
        sock = _bind_unix_socket(self.path, self._backlog)
        self._inode = os.stat(self.path).st_ino
        self._server = await asyncio.start_unix_server(self._accept, sock=sock)

    async def close(self) -> None:
        """Stop accepting, close every channel and wait for all of it. Idempotent."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        # A connection accepted just before close() may not have run its callback yet.
        await asyncio.sleep(0)
        while self._connections or self._channels:
            await asyncio.gather(*(channel.close() for channel in [*self._channels]))
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self._unlink_socket()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._accepted += 1
        channel = Channel(
            reader,
            writer,
            _no_handler,
            name=f"{self.name}#{self._accepted}",
            max_frame=self.max_frame,
            default_timeout=self.default_timeout,
        )
        try:
            if self._closing:
                return
            self._channels.add(channel)
            channel.handler = self._handler_factory(channel)
            channel.start()
            if self._on_channel is not None:
                await self._on_channel(channel)
            await channel.wait_closed()
        except Exception:
            _log.exception("channel_setup_failed", channel=channel.name)
        finally:
            await channel.close()
            self._channels.discard(channel)
            self._connections.discard(task)

    def _unlink_socket(self) -> None:
        # Remove the socket file only if it is still the one this server bound.
        with contextlib.suppress(FileNotFoundError):
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        self._inode = None


def _bind_unix_socket(path: str, backlog: int) -> socket.socket:
    """A listening, non-blocking Unix socket at `path` with mode 0600."""
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Before listen(): until then a connect() is refused, so nobody gets in early.
        os.chmod(path, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _remove_stale_socket(path: str) -> None:
    """Unlink a socket file nobody listens on; refuse to steal a live one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
            return
    raise OSError(f"{path} is already served by a live process")
