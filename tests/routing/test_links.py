"""The passthrough's links to other hosts' hop listeners (routing/splice.py), on real
loopback TCP sockets: how a link connects, fails to, and ends when its worker is known
dead."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from tether.routing.forward import ClaimantGone, ClaimantUnavailable
from tether.routing.front import PASSTHROUGH_MAX
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
async def listener() -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """A hop listener stand-in that answers nothing but holds what connects (the link's
    tests are about the link, not about what serves it): its address and connections."""
    accepted: list[asyncio.StreamWriter] = []

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(held, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"tcp://127.0.0.1:{port}", accepted
    finally:
        server.close()
        for writer in accepted:
            writer.close()
        await server.wait_closed()


async def test_a_link_to_a_port_nobody_listens_on_is_claimant_unavailable_not_gone() -> None:
    links = Links()
    with pytest.raises(ClaimantUnavailable, match="refused the connection"):
        await links.connect(f"tcp://127.0.0.1:{free_port()}")


async def test_a_link_is_kept_idle_after_its_reply_and_taken_again(
    listener: tuple[str, list[asyncio.StreamWriter]],
) -> None:
    address, accepted = listener
    links = Links()
    try:
        link = await links.connect(address)
        reader = Reader()
        assert link.send(REQUEST, reader)
        await asyncio.sleep(0.05)
        accepted[0].write(REPLY)
        await asyncio.wait_for(reader.done.wait(), 5)
        assert reader.data == REPLY and link.keep_alive
        links.put(link)
        assert links.idle(address) is link and link.reused
        assert links.idle(address) is None
    finally:
        links.close()
        link.close()


async def test_set_gone_loses_the_reply_a_dead_workers_link_waits_for_and_closes_its_idle_links(
    listener: tuple[str, list[asyncio.StreamWriter]],
) -> None:
    address, _ = listener
    links = Links()
    busy, idle = await links.connect(address), await links.connect(address)
    links.put(idle)
    reader = Reader()
    assert busy.send(REQUEST, reader)
    links.set_gone(frozenset({address}))
    assert reader.was_lost
    assert busy.closed and idle.closed
    assert links.idle(address) is None
    links.set_gone(frozenset())


async def test_a_link_whose_worker_is_found_dead_while_it_connects_is_closed_not_kept(
    listener: tuple[str, list[asyncio.StreamWriter]],
) -> None:
    address, _ = listener
    links = Links()
    connecting = asyncio.ensure_future(links.connect(address))
    links.set_gone(frozenset({address}))
    with pytest.raises(ClaimantGone):
        await connecting


async def test_a_new_link_takes_the_largest_request_the_passthrough_sends_in_one_write(
    listener: tuple[str, list[asyncio.StreamWriter]],
) -> None:
    """A request the socket takes only in part is sent again the copying way, the part
    already sent a request cut short on the holder's side: so a link's send buffer holds
    the largest one whole (on loopback it would anyway; a real network's path starts
    smaller)."""
    address, _ = listener
    links = Links()
    link = await links.connect(address)
    try:
        request = b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % PASSTHROUGH_MAX
        request += b"x" * PASSTHROUGH_MAX
        assert link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > len(request)
        assert link.send(request, Reader())
    finally:
        link.close()
