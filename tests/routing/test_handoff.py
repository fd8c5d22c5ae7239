"""Connection handoff (routing/handoff.py) in-process: real workers on real sockets, each
running `FrontProtocol` and taking handed-off connections as `tether serve` does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.routing.apps import session_app
from tests.routing.conftest import Cluster, Node
from tests.routing.test_hop import seeded
from tether.routing.handoff import Handoffs
from tether.routing.worker import handoff_path


def port_of(node: Node) -> int:
    return int(node.url.rsplit(":", 1)[1])


class Connection:
    """One kept-alive client connection that sends exactly the cookie it is told."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, node: Node) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port_of(node)))

    async def get(self, path: str, cookies: httpx.Cookies | None = None) -> tuple[int, Any]:
        cookie = "; ".join(f"{name}={value}" for name, value in (cookies or {}).items())
        lines = [f"GET {path} HTTP/1.1", "host: test"] + ([f"cookie: {cookie}"] if cookie else [])
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = await self.reader.readexactly(length)
        return int(head.split(b" ", 2)[1]), json.loads(body)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def on_one_connection(
    node: Node, *requests: tuple[str, httpx.Cookies | None]
) -> list[tuple[int, Any]]:
    """Each `(path, cookies)` as a GET, in turn, on one new connection to `node`."""
    connection = await Connection.to(node)
    try:
        return [await connection.get(path, cookies) for path, cookies in requests]
    finally:
        await connection.close()


async def test_a_connections_first_request_for_another_workers_session_moves_it_to_the_holder(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "moved")
    local_before = a.routing.router.stats.local

    replies = await on_one_connection(b, *[("/touch", cookies)] * 3)

    assert [(status, body["worker"], body["n"]) for status, body in replies] == [
        (200, a.id, 1), (200, a.id, 2), (200, a.id, 3)
    ]
    sa, sb = a.routing.router.stats, b.routing.router.stats
    assert (sb.forwarded, sb.handed_off, sb.passed_through) == (1, 1, 0)
    assert sa.served_forwarded == 1  # the first, as a forwarded request
    assert sa.local - local_before == 2  # the later ones: the holder's own
    assert a.routing.handoffs is not None and a.routing.handoffs.taken == 1


async def test_the_holder_of_a_handed_off_connection_sees_the_callers_own_address(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "address")

    connection = await Connection.to(b)
    try:
        caller = list(connection.writer.get_extra_info("sockname"))
        status, seen = await connection.get("/whoami", cookies)
    finally:
        await connection.close()

    assert status == 200 and seen["worker"] == a.id
    assert seen["client"] == caller
    assert seen["server"] == ["127.0.0.1", port_of(b)]  # the socket the caller reached
    assert b.routing.router.stats.handed_off == 1


