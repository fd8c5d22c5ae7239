"""The routing benchmark (SPEC 11): what tether's forwarding hop adds to a tiny request.

Run from the repository root (about 30 seconds)::

    .venv/bin/python -m e2e.bench.routing [--rounds 5000] [--warmup 500] [--diagnose]
                                          [--no-doc]

It starts `tether serve examples.counter:app --workers 2 --port 0 --log-format json`
(the router's access log on, as users run it; JSON lines go to a file) and the baseline
forwarder of `e2e/bench/baseline_forwarder.py`, each in its own processes, seeds one
session and times `GET /count` for it over three kept-alive client connections, one
request on each per round, in an order that rotates every round:

    direct  a connection the session's holder accepted: served with no hop
    tether  a connection the other worker accepted: its first request (before the
            measurement) handed it to the holder (routing/handoff.py), which serves
            the rest with no hop
    plain   a connection to the baseline (Starlette Request + aiohttp UnixConnector +
            StreamingResponse on its own uvicorn), which forwards to the holder's
            private socket, the same socket tether forwards to

Then, as many rounds again, `direct` against one more connection, each in turn:

    passthrough  a connection the other worker accepted whose first request was its
                 own (a seed), so it never moved: every request on it is forwarded by
                 the passthrough (routing/front.py), as every request of a connection
                 of mixed sessions is once it has moved

`--diagnose` adds a fourth, `private`: straight to the holder's private socket, what the
holder's side of a forwarded request costs.

The client is this process: one blocking socket per connection, writing fixed request
bytes and reading exactly one reply, so it shares no event loop with the servers. While
it measures, it reads from /proc each process's CPU time per request, and how much CPU
other processes on the machine used (the noise these figures are most sensitive to).
Then it times `WorkerClaims.lookup` in this process, for a session the worker holds
(memory) and one another worker holds (its claim file), and counts the lookups' system
calls with strace when strace is installed.

It prints a table, writes `e2e/bench/results/routing.json` and rewrites the generated
part of the "Routing" section of `docs/benchmarks.md` (not with `--no-doc`). It exits 1
if the run's own checks fail (requests not forwarded as intended, a process left over).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import math
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import repeat
from pathlib import Path
from typing import Any

from e2e.bench import machine, stop, write_generated
from tether.routing.claims import FileClaimStore, WorkerClaims
from tether.routing.lifetimes import Lifetimes
from tether.routing.types import SessionId, WorkerId, new_worker_id

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "e2e" / "bench" / "results" / "routing.json"
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.routing"

VARIANTS = ("direct", "tether", "plain")
WORKERS = 2
START_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 10.0
CONNECT_ATTEMPTS = 50  # batches of new connections tried to find one on each worker
CONNECT_BATCH = 4
TARGETS = {  # SPEC 11
    "tether_over_direct_median": 1.5,
    "tether_over_direct_p99": 2.0,
    "added_over_plain_added_median": 0.3,
    "receiving_cpu_over_holder_cpu": 0.5,
}
"""SPEC 11's targets, judged on the `tether` connection; the passthrough's own figures are
reported beside them, for connections of mixed sessions."""
OTHER_WORK_NOTE_PERCENT = 10.0

_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_SET_SESSION = re.compile(rb"\r\nset-cookie:[ \t]*(session=[^;\r]*)", re.IGNORECASE)


# The client


class RawClient:
    """One kept-alive HTTP/1.1 connection on a blocking socket: write a request's bytes,
    read exactly one reply. Lean on purpose, so the client's own time stays small."""

    def __init__(self, address: int | str) -> None:
        """Connect to 127.0.0.1 at a port, or to a Unix socket at a path."""
        if isinstance(address, int):
            self.sock = socket.create_connection(("127.0.0.1", address), CLIENT_TIMEOUT_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(CLIENT_TIMEOUT_S)
            self.sock.connect(address)
        self._buffer = b""

    def close(self) -> None:
        self.sock.close()

    def exchange(self, request: bytes) -> tuple[bytes, bytes]:
        """Send `request`; return the reply's head (status line and headers) and body."""
        self.sock.sendall(request)
        data = self._buffer
        end = data.find(b"\r\n\r\n")
        while end < 0:
            data += self._recv()
            end = data.find(b"\r\n\r\n")
        head = data[: end + 2]
        rest = data[end + 4 :]
        match = _LENGTH.search(head)
        if match is not None:
            size = int(match.group(1))
            while len(rest) < size:
                rest += self._recv()
            self._buffer = rest[size:]
            return head, rest[:size]
        if _CHUNKED.search(head) is None:
            raise ValueError(f"a reply with no framing on a kept-alive connection: {head!r}")
        body, self._buffer = self._chunked(rest)
        return head, body

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def _chunked(self, data: bytes) -> tuple[bytes, bytes]:
        """The body of a chunked reply starting in `data` (no trailers), and what follows."""
        body: list[bytes] = []
        while True:
            line_end = data.find(b"\r\n")
            while line_end < 0:
                data += self._recv()
                line_end = data.find(b"\r\n")
            size = int(data[:line_end].split(b";")[0], 16)
            after = line_end + 2 + size + 2
            while len(data) < after:
                data += self._recv()
            if size == 0:
                return b"".join(body), data[after:]
            body.append(data[line_end + 2 : line_end + 2 + size])
            data = data[after:]


def http_request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def status_of(head: bytes) -> int:
    return int(head[9:12])


def json_reply(client: RawClient, request: bytes) -> tuple[bytes, Any]:
    head, body = client.exchange(request)
    if status_of(head) != 200:
        raise RuntimeError(f"unexpected reply: {head!r} {body!r}")
    return head, json.loads(body)


# The servers


@dataclass
class Tether:
    """A running `tether serve`."""

    process: subprocess.Popen[bytes]
    port: int
    runtime_dir: str
    token: str

    def socket_path(self, worker: str) -> str:
        return os.path.join(self.runtime_dir, "w", f"{worker}.sock")


def _tether_command() -> list[str]:
    script = Path(sys.executable).parent / "tether"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from tether.coordinator.cli import main; main()"]


def _wait_for(found: Callable[[], Any], process: subprocess.Popen[bytes], what: str) -> Any:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        value = found()
        if value is not None:
            return value
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it served")
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S} s")


