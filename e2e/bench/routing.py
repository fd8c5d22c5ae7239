"""The routing benchmark (SPEC 11): what tether's forwarding hop adds to a tiny request.

Run from the repository root (about 30 seconds)::

    .venv/bin/python -m e2e.bench.routing [--rounds 5000] [--warmup 500] [--no-doc]

It starts `tether serve examples.counter:app --workers 2 --port 0 --log-format json`
(the router's access log on, as users run it; JSON lines go to a file) and the baseline
forwarder of `e2e/bench/baseline_forwarder.py`, each in its own processes, seeds one
session and times `GET /count` for it over three kept-alive client connections, one
request on each per round, in an order that rotates every round:

    direct  a connection the session's holder accepted: served with no hop
    tether  a connection the other worker accepted: tether's router forwards it
    plain   a connection to the baseline (Starlette Request + aiohttp UnixConnector +
            StreamingResponse on its own uvicorn), which forwards to the holder's
            private socket, the same socket tether forwards to

The client is this process: one blocking socket per connection, writing fixed request
bytes and reading exactly one reply, so it shares no event loop with the servers.
It also times `WorkerClaims.lookup` in this process, for a session the worker holds
(memory) and one another worker holds (a claim file read).

It prints a table, writes `e2e/bench/results/routing.json` and rewrites the generated
part of the "Routing" section of `docs/benchmarks.md` (not with `--no-doc`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from itertools import repeat
from pathlib import Path
from typing import Any

from routing.claims import FileClaimStore, WorkerClaims
from routing.lifetimes import Lifetimes
from routing.types import SessionId, WorkerId, new_worker_id

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "e2e" / "bench" / "results" / "routing.json"
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.routing"

VARIANTS = ("direct", "tether", "plain")
WORKERS = 2
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 10.0
CONNECT_ATTEMPTS = 50  # batches of new connections tried to find one on each worker
CONNECT_BATCH = 4
TARGETS = {  # SPEC 11
    "tether_over_direct_median": 2.0,
    "tether_over_direct_p99": 2.5,
    "added_over_plain_added_median": 0.5,
}
STRETCH_TETHER_OVER_DIRECT_MEDIAN = 1.5

_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_SET_SESSION = re.compile(rb"\r\nset-cookie:[ \t]*(session=[^;\r]*)", re.IGNORECASE)


# The client


class RawClient:
    """One kept-alive HTTP/1.1 connection on a blocking socket: write a request's bytes,
    read exactly one reply. Lean on purpose, so the client's own time stays small."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        body = []
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
    return [sys.executable, "-c", "import sys; from coordinator.cli import main; main()"]


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


def start_tether(log_dir: str) -> Tether:
    token = secrets.token_urlsafe(24)
    env = {**os.environ, "TETHER_CONTROL_TOKEN": token}
    log_path = os.path.join(log_dir, "tether.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *_tether_command(),
                "serve",
                "examples.counter:app",
                "--workers",
                str(WORKERS),
                "--port",
                "0",
                "--log-format",
                "json",
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


def stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL to its process group if it has not exited in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


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
            for name in ("tether", "plain")
        },
        "added_tether_over_added_plain": {
            "median": added_ratio("median_ms"),
            "p99": added_ratio("p99_ms"),
        },
    }


