"""The checkpoint benchmark at several workers: SPEC 11's scale benchmark.

    .venv/bin/python -m e2e.bench.checkpoint --workers 4 --restore-onto 2,4,6 [--reps 3]
        [--sessions 100000] [--episodes 10000] [--state-bytes 2048] [--step-ms 500] [--no-doc]

`e2e/bench/checkpoint.py` runs this when `--workers` is above 1. Each repetition:

1. Server A, `tether serve e2e.bench.state_app:app --workers N`: the idle status and
   prepare pairs as at one worker; then every worker gets its share of the sessions and
   of the episodes, each share with its own `start` offset so IDs are unique across
   workers, by requests naming the worker (`x-tether-worker`, a new connection each), and
   the status' per-worker session counts are checked. Timed: the prepare that parks the
   episodes, the commit (the same-run baseline right before or after it, alternating: the
   one-process pack + write + fsync of the same records, so it is one process against N
   workers writing their segments in parallel), and the resume. `channel_bytes` from
   `GET /_tether/status` right before and right after the commit: what the commit sent
   over the coordinator's channels, checked under 1 MB (records never cross it).
2. For each M of `--restore-onto`, a fresh server with `--workers M`: the one-process
   read + unpack baseline in a fresh process, then the restore and resume control calls,
   timed, and the channel bytes the restore moved. Checked: every session restored
   exactly (`GET /bench/digest`'s order-independent `sum` of every worker adds up to A's),
   the workers' session counts differ by at most one (SPEC 5.7), every episode held for
   attempt 2, the tables hold every session. Measured: each worker's routing tables
   (`GET /bench/tables`: the placed-session and owner-alias dicts, by `sys.getsizeof`),
   its RSS, and what it read (`/proc/PID/io`: bytes and calls of read system calls, so
   the bytes ÷ (segment bytes ÷ M) shows whether it read only its share) right before
   and right after the restore call.

Figures are medians over the repetitions, each ratio taken within its repetition. The
checkpoint root and logs are in a temporary directory removed at the end; every server is
stopped and its process group checked gone. It exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2e.bench import machine
from e2e.bench.checkpoint import (
    APP,
    CALL_TIMEOUT_S,
    DOC,
    FULL_ROUNDS,
    IDLE_ROUNDS,
    NAME,
    PACKAGES,
    PREPARE_DEADLINE_S,
    RESULTS,
    TARGETS,
    WRITE_BUFFER,
    Measured,
    Scale,
    Server,
    _busy,
    baseline_restore_fresh,
    beside_baseline,
    build_records,
    command_line,
    cpu_seconds,
    cpu_ticks,
    idle_pairs,
    measure,
    publish,
    start_server,
)
from e2e.bench.state_app import session_id, summed_digest
from tether.routing.types import new_session_id

CHANNEL_LIMIT = 1_000_000  # bytes a commit may send over the channel (issue #4)
RSS_STEP = 0.2  # the poll while waiting for a worker's RSS to settle, seconds

# Talking to one worker


def on_worker(server: Server, worker: str, method: str, path: str, body: Any = None) -> Any:
    """One request to `worker`, named by `x-tether-worker`, on a new connection (so the
    router's header routing, not the accepting worker, picks it); its JSON answer."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CALL_TIMEOUT_S)
    headers = {"x-tether-worker": worker, "content-type": "application/json"}
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers=headers)
        reply = connection.getresponse()
        raw = reply.read()
    finally:
        connection.close()
    if reply.status != 200:
        raise RuntimeError(f"{method} {path} on worker {worker} answered {reply.status}: {raw!r}")
    return json.loads(raw)


def shares(total: int, parts: int) -> list[tuple[int, int]]:
    """`total` split into `parts` (start, count) ranges, as even as they go."""
    ranges, start = [], 0
    for part in range(parts):
        count = total // parts + (1 if part < total % parts else 0)
        ranges.append((start, count))
        start += count
    return ranges


def rss_bytes(pid: int) -> int:
    """The process's resident set size."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def read_io(pid: int) -> dict[str, int]:
    """What the process has read so far through read system calls (`rchar`: bytes, page
    cache hits included; `syscr`: calls), from /proc/PID/io."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return {"bytes": int(fields["rchar"]), "calls": int(fields["syscr"])}


def sessions_by_worker(status: dict[str, Any]) -> dict[str, int | None]:
    return {str(row["id"]): row.get("sessions") for row in status["workers"]}


def digests(server: Server) -> dict[str, dict[str, Any]]:
    """Every worker's `GET /bench/digest`, by worker ID."""
    return {w: on_worker(server, w, "GET", "/bench/digest") for w in server.worker_ids}


# One repetition


