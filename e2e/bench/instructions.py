"""Instructions one worker spends per request, counted by callgrind: a figure that does
not move with the machine's speed or load, for comparing two versions of a hot path
(wall-clock CPU on a shared 2-core machine varies by more than most changes save).

Run from the repository root (needs `valgrind`; a few minutes)::

    .venv/bin/python -m e2e.bench.instructions [--requests 1000] [--source DIR]

One worker runs under valgrind: the routing and passthrough of `tether serve` in front of
the throughput benchmark's app (e2e/bench/throughput_app.py), on Unix sockets, its
sessions `tp-0`..`tp-99` claimed by itself and `tp-100`..`tp-199` by a second worker,
whose private socket is a process that answers every request with one fixed reply (so
only the first worker's work is counted). A client in its own process sends sequential
requests on one kept-alive connection. Each variant runs twice, with 100 requests and
with 100 + `--requests`, and the difference is divided by `--requests`, so start-up and
shut-down cancel out:

- passed through: requests of the second worker's sessions, without and with the access
  line (`--log-format json`);
- direct: requests of the worker's own sessions, the app's work included;
- forwarded in: requests of its own sessions arriving on its private socket with a hop
  header, as a receiving worker sends them (the holder's side of a passed-through
  request);
- plain uvicorn: the same app under uvicorn's own protocol, no tether.

`--source` counts another checkout (PYTHONPATH), for a before-and-after in one sitting.

`--load` measures the same set-up under load instead, without valgrind: `--connections`
kept-alive connections (32) each send one request at a time, every request of a random
session of the variant's hundred, for `--seconds` (6) after a warm-up, and the worker's
user and system CPU time per request are read from `/proc`. This is each side of a
forwarded request alone, at the concurrency the throughput benchmark drives it with; it
moves by a few percent from run to run, so it says where the time goes, and the count
says by how much a change moves it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, cast

from e2e.bench.routing import REPO
from e2e.bench.throughput import cookies

OWN, OTHER = "a" * 32, "b" * 32
SESSIONS = 100
FIXED_REPLY = (
    b"HTTP/1.1 200 OK\r\ncontent-length: 36\r\ncontent-type: application/json\r\n"
    b'set-cookie: session=x; path=/\r\n\r\n{"count": 1, "worker": "holder-bbb"}'
)
HOP = b"x-tether-hop: http 127.0.0.1 5000 127.0.0.1 8000 \r\n"


class _Fixed(asyncio.Protocol):
    """The second worker's private socket: one fixed reply per request head."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            self.buffer = self.buffer.partition(b"\r\n\r\n")[2]
            self.transport.write(FIXED_REPLY)


async def _fixture(path: str) -> None:
    server = await asyncio.get_running_loop().create_unix_server(_Fixed, path)
    async with server:
        print("ready", flush=True)
        await asyncio.Event().wait()