def judge(figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    values = {
        "tether_over_direct_median": figures["tether_over_direct"]["median"],
        "tether_over_direct_p99": figures["tether_over_direct"]["p99"],
        "added_over_plain_added_median": figures["added_tether_over_added_plain"]["median"],
    }
    return {
        name: {
            "value": value,
            "at_most": TARGETS[name],
            "pass": value is not None and value <= TARGETS[name],
        }
        for name, value in values.items()
    }


# Claim lookups


class _CountingStore:
    """A claim store that counts the calls made to it."""

    def __init__(self, store: FileClaimStore) -> None:
        self.store = store
        self.calls = 0

    def claim(self, session_id: SessionId, worker: WorkerId) -> WorkerId:
        self.calls += 1
        return self.store.claim(session_id, worker)

    def claimant(self, session_id: SessionId) -> WorkerId | None:
        self.calls += 1
        return self.store.claimant(session_id)

    def release(self, session_id: SessionId, worker: WorkerId) -> None:
        self.calls += 1
        self.store.release(session_id, worker)


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
        claims.claim(mine)
        store.claim(theirs, other)
        counting = _CountingStore(store)
        counted = WorkerClaims(counting, me, Lifetimes(300.0))
        counted.claim(mine)
        counting.calls = 0
        checks = 1000
        for _ in range(checks):
            assert counted.lookup(mine) == me
        own_store_calls = counting.calls
        for _ in range(checks):
            assert counted.lookup(theirs) == other
        other_store_calls = counting.calls - own_store_calls
        gc.collect()
        gc.disable()
        try:
            own_us = _per_call_us(claims.lookup, mine, batch=10_000, batches=100)
            other_us = _per_call_us(claims.lookup, theirs, batch=200, batches=100)
        finally:
            gc.enable()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "own_session_us": round(own_us, 4),
        "other_workers_session_us": round(other_us, 2),
        "calls": {"own_session": 10_000 * 100, "other_workers_session": 200 * 100},
        "store_calls_per_lookup": {
            "own_session": own_store_calls / checks,
            "other_workers_session": other_store_calls / checks,
        },
    }


# Reporting


def machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as file:
        for line in file:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("uvicorn", "starlette", "aiohttp", "httptools", "uvloop", "structlog"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
    }


def table(result: dict[str, Any]) -> str:
    stats, figures = result["variants"], result["ratios"]
    lines = [
        "| variant | median ms | p90 ms | p99 ms | mean ms | added median ms | added p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in VARIANTS:
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
        f"| tether ÷ direct | {tod['median']:.2f}x | {tod['p99']:.2f}x | ≤ 2.0x median, "
        f"≤ 2.5x p99 (stretch 1.5x) | median {verdict('tether_over_direct_median')}, "
        f"p99 {verdict('tether_over_direct_p99')} |"
    )
    pod = figures["plain_over_direct"]
    lines.append(f"| plain ÷ direct | {pod['median']:.2f}x | {pod['p99']:.2f}x | | |")
    ratio = figures["added_tether_over_added_plain"]["median"]
    lines.append(
        f"| tether's added ÷ plain's added | {ratio:.3f} | "
        f"{'n/a' if added_p99 is None else f'{added_p99:.3f}'} | ≤ 0.5 (median) | "
        f"{verdict('added_over_plain_added_median')} |"
    )
    lookups = result["lookups"]
    lines += [
        "",
        "| claim lookup (`WorkerClaims.lookup`) | median µs per call | store calls | target |",
        "| --- | ---: | ---: | --- |",
        f"| this worker's session (memory) | {lookups['own_session_us']:.3f} | "
        f"{lookups['store_calls_per_lookup']['own_session']:g} | no system call |",
        f"| another worker's session (claim file read) | "
        f"{lookups['other_workers_session_us']:.2f} | "
        f"{lookups['store_calls_per_lookup']['other_workers_session']:g} | one small read |",
    ]
    return "\n".join(lines)


def _generated_section(result: dict[str, Any]) -> str:
    m = result["machine"]
    summary = {
        key: result[key]
        for key in ("rounds", "warmup", "variants", "ratios", "targets", "lookups", "checks")
    }
    return "\n".join(
        [
            "<!-- routing:generated:begin (written by the benchmark; edit outside it) -->",
            f"Latest run: {result['timestamp']}, `{COMMAND} --rounds {result['rounds']}` "
            f"({result['warmup']} warm-up rounds), router access log **on** "
            f"(JSON lines to a file), {m['nproc']} CPUs ({m['cpu_model']}), "
            f"Python {m['python']}.",
            "",
            table(result),
            "",
            "JSON summary (the full result is in `e2e/bench/results/routing.json`):",
            "",
            "```json",
            json.dumps(summary, indent=1, ensure_ascii=False),
            "```",
            "<!-- routing:generated:end -->",
        ]
    )


_GENERATED = re.compile(r"<!-- routing:generated:begin.*?<!-- routing:generated:end -->", re.S)


