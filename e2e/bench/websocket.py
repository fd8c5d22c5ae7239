"""The WebSocket benchmark (SPEC 4.8, 11): what relaying a WebSocket to its session's
holder adds to a message round trip, and what a client that does not read costs the
relaying worker.

Run from the repository root (about 30 seconds)::

    .venv/bin/python -m e2e.bench.websocket [--rounds 5000] [--warmup 500]
                                            [--flood-s 5] [--no-doc]

It starts `tether serve e2e.apps.wscounter:app --workers 2 --port 0 --log-format json`
(the router's access log on, as users run it), seeds one session over HTTP and opens two
WebSockets with its cookie (new TCP connections until it has one of each):

    direct    a WebSocket the session's holder accepted: served with no hop
    relayed   one the other worker accepted: relayed over the holder's private socket

and times a message round trip on each (`get` → `{"count", "worker"}`, one text frame
each way), one per variant per round in an order that alternates every round. The
client is this process: a blocking socket per WebSocket writing a pre-masked frame and
reading exactly one frame back, so it shares no event loop with the servers. It reads
each process's CPU time from /proc while it measures.

Then the slow reader: a client opens `/flood` (the holder sends 64 KiB messages until
its client leaves) and reads nothing, with a 64 KiB receive buffer; the benchmark samples
the receiving worker's RSS and the relay's progress for `--flood-s` seconds, and does the
same on a direct WebSocket, so the bytes the holder got to send through a relay compare
with what it got to send straight to the client (socket buffers only).

It prints a table, writes `e2e/bench/results/websocket.json` and rewrites the generated
part of the "WebSockets" section of `docs/benchmarks.md` (not with `--no-doc`). It exits 1
if the run's own checks fail (a WebSocket not relayed as intended, a process left over).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2e.bench import machine, stop
from e2e.bench.routing import (
    RawClient,
    Tether,
    _serving_event,
    _tether_command,
    _wait_for,
    code_version,
    cpu_seconds,
    http_request,
    json_reply,
    load_average,
    summarize,
    worker_stats,
)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "e2e" / "bench" / "results" / "websocket.json"
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.websocket"
APP = "e2e.apps.wscounter:app"
WORKERS = 2
VARIANTS = ("direct", "relayed")
CLIENT_TIMEOUT_S = 10.0
CONNECT_ATTEMPTS = 200
PACKAGES = ("uvicorn", "starlette", "websockets", "httptools", "uvloop", "structlog")
FLOOD_RCVBUF = 1 << 16
_SET_SESSION = re.compile(rb"\r\nset-cookie:[ \t]*(session=[^;\r]*)", re.IGNORECASE)
_MASK = secrets.token_bytes(4)


def masked_frame(opcode: int, payload: bytes) -> bytes:
    """One client frame (clients must mask), built once so the client's time stays small."""
    size = len(payload)
    if size < 126:
        head = bytes([0x80 | opcode, 0x80 | size])
    elif size < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + size.to_bytes(8, "big")
    masked = bytes(byte ^ _MASK[index % 4] for index, byte in enumerate(payload))
    return head + _MASK + masked


class RawWebSocket:
    """One WebSocket on a blocking socket: write a frame's bytes, read one frame back."""

    def __init__(self, port: int, path: str, cookie: str, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(CLIENT_TIMEOUT_S)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nupgrade: websocket\r\n"
                "connection: Upgrade\r\nsec-websocket-version: 13\r\n"
                "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                f"cookie: {cookie}\r\n\r\n"
            ).encode("latin-1")
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += self._recv()
        head, _, self._buffer = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise RuntimeError(f"the handshake was refused: {head!r}")

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._buffer += self._recv()
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def exchange(self, frame: bytes) -> bytes:
        """Send `frame`; return the payload of the one frame that answers it."""
        self.sock.sendall(frame)
        first, second = self._take(2)
        size = second & 0x7F
        if size == 126:
            size = int.from_bytes(self._take(2), "big")
        elif size == 127:
            size = int.from_bytes(self._take(8), "big")
        if first & 0x0F != 0x1:
            raise RuntimeError(f"expected a text frame, got opcode {first & 0x0F}")
        return self._take(size)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# The server


