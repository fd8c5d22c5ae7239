"""The concurrent-sessions benchmark (SPEC 11): 10,000 counter sessions alive at once on
4 workers, every request on a new connection.

Run from the repository root (about 3 minutes on 2 CPUs)::

    .venv/bin/python -m e2e.bench.stress [--sessions 10000] [--workers 4]
                                         [--concurrency 256] [--close-window 5]
                                         [--no-baseline] [--no-doc]

It starts `tether serve tether.examples.counter:app --workers 4 --close-window 5 --port 0
--log-format json` and drives every session through seed, 5 increments, verify, close
(8 requests, each on a connection of its own), one step at a time across all sessions:
all seeds, then the first increment of every session, and so on, so every session is
held at once between its seed and its verify. At most `--concurrency` requests are in
flight; the client is this process (raw HTTP/1.1 over asyncio streams, on uvloop when
installed), so it costs little next to the servers.

For each session it checks: every reply is 200, each increment answers the next count,
verify answers 5, close answers closed, and every reply that names a worker names the
same one. A session is *right* if all of that holds and *split* if its replies named more
than one worker. Non-200 replies are counted by status and code. `close_window_s` plus
one second after the last close, it counts the claim files left in the runtime directory
(`Server.claims()`), then how long until none is left.

Every figure is set beside a baseline of the same run: the same client against plain
`uvicorn tether.examples.counter:app --workers 4` (no tether routing: a session's
requests land on whichever worker accepts them, so most read another worker's empty
state). Its wall time is what the machine and this client need for the same 80,000
connections; its right count shows what tether is for.

It prints a table, writes `e2e/bench/results/stress.json` and rewrites the generated part
of the "Concurrent sessions" section of `docs/benchmarks.md` (not with `--no-doc`). It
exits 1 if a check fails: a session not right, a split, a claim left after the window,
or a server process left over.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2e.bench import machine, stop, write_generated
from e2e.harness import COUNTER_APP, Server, start_server

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "e2e" / "bench" / "results" / "stress.json"
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.stress"

INCREMENTS = 5
REQUEST_TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
CLAIMS_GONE_WITHIN_S = 60.0

_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_SET_SESSION = re.compile(rb"\r\nset-cookie:[ \t]*(session=[^;\r]*)", re.IGNORECASE)


# The client -------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: Any
    cookie: str | None = None


async def exchange(port: int, request: bytes) -> Answer:
    """One request on a new connection to 127.0.0.1:port, read whole, then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = _LENGTH.search(head)
        payload = await reader.readexactly(int(length.group(1)) if length else 0)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    cookie = _SET_SESSION.search(head)
    try:
        body = json.loads(payload)
    except ValueError:
        body = None
    return Answer(int(head.split(b" ", 2)[1]), body, cookie.group(1).decode() if cookie else None)