def checkpoint_round(
    work: Path, root: Path, rep: int, scale: Scale, records: list[dict[str, Any]], workers: int
) -> tuple[dict[str, Any], str]:
    """Server A at `workers` workers: idle prepares, fill each worker, episodes, prepare,
    the commit and the baseline back to back, resume. Returns the figures and the
    checkpoint ID (published with CHECKPOINT.json)."""
    server = start_server(work, f"a{rep}", root, workers=workers)
    checkpoint_id = f"bench-{rep}"
    try:
        control = server.control()
        control.call("status")
        idle_pairs(control, f"warm-{rep}", 3)
        empty = idle_pairs(control, f"idle-{rep}", IDLE_ROUNDS)
        session_shares = dict(zip(server.worker_ids, shares(scale.sessions, workers), strict=True))
        episode_shares = dict(zip(server.worker_ids, shares(scale.episodes, workers), strict=True))
        fill_s = 0.0
        for worker, (start, count) in session_shares.items():
            started = time.perf_counter()
            on_worker(
                server,
                worker,
                "POST",
                "/bench/sessions",
                {"n": count, "size": scale.state_bytes, "start": start},
            )
            fill_s += time.perf_counter() - started
            for index in range(start, start + count):  # the baseline writes the same owner
                records[index]["owner"] = worker
        filled = sessions_by_worker(control.call("status")[0])
        original = digests(server)
        full = idle_pairs(control, f"full-{rep}", FULL_ROUNDS)
        episodes = 0
        for worker, (start, count) in episode_shares.items():
            body = {"n": count, "size": scale.state_bytes, "step_ms": scale.step_ms, "start": start}
            answer = on_worker(server, worker, "POST", "/bench/episodes", body)
            episodes += answer["episodes"]
        for worker in server.worker_ids:
            on_worker(server, worker, "POST", "/bench/parks")
        time.sleep(2 * scale.step_ms / 1000)  # every episode has stepped at least once
        channel = {"before_prepare": control.call("status")[0]["channel_bytes"]}
        before = time.monotonic()
        prepared, prepare_s = control.call(
            "prepare", checkpoint_id=checkpoint_id, deadline_s=PREPARE_DEADLINE_S
        )
        answered = time.monotonic()
        if prepared["state"] != "prepared":
            raise RuntimeError(f"the prepare answered {prepared}")
        channel["after_prepare"] = control.call("status")[0]["channel_bytes"]

        def commit_call() -> tuple[Any, Measured, float]:
            channel["before_commit"] = control.call("status")[0]["channel_bytes"]
            main_cpu = cpu_seconds(server.process.pid)
            with measure(server.worker_pids) as commit:
                manifest, _ = control.call("commit", checkpoint_id=checkpoint_id)
            channel["after_commit"] = control.call("status")[0]["channel_bytes"]
            return manifest, commit, cpu_seconds(server.process.pid) - main_cpu

        (manifest, commit, coordinator_cpu), baseline = beside_baseline(
            work, rep, scale, records, commit_call
        )
        publish(root, checkpoint_id, server)
        _, resume_s = control.call("resume", checkpoint_id=checkpoint_id)
        channel["after_resume"] = control.call("status")[0]["channel_bytes"]
        parks = [on_worker(server, w, "POST", "/bench/parks") for w in server.worker_ids]
        logged = server.events("checkpoint_committed")
    finally:
        stopped = server.stop()
    lasts = [p["last"] for p in parks if p["last"] is not None]
    segments = manifest["segments"]
    figures = {
        "server_start_s": server.started_s,
        "workers": server.worker_ids,
        "empty": empty,
        "fill_s": fill_s,
        "session_shares": {w: count for w, (_, count) in session_shares.items()},
        "sessions_by_worker": filled,
        "digest_sum": summed_digest(d["sum"] for d in original.values()),
        "digest_sessions": sum(d["sessions"] for d in original.values()),
        "full": full,
        "episodes_started": episodes,
        "prepare_s": prepare_s,
        "episodes_parked": sum(p["parks"] for p in parks),
        "prepare_wait_for_last_park_s": (max(lasts) - before) if lasts else None,
        "prepare_after_last_park_s": (answered - max(lasts)) if lasts else None,
        "commit_s": commit.seconds,
        "commit_logged_s": logged[-1]["seconds"] if logged else None,
        "commit_workers_cpu_s": commit.cpu_s,
        "commit_coordinator_cpu_s": coordinator_cpu,
        "commit_other_cpus": commit.other_cpus,
        "baseline_commit": baseline,
        "resume_s": resume_s,
        "channel_bytes": channel,
        "prepare_channel_bytes": channel["after_prepare"] - channel["before_prepare"],
        "commit_channel_bytes": channel["after_commit"] - channel["before_commit"],
        "checkpoint_channel_bytes": channel["after_resume"] - channel["before_prepare"],
        "segments": [
            {"worker": s["worker"], "bytes": s["bytes"], "records": s["records"]} for s in segments
        ],
        "segment_bytes": sum(s["bytes"] for s in segments),
        "records": manifest["records"],
        "stop": stopped,
    }
    return figures, checkpoint_id