def start_tether(log_dir: str) -> Tether:
    token = secrets.token_urlsafe(24)
    env = {**os.environ, "TETHER_CONTROL_TOKEN": token}
    log_path = os.path.join(log_dir, "tether.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*_tether_command(), "serve", APP, "--workers", str(WORKERS), "--port", "0",
             "--log-format", "json"],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    try:
        event = _wait_for(lambda: _serving_event(log_path), process, "tether serve")
    except BaseException:
        stop(process)
        raise
    return Tether(process, int(event["port"]), str(event["runtime_dir"]), token)


def seed(port: int, session_id: str) -> tuple[str, str]:
    """Seed the session over HTTP; return its holder and its cookie."""
    client = RawClient(port)
    try:
        body = json.dumps({"session_id": session_id}).encode()
        request = http_request("POST", "/seed_session", {"content-type": "application/json"}, body)
        head, reply = json_reply(client, request)
    finally:
        client.close()
    cookie = _SET_SESSION.search(head)
    if cookie is None:
        raise RuntimeError(f"the seed reply set no session cookie: {head!r}")
    return str(reply["worker"]), cookie.group(1).decode("latin-1")


def opened(
    tether: Tether, path: str, cookie: str, relayed: bool, rcvbuf: int | None = None
) -> tuple[RawWebSocket, str]:
    """A WebSocket the holder accepted (`relayed` False) or the other worker accepted,
    told by the status route's `forwarded` counters; and the worker that accepted it."""
    for _ in range(CONNECT_ATTEMPTS):
        before = worker_stats(tether)
        ws = RawWebSocket(tether.port, path, cookie, rcvbuf)
        after = worker_stats(tether)
        senders = [w for w in after if after[w]["forwarded"] > before[w]["forwarded"]]
        if bool(senders) == relayed:
            return ws, (senders[0] if senders else "")
        ws.close()
    raise RuntimeError(f"no WebSocket landed as wanted in {CONNECT_ATTEMPTS} tries")


# Measuring


def measure(
    sockets: dict[str, RawWebSocket], frame: bytes, rounds: int, warmup: int, holder: str
) -> dict[str, list[int]]:
    """Nanoseconds per round trip and variant, the order alternating every round."""
    names = list(sockets)
    orders = [names, names[::-1]]
    samples: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for name in names:  # both reach the holder
        if json.loads(sockets[name].exchange(frame))["worker"] != holder:
            raise RuntimeError(f"the {name} WebSocket did not reach the holder")
    gc.collect()
    gc.disable()
    try:
        for index in range(warmup + rounds):
            for name in orders[index % 2]:
                started = clock()
                sockets[name].exchange(frame)
                elapsed = clock() - started
                if index >= warmup:
                    samples[name].append(elapsed)
    finally:
        gc.enable()
    return samples


def flood(
    tether: Tether, cookie: str, relayed: bool, seconds: float, receiving_pid: int
) -> dict[str, Any]:
    """Open /flood and read nothing; sample the receiving worker's RSS and the holder's
    progress for `seconds`."""
    http = RawClient(tether.port)
    progress = http_request("GET", "/flood_sent", {"cookie": cookie})

    def sent() -> int:
        return int(json_reply(http, progress)[1]["sent"])

    try:
        rss_before = rss_bytes(receiving_pid)
        ws, _ = opened(tether, "/flood", cookie, relayed, rcvbuf=FLOOD_RCVBUF)
        try:
            started = time.monotonic()
            samples = []
            while time.monotonic() - started < seconds:
                time.sleep(0.1)
                samples.append((round(time.monotonic() - started, 2), sent(),
                                rss_bytes(receiving_pid)))
        finally:
            ws.close()
    finally:
        http.close()
    half = [s for s in samples if s[0] >= seconds / 2]
    return {
        "seconds": seconds,
        "holder_sent_bytes": samples[-1][1],
        "holder_sent_at_half_time": half[0][1] if half else None,
        "receiving_worker_rss_before": rss_before,
        "receiving_worker_rss_max": max(s[2] for s in samples),
        "receiving_worker_rss_growth": max(s[2] for s in samples) - rss_before,
        "samples": samples,
    }


