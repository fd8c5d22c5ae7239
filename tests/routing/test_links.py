"""The passthrough's links to other hosts' hop listeners (routing/splice.py), on real
loopback TCP sockets: how a link connects, fails to, writes a request, and ends when its
worker is known dead."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator

import pytest

from tether.routing.forward import ClaimantGone, ClaimantUnavailable
from tether.routing.splice import Link, Links

REPLY = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
REQUEST = b"GET / HTTP/1.1\r\nhost: t\r\n\r\n"


class Reader:
    """Who takes a link's reply (splice.Reader): keeps what it was told."""

    def __init__(self) -> None:
        self.data = b""
        self.done = asyncio.Event()
        self.was_lost = False

    def reply(self, data: bytes, link: Link) -> None:
        self.data += data
        if link.complete:
            self.done.set()

    def lost(self, link: Link) -> None:
        self.was_lost = True


class Listener:
    """A hop listener stand-in that answers nothing by itself but hands over what
    connects (these tests are about the link, not about what serves it)."""

    def __init__(self) -> None:
        self.address = ""
        self.peers: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.Queue()
        )
        self.writers: list[asyncio.StreamWriter] = []

    async def took(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await self.peers.put((reader, writer))

    async def peer(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The next connection it accepted."""
        return await asyncio.wait_for(self.peers.get(), 10)


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    held = Listener()
    server = await asyncio.start_server(held.took, "127.0.0.1", 0)
    held.address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield held
    finally:
        server.close()
        for writer in held.writers:
            writer.close()
        await server.wait_closed()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_link_to_a_port_nobody_listens_on_is_claimant_unavailable_not_gone() -> None:
    links = Links()
    with pytest.raises(ClaimantUnavailable, match="refused the connection"):
        await links.connect(f"tcp://127.0.0.1:{free_port()}")


async def test_a_link_is_kept_idle_after_its_reply_and_taken_again(listener: Listener) -> None:
    links = Links()
    link = await links.connect(listener.address)
    try:
        reader = Reader()
        assert link.send(REQUEST, reader)
        _, peer = await listener.peer()
        peer.write(REPLY)
        await asyncio.wait_for(reader.done.wait(), 10)
        assert reader.data == REPLY and link.keep_alive
        links.put(link)
        assert links.idle(listener.address) is link and link.reused
        assert links.idle(listener.address) is None
    finally:
        link.close()


async def test_set_gone_loses_the_reply_a_dead_workers_link_waits_for_and_closes_its_idle_links(
    listener: Listener,
) -> None:
    links = Links()
    busy, idle = await links.connect(listener.address), await links.connect(listener.address)
    links.put(idle)
    reader = Reader()
    assert busy.send(REQUEST, reader)
    links.set_gone(frozenset({listener.address}))
    assert reader.was_lost
    assert busy.closed and idle.closed
    assert links.idle(listener.address) is None


async def test_a_link_whose_worker_is_found_dead_while_it_connects_is_closed_not_kept(
    listener: Listener,
) -> None:
    links = Links()
    connecting = asyncio.ensure_future(links.connect(listener.address))
    await asyncio.sleep(0)  # (it has begun: the name is being resolved)
    links.set_gone(frozenset({listener.address}))
    with pytest.raises(ClaimantGone):
        await connecting
    peer, _ = await listener.peer()
    assert await asyncio.wait_for(peer.read(), 10) == b"", "its socket was left open"


async def test_a_request_the_socket_takes_in_part_is_written_whole_by_the_link(
    listener: Listener,
) -> None:
    """Once a byte of a request is sent the request is the link's (sent again the copying
    way, its first part would be a request cut short on the holder's side): the rest is
    written as the socket takes it."""
    links = Links()
    link = await links.connect(listener.address)
    try:
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        body = os.urandom(1 << 20)
        request = b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(body)
        assert link.send(request + body, Reader())
        assert link.unsent, "the socket took it all at once: not the case tested"
        peer, _ = await listener.peer()
        got = await asyncio.wait_for(peer.readexactly(len(request) + len(body)), 10)
        assert got == request + body
        assert not link.unsent and not link.closed
    finally:
        link.close()
