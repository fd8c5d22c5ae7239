"""A floor for a candidate design: the holder writes a forwarded request's reply straight
to the client's socket, so the reply never crosses the receiving worker.

As in `splice_floor.py`, N uvicorn processes share one TCP port and a request whose
`cookie` header hashes (crc32) to another process is sent, as it came, to that process
over a Unix socket; no routing work on either side. Here the first request of a client
connection sent to a process carries the connection's descriptor too (`SCM_RIGHTS`);
that process serves the request with uvicorn's protocol over a transport that writes to
its copy of the client's socket. Before the reply's last bytes leave, it says the reply
is done, so that the receiving process knows the connection is its own again when the
client's next request arrives (by then the "done" is there, so a forwarded request
wakes the receiving process once, not twice). How it says so (`MODE`):

- `socket`: four bytes on the Unix socket, which the receiving process reads when the
  connection's next request arrives (6 system calls per forwarded request, as the
  splice's: the Unix socket's read moves from the holder's reply to the done);
- `memory`: a sequence number written to a shared memory map, one slot per connection
  (4 system calls).

Not a design for tether as it stands: nothing here handles a holder that dies mid-reply,
a slow client, a streamed reply or `connection: close`. It measures what such a design
could reach, against the splice floor, in the throughput benchmark's set-up
(`python -m e2e.bench.throughput --candidates`).

    python -m e2e.bench.direct_reply_floor WORKERS RUNTIME_DIR [socket|memory]
        (prints `port N`, then serves)
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import mmap
import os
import socket
import struct
import sys
import zlib
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from e2e.bench.splice_floor import run_processes

APP = "e2e.bench.throughput_app:app"
MODES = ("socket", "memory")
SLOTS = 1 << 16
"""Connection slots in each process's done map (`memory`)."""
_FRAME = struct.Struct("!IIIBB")  # connection, sequence, length, a descriptor comes, sender
_DONE = struct.Struct("!I")
_connections = itertools.count(1)
_maps: list[mmap.mmap] = []
"""Each process's done map, by index (`memory`)."""