def run(rounds: int, warmup: int, flood_s: float) -> dict[str, Any]:
    load_before = load_average()
    with contextlib.ExitStack() as stack:
        log_dir = tempfile.mkdtemp(prefix="tb-", dir="/tmp")
        stack.callback(shutil.rmtree, log_dir, ignore_errors=True)
        tether = start_tether(log_dir)
        stack.callback(stop, tether.process)
        holder, cookie = seed(tether.port, f"bench-{secrets.token_hex(4)}")
        direct, _ = opened(tether, "/ws", cookie, relayed=False)
        stack.callback(direct.close)
        relayed, other = opened(tether, "/ws", cookie, relayed=True)
        stack.callback(relayed.close)
        sockets = {"direct": direct, "relayed": relayed}
        before = worker_stats(tether)
        pids = {"receiving_worker": int(before[other]["pid"]),
                "holder": int(before[holder]["pid"]), "client": os.getpid()}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        samples = measure(sockets, masked_frame(0x1, b"get"), rounds, warmup, holder)
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        after = worker_stats(tether)
        floods = {
            "relayed": flood(tether, cookie, True, flood_s, pids["receiving_worker"]),
            "direct": flood(tether, cookie, False, flood_s, pids["receiving_worker"]),
        }
    messages = rounds + warmup
    per_message = {"receiving_worker": messages, "holder": 2 * messages, "client": 2 * messages}
    cpu = {name: round((cpu_after[name] - cpu_before[name]) * 1e6 / per_message[name], 1)
           for name in pids}
    stats = {name: summarize(values) for name, values in samples.items()}
    checks: dict[str, Any] = {
        "holder_forwarded": after[holder]["forwarded"] - before[holder]["forwarded"],
        "other_forwarded": after[other]["forwarded"] - before[other]["forwarded"],
        "tether_exit_code": tether.process.returncode,
        "runtime_dir_removed": not os.path.exists(tether.runtime_dir),
        "flood_stalled": all(
            f["holder_sent_at_half_time"] == f["holder_sent_bytes"] for f in floods.values()
        ),
    }
    checks["ok"] = (
        checks["holder_forwarded"] == 0 and checks["other_forwarded"] == 0
        and checks["tether_exit_code"] == 0 and checks["runtime_dir_removed"]
        and checks["flood_stalled"]
    )
    relayed_flood, direct_flood = floods["relayed"], floods["direct"]
    return {
        "benchmark": "websocket",
        "command": f"{COMMAND} --rounds {rounds} --warmup {warmup} --flood-s {flood_s:g}",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {**machine(PACKAGES), "load_average_before": load_before,
                    "load_average_after": load_average()},
        "code": code_version(),
        "setup": {
            "server": f"tether serve {APP} --workers {WORKERS} --port 0 --log-format json",
            "message": "text `get` -> text {\"count\", \"worker\"} on /ws, one frame each way",
            "order": "one round trip per variant per round, order alternating each round",
            "client": "this process, blocking sockets, gc off while measuring",
            "flood": f"/flood, 64 KiB binary messages, client reads nothing, "
                     f"SO_RCVBUF {FLOOD_RCVBUF}",
        },
        "rounds": rounds,
        "warmup": warmup,
        "variants": stats,
        "ratios": {
            "relayed_over_direct": {
                "median": round(stats["relayed"]["median_ms"] / stats["direct"]["median_ms"], 3),
                "p99": round(stats["relayed"]["p99_ms"] / stats["direct"]["p99_ms"], 3),
            },
            "added_ms": {
                "median": round(stats["relayed"]["median_ms"] - stats["direct"]["median_ms"], 4),
                "p99": round(stats["relayed"]["p99_ms"] - stats["direct"]["p99_ms"], 4),
            },
            "relay_cpu_over_holder_cpu": round(cpu["receiving_worker"] / cpu["holder"], 3)
            if cpu["holder"] else None,
            "flood_sent_relayed_over_direct": round(
                relayed_flood["holder_sent_bytes"] / direct_flood["holder_sent_bytes"], 2)
            if direct_flood["holder_sent_bytes"] else None,
        },
        "cpu_us_per_message": cpu,
        "flood": floods,
        "checks": checks,
    }


# Reporting


