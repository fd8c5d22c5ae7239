"""The throughput benchmark (SPEC 11): requests per second at 4 workers for requests of
random sessions, against plain `uvicorn --workers 4` serving the same handler with no
sessions, in the same run.

Run from the repository root (about three minutes)::

    .venv/bin/python -m e2e.bench.throughput [--seconds 10] [--rounds 5] [--candidates]
        [--sticky] [--no-doc]

Each round runs `tether serve e2e.bench.throughput_app:app --workers 4`, then
`uvicorn e2e.bench.throughput_app:app --workers 4` (both without access logs, so the
figure is routing's cost, not logging's), then the splice floor of
`e2e/bench/splice_floor.py` (the passthrough's design with a free routing decision and
no router: how close the design itself can come), and with `--candidates` the two
direct-reply floors of `e2e/bench/direct_reply_floor.py` (a candidate design: the same,
with the holder writing the reply to the client's socket), each driven for `--seconds`
by the client of `e2e/bench/load_client.py` in its own process: 64 kept-alive
connections, one request at a time on each, `GET /count` with the signed session cookie
of one of 1,000 sessions picked at random per request. With 4 workers three requests in
four reach a worker that does not hold their session. Before the clock starts every
session is used once (under tether, that claims it where it lands).

`--sticky` adds a round of tether and of uvicorn whose connections each keep to the
session of their first request: under tether that request moves the connection to the
session's holder (handoff.py), so every timed request is served where it lands and none
is forwarded. Their ratio is what tether costs with nothing forwarded (no target): it
tells the routing work on the holder's side from the forwarding itself.

The target is judged on the ratio of the two medians of rounds. Five rounds by default:
on a shared 2-core VM one round's ratio moves by ±0.1 from the next, and the median of
five interleaved rounds by much less. Each round's own ratio (tether's rate over the
uvicorn run just after it) is printed too, with its median: the same comparison with
the machine's slower drift taken out.

Under tether it also reads `tether_requests_total` from `/_tether/metrics` before and
after each run, for the share of requests the workers forwarded (the kernel's spread of
the connections over the workers moves it around 0.75, and the figure with it).

It prints a table, writes `e2e/bench/results/throughput.json` and rewrites the generated
part of the "Throughput" section of `docs/benchmarks.md` (not with `--no-doc`); it exits
1 if a run's checks fail (an error reply, a lost connection, a process left over, or a
forwarded request in a `--sticky` round).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from itsdangerous import TimestampSigner
from prometheus_client.parser import text_string_to_metric_families

from e2e.bench import machine, stop, write_generated
from e2e.bench.routing import (
    REPO,
    Tether,
    code_version,
    cpu_seconds,
    cpu_ticks,
    finish,
    load_average,
    start_tether,
)
from e2e.bench.throughput_app import SECRET

RESULTS = REPO / "e2e" / "bench" / "results" / "throughput.json"
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.throughput"
APP = "e2e.bench.throughput_app:app"
WORKERS = 4
CONNECTIONS = 64
SESSIONS = 1000
WARMUP_S = 2.0
TARGET = 0.7  # SPEC 11: tether ÷ plain uvicorn
PACKAGES = ("uvicorn", "uvloop", "httptools", "starlette")


def cookies(count: int) -> list[str]:
    """Cookie header values naming sessions `tp-0` ... as Starlette's SessionMiddleware
    signs them with the app's secret."""
    signer = TimestampSigner(SECRET)
    values = []
    for index in range(count):
        data = base64.b64encode(json.dumps({"session_id": f"tp-{index}"}).encode())
        values.append("session=" + signer.sign(data).decode("ascii"))
    return values


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_uvicorn(log_dir: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    log = open(os.path.join(log_dir, "uvicorn.log"), "wb")  # noqa: SIM115 (the process's)
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", APP, "--workers", str(WORKERS), "--port", str(port),
         "--no-access-log"],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"uvicorn exited with code {process.returncode}")
        ready = Path(log_dir, "uvicorn.log").read_text(errors="replace")
        if ready.count("Application startup complete") >= WORKERS:
            return process, port
        time.sleep(0.05)
    stop(process)
    raise RuntimeError("uvicorn did not start its workers within 60 s")