async def _worker(runtime: str, public: str, log: bool, plain: bool) -> None:
    """The counted process: one worker's public protocol on `public`; it exits once its
    first public connection closes."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from e2e.bench.throughput_app import create_app
    from tether.checkpoint.participant import Participant
    from tether.routing.claims import FileClaimStore
    from tether.routing.front import front_protocol
    from tether.routing.kinds import declared_kind
    from tether.routing.logs import configure_logging
    from tether.routing.types import SessionId, WorkerId
    from tether.routing.worker import RoutingWorker

    configure_logging("json")
    app = create_app()
    worker = RoutingWorker(app, kind=declared_kind(app), runtime_dir=runtime,
                           worker=WorkerId(OWN), admission=Participant(), access_log=log)
    worker.tables.set_live([WorkerId(OWN), WorkerId(OTHER)])
    assert worker.claims is not None and worker.passthrough is not None
    store = FileClaimStore(os.path.join(runtime, "claims"))
    for index in range(SESSIONS):
        await worker.claims.claim(SessionId(f"tp-{index}"))
        await store.claim(SessionId(f"tp-{SESSIONS + index}"), WorkerId(OTHER))
    await worker.start()
    config = uvicorn.Config(app=app if plain else worker.router, http="httptools",
                            loop="none", lifespan="off", access_log=False, log_config=None)
    config.load()
    state, ended = ServerState(), asyncio.Event()
    base = HttpToolsProtocol if plain else front_protocol(worker.passthrough)

    class Counted(base):  # type: ignore[valid-type,misc]
        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            ended.set()

    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: Counted(config, state, {}), public)
    print("ready", flush=True)
    await ended.wait()
    server.close()
    await worker.stop()


def _client(path: str, count: int, first: int, hop: bool) -> None:
    values = cookies(first + SESSIONS)
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)
        for index in range(count):
            cookie = values[first + index % SESSIONS].encode()
            client.sendall(b"GET /count HTTP/1.1\r\nhost: bench\r\ncookie: " + cookie
                           + b"\r\n" + (HOP if hop else b"") + b"\r\n")
            reply = b""
            while True:
                reply += client.recv(65536)
                head, blank, body = reply.partition(b"\r\n\r\n")
                found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if blank and found and len(body) >= int(found[1]):
                    break
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


class _Loader(asyncio.Protocol):
    """One of `_load`'s connections: a random request of `requests` whenever the last
    reply has come, until `tally[1]` says stop; `tally[0]` counts the replies."""

    def __init__(self, requests: list[bytes], tally: list[int]) -> None:
        self.requests, self.tally, self.buffer = requests, tally, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        self.transport.write(random.choice(self.requests))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, blank, body = self.buffer.partition(b"\r\n\r\n")
        found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if not blank or found is None or len(body) < int(found[1]):
            return
        assert self.buffer.startswith(b"HTTP/1.1 200 "), self.buffer[:200]
        self.buffer = body[int(found[1]) :]
        self.tally[0] += 1
        if self.tally[1]:
            self.transport.close()
        else:
            self.transport.write(random.choice(self.requests))


async def _load(
    path: str, first: int, hop: bool, pid: int, connections: int, seconds: float
) -> tuple[float, float, float]:
    """Requests a second, and the worker `pid`'s user and system µs a request, while
    `connections` connections to `path` keep it busy."""
    values = cookies(first + SESSIONS)[first:]
    requests = [b"GET /count HTTP/1.1\r\nhost: bench\r\ncookie: " + value.encode()
                + b"\r\n" + (HOP if hop else b"") + b"\r\n" for value in values]
    tally = [0, 0]
    loop = asyncio.get_running_loop()
    transports = [
        (await loop.create_unix_connection(lambda: _Loader(requests, tally), path))[0]
        for _ in range(connections)
    ]
    await asyncio.sleep(1.5)  # warm-up
    before, replies = _cpu_ticks(pid), tally[0]
    await asyncio.sleep(seconds)
    after, replies = _cpu_ticks(pid), tally[0] - replies
    tally[1] = 1
    await asyncio.sleep(0.2)
    for transport in transports:
        transport.close()
    if replies == 0:
        raise RuntimeError("no reply came under load")
    per = 1e6 / os.sysconf("SC_CLK_TCK") / replies
    return (replies / seconds, (after[0] - before[0]) * per, (after[1] - before[1]) * per)


def _cpu_ticks(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def _wait_ready(process: subprocess.Popen[bytes]) -> None:
    assert process.stdout is not None
    if process.stdout.readline().strip() != b"ready":
        raise RuntimeError("a bench process did not start")


def count(
    variant: dict[str, Any], requests: int, source: str,
    load: tuple[int, float] | None = None,
) -> Any:
    """Instructions of the worker for `requests` requests of `variant`; or with `load`
    (connections, seconds), its figures under load (`_load`), not under valgrind."""
    runtime = tempfile.mkdtemp(prefix="ic-", dir="/tmp")
    os.makedirs(os.path.join(runtime, "w"), mode=0o700)
    os.makedirs(os.path.join(runtime, "claims"), mode=0o700)
    public = os.path.join(runtime, "public.sock")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    me = [sys.executable, "-m", "e2e.bench.instructions"]
    # tether from `source`, this module from here (`source` may predate it).
    counted = [sys.executable, "-c", f"import sys; sys.path.insert(0, {source!r}); "
               "import tether; sys.path.pop(0); from e2e.bench.instructions import main; main()"]
    fixture = subprocess.Popen(
        [*me, "fixture", os.path.join(runtime, "w", f"{OTHER}.sock")],
        cwd=REPO, env=env, stdout=subprocess.PIPE,
    )
    try:
        _wait_ready(fixture)
        log_file = os.path.join(runtime, "callgrind.txt")
        valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                    f"--log-file={log_file}"]
        worker = subprocess.Popen(
            [*(valgrind if load is None else []), *counted, "worker", runtime, public,
             "log" if variant["log"] else "-", "plain" if variant["plain"] else "-"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        _wait_ready(worker)
        target = os.path.join(runtime, "w", f"{OWN}.sock") if variant["hop"] else public
        if load is not None:
            import uvloop

            figures = uvloop.run(
                _load(target, variant["first"], variant["hop"], worker.pid, *load)
            )
            if variant["hop"]:
                with socket.socket(socket.AF_UNIX) as ender:
                    ender.connect(public)
            worker.wait(timeout=60)
            return figures
        _client(target, requests, variant["first"], variant["hop"])
        if variant["hop"]:  # the worker ends with its first public connection
            with socket.socket(socket.AF_UNIX) as ender:
                ender.connect(public)
        worker.wait(timeout=600)
        with open(log_file) as text:
            collected = re.search(r"Collected : (\d+)", text.read())
        assert collected is not None, "callgrind wrote no total"
        return int(collected[1])
    finally:
        fixture.kill()
        fixture.wait()
        shutil.rmtree(runtime, ignore_errors=True)


VARIANTS: dict[str, dict[str, Any]] = {
    "passed through": {"first": SESSIONS, "log": False, "plain": False, "hop": False},
    "passed through, access line": {"first": SESSIONS, "log": True, "plain": False,
                                    "hop": False},
    "direct": {"first": 0, "log": False, "plain": False, "hop": False},
    "forwarded in (the holder's side)": {"first": 0, "log": False, "plain": False,
                                          "hop": True},
    "plain uvicorn": {"first": 0, "log": False, "plain": True, "hop": False},
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "fixture":
        asyncio.run(_fixture(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        import uvloop

        uvloop.run(_worker(sys.argv[2], sys.argv[3], sys.argv[4] == "log",
                           sys.argv[5] == "plain"))
        return
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.instructions",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="counted requests (1000)")
    parser.add_argument("--source", default=str(REPO), help="the checkout counted (this one)")
    parser.add_argument("--load", action="store_true",
                        help="CPU time per request under load instead (no valgrind)")
    parser.add_argument("--connections", type=int, default=32, help="with --load (32)")
    parser.add_argument("--seconds", type=float, default=6.0, help="with --load (6)")
    args = parser.parse_args()
    started = time.monotonic()
    if args.load:
        print("| worker's requests, under load | requests/s | user µs per request "
              "| system µs per request |\n| --- | ---: | ---: | ---: |")
        for name, variant in VARIANTS.items():
            rate, user, system = count(variant, 0, args.source,
                                       (args.connections, args.seconds))
            print(f"| {name} | {rate:,.0f} | {user:.1f} | {system:.1f} |", flush=True)
        print(f"\n({args.source}, {args.connections} connections, "
              f"{time.monotonic() - started:.0f} s)")
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: apt-get install valgrind")
    print("| worker's requests | instructions per request |\n| --- | ---: |")
    for name, variant in VARIANTS.items():
        few = count(variant, SESSIONS, args.source)
        more = count(variant, SESSIONS + args.requests, args.source)
        print(f"| {name} | {(more - few) // args.requests:,} |", flush=True)
    print(f"\n({args.source}, {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