async def test_a_later_request_for_another_workers_session_passes_through_and_never_moves_it_again(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    on_a, on_b = await seeded(a, "first"), await seeded(b, "later")

    # The first moves the connection to a; the second, b's, a sends back as bytes.
    first, later, again = await on_one_connection(
        b, ("/touch", on_a), ("/touch", on_b), ("/touch", on_a)
    )

    assert [(s, body["worker"]) for s, body in (first, later, again)] == [
        (200, a.id), (200, b.id), (200, a.id)
    ]
    sa, sb = a.routing.router.stats, b.routing.router.stats
    assert (sb.handed_off, sa.handed_off) == (1, 0)
    assert sa.passed_through == 1


async def test_a_holder_that_takes_no_handoffs_gets_the_first_request_by_the_passthrough(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "fallback")
    await a.routing.stop_handoffs()  # its handoff socket is gone
    directory, name = handoff_path(cluster.runtime_dir, a.id).rsplit("/", 1)
    assert name not in os.listdir(directory)

    ((status, body),) = await on_one_connection(b, ("/touch", cookies))

    assert (status, body["worker"]) == (200, a.id)
    sb = b.routing.router.stats
    assert (sb.handed_off, sb.passed_through) == (0, 1)


async def test_a_sender_connected_before_the_holder_stopped_taking_handoffs_passes_through(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "stopped")
    # b's socket to a's handoff socket is open after this move.
    ((_, moved),) = await on_one_connection(b, ("/touch", cookies))
    assert moved["worker"] == a.id
    await a.routing.stop_handoffs()

    ((status, body),) = await on_one_connection(b, ("/touch", cookies))

    assert (status, body["worker"], body["n"]) == (200, a.id, 2)
    sb = b.routing.router.stats
    assert (sb.handed_off, sb.passed_through) == (1, 1)


async def test_a_request_with_no_session_keeps_its_connection_where_it_landed(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "stays")

    # The second is no longer the connection's first: passed through.
    plain, touched = await on_one_connection(b, ("/health", None), ("/touch", cookies))

    assert (plain[1]["worker"], touched[1]["worker"]) == (b.id, a.id)
    sb = b.routing.router.stats
    assert (sb.handed_off, sb.passed_through) == (0, 1)


async def answer(number: int, taken: bool, channel: socket.socket, within: float = 5.0) -> None:
    """Wait for the handoff socket's answer on `channel` and check it."""
    for _ in range(int(within / 0.01)):
        try:
            message = channel.recv(64)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        assert message == struct.pack("<Q?", number, taken), message
        return
    raise AssertionError(f"no answer to move {number}")


async def test_the_handoff_socket_is_0600_and_refuses_anything_but_one_stream_connection(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), front=True)
    path = handoff_path(cluster.runtime_dir, a.id)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    pipe_read, pipe_write = os.pipe()  # not a socket
    spare_read, spare_write = os.pipe()
    datagrams, datagrams_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"

    def move(number: int, *fds: int) -> None:
        socket.send_fds(channel, [struct.pack("<Q", number), request], list(fds))

    try:
        channel.connect(path)
        channel.setblocking(False)
        move(0)  # no descriptor
        await answer(0, False, channel)
        move(1, pipe_read)
        await answer(1, False, channel)
        move(2, datagrams.fileno())
        await answer(2, False, channel)
        move(3, datagrams.fileno(), spare_read)
        await answer(3, False, channel)
        for fd in (pipe_read, spare_read):
            os.close(fd)
        datagrams.close()

        async def closed(fd: int) -> bool:  # the read end: the holder closed its copy
            for _ in range(200):
                try:
                    os.write(fd, b"x")
                except BrokenPipeError:
                    return True
                await asyncio.sleep(0.01)
            return False

        assert await closed(pipe_write), "the holder kept the pipe it was sent"
        assert await closed(spare_write), "the holder kept the second descriptor it was sent"
        datagrams_peer.setblocking(False)
        with contextlib.suppress(ConnectionRefusedError):  # its peer is closed
            datagrams_peer.send(b"x")
            raise AssertionError("the holder kept the datagram socket it was sent")

        channel.send(b"x")  # not even a move's number: the holder closes the channel
        for _ in range(500):
            with contextlib.suppress(BlockingIOError):
                assert channel.recv(64) == b"", "an answer to what is not a move"
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the holder kept a channel that sent it garbage")
    finally:
        for fd in (pipe_write, spare_write):
            os.close(fd)
        datagrams_peer.close()
        channel.close()

    assert a.routing.handoffs is not None and a.routing.handoffs.taken == 0
    async with a.client() as client:  # and it serves as before
        assert (await client.get("/health")).json()["worker"] == a.id


@pytest.mark.parametrize("taken", [False, None], ids=["refused", "unanswered"])
async def test_a_move_the_holder_does_not_take_is_served_from_the_worker_that_received_it(
    cluster: Cluster, taken: bool | None
) -> None:
    """The holder refuses the move (it could not receive the descriptor, say), or closes
    its socket with the move unanswered (as when it crashes with the move queued): the
    receiving worker, which kept its descriptor, serves the request the copying way."""
    a = await cluster.add(session_app(), front=True)
    b = await cluster.add(session_app(), front=True)
    cookies = await seeded(a, "kept")
    await a.routing.stop_handoffs()  # a's handoff socket is then this test's
    path = handoff_path(cluster.runtime_dir, a.id)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def holder() -> None:
        channel, _ = await loop.sock_accept(listener)
        with channel:
            for _ in range(500):
                try:
                    data, fds, _, _ = socket.recv_fds(channel, 1 << 17, 1)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.01)
            else:
                raise AssertionError("no move came")
            for fd in fds:
                os.close(fd)  # the holder's copy only
            if taken is not None:
                channel.send(struct.pack("<Q?", struct.unpack_from("<Q", data)[0], taken))

    try:
        holding = asyncio.create_task(holder())
        async with asyncio.timeout(15):
            replies = await on_one_connection(b, ("/touch", cookies), ("/touch", cookies))
            await holding
    finally:
        listener.close()
        os.unlink(path)

    assert [(status, body["worker"], body["n"]) for status, body in replies] == [
        (200, a.id, 1), (200, a.id, 2)
    ]
    sb = b.routing.router.stats
    assert (sb.handed_off, sb.forwarded, sb.passed_through) == (0, 2, 1)