FLOOR = ("e2e.bench.splice_floor",)
"""The passthrough's design with no routing work."""
CANDIDATES = {
    "direct-reply floor (socket)": ("e2e.bench.direct_reply_floor", "socket"),
    "direct-reply floor (memory)": ("e2e.bench.direct_reply_floor", "memory"),
}
"""Other designs with no routing work (`--candidates`): the holder writes the reply to
the client's socket, and says it is done on the Unix socket or in shared memory."""


def start_floor(log_dir: str, floor: tuple[str, ...]) -> tuple[subprocess.Popen[bytes], int]:
    """A floor (`FLOOR`, `CANDIDATES`: its module and arguments) with as many processes
    as workers."""
    runtime = tempfile.mkdtemp(prefix="floor-", dir="/tmp")
    log = open(os.path.join(log_dir, "floor.log"), "ab")  # noqa: SIM115 (the process's)
    module, *extra = floor
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(WORKERS), runtime, *extra],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
        start_new_session=True,
    )
    log.close()
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    if not line.startswith("port "):
        stop(process)
        raise RuntimeError(f"{module} did not start")
    return process, int(line.split()[1])


def group_cpu(root: int) -> float:
    """CPU seconds of `root` and every process in its session (the server's workers)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == root:
                    total += cpu_seconds(int(entry))
            except (OSError, ValueError):
                continue
    return total


def drive(
    port: int, seconds: float, cookie_file: str, server: int, sticky: bool = False
) -> dict[str, Any]:
    """Run the load client against `port` (each connection keeping to one session if
    `sticky`); its figures, the server's CPU, and the CPU every process used meanwhile
    (`window_busy_s` of `window_s`, from /proc/stat)."""
    cpu, ticks, children = group_cpu(server), cpu_ticks(), _children_cpu()
    client = subprocess.run(
        [sys.executable, "-m", "e2e.bench.load_client", str(port), str(CONNECTIONS),
         str(WARMUP_S), str(seconds), cookie_file, *(["sticky"] if sticky else [])],
        cwd=REPO, capture_output=True, check=True, timeout=seconds + 120,
    )
    after, client_cpu = cpu_ticks(), _children_cpu() - children
    server_cpu = group_cpu(server) - cpu  # warm-up included: an upper bound per reply
    result: dict[str, Any] = json.loads(client.stdout.decode().strip().splitlines()[-1])
    result["requests_per_s"] = round(result["replies"] / result["seconds"], 1)
    result["server_cpu_s"] = round(server_cpu, 3)
    tick = os.sysconf("SC_CLK_TCK")
    result["window_busy_s"] = round((after[0] - ticks[0]) / tick, 2)
    result["window_s"] = round((after[1] - ticks[1]) / tick, 2)
    result["client_process_cpu_s"] = round(client_cpu, 3)  # its start and warm-up too
    return result


def _children_cpu() -> float:
    """User and system CPU seconds of this process's children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def outcomes(tether: Tether) -> dict[str, float]:
    """`tether_requests_total` by outcome, summed over the workers (SPEC 9)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{tether.port}/_tether/metrics",
        headers={"authorization": f"Bearer {tether.token}"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tether_requests":
            for sample in family.samples:
                if sample.name == "tether_requests_total":
                    outcome = sample.labels["outcome"]
                    totals[outcome] = totals.get(outcome, 0.0) + sample.value
    return totals


def forwarded_fraction(before: dict[str, float], after: dict[str, float]) -> float:
    """Of the requests the workers received between two readings, the share they
    forwarded (the rest they served where they landed): the kernel's spread of the
    client's connections over the workers moves it around 0.75."""
    def delta(outcome: str) -> float:
        return after.get(outcome, 0.0) - before.get(outcome, 0.0)

    received = delta("forwarded") + delta("local")
    return round(delta("forwarded") / received, 3) if received else 0.0


