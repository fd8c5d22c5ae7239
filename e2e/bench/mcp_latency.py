"""The MCP hop benchmark: what tether's forwarding adds to one MCP tool call.

Run from the repository root (about 30 seconds)::

    .venv/bin/python -m e2e.bench.mcp_latency [--rounds 2000] [--warmup 200]

It starts `tether serve <the MCP counter> --workers 2 --sessions mcp --port 0`, the
reference app written for the installed SDK line (`examples/mcp_counter.py` on 2.x,
`examples/mcp_counter_v1.py` on 1.x), with the router's access log on, JSON lines to a
file, as users run it; then it opens kept-alive connections until two were accepted by
different workers. A session initialized on a connection is held by the worker that
accepted it, so with session S initialized on connection D (worker 1), and connection F
accepted by worker 2, it times the streamable HTTP `tools/call` of `get` for S, and for
scale the app's tiny `GET /health`, sent to worker 1 by `x-tether-worker` (a request
naming no session goes to the worker it names).
Each round sends one of each, in an order that rotates every round:

    direct            `get` for S on D: the receiving worker holds the session, no hop
    forwarded         `get` for S on F: forwarded to the holder's private socket
    health direct     `/health` on D, served by worker 1
    health forwarded  `/health` on F, forwarded to worker 1

The tool calls are the SDK server's real replies (an SSE stream carrying the JSON-RPC
result). The client is this process, one blocking socket per connection, sharing no event
loop with the servers. The figures are ratios within the same run (SPEC 11): forwarded ÷
direct for the tool call, and the tool call's added time ÷ the tiny request's. It prints
a table and writes `e2e/bench/results/mcp.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2e.bench import machine, stop
from tether.examples import mcp_counter_app

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "e2e" / "bench" / "results" / "mcp.json"
COMMAND = ".venv/bin/python -m e2e.bench.mcp_latency"
APP = mcp_counter_app()
VARIANTS = ("direct", "forwarded", "health direct", "health forwarded")
PROTOCOL = "2025-06-18"
START_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 10.0
CONNECT_ATTEMPTS = 200

_HEAD_END = b"\r\n\r\n"
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:\s*chunked", re.IGNORECASE)
_SESSION = re.compile(rb"\r\nmcp-session-id:\s*([!-~]+)", re.IGNORECASE)


class Connection:
    """One kept-alive HTTP/1.1 connection on a blocking socket: one request, one reply."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), CLIENT_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = b""

    def close(self) -> None:
        self.sock.close()

    def request(self, body: dict[str, Any], session_id: bytes | None) -> bytes:
        """The bytes of a POST /mcp carrying one JSON-RPC message."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        head = [
            b"POST /mcp HTTP/1.1",
            b"host: 127.0.0.1:%d" % self.port,
            b"accept: application/json, text/event-stream",
            b"content-type: application/json",
            b"content-length: %d" % len(payload),
        ]
        if session_id is not None:
            head.append(b"mcp-session-id: " + session_id)
            head.append(b"mcp-protocol-version: " + PROTOCOL.encode())
        return b"\r\n".join(head) + _HEAD_END + payload

    def exchange(self, request: bytes) -> tuple[bytes, bytes]:
        """Send a request; return the reply's head and its whole body."""
        self.sock.sendall(request)
        data = self.pending
        while (end := data.find(_HEAD_END)) < 0:
            data += self._recv()
        head, rest = data[: end + 2], data[end + 4 :]
        if (length := _LENGTH.search(head)) is not None:
            size = int(length.group(1))
            while len(rest) < size:
                rest += self._recv()
            self.pending = rest[size:]
            return head, rest[:size]
        if _CHUNKED.search(head) is None:
            raise RuntimeError(f"a reply without framing: {head!r}")
        chunks: list[bytes] = []
        while True:
            while (line := rest.find(b"\r\n")) < 0:
                rest += self._recv()
            size = int(rest[:line].split(b";")[0], 16)
            while len(rest) < line + 2 + size + 2:
                rest += self._recv()
            chunks.append(rest[line + 2 : line + 2 + size])
            rest = rest[line + 2 + size + 2 :]
            if size == 0:
                self.pending = rest
                return head, b"".join(chunks)

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data


