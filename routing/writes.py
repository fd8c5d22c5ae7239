"""A transport that joins the writes made in one turn of the event loop into one.

uvicorn writes a reply's head and body apart, two system calls; on the private socket
the receiving worker then often reads them apart too and writes each on to its client,
two more calls and two wake-ups of the client. Held until the turn ends (or the next write
comes), the head goes out with the body, and a streaming reply's parts wait at most one
turn.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["JoinedWrites"]

JOIN_MAX = 1 << 16
"""A write over this is not copied onto the held one."""


class JoinedWrites(asyncio.Transport):
    """Wraps a transport: what `write` is given goes out at the next write or at the end
    of this turn of the loop, whichever comes first; `close` sends what is held first."""

    __slots__ = ("_flush", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is None:
            self._held = bytes(data)
            self._flush = self._loop.call_soon(self._write_held)
            return
        self._held = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if len(data) <= JOIN_MAX:
            self._transport.write(held + data)
        else:  # (uvloop writes the two with one writev, without copying the big one)
            self._transport.writelines((held, data))

    def _write_held(self) -> None:
        self._flush = None
        held, self._held = self._held, None
        # The connection may have closed under it meanwhile (the peer left): uvloop's
        # transport then raises on a write, asyncio's warns.
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._write_held_now()
        self._transport.close()

    def abort(self) -> None:
        self._drop_held()
        self._transport.abort()

    def write_eof(self) -> None:
        self._write_held_now()
        self._transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._write_held_now()  # (an upgrade: the new protocol writes unjoined)
        self._transport.set_protocol(protocol)

    def get_write_buffer_size(self) -> int:
        held = len(self._held) if self._held is not None else 0
        return self._transport.get_write_buffer_size() + held

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def _write_held_now(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self._write_held()

    def _drop_held(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._held = None
