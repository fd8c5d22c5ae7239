"""JoinedWrites: the writes of one loop turn leave as one, on a real socket pair."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from tether.routing.writes import JoinedWrites


class _Counting(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]


class _Pair:
    """Our end as a transport (wrapped), the peer's as a plain socket we read."""

    def __init__(self, joined: JoinedWrites, real: asyncio.Transport, peer: socket.socket) -> None:
        self.joined = joined
        self.real = real
        self.peer = peer
        self.sends = 0


@pytest.fixture
async def pair() -> AsyncIterator[_Pair]:
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    real, _ = await loop.connect_accepted_socket(_Counting, ours)
    counted = _Pair(JoinedWrites(real, loop), real, peer)  # type: ignore[arg-type]
    original = real.write

    def write(data: bytes | bytearray | memoryview) -> None:
        counted.sends += 1
        original(data)

    real.write = write  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        real.close()
        peer.close()
        await asyncio.sleep(0)


async def _read(peer: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        data += await asyncio.wait_for(loop.sock_recv(peer, size - len(data)), 5)
    return data


async def test_a_head_and_body_written_in_one_turn_leave_as_one_write(pair: _Pair) -> None:
    pair.joined.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    pair.joined.write(b"ok")
    assert pair.sends == 1
    assert await _read(pair.peer, 40) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def test_a_big_body_follows_the_held_head_in_order(pair: _Pair) -> None:
    body = bytes(range(256)) * 1024  # 256 KiB, over JoinedWrites' copy limit
    pair.joined.write(b"head:")
    pair.joined.write(body)
    assert await _read(pair.peer, 5 + len(body)) == b"head:" + body


async def test_a_lone_write_leaves_when_the_turn_ends(pair: _Pair) -> None:
    pair.joined.write(b"head")
    assert pair.sends == 0 and pair.joined.get_write_buffer_size() == 4
    await asyncio.sleep(0)
    assert pair.sends == 1
    assert await _read(pair.peer, 4) == b"head"


async def test_parts_of_a_stream_keep_their_order(pair: _Pair) -> None:
    pair.joined.write(b"a")
    pair.joined.write(b"b")
    pair.joined.write(b"c")
    await asyncio.sleep(0)
    pair.joined.write(b"d")
    await asyncio.sleep(0)
    assert await _read(pair.peer, 4) == b"abcd"


async def test_close_sends_what_is_held_first(pair: _Pair) -> None:
    pair.joined.write(b"last words")
    pair.joined.close()
    assert await _read(pair.peer, 10) == b"last words"
    assert pair.joined.is_closing()


async def test_abort_drops_what_is_held(pair: _Pair) -> None:
    pair.joined.write(b"never")
    pair.joined.abort()
    await asyncio.sleep(0.01)
    assert pair.sends == 0
    loop = asyncio.get_running_loop()
    assert await asyncio.wait_for(loop.sock_recv(pair.peer, 10), 5) == b""


async def test_what_is_held_when_the_connection_closes_under_it_is_dropped(
    pair: _Pair,
) -> None:
    """The peer leaves (the loop closes the transport) between a write and the end of
    its turn: what was held is dropped, not written to a closed transport (uvloop's
    raises, and each client leaving mid-stream logged a traceback)."""
    pair.joined.write(b"too late")
    pair.real.close()
    await asyncio.sleep(0.01)
    assert pair.sends == 0