def rpc_result(head: bytes, body: bytes) -> dict[str, Any]:
    """The JSON-RPC result in a 200 reply (an SSE stream or a JSON body)."""
    if head[9:12] != b"200":
        raise RuntimeError(f"unexpected reply {head!r} {body[:300]!r}")
    for line in body.splitlines():
        if line.startswith(b"data: "):
            message: dict[str, Any] = json.loads(line[6:])
            if "result" in message:
                return dict(message["result"])
    raise RuntimeError(f"no JSON-RPC result in {body[:300]!r}")


def open_session(conn: Connection) -> tuple[bytes, str]:
    """Initialize a session on `conn`; return its ID and the worker that holds it."""
    head, body = conn.exchange(
        conn.request(
            {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "initialize",
                "params": {
                    "protocolVersion": PROTOCOL,
                    "capabilities": {},
                    "clientInfo": {"name": "bench", "version": "0"},
                },
            },
            None,
        )
    )
    rpc_result(head, body)
    found = _SESSION.search(head)
    if found is None:
        raise RuntimeError(f"initialize named no session: {head!r}")
    session_id = found.group(1)
    head, _ = conn.exchange(
        conn.request({"jsonrpc": "2.0", "method": "notifications/initialized"}, session_id)
    )
    if head[9:12] != b"202":
        raise RuntimeError(f"notifications/initialized: {head!r}")
    return session_id, str(call_get(conn, session_id, 1)["worker"])


def health_request(conn: Connection, worker: str) -> bytes:
    return b"GET /health HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nx-tether-worker: %s\r\n\r\n" % (
        conn.port,
        worker.encode(),
    )


def get_request(conn: Connection, session_id: bytes, request_id: int) -> bytes:
    return conn.request(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": "get", "arguments": {}},
        },
        session_id,
    )


def call_get(conn: Connection, session_id: bytes, request_id: int) -> dict[str, Any]:
    result = rpc_result(*conn.exchange(get_request(conn, session_id, request_id)))
    content: dict[str, Any] = result["structuredContent"]
    return content


def two_workers(port: int) -> tuple[Connection, Connection, bytes, str]:
    """A connection the holder of session S accepted, one another worker accepted, and S."""
    seen: dict[str, tuple[Connection, bytes]] = {}
    spare: list[Connection] = []
    try:
        for _ in range(CONNECT_ATTEMPTS):
            conn = Connection(port)
            session_id, worker = open_session(conn)
            if worker in seen:
                spare.append(conn)
                continue
            seen[worker] = (conn, session_id)
            if len(seen) == 2:
                (direct, held), (forwarded, _) = seen.values()
                holder = str(call_get(direct, held, 2)["worker"])
                return direct, forwarded, held, holder
    finally:
        for conn in spare:
            conn.close()
    raise RuntimeError(f"{CONNECT_ATTEMPTS} connections all landed on one worker")


def measure(
    direct: Connection,
    forwarded: Connection,
    session_id: bytes,
    holder: str,
    rounds: int,
    warmup: int,
) -> dict[str, list[int]]:
    """Nanoseconds per request and variant, one each per round, the order rotating."""
    request_id = 100

    def tool_call(conn: Connection) -> bytes:
        nonlocal request_id
        request_id += 1
        return get_request(conn, session_id, request_id)

    def health(conn: Connection) -> bytes:
        return health_request(conn, holder)

    plan = {
        "direct": (direct, tool_call, b'"isError":false'),
        "forwarded": (forwarded, tool_call, b'"isError":false'),
        "health direct": (direct, health, b'"ok":true'),
        "health forwarded": (forwarded, health, b'"ok":true'),
    }
    samples: dict[str, list[int]] = {name: [] for name in VARIANTS}
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for index in range(warmup + rounds):
            shift = index % len(VARIANTS)
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                conn, build, expected = plan[name]
                request = build(conn)
                started = clock()
                head, body = conn.exchange(request)
                elapsed = clock() - started
                if head[9:12] != b"200" or expected not in body:
                    raise RuntimeError(f"{name}: unexpected reply {head!r} {body[:300]!r}")
                if index >= warmup:
                    samples[name].append(elapsed)
    finally:
        gc.enable()
    return samples