def request_bytes(method: str, path: str, body: Any = None, cookie: str | None = None) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", "connection: close",
             f"content-length: {len(payload)}"]
    if body is not None:
        lines.append("content-type: application/json")
    if cookie is not None:
        lines.append(f"cookie: {cookie}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


@dataclass
class Session:
    """What one session's requests saw."""

    id: str
    cookie: str | None = None
    workers: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


@dataclass
class Tally:
    """Every reply's outcome, by step."""

    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    requests: int = 0
    latencies_ms: list[float] = field(default_factory=list)


async def call(
    port: int, session: Session, tally: Tally, step: str, request: bytes,
    ok: Callable[[Any], bool],
) -> Answer | None:
    started = time.perf_counter()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            answer = await exchange(port, request)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        tally.requests += 1
        tally.statuses[f"client {type(e).__name__}"] += 1
        session.problems.append(f"{step}: {e!r}")
        return None
    tally.latencies_ms.append((time.perf_counter() - started) * 1000)
    tally.requests += 1
    if answer.status != 200:
        code = answer.body.get("code") if isinstance(answer.body, dict) else None
        tally.statuses[f"{answer.status} {code}"] += 1
        session.problems.append(f"{step}: {answer.status} {code}")
        return answer
    tally.statuses["200"] += 1
    body = answer.body
    if isinstance(body, dict) and isinstance(body.get("worker"), str):
        session.workers.add(body["worker"])
    if not ok(body):
        session.problems.append(f"{step}: unexpected {body!r}")
    return answer


async def drive(port: int, count: int, concurrency: int, run_id: str) -> dict[str, Any]:
    """All sessions, one step at a time across all of them; the outcome."""
    sessions = [Session(f"stress-{run_id}-{i:05d}") for i in range(count)]
    tally = Tally()
    limit = asyncio.Semaphore(concurrency)

    async def each(step: Callable[[Session], Awaitable[None]]) -> float:
        async def one(session: Session) -> None:
            async with limit:
                await step(session)

        started = time.perf_counter()
        await asyncio.gather(*(one(s) for s in sessions))
        return time.perf_counter() - started

    async def seed(s: Session) -> None:
        answer = await call(port, s, tally, "seed",
                            request_bytes("POST", "/seed_session", {"session_id": s.id}),
                            lambda b: b["session_id"] == s.id)
        if answer is not None and answer.status == 200:
            s.cookie = answer.cookie
            if s.cookie is None:
                s.problems.append("seed: no session cookie")

    def increment(n: int) -> Callable[[Session], Awaitable[None]]:
        async def step(s: Session) -> None:
            if s.cookie is not None:
                await call(port, s, tally, f"increment {n}",
                           request_bytes("POST", "/increment", cookie=s.cookie),
                           lambda b: b["count"] == n)

        return step

    async def verify(s: Session) -> None:
        if s.cookie is not None:
            await call(port, s, tally, "verify", request_bytes("POST", "/verify", cookie=s.cookie),
                       lambda b: b == {"session_id": s.id, "count": INCREMENTS})

    async def close(s: Session) -> None:
        if s.cookie is not None:
            await call(port, s, tally, "close",
                       request_bytes("POST", "/close_session", {"session_id": s.id}, s.cookie),
                       lambda b: b.get("closed") is True)

    steps: dict[str, float] = {}
    cpu_before = _client_cpu()
    started = time.perf_counter()
    steps["seed"] = await each(seed)
    for n in range(1, INCREMENTS + 1):
        steps[f"increment {n}"] = await each(increment(n))
    steps["verify"] = await each(verify)
    steps["close"] = await each(close)
    wall = time.perf_counter() - started
    right = sum(1 for s in sessions if not s.problems and len(s.workers) == 1)
    split = sum(1 for s in sessions if len(s.workers) > 1)
    latencies = sorted(tally.latencies_ms)
    return {
        "sessions": count,
        "right": right,
        "split": split,
        "requests": tally.requests,
        "replies": dict(sorted(tally.statuses.items())),
        "non_200": {k: v for k, v in sorted(tally.statuses.items()) if k != "200"},
        "wall_s": round(wall, 2),
        "requests_per_s": round(tally.requests / wall, 1),
        "step_s": {k: round(v, 2) for k, v in steps.items()},
        "latency_ms": _percentiles(latencies),
        "client_cpu_s": round(_client_cpu() - cpu_before, 2),
        "first_problems": [f"{s.id}: {s.problems[:2]}" for s in sessions if s.problems][:5],
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}

    def at(share: float) -> float:
        return round(values[min(len(values) - 1, int(share * len(values)))], 2)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(values[-1], 2)}


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def group_cpu(pgid: int) -> float:
    """CPU seconds used so far by the running processes of a process group."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                total += (int(fields[11]) + int(fields[12])) / ticks
    return total


# The servers -------------------------------------------------------------------------------


async def run_tether(
    sessions: int, workers: int, concurrency: int, window_s: float
) -> dict[str, Any]:
    server = await asyncio.to_thread(
        start_server, COUNTER_APP, workers, "--close-window", str(window_s),
        timeout=START_TIMEOUT_S,
    )
    problems: list[str] = []
    try:
        port = server.host_port[1]
        cpu_before = group_cpu(server.pid)
        outcome = await drive(port, sessions, concurrency, os.urandom(3).hex())
        outcome["server_cpu_s"] = round(group_cpu(server.pid) - cpu_before, 2)
        outcome.update(await _claims_after(server, window_s + 1.0))
        outcome["pids"] = len(server.group())
    finally:
        problems = await asyncio.to_thread(server.shutdown)
    outcome["shutdown_problems"] = problems
    return outcome


async def _claims_after(server: Server, window_s: float) -> dict[str, Any]:
    """The claim files at the last close, `window_s` after it, and how long after it
    until none is left (None if some are still there `CLAIMS_GONE_WITHIN_S` after)."""
    started = time.monotonic()
    found: dict[str, Any] = {"claims_at_last_close": len(server.claims())}
    while True:
        waited = time.monotonic() - started
        left = len(server.claims())
        if waited >= window_s and "claims_left_after_window" not in found:
            found["claims_left_after_window"] = left
        if not left and "claims_gone_after_s" not in found:
            found["claims_gone_after_s"] = round(waited, 1)
        if len(found) == 3:
            return found
        if waited > CLAIMS_GONE_WITHIN_S:
            found.setdefault("claims_gone_after_s", None)
            return found
        await asyncio.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_plain(sessions: int, workers: int, concurrency: int) -> dict[str, Any]:
    """The same client against plain `uvicorn --workers N` serving the counter."""
    base = Path(tempfile.mkdtemp(prefix="tb-", dir="/tmp"))
    port = _free_port()
    process = await asyncio.to_thread(_start_plain, base, port, workers)
    try:
        await _listening(port, process)
        cpu_before = group_cpu(process.pid)
        outcome = await drive(port, sessions, concurrency, os.urandom(3).hex())
        outcome["server_cpu_s"] = round(group_cpu(process.pid) - cpu_before, 2)
    finally:
        code = await asyncio.to_thread(stop, process)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        shutil.rmtree(base, ignore_errors=True)
    outcome["exit_code"] = code
    return outcome


def _start_plain(base: Path, port: int, workers: int) -> subprocess.Popen[bytes]:
    uvicorn = Path(sys.executable).with_name("uvicorn")
    with open(base / "stderr", "wb") as err:
        return subprocess.Popen(
            [str(uvicorn), COUNTER_APP, "--workers", str(workers), "--port", str(port),
             "--no-access-log", "--log-level", "warning", "--backlog", "2048"],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )


async def _listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {process.returncode}")
        with contextlib.suppress(OSError):
            answer = await exchange(port, request_bytes("GET", "/health"))
            if answer.status == 200:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"uvicorn did not answer on {port} within {START_TIMEOUT_S} s")


# Reporting ---------------------------------------------------------------------------------


def checks(result: dict[str, Any]) -> dict[str, Any]:
    tether = result["tether"]
    found = {
        "all_right": tether["right"] == tether["sessions"],
        "none_split": tether["split"] == 0,
        "no_claim_left_after_window": tether["claims_left_after_window"] == 0,
        "clean_shutdown": not tether["shutdown_problems"],
    }
    found["ok"] = all(found.values())
    return found


def table(result: dict[str, Any]) -> str:
    tether, plain = result["tether"], result.get("plain")
    rows = [
        ("sessions", tether["sessions"], plain and plain["sessions"]),
        ("right", tether["right"], plain and plain["right"]),
        ("split (replies from >1 worker)", tether["split"], plain and plain["split"]),
        ("non-200 replies", sum(tether["non_200"].values()),
         plain and sum(plain["non_200"].values())),
        ("requests (new connection each)", tether["requests"], plain and plain["requests"]),
        ("wall s", tether["wall_s"], plain and plain["wall_s"]),
        ("requests / s", tether["requests_per_s"], plain and plain["requests_per_s"]),
        ("latency p50 / p99 ms",
         f"{tether['latency_ms'].get('p50')} / {tether['latency_ms'].get('p99')}",
         plain and f"{plain['latency_ms'].get('p50')} / {plain['latency_ms'].get('p99')}"),
        ("server CPU s", tether["server_cpu_s"], plain and plain["server_cpu_s"]),
        ("client CPU s", tether["client_cpu_s"], plain and plain["client_cpu_s"]),
        ("claims at the last close", tether["claims_at_last_close"], None),
        (f"claims left {result['close_window_s']} s + 1 s after it",
         tether["claims_left_after_window"], None),
        ("claims all gone after s", tether["claims_gone_after_s"], None),
    ]
    lines = ["| figure | tether | plain uvicorn (baseline) |", "| --- | ---: | ---: |"]
    for name, ours, theirs in rows:
        lines.append(f"| {name} | {ours} | {'' if theirs is None else theirs} |")
    lines.append("")
    lines.append("| non-200 by status and code | tether | plain uvicorn |")
    lines.append("| --- | ---: | ---: |")
    codes = sorted({*tether["non_200"], *(plain["non_200"] if plain else {})})
    for code in codes or ["(none)"]:
        lines.append(f"| {code} | {tether['non_200'].get(code, 0)} | "
                     f"{plain['non_200'].get(code, 0) if plain else ''} |")
    ratio = result.get("ratios", {}).get("wall_over_plain")
    if ratio is not None:
        lines.append("")
        lines.append(f"tether wall time ÷ plain uvicorn's, same client, same run: {ratio}")
    return "\n".join(lines)


def _generated_section(result: dict[str, Any]) -> str:
    m = result["machine"]
    summary = {
        "sessions": result["tether"]["sessions"],
        "workers": result["workers"],
        "concurrency": result["concurrency"],
        "close_window_s": result["close_window_s"],
        "right": result["tether"]["right"],
        "split": result["tether"]["split"],
        "non_200": result["tether"]["non_200"],
        "claims_left_after_window": result["tether"]["claims_left_after_window"],
        "wall_s": result["tether"]["wall_s"],
        "ratios": result.get("ratios", {}),
        "checks_ok": result["checks"]["ok"],
    }
    lines = [f'  "{key}": {json.dumps(value)}' for key, value in summary.items()]
    return "\n".join([
        "<!-- stress:generated:begin (written by the benchmark; edit outside it) -->",
        f"Latest run: {result['timestamp']}, `{result['command']}`, {m['nproc']} CPUs "
        f"({m['cpu_model']}), Python {m['python']}; load average {result['load_before']} "
        f"before, {result['load_after']} after; {result['total_s']} s in all.",
        "",
        table(result),
        "",
        "JSON summary (the full result is in `e2e/bench/results/stress.json`):",
        "",
        "```json",
        "{\n" + ",\n".join(lines) + "\n}",
        "```",
        "<!-- stress:generated:end -->",
    ])


def update_doc(result: dict[str, Any], path: Path) -> None:
    """Rewrite the generated part of the section, or add the section at the end."""
    write_generated(path, "stress", "## Concurrent sessions", _generated_section(result))


# The run -----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = [round(v, 2) for v in os.getloadavg()]
    result: dict[str, Any] = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([COMMAND, *sys.argv[1:]]),
        "workers": args.workers,
        "concurrency": args.concurrency,
        "close_window_s": args.close_window,
        "machine": machine(["uvicorn", "starlette", "httptools", "uvloop"]),
        "client": "this process: raw HTTP/1.1 on asyncio streams, a new connection per "
                  f"request, at most {args.concurrency} in flight"
                  + (", uvloop" if _uvloop() else ""),
    }
    result["tether"] = await run_tether(args.sessions, args.workers, args.concurrency,
                                        args.close_window)
    if not args.no_baseline:
        result["plain"] = await run_plain(args.sessions, args.workers, args.concurrency)
        result["ratios"] = {"wall_over_plain": round(
            result["tether"]["wall_s"] / result["plain"]["wall_s"], 3)}
    result["load_before"] = load_before
    result["load_after"] = [round(v, 2) for v in os.getloadavg()]
    result["total_s"] = round(time.perf_counter() - started, 1)
    result["checks"] = checks(result)
    return result


def _uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.bench.stress", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=10_000, help="sessions (10000)")
    parser.add_argument("--workers", type=int, default=4, help="tether workers (4)")
    parser.add_argument("--concurrency", type=int, default=256,
                        help="requests in flight at most (256)")
    parser.add_argument("--close-window", type=float, default=5.0,
                        help="tether serve --close-window (5)")
    parser.add_argument("--no-baseline", action="store_true", help="skip plain uvicorn")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON result")
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc to update")
    parser.add_argument("--no-doc", action="store_true", help="leave the doc alone")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.concurrency < 1 or args.close_window <= 0:
        parser.error("--sessions and --concurrency must be positive, --close-window > 0")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, max(soft, 4 * args.concurrency + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if _uvloop():
        import uvloop

        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    print(table(result))
    if not result["checks"]["ok"]:
        print(f"\nchecks failed: {result['checks']}", file=sys.stderr)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if not args.no_doc:
        update_doc(result, args.doc)
    print(f"\nwrote {args.output}" + ("" if args.no_doc else f" and {args.doc}"))
    return 0 if result["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