class Told:
    """A mover that records how its move ended."""

    def __init__(
        self, name: str, log: list[tuple[str, str]], then: Callable[[], None] | None = None
    ) -> None:
        self.name, self.log, self.then = name, log, then

    def moved(self) -> None:
        self.log.append((self.name, "moved"))
        if self.then is not None:
            self.then()

    def kept(self) -> None:
        self.log.append((self.name, "kept"))


class Holder:
    """A handoff socket at `path` that this test answers by hand, as a holder would, or
    fails to, at the step a test names."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.channel: socket.socket | None = None

    def take(self) -> tuple[int, list[int]]:
        """Read one move: its number and descriptors (the test closes them)."""
        if self.channel is None:
            self.channel, _ = self.listener.accept()
        data, fds, _, _ = socket.recv_fds(self.channel, 1 << 17, 1)
        return struct.unpack_from("<Q", data)[0], fds

    def answer(self, number: int, taken: bool) -> None:
        assert self.channel is not None
        self.channel.send(struct.pack("<Q?", number, taken))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.listener.close()


async def moves(
    short_tmp: Path, count: int, then: Callable[[], None] | None = None
) -> tuple[Handoffs, Holder, list[Any], list[Any]]:
    """A sender with `count` moves sent to a `Holder`: the sender, the holder, the movers'
    record, and the descriptors moved (pipes' read ends, closed by the test). `then`
    runs when move 0 is told it moved."""
    holder = Holder(short_tmp / "h.handoff")
    sender = Handoffs(lambda worker: str(short_tmp / f"{worker}.handoff"), move_timeout=0.3)
    told: list[tuple[str, str]] = []
    pipes = [os.pipe() for _ in range(count)]
    for index, (read, _) in enumerate(pipes):
        mover = Told(f"move {index}", told, then if index == 0 else None)
        assert sender.send("h", read, b"GET / HTTP/1.1\r\n\r\n", mover)
    return sender, holder, told, pipes


async def settled(told: list[Any], count: int) -> list[Any]:
    for _ in range(300):
        if len(told) >= count:
            return sorted(told)
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {told} of {count} moves were settled")


def close_all(pipes: list[tuple[int, int]], *fds: int) -> None:
    for fd in [fd for pair in pipes for fd in pair] + list(fds):
        os.close(fd)


@pytest.mark.parametrize("closing_first", [False, True], ids=["reading", "closing"])
async def test_a_holder_that_takes_one_move_and_closes_with_the_next_unread_gives_back_only_that(
    short_tmp: Path, closing_first: bool
) -> None:
    sender, holder, told, pipes = await moves(short_tmp, 2)
    number, fds = holder.take()
    holder.answer(number, True)
    holder.close()  # (move 1 unread: the sender reads a reset before the answer)
    if closing_first:
        sender.close()  # (it stops as the holder crashes: its close reads what is left)

    assert await settled(told, 2) == [("move 0", "moved"), ("move 1", "kept")]
    sender.close()
    close_all(pipes, *fds)


async def test_a_sender_closing_its_channel_gives_its_moves_back_and_no_answer_reaches_it_after(
    short_tmp: Path,
) -> None:
    """The holder answers move 1 while the sender is closing (from inside the close,
    after it read move 0's answer): that answer must fail, so the holder does not take
    a move the sender gives back."""
    late: list[BaseException | None] = []

    def answer_late() -> None:  # told during the close, after move 0's answer was read
        try:
            holder.answer(second, True)
            late.append(None)
        except OSError as error:
            late.append(error)

    sender, holder, told, pipes = await moves(short_tmp, 2, then=answer_late)
    first, first_fds = holder.take()
    second, second_fds = holder.take()
    holder.answer(first, True)

    sender.close()

    assert len(late) == 1 and isinstance(late[0], BrokenPipeError), late
    assert told == [("move 0", "moved"), ("move 1", "kept")]
    holder.close()
    close_all(pipes, *first_fds, *second_fds)


async def test_a_move_its_holder_does_not_answer_in_time_is_given_back(short_tmp: Path) -> None:
    sender, holder, told, pipes = await moves(short_tmp, 1)
    _, fds = holder.take()  # and never answered

    assert await settled(told, 1) == [("move 0", "kept")]
    sender.close()
    holder.close()
    close_all(pipes, *fds)