def _serving_event(log_path: str) -> dict[str, Any] | None:
    with open(log_path, encoding="utf-8", errors="replace") as file:
        for line in file:
            if line.startswith("{") and '"serving"' in line:
                event: dict[str, Any] = json.loads(line)
                if event.get("event") == "serving":
                    return event
    return None


def _announced_port(log_path: str) -> int | None:
    with open(log_path, encoding="utf-8") as file:
        for line in file:
            if line.startswith("port "):
                return int(line.split()[1])
    return None


def start_tether(
    log_dir: str,
    app: str = "tether.examples.counter:app",
    workers: int = WORKERS,
    extra: tuple[str, ...] = ("--log-format", "json"),
) -> Tether:
    """`tether serve APP --workers N --port 0` with `extra` flags, its log in `log_dir`."""
    token = secrets.token_urlsafe(24)
    env = {**os.environ, "TETHER_CONTROL_TOKEN": token}
    log_path = os.path.join(log_dir, "tether.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *_tether_command(),
                "serve",
                app,
                "--workers",
                str(workers),
                "--port",
                "0",
                *extra,
            ],
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


def start_baseline(socket_path: str, log_dir: str) -> tuple[subprocess.Popen[bytes], int]:
    out_path = os.path.join(log_dir, "baseline.out")
    with open(out_path, "wb") as out, open(os.path.join(log_dir, "baseline.err"), "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "e2e.bench.baseline_forwarder", socket_path],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        port = _wait_for(lambda: _announced_port(out_path), process, "the baseline forwarder")
    except BaseException:
        stop(process)
        raise
    return process, int(port)




# Finding the connections


def worker_stats(tether: Tether) -> dict[str, dict[str, Any]]:
    """Each worker's line in status, by worker ID (on a new connection: an idle one
    would be closed by the server's keep-alive timeout while the benchmark runs)."""
    request = http_request("GET", "/_tether/status", {"authorization": f"Bearer {tether.token}"})
    client = RawClient(tether.port)
    try:
        _, status = json_reply(client, request)
    finally:
        client.close()
    return {worker["id"]: worker for worker in status["workers"]}


def seed(port: int, session_id: str) -> tuple[str, bytes]:
    """Seed the session; return its holder and the request that reads its count."""
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
    count = http_request("GET", "/count", {"cookie": cookie.group(1).decode("latin-1")})
    return str(reply["worker"]), count


def variant_connections(
    tether: Tether, count: bytes, holder: str
) -> tuple[RawClient, RawClient, str]:
    """A connection the holder accepted, one the other worker accepted, and that worker.

    The reply names the worker that served the request (always the holder); the status
    route's `forwarded` counters tell whether the worker that accepted it forwarded it.
    """
    direct: RawClient | None = None
    forwarded: RawClient | None = None
    other = ""
    for _ in range(CONNECT_ATTEMPTS):
        batch = [RawClient(tether.port) for _ in range(CONNECT_BATCH)]
        for client in batch:
            before = worker_stats(tether)
            _, reply = json_reply(client, count)
            if reply["worker"] != holder:
                raise RuntimeError(f"served by {reply['worker']}, not the holder {holder}")
            after = worker_stats(tether)
            senders = [w for w in after if after[w]["forwarded"] > before[w]["forwarded"]]
            if not senders and direct is None:
                direct = client
            elif senders and forwarded is None:
                forwarded, other = client, senders[0]
            else:
                client.close()
        if direct is not None and forwarded is not None:
            return direct, forwarded, other
    raise RuntimeError(f"no connection landed on each worker in {CONNECT_ATTEMPTS} batches")


def passthrough_connection(tether: Tether, other: str) -> RawClient:
    """A connection the worker `other` accepted whose first request, a seed of a session
    of its own, kept it there (a connection moves only on its first request)."""
    for _ in range(CONNECT_ATTEMPTS * CONNECT_BATCH):
        client = RawClient(tether.port)
        body = json.dumps({"session_id": f"stay-{secrets.token_hex(4)}"}).encode()
        request = http_request("POST", "/seed_session", {"content-type": "application/json"}, body)
        if json_reply(client, request)[1]["worker"] == other:
            return client
        client.close()
    raise RuntimeError(f"no connection landed on {other} in {CONNECT_ATTEMPTS} batches")


# Measuring


def measure(
    clients: dict[str, RawClient], request: bytes, rounds: int, warmup: int
) -> dict[str, list[int]]:
    """Nanoseconds per request and variant; one request per variant per round, the order
    rotating each round so none always follows another."""
    names = list(clients)
    orders = [
        [(name, clients[name].exchange) for name in names[shift:] + names[:shift]]
        for shift in range(len(names))
    ]
    samples: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    name = ""
    index = 0
    try:
        for index in range(warmup + rounds):
            for name, exchange in orders[index % len(orders)]:
                started = clock()
                head, _ = exchange(request)
                elapsed = clock() - started
                if head[9:12] != b"200":
                    raise RuntimeError(f"{name}: unexpected reply {head!r}")
                if index >= warmup:
                    samples[name].append(elapsed)
    except OSError as error:
        raise RuntimeError(f"{name} connection, round {index}: {error!r}") from error
    finally:
        gc.enable()
    return samples


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summarize(nanoseconds: list[int]) -> dict[str, float]:
    ms = sorted(value / 1e6 for value in nanoseconds)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "p90_ms": round(percentile(ms, 0.90), 4),
        "p99_ms": round(percentile(ms, 0.99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "min_ms": round(ms[0], 4),
        "max_ms": round(ms[-1], 4),
    }


def ratios(stats: dict[str, dict[str, float]]) -> dict[str, Any]:
    direct, tether, plain = (stats[name] for name in VARIANTS)

    def added(of: dict[str, float], at: str) -> float:
        return of[at] - direct[at]

    def added_ratio(at: str) -> float | None:
        baseline = added(plain, at)
        return round(added(tether, at) / baseline, 3) if baseline > 0 else None

    return {
        "tether_over_direct": {
            "median": round(tether["median_ms"] / direct["median_ms"], 3),
            "p99": round(tether["p99_ms"] / direct["p99_ms"], 3),
        },
        "plain_over_direct": {
            "median": round(plain["median_ms"] / direct["median_ms"], 3),
            "p99": round(plain["p99_ms"] / direct["p99_ms"], 3),
        },
        "added_ms": {
            name: {
                "median": round(added(stats[name], "median_ms"), 4),
                "p99": round(added(stats[name], "p99_ms"), 4),
            }
            for name in stats
            if name != "direct"
        },
        "added_tether_over_added_plain": {
            "median": added_ratio("median_ms"),
            "p99": added_ratio("p99_ms"),
        },
    }


def judge(figures: dict[str, Any], passthrough: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """SPEC 11's targets on the `tether` connection, and the same bounds on the
    passthrough's connection (`passthrough_*`), which forwards every request."""
    values = {
        "tether_over_direct_median": figures["tether_over_direct"]["median"],
        "tether_over_direct_p99": figures["tether_over_direct"]["p99"],
        "added_over_plain_added_median": figures["added_tether_over_added_plain"]["median"],
        "receiving_cpu_over_holder_cpu": figures["receiving_cpu_over_holder_cpu"],
        "passthrough_over_direct_median": passthrough["over_direct"]["median"],
        "passthrough_over_direct_p99": passthrough["over_direct"]["p99"],
        "passthrough_receiving_cpu_over_holder_cpu": passthrough["receiving_cpu_over_holder_cpu"],
    }
    bounds = {
        **TARGETS,
        "passthrough_over_direct_median": TARGETS["tether_over_direct_median"],
        "passthrough_over_direct_p99": TARGETS["tether_over_direct_p99"],
        "passthrough_receiving_cpu_over_holder_cpu": TARGETS["receiving_cpu_over_holder_cpu"],
    }
    return {
        name: {
            "value": value,
            "at_most": bounds[name],
            "pass": value is not None and value <= bounds[name],
        }
        for name, value in values.items()
    }


# Claim lookups


class _CountingStore:
    """A claim store that counts the calls made to it."""

    def __init__(self, store: FileClaimStore) -> None:
        self.store = store
        self.calls = 0

    async def claim(
        self, session_id: SessionId, worker: WorkerId, *, fresh: bool = False
    ) -> WorkerId:
        self.calls += 1
        return await self.store.claim(session_id, worker, fresh=fresh)

    async def claimant(self, session_id: SessionId) -> WorkerId | None:
        self.calls += 1
        return await self.store.claimant(session_id)

    async def release(self, session_id: SessionId, worker: WorkerId) -> None:
        self.calls += 1
        await self.store.release(session_id, worker)


def _done(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the file store's) to its result, as an
    `await` of it inside the router does, without an event loop's cost around it."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    raise RuntimeError("the coroutine suspended")


def _per_call_us(
    call: Callable[[SessionId], Any], argument: SessionId, batch: int, batches: int
) -> float:
    """The median over `batches` of the mean time per call in a batch, in microseconds
    (the bare `for` loop, about 0.01 us a call, included)."""
    clock = time.perf_counter_ns
    results = []
    for _ in range(batches):
        started = clock()
        for _ in repeat(None, batch):
            call(argument)
        results.append((clock() - started) / batch / 1000)
    return statistics.median(results)


def bench_lookups() -> dict[str, Any]:
    """`WorkerClaims.lookup` for this worker's session and for another worker's."""
    mine, theirs = SessionId("bench-mine"), SessionId("bench-theirs")
    me, other = new_worker_id(), new_worker_id()
    directory = tempfile.mkdtemp(prefix="tl-", dir="/tmp")
    try:
        store = FileClaimStore(directory)
        claims = WorkerClaims(store, me, Lifetimes(300.0))
        _done(claims.claim(mine))
        _done(store.claim(theirs, other))
        counting = _CountingStore(store)
        counted = WorkerClaims(counting, me, Lifetimes(300.0))
        _done(counted.claim(mine))
        counting.calls = 0
        checks = 1000
        for _ in range(checks):
            assert _done(counted.lookup(mine)) == me
        own_store_calls = counting.calls
        for _ in range(checks):
            assert _done(counted.lookup(theirs)) == other
        other_store_calls = counting.calls - own_store_calls
        gc.collect()
        gc.disable()
        try:
            def lookup(session_id: SessionId) -> Any:
                return _done(claims.lookup(session_id))

            own_us = _per_call_us(lookup, mine, batch=10_000, batches=100)
            other_us = _per_call_us(lookup, theirs, batch=200, batches=100)
            loop = asyncio.new_event_loop()
            watched = FileClaimStore(directory)
            watched.watch(loop)  # (as a worker's store is: claimants remembered)
            try:
                watched_claims = WorkerClaims(watched, me, Lifetimes(300.0))
                remembered_us = _per_call_us(
                    lambda sid: _done(watched_claims.lookup(sid)), theirs,
                    batch=10_000, batches=100,
                )
            finally:
                watched.close()
                loop.close()
        finally:
            gc.enable()
        syscalls = _syscalls_per_lookup(directory, me, mine, theirs)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "own_session_us": round(own_us, 4),
        "other_workers_session_us": round(other_us, 2),
        "other_workers_session_remembered_us": round(remembered_us, 4),
        "calls": {"own_session": 10_000 * 100, "other_workers_session": 200 * 100},
        "store_calls_per_lookup": {
            "own_session": own_store_calls / checks,
            "other_workers_session": other_store_calls / checks,
        },
        "system_calls_per_lookup": syscalls,
    }


_LOOKUPS_UNDER_STRACE = """
import asyncio, os, sys
from tether.routing.claims import FileClaimStore, WorkerClaims
from tether.routing.lifetimes import Lifetimes
directory, me, mine, theirs, count = sys.argv[1:]
claims = WorkerClaims(FileClaimStore(directory), me, Lifetimes(300.0))

def done(coroutine):
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value

done(claims.claim(mine))
loop = asyncio.new_event_loop()
watched = FileClaimStore(directory)
watched.watch(loop)
remembering = WorkerClaims(watched, me, Lifetimes(300.0))
done(remembering.lookup(theirs))  # (read once, then remembered)
for marker, session in ((b"own", mine), (b"other", theirs)):
    os.write(1, b"<" + marker + b">")
    for _ in range(int(count)):
        done(claims.lookup(session))
os.write(1, b"<remembered>")
for _ in range(int(count)):
    done(remembering.lookup(theirs))
os.write(1, b"<end>")
"""


def _syscalls_per_lookup(
    directory: str, me: WorkerId, mine: SessionId, theirs: SessionId, count: int = 1000
) -> dict[str, Any] | None:
    """System calls per lookup, counted by strace in a child process (None without it)."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    trace = os.path.join(directory, "strace.out")
    command = [strace, "-o", trace, sys.executable, "-c", _LOOKUPS_UNDER_STRACE]
    done = subprocess.run(
        [*command, directory, me, mine, theirs, str(count)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        return None
    calls: dict[str, collections.Counter[str]] = {}
    current: collections.Counter[str] | None = None
    with open(trace, encoding="utf-8", errors="replace") as file:
        for line in file:
            marker = re.match(r'write\(1, "<(\w+)>"', line)
            if marker:
                current = calls.setdefault(marker.group(1), collections.Counter())
            elif current is not None and (name := re.match(r"(\w+)\(", line)):
                current[name.group(1)] += 1
    return {
        kind: {
            "total": round(sum(calls.get(marker, {}).values()) / count, 2),
            "by_call": {name: round(n / count, 2) for name, n in calls.get(marker, {}).items()},
        }
        for kind, marker in (
            ("own_session", "own"),
            ("other_workers_session", "other"),
            ("other_workers_session_remembered", "remembered"),
        )
    }


# Reporting


PACKAGES = ("uvicorn", "starlette", "aiohttp", "httptools", "uvloop", "structlog")



def code_version() -> dict[str, Any]:
    """The commit measured, and the package files that differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", "routing", "coordinator", "examples")
    return {
        "commit": git("rev-parse", "HEAD") or None,
        # `--porcelain` lines are `XY path`; the strip above may have eaten a leading X.
        "modified": [line.lstrip().split(" ", 1)[-1] for line in changed.splitlines()],
    }


def table(result: dict[str, Any]) -> str:
    stats, figures = result["variants"], result["ratios"]
    lines = [
        "| variant | median ms | p90 ms | p99 ms | mean ms | added median ms | added p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in stats:
        s = stats[name]
        added = figures["added_ms"].get(name, {"median": 0.0, "p99": 0.0})
        lines.append(
            f"| {name} | {s['median_ms']:.3f} | {s['p90_ms']:.3f} | {s['p99_ms']:.3f} | "
            f"{s['mean_ms']:.3f} | {added['median']:+.3f} | {added['p99']:+.3f} |"
        )
    added_p99 = figures["added_tether_over_added_plain"]["p99"]
    lines += [
        "",
        "| figure | median | p99 | target | result |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    targets = result["targets"]

    def verdict(name: str) -> str:
        return "pass" if targets[name]["pass"] else "FAIL"

    tod = figures["tether_over_direct"]
    lines.append(
        f"| tether ÷ direct | {tod['median']:.2f}x | {tod['p99']:.2f}x | ≤ 1.5x median, "
        f"≤ 2.0x p99 (stretch 1.2x) | median {verdict('tether_over_direct_median')}, "
        f"p99 {verdict('tether_over_direct_p99')} |"
    )
    pod = figures["plain_over_direct"]
    lines.append(f"| plain ÷ direct | {pod['median']:.2f}x | {pod['p99']:.2f}x | | |")
    ratio = figures["added_tether_over_added_plain"]["median"]
    lines.append(
        f"| tether's added ÷ plain's added | {ratio:.3f} | "
        f"{'n/a' if added_p99 is None else f'{added_p99:.3f}'} | ≤ 0.3 (median) | "
        f"{verdict('added_over_plain_added_median')} |"
    )
    cpu = result["cpu_us_per_request"]
    lines += [
        "",
        "| CPU per request (user + system, µs) | tether's receiving worker | holder (any "
        "variant) | receiving ÷ holder (≤ 0.5) | plain forwarder | client |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| | {cpu['tether_receiving_worker']:.0f} | {cpu['holder']:.0f} | "
        f"{cpu['receiving_over_holder']:.3f} ({verdict('receiving_cpu_over_holder_cpu')}) | "
        f"{cpu['plain_forwarder']:.0f} | {cpu['client']:.0f} |",
    ]
    passing = result["passthrough"]
    over, pcpu = passing["over_direct"], passing["cpu_us_per_request"]
    lines += [
        "",
        "| the passthrough (a connection that never moved), its own rounds | median | p99 "
        "| receiving worker µs | holder µs | receiving ÷ holder | same bounds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| passthrough ÷ direct | {over['median']:.2f}x | {over['p99']:.2f}x | "
        f"{pcpu['receiving_worker']:.0f} | {pcpu['holder']:.0f} | "
        f"{passing['receiving_cpu_over_holder_cpu']:.3f} | "
        f"median {verdict('passthrough_over_direct_median')}, "
        f"p99 {verdict('passthrough_over_direct_p99')}, "
        f"CPU {verdict('passthrough_receiving_cpu_over_holder_cpu')} |",
    ]
    lookups = result["lookups"]
    lines += [
        "",
        "| claim lookup (`WorkerClaims.lookup`) | median µs per call | store calls "
        "| system calls (strace) | target |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    syscalls = lookups["system_calls_per_lookup"]
    for kind, label, target in (
        ("own_session", "this worker's session (memory)", "no system call"),
        ("other_workers_session", "another worker's session (claim file)", "one small read"),
    ):
        counted = "not counted (no strace)"
        if syscalls is not None:
            by_call = ", ".join(f"{name} {n:g}" for name, n in syscalls[kind]["by_call"].items())
            counted = f"{syscalls[kind]['total']:g}" + (f" ({by_call})" if by_call else "")
        lines.append(
            f"| {label} | {lookups[kind + '_us']:.{3 if kind == 'own_session' else 2}f} | "
            f"{lookups['store_calls_per_lookup'][kind]:g} | {counted} | {target} |"
        )
    counted = "not counted (no strace)"
    if syscalls is not None:
        counted = f"{syscalls['other_workers_session_remembered']['total']:g}"
    lines.append(
        "| another worker's session, its claim file read before (a worker's watched store, "
        f"dirwatch.py) | {lookups['other_workers_session_remembered_us']:.3f} | 1 | {counted} "
        "| |"
    )
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result's key figures (the JSON kept in the doc)."""
    stats, figures, lookups = result["variants"], result["ratios"], result["lookups"]
    return {
        "timestamp": result["timestamp"],
        "rounds": result["rounds"],
        "access_log": result["setup"]["access_log"],
        "other_work_cpu_percent": result["machine"]["other_work_cpu_percent"],
        "median_ms": {name: s["median_ms"] for name, s in stats.items()},
        "p99_ms": {name: s["p99_ms"] for name, s in stats.items()},
        "tether_over_direct": figures["tether_over_direct"],
        "plain_over_direct": figures["plain_over_direct"],
        "added_tether_over_added_plain": figures["added_tether_over_added_plain"],
        "targets_pass": {name: t["pass"] for name, t in result["targets"].items()},
        "cpu_us_per_request": result["cpu_us_per_request"],
        "passthrough_over_direct": result["passthrough"]["over_direct"],
        "passthrough_receiving_cpu_over_holder_cpu":
            result["passthrough"]["receiving_cpu_over_holder_cpu"],
        "lookup_us": {
            "own_session": lookups["own_session_us"],
            "other_workers_session": lookups["other_workers_session_us"],
            "other_workers_session_remembered":
                lookups["other_workers_session_remembered_us"],
        },
        "lookup_system_calls": {
            kind: counted["total"]
            for kind, counted in (lookups["system_calls_per_lookup"] or {}).items()
        },
        "checks_ok": result["checks"]["ok"],
    }


def _generated_section(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f'  "{key}": {json.dumps(value)}' for key, value in summary(result).items()]
    return "\n".join(
        [
            "<!-- routing:generated:begin (written by the benchmark; edit outside it) -->",
            f"Latest run: {result['timestamp']}, `{result['command']}`, router access log "
            f"**on** (JSON lines to a file), {m['nproc']} CPUs ({m['cpu_model']}), "
            f"Python {m['python']}; other processes used {m['other_work_cpu_percent']}% "
            f"of the CPUs while it measured.",
            "",
            table(result),
            "",
            "JSON summary (the full result is in `e2e/bench/results/routing.json`):",
            "",
            "```json",
            "{\n" + ",\n".join(lines) + "\n}",
            "```",
            "<!-- routing:generated:end -->",
        ]
    )


def update_doc(result: dict[str, Any], path: Path) -> None:
    """Rewrite the generated part of the Routing section, leaving the rest as it is."""
    write_generated(path, "routing", "## Routing", _generated_section(result))


# The run


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """All CPUs' (busy, total) clock ticks so far, from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already counted in user time
    idle = fields[3] + fields[4]
    return total - idle, total


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def _show_logs(log_dir: str) -> None:
    """The servers' last log lines (on the way out of a failed run, while they exist)."""
    for name in ("tether.log", "baseline.err"):
        with contextlib.suppress(OSError), open(os.path.join(log_dir, name)) as file:
            lines = file.readlines()[-15:]
            print(f"--- last lines of {name}:\n{''.join(lines)}", file=sys.stderr)


def run(rounds: int, warmup: int, diagnose: bool) -> dict[str, Any]:
    """Start the servers, measure, stop every process; the result, ready for JSON."""
    load_before = load_average()
    with contextlib.ExitStack() as stack:  # closed in reverse: clients, baseline, tether
        log_dir = tempfile.mkdtemp(prefix="tb-", dir="/tmp")
        stack.callback(shutil.rmtree, log_dir, ignore_errors=True)
        stack.push(lambda kind, *_: _show_logs(log_dir) if kind is not None else None)
        tether = start_tether(log_dir)
        stack.callback(stop, tether.process)
        holder, count = seed(tether.port, f"bench-{secrets.token_hex(4)}")
        baseline, baseline_port = start_baseline(tether.socket_path(holder), log_dir)
        stack.callback(stop, baseline)
        direct, forwarded, other = variant_connections(tether, count, holder)
        clients = {"direct": direct, "tether": forwarded, "plain": RawClient(baseline_port)}
        if diagnose:
            clients["private"] = RawClient(tether.socket_path(holder))
        for client in clients.values():
            stack.callback(client.close)
        for name in ("plain", "private"):
            if name in clients and json_reply(clients[name], count)[1]["worker"] != holder:
                raise RuntimeError(f"the {name} connection did not reach the holder")
        before = worker_stats(tether)
        pids = {
            "tether_receiving_worker": int(before[other]["pid"]),
            "plain_forwarder": baseline.pid,
            "holder": int(before[holder]["pid"]),
            "client": os.getpid(),
        }
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        ticks_before = cpu_ticks()
        samples = measure(clients, count, rounds, warmup)
        ticks_after = cpu_ticks()
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        after = worker_stats(tether)
        # Made now: idle through the first rounds, uvicorn's keep-alive timeout would close it.
        passing = passthrough_connection(tether, other)
        stack.callback(passing.close)
        after = worker_stats(tether)
        receiving, holding = pids["tether_receiving_worker"], pids["holder"]
        passing_cpu_before = (cpu_seconds(receiving), cpu_seconds(holding))
        passing_samples = measure(
            {"direct": direct, "passthrough": passing}, count, rounds, warmup
        )
        passing_cpu_after = (cpu_seconds(receiving), cpu_seconds(holding))
        passed = worker_stats(tether)
    requests = rounds + warmup
    served = requests * len(clients)  # requests the holder and the client each saw
    per_request = {
        "tether_receiving_worker": requests,
        "plain_forwarder": requests,
        "holder": served,
        "client": served,
    }
    cpu = {
        name: round((cpu_after[name] - cpu_before[name]) * 1e6 / per_request[name], 1)
        for name in pids
    }
    # CPU time that processes other than ours used while we measured: other work on a
    # shared machine, the noise these figures are most sensitive to.
    tick = os.sysconf("SC_CLK_TCK")
    busy = (ticks_after[0] - ticks_before[0]) / tick
    capacity = (ticks_after[1] - ticks_before[1]) / tick
    ours = sum(cpu_after[name] - cpu_before[name] for name in pids)
    other_work = round(100 * max(0.0, busy - ours) / capacity, 1) if capacity else 0.0

    def delta(worker: str, field: str) -> int:
        return int(after[worker][field] - before[worker][field])

    def passed_delta(worker: str, field: str) -> int:
        return int(passed[worker][field] - after[worker][field])

    forwarded_to_holder = requests * (len(clients) - 2)  # the plain forwarder's (and private)
    checks: dict[str, Any] = {
        "tether_connection_handed_off": int(before[other]["handed_off"]),
        "holder_forwarded": delta(holder, "forwarded"),
        "other_forwarded": delta(other, "forwarded"),
        "expected_other_forwarded": 0,
        "holder_served_forwarded": delta(holder, "served_forwarded"),
        "expected_holder_served_forwarded": forwarded_to_holder,
        "other_passed_through": passed_delta(other, "passed_through"),
        "expected_other_passed_through": requests,
        "holder_served_passed": passed_delta(holder, "served_forwarded"),
        "tether_exit_code": tether.process.returncode,
        "baseline_exit_code": baseline.returncode,
        "runtime_dir": tether.runtime_dir,
        "runtime_dir_removed": not os.path.exists(tether.runtime_dir),
    }
    checks["ok"] = (
        checks["tether_connection_handed_off"] >= 1  # (and any probe that landed there)
        and checks["holder_forwarded"] == 0
        and checks["other_forwarded"] == 0
        and checks["holder_served_forwarded"] == forwarded_to_holder
        and checks["other_passed_through"] == requests
        and checks["holder_served_passed"] == requests
        and checks["tether_exit_code"] == 0
        and checks["runtime_dir_removed"]
    )
    stats = {name: summarize(values) for name, values in samples.items()}
    figures = ratios(stats)
    cpu["receiving_over_holder"] = round(cpu["tether_receiving_worker"] / cpu["holder"], 3)
    figures["receiving_cpu_over_holder_cpu"] = cpu["receiving_over_holder"]
    passing_stats = {name: summarize(values) for name, values in passing_samples.items()}
    receiving_us, holding_us = (
        (after_s - before_s) * 1e6 / per
        for after_s, before_s, per in zip(
            passing_cpu_after, passing_cpu_before, (requests, 2 * requests), strict=True
        )
    )
    passing_ms = {name: passing_stats[name] for name in ("passthrough", "direct")}
    passthrough = {
        "variants": passing_stats,
        "over_direct": {
            at: round(passing_ms["passthrough"][f"{at}_ms"] / passing_ms["direct"][f"{at}_ms"], 3)
            for at in ("median", "p99")
        },
        "cpu_us_per_request": {
            "receiving_worker": round(receiving_us, 1), "holder": round(holding_us, 1),
        },
        "receiving_cpu_over_holder_cpu": round(receiving_us / holding_us, 3),
    }
    lookups = bench_lookups()
    return {
        "benchmark": "routing",
        "command": f"{COMMAND} --rounds {rounds} --warmup {warmup}"
        + (" --diagnose" if diagnose else ""),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            **machine(PACKAGES),
            "load_average_before": load_before,
            "load_average_after": load_average(),
            "other_work_cpu_percent": other_work,
        },
        "code": code_version(),
        "setup": {
            "server": f"tether serve examples.counter:app --workers {WORKERS} --port 0 "
            "--log-format json",
            "request": "GET /count with the seeded session's cookie",
            "connections": "one kept-alive client connection per variant; the tether "
            "one handed to the holder by its first request, the passthrough one kept where "
            "it landed by its first (a seed of that worker's own)",
            "order": "one request per variant per round, order rotating each round",
            "access_log": True,
            "access_log_sink": "JSON lines to a file (the servers' stderr)",
            "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", ""),
            "baseline": "e2e/bench/baseline_forwarder.py: Starlette Request + aiohttp "
            "UnixConnector + StreamingResponse, uvicorn httptools, no access log",
            "client": "this process, blocking sockets, gc off while measuring",
        },
        "rounds": rounds,
        "warmup": warmup,
        "variants": stats,
        "ratios": figures,
        "targets": judge(figures, passthrough),
        "cpu_us_per_request": cpu,
        "passthrough": passthrough,
        "lookups": lookups,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.bench.routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5000, help="measured rounds (5000)")
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured rounds first (500)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON result")
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc to update")
    parser.add_argument("--no-doc", action="store_true", help="leave the doc alone")
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also time a 4th connection, straight to the holder's private socket",
    )
    args = parser.parse_args(argv)
    if args.rounds < 100 or args.warmup < 0:
        parser.error("--rounds must be at least 100 and --warmup not negative")
    result = run(args.rounds, args.warmup, args.diagnose)
    return finish(result, result["machine"]["other_work_cpu_percent"], args.output,
                  None if args.no_doc else args.doc, table, update_doc)


def finish(
    result: dict[str, Any],
    other_work: float,
    output: Path,
    doc: Path | None,
    table: Callable[[dict[str, Any]], str],
    update_doc: Callable[[dict[str, Any], Path], None],
) -> int:
    """A benchmark's end: print its table (and a note on a busy machine or a failed
    check), write its JSON and, unless `doc` is None, its part of the doc; 1 if a
    check failed."""
    print(table(result))
    if other_work > OTHER_WORK_NOTE_PERCENT:
        print(
            f"\nnote: other processes used {other_work}% of the CPUs during the run; "
            "the ratios are less reliable than in a quiet run",
            file=sys.stderr,
        )
    if not result["checks"]["ok"]:
        print(f"\nchecks failed: {json.dumps(result['checks'])}", file=sys.stderr)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if doc is not None:
        update_doc(result, doc)
    print(f"\nwrote {output}" + ("" if doc is None else f" and {doc}"))
    return 0 if result["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