def run(
    seconds: float, rounds: int, candidates: bool = False, sticky: bool = False
) -> dict[str, Any]:
    load_before = load_average()
    log_dir = tempfile.mkdtemp(prefix="tp-", dir="/tmp")
    cookie_file = os.path.join(log_dir, "cookies")
    Path(cookie_file).write_text("\n".join(cookies(SESSIONS)) + "\n", encoding="latin-1")
    floors = {"splice floor": FLOOR, **(CANDIDATES if candidates else {})}
    runs: dict[str, list[dict[str, Any]]] = {"tether": [], "uvicorn": [],
                                             **{name: [] for name in floors}}
    if sticky:
        runs.update({"tether, one session per connection": [],
                     "uvicorn, one session per connection": []})
    exits: list[int] = []
    def tether_round(one_session: bool) -> dict[str, Any]:
        tether = start_tether(log_dir, APP, WORKERS, ("--log-format", "json",
                                                      "--no-access-log"))
        try:
            before = outcomes(tether)
            result = drive(tether.port, seconds, cookie_file, tether.process.pid, one_session)
            result["forwarded_fraction"] = forwarded_fraction(before, outcomes(tether))
            return result
        finally:
            exits.append(stop(tether.process))

    def uvicorn_round(one_session: bool) -> dict[str, Any]:
        plain, port = start_uvicorn(log_dir)
        try:
            return drive(port, seconds, cookie_file, plain.pid, one_session)
        finally:
            exits.append(stop(plain))

    try:
        for _ in range(rounds):
            runs["tether"].append(tether_round(False))
            runs["uvicorn"].append(uvicorn_round(False))
            for name, command in floors.items():
                floor, port = start_floor(log_dir, command)
                try:
                    runs[name].append(drive(port, seconds, cookie_file, floor.pid))
                finally:
                    exits.append(stop(floor))
            if sticky:
                runs["tether, one session per connection"].append(tether_round(True))
                runs["uvicorn, one session per connection"].append(uvicorn_round(True))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    # Other work: what every process used while a client ran, less that server's and
    # that client's (servers' start-up and stop, between the windows, are not counted).
    timed = [r for rs in runs.values() for r in rs]
    capacity = sum(r["window_s"] for r in timed)
    other = sum(
        r["window_busy_s"] - r["server_cpu_s"] - r["client_process_cpu_s"] for r in timed
    )
    measured = {name: statistics.median(r["requests_per_s"] for r in rs)
                for name, rs in runs.items()}
    ratio = round(measured["tether"] / measured["uvicorn"], 3)
    paired = [round(t["requests_per_s"] / u["requests_per_s"], 3)
              for t, u in zip(runs["tether"], runs["uvicorn"], strict=True)]
    floor_ratio = round(measured["splice floor"] / measured["uvicorn"], 3)
    candidate_ratios = {name: round(measured[name] / measured["uvicorn"], 3)
                        for name in floors if name in CANDIDATES}
    sticky_ratio = (
        round(measured["tether, one session per connection"]
              / measured["uvicorn, one session per connection"], 3)
        if sticky else None
    )
    checks = {
        "errors": sum(r["errors"] for rs in runs.values() for r in rs),
        "lost_connections": sum(r["lost_connections"] for rs in runs.values() for r in rs),
        "exit_codes": exits,
    }
    # With one session per connection nothing may be forwarded, or the round measures
    # something else than it says.
    checks["forwarded_with_one_session_per_connection"] = [
        r["forwarded_fraction"] for r in runs.get("tether, one session per connection", [])
    ]
    checks["ok"] = (
        checks["errors"] == 0 and checks["lost_connections"] == 0
        and all(code in (0, -15) for code in exits)
        and all(share <= 0.01 for share in checks["forwarded_with_one_session_per_connection"])
    )
    return {
        "benchmark": "throughput",
        "command": f"{COMMAND} --seconds {seconds:g} --rounds {rounds}"
        + (" --candidates" if candidates else "") + (" --sticky" if sticky else ""),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            **machine(PACKAGES),
            "load_average_before": load_before,
            "load_average_after": load_average(),
            # While the clients ran (the kernel's own network work counts as other).
            "other_work_cpu_percent": round(
                100 * max(0.0, other) / capacity, 1) if capacity else 0.0,
        },
        "code": code_version(),
        "setup": {
            "tether": f"tether serve {APP} --workers {WORKERS} --port 0 --no-access-log",
            "uvicorn": f"uvicorn {APP} --workers {WORKERS} --no-access-log",
            "splice floor": f"e2e/bench/splice_floor.py: {WORKERS} uvicorn processes, "
            "the passthrough's splice with a crc32 of the cookie for a routing decision",
            **({"direct-reply floors": "e2e/bench/direct_reply_floor.py: the same, but the "
                "holder writes the reply to the client's socket (passed once per connection)"}
               if candidates else {}),
            "client": f"e2e/bench/load_client.py: {CONNECTIONS} kept-alive connections, "
            f"GET /count of a random session of {SESSIONS}, {WARMUP_S:g} s warm-up",
            "seconds": seconds,
        },
        "runs": runs,
        "requests_per_s": measured,
        "tether_over_uvicorn": ratio,
        "tether_over_uvicorn_each_round": paired,
        "splice_floor_over_uvicorn": floor_ratio,
        "candidates_over_uvicorn": candidate_ratios,
        "one_session_per_connection_over_uvicorn": sticky_ratio,
        "target": {"tether_over_uvicorn": TARGET, "pass": ratio >= TARGET},
        "checks": checks,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| server | requests/s (median of rounds) | each round | server CPU µs per reply |",
        "| --- | ---: | --- | ---: |",
    ]
    for name, rs in result["runs"].items():
        each = ", ".join(f"{r['requests_per_s']:.0f}" for r in rs)
        cpu = statistics.median(
            r["server_cpu_s"] * 1e6 / max(1, r["replies"]) for r in rs
        )
        lines.append(f"| {name} | {result['requests_per_s'][name]:.0f} | {each} | {cpu:.0f} |")
    target = result["target"]
    paired: list[float] = result.get("tether_over_uvicorn_each_round", [])
    lines += [
        "",
        "| figure | measured | target | |",
        "| --- | ---: | ---: | --- |",
        f"| tether ÷ uvicorn | {result['tether_over_uvicorn']:.3f} | ≥ {TARGET} | "
        f"{'pass' if target['pass'] else 'FAIL'} |",
        *([f"| tether ÷ uvicorn, each round's own (median of {len(paired)}: "
           f"{', '.join(f'{r:.3f}' for r in paired)}; no target) | "
           f"{statistics.median(paired):.3f} | | |"] if paired else []),
        f"| splice floor ÷ uvicorn (the design with no routing work; no target) | "
        f"{result['splice_floor_over_uvicorn']:.3f} | | |",
        *(f"| {name} ÷ uvicorn (a candidate design, no routing work; no target) | "
          f"{ratio:.3f} | | |" for name, ratio in result["candidates_over_uvicorn"].items()),
        *([f"| tether ÷ uvicorn, one session per connection (nothing forwarded; no target) | "
           f"{result['one_session_per_connection_over_uvicorn']:.3f} | | |"]
          if result.get("one_session_per_connection_over_uvicorn") is not None else []),
        "",
        "tether's requests forwarded, each round (the rest were served where they "
        "landed; 0.75 with the connections spread evenly): "
        + ", ".join(f"{r.get('forwarded_fraction', 0):.3f}" for r in result["runs"]["tether"])
        + "".join(
            "; with one session per connection: "
            + ", ".join(f"{r.get('forwarded_fraction', 0):.3f}" for r in rs)
            for rs in [result["runs"].get("tether, one session per connection", [])] if rs
        ),
    ]
    return "\n".join(lines)


def update_doc(result: dict[str, Any], path: Path) -> None:
    m = result["machine"]
    generated = "\n".join([
        "<!-- throughput:generated:begin (written by the benchmark; edit outside it) -->",
        f"Latest run: {result['timestamp']}, `{result['command']}`, {m['nproc']} CPUs "
        f"({m['cpu_model']}), Python {m['python']}; other processes used "
        f"{m['other_work_cpu_percent']}% of the CPUs while the clients ran.",
        "",
        table(result),
        "<!-- throughput:generated:end -->",
    ])
    write_generated(path, "throughput", "## Throughput", generated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per run (10)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each server (5)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--candidates", action="store_true",
                        help="measure the direct-reply floors too (a candidate design)")
    parser.add_argument("--sticky", action="store_true",
                        help="a round more of each server with one session per connection")
    args = parser.parse_args(argv)
    result = run(args.seconds, args.rounds, args.candidates, args.sticky)
    return finish(result, result["machine"]["other_work_cpu_percent"], args.output,
                  None if args.no_doc else args.doc, table, update_doc)


if __name__ == "__main__":
    sys.exit(main())