def restore_round(
    work: Path, root: Path, rep: int, checkpoint_id: str, onto: int
) -> dict[str, Any]:
    """A fresh server at `onto` workers: the baseline restore, then restore + resume
    through the control API; the restored state, the tables and their memory."""
    fresh = start_server(work, f"b{rep}-{onto}", root, workers=onto)
    try:
        control = fresh.control()
        baseline = baseline_restore_fresh(work / f"baseline-{rep}.msgpack")
        channel_before = control.call("status")[0]["channel_bytes"]
        rss_before = {pid: rss_bytes(pid) for pid in fresh.worker_pids}
        io_before = {pid: read_io(pid) for pid in fresh.worker_pids}
        main_cpu = cpu_seconds(fresh.process.pid)
        with measure(fresh.worker_pids) as restore:
            answer, _ = control.call("restore", checkpoint_id=checkpoint_id)
        coordinator_cpu = cpu_seconds(fresh.process.pid) - main_cpu
        rss_after = {pid: rss_bytes(pid) for pid in fresh.worker_pids}
        io_after = {pid: read_io(pid) for pid in fresh.worker_pids}
        channel_after = control.call("status")[0]["channel_bytes"]
        _, resume_s = control.call("resume", checkpoint_id=checkpoint_id)
        status, _ = control.call("status")
        restored = digests(fresh)
        tables = {w: on_worker(fresh, w, "GET", "/bench/tables") for w in fresh.worker_ids}
    finally:
        stopped = fresh.stop()
    held = status["held_episodes"]
    by_pid = dict(zip(fresh.worker_pids, fresh.worker_ids, strict=True))
    return {
        "workers": onto,
        "fresh_start_s": fresh.started_s,
        "restore_s": restore.seconds,
        "resume_s": resume_s,
        "restore_workers_cpu_s": restore.cpu_s,
        "restore_coordinator_cpu_s": coordinator_cpu,
        "restore_other_cpus": restore.other_cpus,
        "baseline_restore": baseline,
        "installed_sessions": answer["installed_sessions"],
        "answer_placed_sessions": answer["placed_sessions"],
        "answer_owner_aliases": answer["owner_aliases"],
        "restore_channel_bytes": channel_after - channel_before,
        "held_episodes": len(held),
        "held_attempts_ok": all(h["attempt_to_send"] == 2 for h in held),
        "phase_after_resume": status["phase"],
        "status_tables": status["tables"],
        "sessions_by_worker": sessions_by_worker(status),
        "digest_sum": summed_digest(d["sum"] for d in restored.values()),
        "digest_sessions": {w: d["sessions"] for w, d in restored.items()},
        "tables": tables,
        "rss_before": {by_pid[pid]: value for pid, value in rss_before.items()},
        "rss_after_restore": {by_pid[pid]: value for pid, value in rss_after.items()},
        "read_bytes": {by_pid[pid]: io_after[pid]["bytes"] - io_before[pid]["bytes"]
                       for pid in fresh.worker_pids},
        "read_calls": {by_pid[pid]: io_after[pid]["calls"] - io_before[pid]["calls"]
                       for pid in fresh.worker_pids},
        "stop": stopped,
    }


# The run