def mib(value: float) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def table(result: dict[str, Any]) -> str:
    stats, figures = result["variants"], result["ratios"]
    lines = [
        "| variant | median ms | p90 ms | p99 ms | mean ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, s in stats.items():
        lines.append(f"| {name} | {s['median_ms']:.3f} | {s['p90_ms']:.3f} | "
                     f"{s['p99_ms']:.3f} | {s['mean_ms']:.3f} |")
    rod, added = figures["relayed_over_direct"], figures["added_ms"]
    cpu = result["cpu_us_per_message"]
    lines += [
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| relayed ÷ direct, message round trip | {rod['median']:.2f}x median, "
        f"{rod['p99']:.2f}x p99 (+{added['median']:.3f} ms median) |",
        f"| CPU per relayed message, receiving worker | {cpu['receiving_worker']:.0f} µs "
        f"(holder {cpu['holder']:.0f} µs per message it serves; ratio "
        f"{figures['relay_cpu_over_holder_cpu']}) |",
    ]
    for name, f in result["flood"].items():
        lines.append(
            f"| client reading nothing, {name}: holder sent before it stalled | "
            f"{mib(f['holder_sent_bytes'])} in {f['seconds']:g} s (the same at half time: "
            f"{f['holder_sent_at_half_time'] == f['holder_sent_bytes']}) |"
        )
    relayed = result["flood"]["relayed"]
    lines.append(
        f"| client reading nothing: the receiving worker's RSS | "
        f"{mib(relayed['receiving_worker_rss_before'])} before, "
        f"{mib(relayed['receiving_worker_rss_max'])} at most "
        f"(+{mib(relayed['receiving_worker_rss_growth'])}) |"
    )
    lines.append(f"| holder's sent bytes, relayed ÷ direct | "
                 f"{figures['flood_sent_relayed_over_direct']} |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    relayed = result["flood"]["relayed"]
    return {
        "timestamp": result["timestamp"],
        "rounds": result["rounds"],
        "median_ms": {name: s["median_ms"] for name, s in result["variants"].items()},
        "p99_ms": {name: s["p99_ms"] for name, s in result["variants"].items()},
        "relayed_over_direct": result["ratios"]["relayed_over_direct"],
        "cpu_us_per_message": result["cpu_us_per_message"],
        "flood_holder_sent_bytes": {
            name: f["holder_sent_bytes"] for name, f in result["flood"].items()
        },
        "flood_receiving_worker_rss_growth_bytes": relayed["receiving_worker_rss_growth"],
        "checks_ok": result["checks"]["ok"],
    }


_GENERATED = re.compile(
    r"<!-- websocket:generated:begin.*?<!-- websocket:generated:end -->", re.S
)


def update_doc(result: dict[str, Any], path: Path) -> None:
    """Rewrite the generated part of the WebSockets section, leaving the rest as it is."""
    m = result["machine"]
    lines = [f'  "{key}": {json.dumps(value)}' for key, value in summary(result).items()]
    generated = "\n".join([
        "<!-- websocket:generated:begin (written by the benchmark; edit outside it) -->",
        f"Latest run: {result['timestamp']}, `{result['command']}`, {m['nproc']} CPUs "
        f"({m['cpu_model']}), Python {m['python']}, load average "
        f"{m['load_average_before']} before.",
        "",
        table(result),
        "",
        "JSON summary (the full result is in `e2e/bench/results/websocket.json`):",
        "",
        "```json",
        "{\n" + ",\n".join(lines) + "\n}",
        "```",
        "<!-- websocket:generated:end -->",
    ])
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if _GENERATED.search(text):
        text = _GENERATED.sub(lambda _: generated, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## WebSockets\n\n{generated}\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.bench.websocket",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5000, help="measured rounds (5000)")
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured rounds first (500)")
    parser.add_argument("--flood-s", type=float, default=5.0, help="slow-reader seconds (5)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON result")
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc to update")
    parser.add_argument("--no-doc", action="store_true", help="leave the doc alone")
    args = parser.parse_args(argv)
    if args.rounds < 100 or args.warmup < 0 or args.flood_s < 1:
        parser.error("--rounds must be at least 100, --warmup not negative, --flood-s >= 1")
    result = run(args.rounds, args.warmup, args.flood_s)
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if not args.no_doc:
        update_doc(result, args.doc)
    if not result["checks"]["ok"]:
        print(f"checks failed: {result['checks']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