def summarize(nanoseconds: list[int]) -> dict[str, float]:
    ms = sorted(value / 1e6 for value in nanoseconds)

    def at(fraction: float) -> float:
        return ms[max(0, math.ceil(fraction * len(ms)) - 1)]

    return {
        "median_ms": round(statistics.median(ms), 4),
        "p90_ms": round(at(0.90), 4),
        "p99_ms": round(at(0.99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "min_ms": round(ms[0], 4),
        "max_ms": round(ms[-1], 4),
    }


def figures(stats: dict[str, dict[str, float]]) -> dict[str, Any]:
    def over(a: str, b: str, at: str) -> float:
        return round(stats[a][at] / stats[b][at], 3)

    def added(a: str, b: str, at: str) -> float:
        return round(stats[a][at] - stats[b][at], 4)

    tool_added = added("forwarded", "direct", "median_ms")
    tiny_added = added("health forwarded", "health direct", "median_ms")
    return {
        "forwarded_over_direct": {
            "median": over("forwarded", "direct", "median_ms"),
            "p99": over("forwarded", "direct", "p99_ms"),
        },
        "added_ms": {
            "median": tool_added,
            "p99": added("forwarded", "direct", "p99_ms"),
        },
        "health_forwarded_over_direct": {
            "median": over("health forwarded", "health direct", "median_ms"),
            "p99": over("health forwarded", "health direct", "p99_ms"),
        },
        "health_added_ms": {
            "median": tiny_added,
            "p99": added("health forwarded", "health direct", "p99_ms"),
        },
        "tool_call_added_over_tiny_request_added": (
            round(tool_added / tiny_added, 2) if tiny_added > 0 else None
        ),
    }


# The server


@contextlib.contextmanager
def tether_serve(log_dir: str) -> Iterator[int]:
    """`tether serve` of the MCP counter on 2 workers; yields its port."""
    tether = shutil.which("tether", path=str(Path(sys.executable).parent)) or "tether"
    out_path = os.path.join(log_dir, "stdout")
    with open(out_path, "wb") as out, open(os.path.join(log_dir, "stderr"), "wb") as err:
        process = subprocess.Popen(
            [
                tether,
                "serve",
                APP,
                "--workers",
                "2",
                "--sessions",
                "mcp",
                "--port",
                "0",
                "--log-format",
                "json",
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        yield _announced_port(out_path, process)
    finally:
        stop(process)


def _announced_port(out_path: str, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(out_path, encoding="utf-8") as file:
            found = re.search(r"tether serving http://[^\s]+:(\d+) ", file.read())
        if found is not None:
            return int(found.group(1))
        if process.poll() is not None:
            raise RuntimeError(f"tether serve exited with code {process.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"tether serve did not start within {START_TIMEOUT_S} s")


PACKAGES = ("mcp", "mcp-types", "uvicorn", "starlette", "httptools", "uvloop", "sse-starlette")



def table(result: dict[str, Any]) -> str:
    lines = [
        "| variant | median ms | p90 ms | p99 ms | mean ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in VARIANTS:
        row = result["variants"][name]
        lines.append(
            f"| {name} | {row['median_ms']:.3f} | {row['p90_ms']:.3f} | {row['p99_ms']:.3f} "
            f"| {row['mean_ms']:.3f} |"
        )
    found = result["figures"]
    ratio, added = found["forwarded_over_direct"], found["added_ms"]
    tiny, tiny_added = found["health_forwarded_over_direct"], found["health_added_ms"]
    lines += [
        "",
        f"MCP tool call, forwarded ÷ direct: median {ratio['median']:.2f}x, "
        f"p99 {ratio['p99']:.2f}x; the hop adds {added['median']:.3f} ms at the median, "
        f"{added['p99']:.3f} ms at p99",
        f"tiny request, forwarded ÷ direct: median {tiny['median']:.2f}x, "
        f"p99 {tiny['p99']:.2f}x; the hop adds {tiny_added['median']:.3f} ms at the median",
        f"({result['rounds']} rounds, {result['machine']['nproc']} CPUs)",
    ]
    return "\n".join(lines)


def run(rounds: int, warmup: int) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="tt-bench-mcp-") as log_dir,
        tether_serve(log_dir) as port,
    ):
        direct, forwarded, session_id, holder = two_workers(port)
        try:
            samples = measure(direct, forwarded, session_id, holder, rounds, warmup)
        finally:
            direct.close()
            forwarded.close()
    stats = {name: summarize(samples[name]) for name in VARIANTS}
    return {
        "benchmark": "mcp_tool_call_latency",
        "command": COMMAND,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "app": APP,
        "workers": 2,
        "holder": holder,
        "rounds": rounds,
        "warmup": warmup,
        "machine": machine(PACKAGES),
        "variants": stats,
        "figures": figures(stats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(args.rounds, args.warmup)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(table(result))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
