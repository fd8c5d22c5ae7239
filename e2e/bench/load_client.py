"""The throughput benchmark's client: kept-alive connections, each sending one request
at a time, every request naming a random session.

Run as `python -m e2e.bench.load_client PORT CONNECTIONS WARMUP_S SECONDS COOKIES_FILE
[sticky]` (one cookie header value per line). Each connection first sends one request per
cookie it owns (every session is used before the clock starts), then random ones, or with
`sticky` only ever the session of its first request again; it prints one
JSON line: replies counted in the SECONDS after WARMUP_S, non-200 replies, and its own
CPU seconds over that window. Lean on purpose (a protocol, no HTTP library), so the
server, not the client, is what the figure measures.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
import resource
import sys
import time

import uvloop

_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)


class _Connection(asyncio.Protocol):
    def __init__(
        self, requests: list[bytes], first: list[bytes], tally: _Tally, sticky: bool
    ) -> None:
        self.requests = [first[-1]] if sticky else requests  # (`first` is sent from its end)
        self.first = first
        self.tally = tally
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        request = self.first.pop() if self.first else random.choice(self.requests)
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        match = _LENGTH.search(self.buffer, 0, end + 2)
        if match is None:
            raise RuntimeError(f"a reply without content-length: {self.buffer[:200]!r}")
        total = end + 4 + int(match.group(1))
        if len(self.buffer) < total:
            return
        status = self.buffer[9:12]
        self.buffer = self.buffer[total:]
        self.tally.reply(status == b"200")
        if self.tally.stopping:
            assert self.transport is not None
            self.transport.close()
        else:
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.tally.stopping:
            self.tally.lost += 1


class _Tally:
    def __init__(self) -> None:
        self.counting = False
        self.stopping = False
        self.replies = 0
        self.errors = 0
        self.lost = 0

    def reply(self, ok: bool) -> None:
        if self.counting:
            self.replies += 1
            if not ok:
                self.errors += 1


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(port: int, connections: int, warmup_s: float, seconds: float,
              cookies: list[str], sticky: bool = False) -> dict[str, float]:
    requests = [
        f"GET /count HTTP/1.1\r\nhost: bench\r\ncookie: {cookie}\r\n\r\n".encode("latin-1")
        for cookie in cookies
    ]
    tally = _Tally()
    loop = asyncio.get_running_loop()
    conns = []
    for index in range(connections):
        make = functools.partial(
            _Connection, requests, requests[index::connections], tally, sticky
        )
        _, conn = await loop.create_connection(make, "127.0.0.1", port)
        conns.append(conn)
    await asyncio.sleep(warmup_s)
    tally.counting = True
    cpu, started = _cpu(), time.perf_counter()
    await asyncio.sleep(seconds)
    tally.counting = False
    elapsed, cpu = time.perf_counter() - started, _cpu() - cpu
    tally.stopping = True
    await asyncio.wait_for(asyncio.gather(*(conn.closed for conn in conns)), 30)
    return {
        "replies": tally.replies,
        "errors": tally.errors,
        "lost_connections": tally.lost,
        "seconds": round(elapsed, 3),
        "client_cpu_s": round(cpu, 3),
    }


def main() -> None:
    port, connections, warmup_s, seconds, path = sys.argv[1:6]
    sticky = sys.argv[6:] == ["sticky"]
    with open(path, encoding="latin-1") as file:
        cookies = [line.strip() for line in file if line.strip()]
    result = uvloop.run(
        run(int(port), int(connections), float(warmup_s), float(seconds), cookies, sticky)
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