class _Out:
    """The receiving side of the Unix socket to one other process."""

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self.loop = loop
        self.waiting: dict[int, Any] = {}
        """Connections whose reply is not known to be done, by connection (`socket`)."""
        self.stalled: set[Any] = set()
        """Of those, the ones whose next request came already."""
        self.watched = False
        self.pending = b""

    def send(self, frame: tuple[int, int, int], data: bytes, fd: int | None) -> None:
        connection, sequence, sender = frame
        message = _FRAME.pack(connection, sequence, len(data), fd is not None, sender) + data
        if fd is None:
            sent = self.sock.send(message)
        else:
            sent = self.sock.sendmsg(
                [message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        assert sent == len(message), "a prototype: the socket takes a small request whole"

    def drain(self) -> None:
        """Read the dones that came (`socket`); watch the socket while a stalled
        connection still waits for its own."""
        with contextlib.suppress(BlockingIOError):
            self.pending += self.sock.recv(1 << 16)
        pending = self.pending
        whole = len(pending) // 4 * 4
        for at in range(0, whole, 4):
            front = self.waiting.pop(_DONE.unpack_from(pending, at)[0], None)
            if front is not None:
                self.stalled.discard(front)
                front.done()
        self.pending = pending[whole:]
        if self.stalled and not self.watched:
            self.watched = True
            self.loop.add_reader(self.sock.fileno(), self.drain)
        elif not self.stalled and self.watched:
            self.watched = False
            self.loop.remove_reader(self.sock.fileno())


class _Reply(asyncio.Transport):
    """The holder's transport for a connection another process reads: writes go to its
    copy of the client's socket, joined until the turn ends or the reply does."""

    def __init__(self, sock: socket.socket, link: socket.socket, frame: tuple[int, int],
                 mode: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.sock, self.link, self.mode, self.loop = sock, link, mode, loop
        self.connection, self.sender = frame
        self.sequence = 0
        self.held = b""
        self.flush_at: asyncio.Handle | None = None
        self.closing = False
        self.protocol: asyncio.Protocol | None = None

    def write(self, data: Any) -> None:
        self.held += bytes(data)
        if self.flush_at is None:
            self.flush_at = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        held, self.held = self.held, b""
        if held:
            sent = self.sock.send(held)
            assert sent == len(held), "a prototype: the socket takes a small reply whole"

    def done(self) -> None:
        """The reply is complete: say so, then let its last bytes go."""
        if self.mode == "memory":
            _DONE.pack_into(_maps[self.sender], self.connection * 4, self.sequence)
        else:
            self.link.send(_DONE.pack(self.connection))
        self.flush()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            assert self.protocol is not None
            self.closing = True
            self.sock.close()
            self.loop.call_soon(self.protocol.connection_lost, None)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


class _Back(HttpToolsProtocol):
    def on_response_complete(self) -> None:
        transport = self.transport
        assert isinstance(transport, _Reply)
        transport.done()
        super().on_response_complete()


class _In:
    """The holder's side of one Unix socket from another process."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, make: Any, mode: str
    ) -> None:
        self.sock, self.loop, self.make, self.mode = sock, loop, make, mode
        sock.setblocking(False)
        self.buffer = b""
        self.fds: list[int] = []
        self.protocols: dict[int, _Back] = {}
        loop.add_reader(sock.fileno(), self.readable)

    def readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(64))
        except BlockingIOError:
            return
        if not data:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            return
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % 4])
                self.fds.extend(fds)
        buffer = self.buffer + data
        while len(buffer) >= _FRAME.size:
            connection, sequence, length, has_fd, sender = _FRAME.unpack_from(buffer)
            end = _FRAME.size + length
            if len(buffer) < end:
                break
            request, buffer = buffer[_FRAME.size : end], buffer[end:]
            protocol = self.protocols.get(connection)
            if has_fd:
                client = socket.socket(fileno=self.fds.pop(0))
                protocol = self.protocols[connection] = self.make()
                reply = _Reply(client, self.sock, (connection, sender), self.mode, self.loop)
                reply.protocol = protocol
                protocol.connection_made(reply)
            assert protocol is not None and isinstance(protocol.transport, _Reply)
            protocol.transport.sequence = sequence
            protocol.data_received(request)
        self.buffer = buffer


def _front_class(index: int, paths: list[str], mode: str) -> type[HttpToolsProtocol]:
    outs: dict[int, _Out] = {}

    class Front(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.connection = next(_connections) % SLOTS
            self.sequence = 0
            self.busy: _Out | None = None
            self.held: list[bytes] = []
            self.told: set[int] = set()

        def data_received(self, data: bytes) -> None:
            busy = self.busy
            if busy is not None and not self._is_done(busy):
                self.held.append(data)
                if mode == "memory":
                    if len(self.held) == 1:
                        self.loop.call_later(0.0005, self._check_again)
                else:
                    busy.stalled.add(self)
                    busy.drain()
                return
            self.busy = None
            if self.cycle is None or self.cycle.response_complete:
                at = data.find(b"\r\ncookie: ")
                if at >= 0:
                    target = zlib.crc32(data[at : data.find(b"\r\n", at + 2)]) % len(paths)
                    if target != index:
                        self._send(target, data)
                        return
            super().data_received(data)

        def _send(self, target: int, data: bytes) -> None:
            out = outs.get(target)
            if out is None:
                out = outs[target] = _Out(paths[target], self.loop)
            fd = None
            if target not in self.told:
                self.told.add(target)
                fd = self.transport.get_extra_info("socket").fileno()
            self._unset_keepalive_if_required()
            self.busy = out
            self.sequence += 1
            if mode == "socket":
                out.waiting[self.connection] = self
            out.send((self.connection, self.sequence, index), data, fd)

        def _is_done(self, busy: _Out) -> bool:
            if mode == "memory":
                done: int = _DONE.unpack_from(_maps[index], self.connection * 4)[0]
                return done == self.sequence
            busy.drain()
            return self.busy is None

        def _check_again(self) -> None:
            if self.busy is not None and not self._is_done(self.busy):
                self.loop.call_later(0.0005, self._check_again)
                return
            self.done()

        def done(self) -> None:
            self.busy = None
            if self.held:
                data, self.held = b"".join(self.held), []
                self.data_received(data)

    return Front


def serve_one(index: int, count: int, fd: int, runtime_dir: str, mode: str) -> None:
    paths = [os.path.join(runtime_dir, f"direct-{i}.sock") for i in range(count)]
    for i in range(count):
        with open(os.path.join(runtime_dir, f"done-{i}"), "r+b") as file:
            _maps.append(mmap.mmap(file.fileno(), SLOTS * 4))
    config = uvicorn.Config(APP, http=_front_class(index, paths, mode), access_log=False,
                            log_level="warning", loop="uvloop")
    server = uvicorn.Server(config)

    async def main() -> None:
        config.load()
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(paths[index])
        listener.listen(2048)
        listener.setblocking(False)
        links: list[_In] = []

        def make() -> _Back:
            return _Back(config=config, server_state=server.server_state, app_state={})

        def accept() -> None:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            links.append(_In(sock, loop, make, mode))

        loop.add_reader(listener.fileno(), accept)
        await server.serve(sockets=[socket.socket(fileno=fd)])

    import uvloop

    uvloop.run(main())


def main() -> None:
    if sys.argv[1] == "one":
        serve_one(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
                  sys.argv[6])
        return
    count, runtime_dir = int(sys.argv[1]), sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "socket"
    if mode not in MODES:
        sys.exit(f"the mode is one of {', '.join(MODES)}, not {mode!r}")
    for i in range(count):
        with open(os.path.join(runtime_dir, f"done-{i}"), "wb") as file:
            file.truncate(SLOTS * 4)
    run_processes("e2e.bench.direct_reply_floor", count, runtime_dir, "direct-{}.sock", mode)


if __name__ == "__main__":
    main()