def run(reps: int, scale: Scale, workers: int, onto: Sequence[int]) -> dict[str, Any]:
    load_before = [round(v, 2) for v in os.getloadavg()]
    ticks_before = cpu_ticks()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tether-bench-checkpoint-"))
    root = work / "root"
    rounds: list[dict[str, Any]] = []
    try:
        records = build_records(scale)
        for rep in range(reps):
            tether, checkpoint_id = checkpoint_round(work, root, rep, scale, records, workers)
            restores = {}
            for count in onto:
                restores[str(count)] = restore_round(work, root, rep, checkpoint_id, count)
            shutil.rmtree(root / checkpoint_id)
            (work / f"baseline-{rep}.msgpack").unlink()
            rounds.append({"tether": tether, "restores": restores})
            restored = ", ".join(
                f"onto {m} {r['restore_s']:.2f} s (baseline {r['baseline_restore']['seconds']:.2f}"
                " s)"
                for m, r in restores.items()
            )
            print(
                f"repetition {rep + 1}/{reps}: commit at {workers} workers "
                f"{tether['commit_s']:.2f} s (baseline {tether['baseline_commit']['seconds']:.2f}"
                f" s), {tether['commit_channel_bytes']:,} B over the channel; restore {restored}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ticks_after = cpu_ticks()
    return {
        "benchmark": "checkpoint",
        "command": command_line(reps, scale, False, workers, onto),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            **machine(PACKAGES),
            "load_average_before": load_before,
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
            "machine_busy_share": _busy(ticks_before, ticks_after),
        },
        "setup": {
            "server": f"tether serve {APP} --workers {workers} --checkpoint-root DIR --name "
            f"{NAME} --port 0 --log-format json",
            "workers": workers,
            "restore_onto": list(onto),
            "scale": scale.__dict__,
            "repetitions": reps,
            "fill": "each worker its share of the sessions and episodes, with its own start "
            "offset, by requests naming it with x-tether-worker (a new connection each)",
            "episodes": "background tasks in the app, through participant.episode() and "
            "boundary(), stepping every step_ms at spread phases",
            "baseline_commit": "this process: one msgpack.Packer, one buffered file "
            f"({WRITE_BUFFER} B buffer), fsync: one process against the server's workers",
            "baseline_restore": "a fresh Python process: the baseline's file through a "
            "streaming msgpack.Unpacker, every record kept in a list",
            "channel_bytes": "GET /_tether/status channel_bytes (both ways, every live "
            "worker's channel) right before and right after the call",
            "tables_bytes": "GET /bench/tables in each worker: sys.getsizeof of the router's "
            "placed-session and owner-alias dicts, their keys and each distinct value once",
            "rss": "each worker's VmRSS right before and right after the restore call (it "
            "loads the tables and installs the worker's sessions)",
            "read": "each worker's rchar and syscr (/proc/PID/io: bytes and calls of read "
            "system calls, page cache hits included) right before and right after the "
            "restore call; the share divides the bytes by segment bytes ÷ M",
        },
        "work_dir_removed": not work.exists(),
        "seconds": round(time.perf_counter() - started, 1),
        "rounds": rounds,
    }


def derived(r: dict[str, Any]) -> dict[str, Any]:
    """One repetition's figures (seconds unless named otherwise), ratios included."""
    t = r["tether"]
    c = t["baseline_commit"]
    med = statistics.median
    figures: dict[str, Any] = {
        "segment_bytes": t["segment_bytes"],
        "baseline_bytes": c["bytes"],
        "fill_s": t["fill_s"],
        "commit_s": t["commit_s"],
        "commit_logged_s": t["commit_logged_s"] or 0.0,
        "commit_workers_cpu_s": t["commit_workers_cpu_s"],
        "commit_coordinator_cpu_s": t["commit_coordinator_cpu_s"],
        "commit_other_cpus": t["commit_other_cpus"],
        "baseline_commit_s": c["seconds"],
        "baseline_commit_other_cpus": c["other_cpus"],
        "commit_mb_s": t["segment_bytes"] / t["commit_s"] / 1e6,
        "baseline_commit_mb_s": c["bytes"] / c["seconds"] / 1e6,
        "prepare_channel_bytes": t["prepare_channel_bytes"],
        "commit_channel_bytes": t["commit_channel_bytes"],
        "checkpoint_channel_bytes": t["checkpoint_channel_bytes"],
        "empty_status_ms": 1e3 * med(t["empty"]["status_s"]),
        "empty_prepare_ms": 1e3 * med(t["empty"]["prepare_s"]),
        "full_status_ms": 1e3 * med(t["full"]["status_s"]),
        "full_prepare_ms": 1e3 * med(t["full"]["prepare_s"]),
        "prepare_episodes_s": t["prepare_s"],
        "prepare_wait_for_last_park_s": t["prepare_wait_for_last_park_s"] or 0.0,
        "prepare_after_last_park_s": t["prepare_after_last_park_s"] or 0.0,
        "commit_resume_ms": 1e3 * t["resume_s"],
    }
    figures["commit_throughput_ratio"] = figures["commit_mb_s"] / figures["baseline_commit_mb_s"]
    figures["idle_prepare_round_trips"] = figures["empty_prepare_ms"] / figures["empty_status_ms"]
    figures["full_idle_prepare_round_trips"] = (
        figures["full_prepare_ms"] / figures["full_status_ms"]
    )
    for onto, b in r["restores"].items():
        load = b["baseline_restore"]
        restore_s = b["restore_s"] + b["resume_s"]
        tables = [t for t in b["tables"].values() if t["placed_sessions"]]
        placed = [t["placed_bytes"] / t["placed_sessions"] for t in tables]
        keys = [t["placed_key_bytes"] / t["placed_sessions"] for t in tables]
        figures[f"onto_{onto}"] = {
            "restore_s": restore_s,
            "restore_call_s": b["restore_s"],
            "restore_resume_s": b["resume_s"],
            "restore_workers_cpu_s": b["restore_workers_cpu_s"],
            "restore_coordinator_cpu_s": b["restore_coordinator_cpu_s"],
            "restore_other_cpus": b["restore_other_cpus"],
            "baseline_restore_s": load["seconds"],
            "baseline_restore_other_cpus": load["other_cpus"],
            "restore_mb_s": t["segment_bytes"] / restore_s / 1e6,
            "baseline_restore_mb_s": load["bytes"] / load["seconds"] / 1e6,
            "restore_channel_bytes": b["restore_channel_bytes"],
            "fresh_start_s": b["fresh_start_s"],
            "tables_bytes_per_worker": med(t["bytes"] for t in b["tables"].values()),
            "placed_bytes_per_entry": med(placed) if placed else 0.0,
            "placed_key_bytes_per_entry": med(keys) if keys else 0.0,
        }
        g = figures[f"onto_{onto}"]
        g["restore_throughput_ratio"] = g["restore_mb_s"] / g["baseline_restore_mb_s"]
        # Bytes each worker read over the restore call ÷ its even share of the segments:
        # 1.0 is reading exactly 1/M of them (the tables file and indexes add a little).
        share = t["segment_bytes"] / int(onto)
        g["read_share_max"] = max(b["read_bytes"].values()) / share
        g["read_share_min"] = min(b["read_bytes"].values()) / share
        g["read_calls_max"] = max(b["read_calls"].values())
    return figures