def update_doc(result: dict[str, Any], path: Path) -> None:
    """Rewrite the generated part of the Routing section, leaving the rest as it is."""
    generated = _generated_section(result)
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if _GENERATED.search(text):
        text = _GENERATED.sub(lambda _: generated, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## Routing\n\n{generated}\n"
    path.write_text(text, encoding="utf-8")


# The run


@contextlib.contextmanager
def servers(log_dir: str) -> Iterator[Tether]:
    tether = start_tether(log_dir)
    try:
        yield tether
    finally:
        stop(tether.process)


def run(rounds: int, warmup: int) -> dict[str, Any]:
    log_dir = tempfile.mkdtemp(prefix="tb-", dir="/tmp")
    clients: list[RawClient] = []
    try:
        with servers(log_dir) as tether:
            holder, count = seed(tether.port, f"bench-{secrets.token_hex(4)}")
            baseline, baseline_port = start_baseline(tether.socket_path(holder), log_dir)
            try:
                direct, forwarded, other = variant_connections(tether, count, holder)
                clients += [direct, forwarded]
                plain = RawClient(baseline_port)
                clients.append(plain)
                _, reply = json_reply(plain, count)
                if reply["worker"] != holder:
                    raise RuntimeError("the baseline did not reach the holder")
                before = worker_stats(tether)
                samples = measure(
                    {"direct": direct, "tether": forwarded, "plain": plain}, count, rounds, warmup
                )
                after = worker_stats(tether)
            finally:
                baseline_code = stop(baseline)
            for client in clients:
                client.close()
            clients.clear()
        runtime_removed = not os.path.exists(tether.runtime_dir)
        requests = rounds + warmup

        def delta(worker: str, field: str) -> int:
            return int(after[worker][field] - before[worker][field])

        checks = {
            "holder_forwarded": delta(holder, "forwarded"),
            "other_forwarded": delta(other, "forwarded"),
            "holder_served_forwarded": delta(holder, "served_forwarded"),
            "expected_other_forwarded": requests,
            "expected_holder_served_forwarded": 2 * requests,
            "tether_exit_code": tether.process.returncode,
            "baseline_exit_code": baseline_code,
            "runtime_dir_removed": runtime_removed,
        }
        checks["ok"] = (
            checks["holder_forwarded"] == 0
            and checks["other_forwarded"] == requests
            and checks["holder_served_forwarded"] == 2 * requests
            and runtime_removed
        )
    finally:
        for client in clients:
            client.close()
        shutil.rmtree(log_dir, ignore_errors=True)
    stats = {name: summarize(samples[name]) for name in VARIANTS}
    figures = ratios(stats)
    return {
        "benchmark": "routing",
        "command": f"{COMMAND} --rounds {rounds} --warmup {warmup}",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "setup": {
            "server": f"tether serve examples.counter:app --workers {WORKERS} --port 0 "
            "--log-format json",
            "request": "GET /count with the seeded session's cookie",
            "connections": "one kept-alive client connection per variant",
            "order": "one request per variant per round, order rotating each round",
            "access_log": True,
            "access_log_sink": "JSON lines to a file (the servers' stderr)",
            "baseline": "e2e/bench/baseline_forwarder.py: Starlette Request + aiohttp "
            "UnixConnector + StreamingResponse, uvicorn httptools, no access log",
            "client": "this process, blocking sockets, gc off while measuring",
        },
        "rounds": rounds,
        "warmup": warmup,
        "variants": stats,
        "ratios": figures,
        "targets": judge(figures),
        "lookups": bench_lookups(),
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
    args = parser.parse_args(argv)
    if args.rounds < 100 or args.warmup < 0:
        parser.error("--rounds must be at least 100 and --warmup not negative")
    result = run(args.rounds, args.warmup)
    print(table(result))
    if not result["checks"]["ok"]:
        print(f"checks failed: {result['checks']}", file=sys.stderr)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if not args.no_doc:
        update_doc(result, args.doc)
    print(f"\nwrote {args.output}" + ("" if args.no_doc else f" and {args.doc}"))
    return 0 if result["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