RATIOS = ("commit_throughput_ratio", "idle_prepare_round_trips", "full_idle_prepare_round_trips")


def _median_of(each: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians, key by key, of equally shaped (nested) dicts of numbers."""
    out: dict[str, Any] = {}
    for name, value in each[0].items():
        if isinstance(value, dict):
            out[name] = _median_of([e[name] for e in each])
        else:
            out[name] = round(statistics.median(e[name] for e in each), 4)
    return out


def summarize(result: dict[str, Any]) -> None:
    """Medians over the repetitions (each ratio within its repetition first), the targets,
    the per-worker memory of the last repetition's restores, and the checks."""
    each = [derived(r) for r in result["rounds"]]
    figures = _median_of(each)
    ratios = {name: round(figures.pop(name), 3) for name in RATIOS}
    for onto in result["setup"]["restore_onto"]:
        key = f"onto_{onto}"
        ratio = figures[key].pop("restore_throughput_ratio")
        ratios[f"restore_onto_{onto}_throughput_ratio"] = round(ratio, 3)
    targets: dict[str, Any] = {}
    for name, value in ratios.items():
        base = "restore_throughput_ratio" if name.startswith("restore_onto_") else name
        if base not in TARGETS:
            continue
        limit = TARGETS[base]
        at_most = base == "idle_prepare_round_trips"
        targets[name] = {
            "target": f"{'≤' if at_most else '≥'} {limit:g}",
            "value": value,
            "pass": value <= limit if at_most else value >= limit,
        }
    result["figures"] = figures
    result["ratios"] = ratios
    result["per_repetition"] = each
    result["targets"] = targets
    result["memory"] = memory(result["rounds"][-1])
    result["checks"] = checks(result)


def memory(r: dict[str, Any]) -> dict[str, Any]:
    """Per restore, per worker: sessions installed, table entries and bytes, RSS growth."""
    out: dict[str, Any] = {}
    for onto, b in r["restores"].items():
        rows = []
        for worker, tables in b["tables"].items():
            grown = b["rss_after_restore"][worker] - b["rss_before"][worker]
            rows.append(
                {
                    "worker": worker,
                    "sessions": b["digest_sessions"][worker],
                    "placed_sessions": tables["placed_sessions"],
                    "owner_aliases": tables["owner_aliases"],
                    "tables_bytes": tables["bytes"],
                    "rss_before": b["rss_before"][worker],
                    "rss_growth": grown,
                }
            )
        out[onto] = sorted(rows, key=lambda row: (-row["sessions"], row["worker"]))
    return out


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """Did every repetition do what it claims, and leave nothing behind?"""
    scale = result["setup"]["scale"]
    workers = result["setup"]["workers"]
    problems: list[str] = []
    expect = {"sessions": scale["sessions"], "episodes": scale["episodes"]}
    for number, r in enumerate(result["rounds"]):
        t = r["tether"]
        if t["sessions_by_worker"] != t["session_shares"]:
            problems.append(
                f"rep {number}: workers hold {t['sessions_by_worker']}, not {t['session_shares']}"
            )
        if t["records"] != expect or len(t["segments"]) != workers:
            problems.append(
                f"rep {number}: the manifest holds {t['records']} in {len(t['segments'])} "
                f"segments, not {expect} in {workers}"
            )
        if t["episodes_started"] != scale["episodes"]:
            problems.append(f"rep {number}: {t['episodes_started']} episodes started")
        if t["episodes_parked"] < scale["episodes"]:
            problems.append(f"rep {number}: {t['episodes_parked']} episodes parked")
        if t["commit_channel_bytes"] >= CHANNEL_LIMIT:
            problems.append(
                f"rep {number}: the commit sent {t['commit_channel_bytes']:,} bytes over the "
                f"channel (limit {CHANNEL_LIMIT:,})"
            )
        stops = [t["stop"]]
        for onto, b in r["restores"].items():
            where = f"rep {number} onto {onto}"
            restored = sum(b["digest_sessions"].values())
            if (
                b["installed_sessions"] != scale["sessions"]
                or restored != scale["sessions"]
                or b["digest_sum"] != t["digest_sum"]
            ):
                problems.append(f"{where}: the restored sessions differ ({restored} held)")
            if b["sessions_by_worker"] != b["digest_sessions"]:
                problems.append(f"{where}: status and digests count sessions differently")
            held = b["digest_sessions"].values()
            if max(held) - min(held) > 1:  # SPEC 5.7, 11: spread over every worker
                problems.append(f"{where}: sessions per worker differ by more than one: "
                                f"{sorted(held, reverse=True)}")
            if b["held_episodes"] != scale["episodes"] or not b["held_attempts_ok"]:
                problems.append(f"{where}: the restore holds {b['held_episodes']} episodes")
            if b["baseline_restore"]["records"] != expect["sessions"] + expect["episodes"]:
                problems.append(f"{where}: the baseline read {b['baseline_restore']['records']}")
            if b["phase_after_resume"] != "open":
                problems.append(f"{where}: phase {b['phase_after_resume']} after resume")
            if b["status_tables"]["placed_sessions"] != scale["sessions"] or any(
                tables["placed_sessions"] != scale["sessions"] for tables in b["tables"].values()
            ):
                problems.append(
                    f"{where}: tables {b['status_tables']}, per worker "
                    f"{[tables['placed_sessions'] for tables in b['tables'].values()]}"
                )
            stops.append(b["stop"])
        for stop in stops:
            if stop["exit_code"] != 0 or stop["left_over"]:
                problems.append(f"rep {number}: a server stopped with {stop}")
    if not result["work_dir_removed"]:
        problems.append("the temporary directory is still there")
    return {"ok": not problems, "problems": problems}


# Reporting


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def _verdict(result: dict[str, Any], name: str) -> str:
    return "pass" if result["targets"][name]["pass"] else "FAIL"


def table(result: dict[str, Any]) -> str:
    f, r = result["figures"], result["ratios"]
    setup = result["setup"]
    scale, workers = setup["scale"], setup["workers"]
    mib = f["segment_bytes"] / 2**20
    records = scale["sessions"] + scale["episodes"]
    commit_bytes = f["commit_channel_bytes"]
    lines = [
        f"**Checkpoint at {workers} workers** ({scale['sessions']:,} sessions and "
        f"{scale['episodes']:,} parked episodes: {mib:.0f} MiB in {workers} segments)",
        "",
        f"| step | tether, {workers} workers | baseline, one process (same run) "
        "| tether ÷ baseline throughput | target | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| commit ({records:,} records) | {f['commit_s']:.2f} s, {f['commit_mb_s']:.0f} MB/s "
        f"| {f['baseline_commit_s']:.2f} s, {f['baseline_commit_mb_s']:.0f} MB/s "
        f"| {r['commit_throughput_ratio']:.2f} | ≥ 0.5 "
        f"| {_verdict(result, 'commit_throughput_ratio')} |",
        "",
        "| over the coordinator's channels (both ways) | bytes | limit | result |",
        "| --- | ---: | --- | --- |",
        f"| during the commit call | {commit_bytes:,.0f} | < 1 MB "
        f"| {'pass' if commit_bytes < CHANNEL_LIMIT else 'FAIL'} |",
        f"| during the prepare that parks the {scale['episodes']:,} episodes "
        f"| {f['prepare_channel_bytes']:,.0f} | | |",
        f"| from before the prepare to after the resume | {f['checkpoint_channel_bytes']:,.0f} "
        "| | |",
        "",
        "| prepare | prepare | `GET /_tether/status` | prepare ÷ status | target | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| idle, empty server | {f['empty_prepare_ms']:.2f} ms | {f['empty_status_ms']:.2f} ms "
        f"| {r['idle_prepare_round_trips']:.2f} | a few round trips (≤ 4) "
        f"| {_verdict(result, 'idle_prepare_round_trips')} |",
        f"| idle, holding every session | {f['full_prepare_ms']:.2f} ms "
        f"| {f['full_status_ms']:.2f} ms | {r['full_idle_prepare_round_trips']:.2f} | | |",
        "",
        "| other timings (medians) | seconds |",
        "| --- | ---: |",
        f"| filling the workers ({scale['sessions']:,} sessions) | {f['fill_s']:.2f} |",
        f"| prepare with {scale['episodes']:,} running episodes | {f['prepare_episodes_s']:.3f} |",
        f"| … of which waiting for the last episode to reach a boundary "
        f"(steps every {scale['step_ms']:g} ms) | {f['prepare_wait_for_last_park_s']:.3f} |",
        f"| … of which after the last park | {f['prepare_after_last_park_s']:.3f} |",
        f"| commit as the coordinator logs it (`checkpoint_committed`) "
        f"| {f['commit_logged_s']:.3f} |",
        f"| CPU of the {workers} workers during the commit (sum) "
        f"| {f['commit_workers_cpu_s']:.2f} |",
        f"| CPU of the coordinator (main process) during the commit "
        f"| {f['commit_coordinator_cpu_s']:.2f} |",
        f"| CPUs busy outside the workers and this process during the commit / its baseline "
        f"| {f['commit_other_cpus']:.2f} / {f['baseline_commit_other_cpus']:.2f} |",
        f"| resume after the commit | {f['commit_resume_ms'] / 1e3:.3f} |",
        "",
        restore_table(result),
    ]
    return "\n".join(lines)


def restore_table(result: dict[str, Any]) -> str:
    f, r, memory_rows = result["figures"], result["ratios"], result["memory"]
    setup = result["setup"]
    onto = setup["restore_onto"]
    counts = ", ".join(str(m) for m in onto[:-1]) + (" and " if len(onto) > 1 else "")
    counts += str(onto[-1])
    lines = [
        f"**Restore onto {counts} workers** (each a fresh server: restore, then resume)",
        "",
        "| onto | restore + resume | baseline, one process (same run) "
        "| tether ÷ baseline throughput | target | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for m in onto:
        g = f[f"onto_{m}"]
        name = f"restore_onto_{m}_throughput_ratio"
        lines.append(
            f"| {m} workers | {g['restore_s']:.2f} s, {g['restore_mb_s']:.0f} MB/s "
            f"| {g['baseline_restore_s']:.2f} s, {g['baseline_restore_mb_s']:.0f} MB/s "
            f"| {r[name]:.2f} | ≥ 0.4 | {_verdict(result, name)} |"
        )
    lines += [
        "",
        "| onto | sessions per worker | bytes read per worker ÷ (segment bytes ÷ M), max / min "
        "| read calls, most of any worker | state digests | held episodes (attempt 2) "
        "| channel bytes during the restore | restore call | CPU of the workers (sum) "
        "| resume | fresh server start |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    last = result["rounds"][-1]["restores"]
    ok = not result["checks"]["problems"]
    for m in onto:
        g, b = f[f"onto_{m}"], last[str(m)]
        held = sorted(b["digest_sessions"].values(), reverse=True)
        lines.append(
            f"| {m} workers | {' / '.join(f'{n:,}' for n in held)} "
            f"| {g['read_share_max']:.2f} / {g['read_share_min']:.2f} "
            f"| {g['read_calls_max']:,.0f} "
            f"| {'all match' if ok else 'see checks'} | {b['held_episodes']:,} "
            f"| {g['restore_channel_bytes']:,.0f} | {g['restore_call_s']:.2f} s "
            f"| {g['restore_workers_cpu_s']:.2f} s | {g['restore_resume_s']:.3f} s "
            f"| {g['fresh_start_s']:.2f} s |"
        )
    lines += [
        "",
        "| onto | placed-session entries, owner aliases (every worker) "
        "| tables' bytes per worker (`sys.getsizeof`) | per placed session (its key string) "
        "| RSS growth over the restore call, per worker (sessions it installed) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for m in onto:
        g, rows = f[f"onto_{m}"], memory_rows[str(m)]
        growth = ", ".join(f"+{_mb(row['rss_growth'])} ({row['sessions']:,})" for row in rows)
        lines.append(
            f"| {m} workers | {rows[0]['placed_sessions']:,}, {rows[0]['owner_aliases']} "
            f"| {_mb(g['tables_bytes_per_worker'])} | {g['placed_bytes_per_entry']:.0f} B "
            f"({g['placed_key_bytes_per_entry']:.0f} B) | {growth} |"
        )
    bench_key, tether_key = sys.getsizeof(session_id(0)), sys.getsizeof(new_session_id())
    lines += [
        "",
        f"The bench's session IDs are {len(session_id(0))} characters (`{session_id(0)}`, "
        f"{bench_key} B as a string); the IDs tether mints are {len(new_session_id())} "
        f"({tether_key} B), {tether_key - bench_key} B more per placed session.",
    ]
    return "\n".join(lines)


DOC_FIGURES = (
    "segment_bytes",
    "commit_mb_s",
    "baseline_commit_mb_s",
    "prepare_channel_bytes",
    "commit_channel_bytes",
    "checkpoint_channel_bytes",
)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The key figures (the JSON kept in the doc)."""
    f = result["figures"]
    onto = result["setup"]["restore_onto"]
    return {
        "timestamp": result["timestamp"],
        "workers": result["setup"]["workers"],
        "scale": result["setup"]["scale"],
        "repetitions": result["setup"]["repetitions"],
        "figures": {name: f[name] for name in DOC_FIGURES},
        "restore": {
            str(m): {
                name: f[f"onto_{m}"][name]
                for name in (
                    "restore_mb_s",
                    "baseline_restore_mb_s",
                    "restore_channel_bytes",
                    "tables_bytes_per_worker",
                    "placed_bytes_per_entry",
                    "placed_key_bytes_per_entry",
                    "read_share_max",
                    "read_share_min",
                )
            }
            for m in onto
        },
        "ratios": result["ratios"],
        "targets_pass": {name: t["pass"] for name, t in result["targets"].items()},
        "checks_ok": result["checks"]["ok"],
    }


BEGIN = "<!-- checkpoint-workers:generated:begin (written by the benchmark; edit outside it) -->"
END = "<!-- checkpoint-workers:generated:end -->"
_GENERATED = re.compile(
    r"<!-- checkpoint-workers:generated:begin.*?<!-- checkpoint-workers:generated:end -->", re.S
)
SECTION = "## Checkpoints at several workers"


def _generated_section(result: dict[str, Any], output: Path) -> str:
    m = result["machine"]
    fields = [f'  "{key}": {json.dumps(value)}' for key, value in summary(result).items()]
    body = "{\n" + ",\n".join(fields) + "\n}"
    reps = result["setup"]["repetitions"]
    try:
        shown = output.resolve().relative_to(Path(DOC).resolve().parents[1])
    except ValueError:
        shown = output
    return "\n".join(
        [
            BEGIN,
            f"Latest run: {result['timestamp']}, `{result['command']}`, {reps} "
            f"repetition{'s' if reps != 1 else ''} (medians), {m['nproc']} CPUs "
            f"({m['cpu_model']}), Python {m['python']}, msgpack {m['packages'].get('msgpack')}; "
            f"load average {m['load_average_before'][0]} before, {m['load_average_after'][0]} "
            f"after; the CPUs were {100 * m['machine_busy_share']:.0f}% busy over the run; "
            f"{result['seconds']:.0f} s in all.",
            "",
            table(result),
            "",
            f"JSON summary (the full result is in `{shown}`):",
            "",
            "```json",
            body,
            "```",
            END,
        ]
    )


def update_doc(result: dict[str, Any], path: Path, output: Path) -> None:
    """Rewrite the generated part of "Checkpoints at several workers" (re-reading the file
    just before, so other sections written meanwhile are kept); a missing section is
    added after the one-worker "Checkpoints" section."""
    generated = _generated_section(result, output)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if _GENERATED.search(text):
        text = _GENERATED.sub(lambda _: generated, text, count=1)
    else:
        section = f"{SECTION}\n\n    {result['command']}\n\n{generated}\n"
        after = text.find("\n## Checkpoints\n")
        following = text.find("\n## ", after + 1) if after >= 0 else -1
        if following >= 0:
            text = text[: following + 1] + section + "\n" + text[following + 1 :]
        else:
            text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


def main(args: argparse.Namespace, scale: Scale, onto: list[int]) -> int:
    """The run `e2e/bench/checkpoint.py` hands over at `--workers N` (N > 1)."""
    output: Path = args.output or RESULTS.with_name(f"checkpoint-w{args.workers}.json")
    result = run(args.reps, scale, args.workers, onto)
    output.parent.mkdir(parents=True, exist_ok=True)
    for summarized in (False, True):  # the raw rounds are kept if summarizing fails
        if summarized:
            summarize(result)
        text = json.dumps(result, indent=2, ensure_ascii=False) + "\n"
        output.write_text(text, encoding="utf-8")
    print(table(result))
    print(f"\nwrote {output}", file=sys.stderr)
    if not args.no_doc:
        update_doc(result, args.doc, output)
        print(f"updated {args.doc}", file=sys.stderr)
    if not result["checks"]["ok"]:
        for problem in result["checks"]["problems"]:
            print(f"check failed: {problem}", file=sys.stderr)
        return 1
    busy = result["machine"]["machine_busy_share"]
    if busy > 0.9:
        print(f"note: the CPUs were {busy:.0%} busy over the run", file=sys.stderr)
    return 0
