"""The checkpoint benchmark (SPEC 11): commit and restore throughput against a same-run
baseline, and what a prepare costs, at one worker; with `--workers N`, SPEC 11's scale
benchmark at N workers, restored onto each count of `--restore-onto`
(`e2e/bench/checkpoint_workers.py`).

Run from the repository root (about a minute on two cores; `--profile` adds 40 s)::

    .venv/bin/python -m e2e.bench.checkpoint [--reps 3] [--sessions 100000]
        [--episodes 10000] [--state-bytes 2048] [--step-ms 500] [--profile] [--no-doc]
        [--workers 1] [--restore-onto N,...]

What follows is the one-worker run (the default, `--workers 1`).

Each repetition:

1. `tether serve e2e.bench.state_app:app --workers 1 --checkpoint-root ROOT --name bench
   --port 0` (server A). On it, empty: a trivial `GET /_tether/status` round trip and a
   prepare with nothing to wait for (then its resume), interleaved, over one kept-alive
   connection. Then `POST /bench/sessions` fills the app's session dict with 100,000
   states of about 2 KiB (`state_app.make_state`), the same pair is timed again on that
   idle but full server, and `POST /bench/episodes` starts 10,000 background episodes
   stepping every 500 ms at spread phases. Timed: a prepare that waits for all of them
   to park at their next boundary (split, from the app's park times, into the wait for
   the last episode to reach a boundary and what follows it), the commit, and the resume.
   The bench writes CHECKPOINT.json as the controller would, and stops A.
2. Right before or after the commit (alternating), while A sits prepared, the baseline
   commit in this process: the same 110,000 records (built once, before any timing, by
   the functions the app uses) packed with one `msgpack.Packer` into one buffered file,
   then fsynced.
3. A fresh server B (no `--restore`): `POST /_tether/restore`, then resume, timed; right
   before the restore call, the baseline restore: a fresh Python process, as the fresh
   server is, reads that file back through a streaming `msgpack.Unpacker`, keeping every
   record in a list (timed inside it, start-up excluded). Always before, not alternating:
   on this VM whichever process faults in memory right after another took ~1 GB pays
   3-4x the system time for its page faults, and the baseline is the one that shows it.
4. A server C started with `--restore ID`: time until it serves, against B's start.

Both restored servers are checked: 100,000 sessions whose states hash (`GET
/bench/digest`) exactly as A's did, and 10,000 held episodes awaiting attempt 2.
Figures: commit throughput (segment bytes ÷ commit call time) ÷ the baseline's (file
bytes ÷ pack + write + fsync time), target ≥ 0.5; restore throughput (segment bytes ÷
restore + resume calls) ÷ the baseline's (file bytes ÷ read + unpack time), target ≥ 0.4;
a prepare on an idle server in status round trips, target a few (≤ 4). Medians over the
repetitions; each ratio is taken within its repetition, then the median of those.

`--profile` adds one unmeasured repetition with py-spy (if installed) sampling the worker
during the prepare, the commit and the restore, and reports where their time went.

It prints a table, writes `e2e/bench/results/checkpoint.json` (`checkpoint-wN.json` at N
workers) and rewrites the generated part of the "Checkpoints" section (at N workers, of
"Checkpoints at several workers") of `docs/benchmarks.md` (not with `--no-doc`). The
checkpoint root and every log are in a temporary directory removed at the end; every
process it starts is stopped (and checked gone) before it returns. It exits 1 if a check
fails (a restore that differs, a process left over).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import os
import re
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from e2e.bench import machine
from e2e.bench.state_app import episode_record, session_record
from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "e2e" / "bench" / "results" / "checkpoint.json"
"""At one worker; at N, `checkpoint-wN.json` beside it."""
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.checkpoint"
APP = "e2e.bench.state_app:app"
NAME = "bench"

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 300.0
PREPARE_DEADLINE_S = 60.0
IDLE_ROUNDS = 20  # status + prepare pairs on the empty server, per repetition
FULL_ROUNDS = 5  # the same on the idle server holding every session
WRITE_BUFFER = 1024 * 1024
TARGETS = {  # SPEC 11
    "commit_throughput_ratio": 0.5,
    "restore_throughput_ratio": 0.4,
    "idle_prepare_round_trips": 4.0,
}

_SERVING = re.compile(r"tether serving http://\S+:(\d+) with")


# Servers


class Control:
    """One kept-alive HTTP connection to a server, with its control token."""

    def __init__(self, port: int, token: str) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=CALL_TIMEOUT_S)
        self.headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}

    def close(self) -> None:
        self.connection.close()

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any, float]:
        """(status, decoded JSON reply, seconds from sending to the whole reply read)."""
        data = None if body is None else json.dumps(body).encode()
        started = time.perf_counter()
        self.connection.request(method, path, body=data, headers=self.headers)
        reply = self.connection.getresponse()
        raw = reply.read()
        seconds = time.perf_counter() - started
        return reply.status, json.loads(raw) if raw else None, seconds

    def ok(self, method: str, path: str, body: Any = None) -> tuple[Any, float]:
        status, answer, seconds = self.request(method, path, body)
        if status != 200:
            raise RuntimeError(f"{method} {path} answered {status}: {answer}")
        return answer, seconds

    def call(self, route: str, **body: Any) -> tuple[Any, float]:
        """A control call; `status` is a GET, every other route a POST of `body`."""
        if route == "status":
            return self.ok("GET", "/_tether/status")
        return self.ok("POST", f"/_tether/{route}", body)


@dataclass
class Server:
    """One `tether serve` process group, its port and its worker."""

    process: subprocess.Popen[bytes]
    port: int
    token: str
    log_path: Path
    started_s: float
    """Seconds from spawning it to its "tether serving" line."""
    worker_pid: int = 0
    """The first worker's process (the only one at one worker)."""
    worker_pids: list[int] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)
    """Every worker's process and ID, in the order of the status' rows (by ID)."""
    controls: list[Control] = field(default_factory=list)

    def control(self) -> Control:
        control = Control(self.port, self.token)
        self.controls.append(control)
        return control

    def events(self, name: str) -> list[dict[str, Any]]:
        """The server's JSON log events called `name`."""
        found = []
        with open(self.log_path, encoding="utf-8", errors="replace") as file:
            for line in file:
                if line.startswith("{") and name in line:
                    event = json.loads(line)
                    if event.get("event") == name:
                        found.append(event)
        return found

    def stop(self) -> dict[str, Any]:
        """SIGTERM, SIGKILL to the group if it lingers; how it went."""
        for control in self.controls:
            control.close()
        started = time.perf_counter()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        seconds = time.perf_counter() - started
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = group_members(self.process.pid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return {
            "exit_code": self.process.returncode,
            "seconds": round(seconds, 3),
            "left_over": left,
        }


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def tether_command() -> list[str]:
    script = Path(sys.executable).parent / "tether"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from tether.coordinator.cli import main; main()"]


def start_server(
    work: Path, label: str, root: Path, restore: str | None = None, workers: int = 1
) -> Server:
    """Start `tether serve` on the bench app; wait for its "serving" line (printed once
    every worker registered)."""
    token = secrets.token_urlsafe(24)
    out_path, log_path = work / f"{label}.out", work / f"{label}.log"
    args = [*tether_command(), "serve", APP, "--checkpoint-root", str(root), "--name", NAME]
    args += ["--workers", str(workers), "--port", "0", "--log-format", "json"]
    if restore is not None:
        args += ["--restore", restore]
    started = time.perf_counter()
    with open(out_path, "wb") as out, open(log_path, "wb") as log:
        process = subprocess.Popen(
            args,
            cwd=REPO,
            env={**os.environ, "TETHER_CONTROL_TOKEN": token},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        match = _SERVING.search(out_path.read_text(encoding="utf-8", errors="replace"))
        if match is not None:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"server {label} did not start (exit {process.poll()}):\n{tail}")
        time.sleep(0.005)
    server = Server(process, int(match.group(1)), token, log_path, time.perf_counter() - started)
    try:
        status, _ = server.control().call("status")
        rows = status["workers"]
        if len(rows) != workers or any(row.get("pid") is None for row in rows):
            raise RuntimeError(f"server {label} serves with workers {rows}")
        server.worker_pids = [int(row["pid"]) for row in rows]
        server.worker_ids = [str(row["id"]) for row in rows]
        server.worker_pid = server.worker_pids[0]
    except BaseException:
        server.stop()
        raise
    return server


def cpu_seconds(pid: int, system_only: bool = False) -> float:
    """User plus system (or only system) CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[12]) if system_only else int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """All CPUs' (busy, total) clock ticks so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])
    return total - fields[3] - fields[4], total


# Profiling (--profile)


@contextlib.contextmanager
def sampled(pid: int, path: Path, enabled: bool) -> Iterator[None]:
    """Sample `pid` with py-spy (raw collapsed stacks into `path`) while inside."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not enabled or spy is None:
        yield
        return
    command = [spy, "record", "--pid", str(pid), "--output", str(path)]
    command += ["--rate", "250", "--format", "raw", "--nonblocking"]
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def profile_summary(path: Path, top: int = 12) -> dict[str, Any] | None:
    """Share of the busy samples under each tether or app function (inclusive), and
    where the samples ended (the leaf frames), from py-spy's collapsed stacks."""
    if not path.exists():
        return None
    inclusive: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        # An idle event loop or thread pool shows as a bare wait: skip those samples.
        if not any(marker in stack for marker in ("checkpoint/", "e2e/bench/", "msgpack")):
            continue
        samples = int(count)
        busy += samples
        leaves[_frame(frames[-1])] += samples
        for name in {_frame(f) for f in frames if "checkpoint/" in f or "e2e/bench" in f}:
            inclusive[name] += samples
    if not busy:
        return None
    return {
        "busy_samples": busy,
        "inclusive_share": {k: round(n / busy, 3) for k, n in inclusive.most_common(top)},
        "leaf_share": {k: round(n / busy, 3) for k, n in leaves.most_common(top)},
    }


def _frame(frame: str) -> str:
    """`function (file.py:line)` → `file.py:function`."""
    match = re.match(r"(.*) \((.*?):\d+\)$", frame)
    if match is None:
        return frame
    return f"{match.group(2).rsplit('/', 2)[-1]}:{match.group(1)}"


def publish(root: Path, checkpoint_id: str, server: Server) -> None:
    """Write CHECKPOINT.json for the one participant, as the controller does."""
    entry: Any = {
        "name": NAME,
        "url": f"http://127.0.0.1:{server.port}",
        "manifest_digest": read_manifest_digest(root, checkpoint_id, NAME),
    }
    write_checkpoint_json(root, checkpoint_id, [entry], None, None)


# Baseline


def recycle_page_cache(work: Path, size: int) -> None:
    """Write `size` bytes to a scratch file and delete it, untimed, right before a timed
    step that writes about that much: both commits then write into page cache just freed.

    On this VM, writing into memory the guest has not used lately costs 2-4 µs a page:
    234 MB took 0.4-0.9 s to write against 0.06-0.08 s into the pages of a file just
    deleted (freeing anonymous memory instead does not help). Without this, whichever
    commit ran second in a repetition paid that alone (e2e/bench/checkpoint.py's history
    in docs/benchmarks.md)."""
    block = b"\xa5" * WRITE_BUFFER
    scratch = work / "scratch"
    with open(scratch, "wb", buffering=0) as file:
        for _ in range(0, size, len(block)):
            file.write(block)
    scratch.unlink()


def beside_baseline(
    work: Path, rep: int, scale: Scale, records: list[dict[str, Any]], commit: Callable[[], T]
) -> tuple[T, dict[str, Any]]:
    """`commit()` and the baseline commit back to back, their order alternating by
    repetition, each right after `recycle_page_cache`: what `commit` returned, and the
    baseline's measures with its bytes."""
    done: T | None = None
    baseline: dict[str, Any] = {}
    for step in ("baseline", "tether") if rep % 2 == 0 else ("tether", "baseline"):
        recycle_page_cache(work, scale.segment_bytes)
        if step == "tether":
            done = commit()
        else:
            with measure(os.getpid()) as measured:
                size = baseline_commit(records, work / f"baseline-{rep}.msgpack")
            baseline = {**measured.__dict__, "bytes": size}
    assert done is not None
    return done, baseline


def baseline_commit(records: list[dict[str, Any]], path: Path) -> int:
    """Pack every record with one Packer into one buffered file, then fsync it; its size."""
    packer = msgpack.Packer(use_bin_type=True)
    with open(path, "wb", buffering=WRITE_BUFFER) as file:
        for record in records:
            file.write(packer.pack(record))
        file.flush()
        os.fsync(file.fileno())
        return file.tell()


def baseline_restore(path: Path) -> list[Any]:
    """Read the file back through a streaming Unpacker, keeping every record."""
    with open(path, "rb") as file:
        unpacker = msgpack.Unpacker(file, raw=False, strict_map_key=False, read_size=WRITE_BUFFER)
        return list(unpacker)


def baseline_restore_fresh(path: Path) -> dict[str, Any]:
    """`baseline_restore` in a fresh Python process, as the fresh server restores: its own
    timing, plus how many CPUs were busy outside it meanwhile."""
    ticks, children = cpu_ticks(), _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "e2e.bench.checkpoint", "--baseline-restore", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - started
    busy = (cpu_ticks()[0] - ticks[0]) / os.sysconf("SC_CLK_TCK")
    result: dict[str, Any] = json.loads(done.stdout)
    result["other_cpus"] = max(busy - (_children_cpu() - children), 0.0) / wall
    result["bytes"] = path.stat().st_size
    return result


def _counts(text: str) -> list[int]:
    """`4,2,6` → [4, 2, 6]."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of worker counts: {text!r}") from None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_baseline_restore(path: Path) -> dict[str, Any]:
    """What `--baseline-restore` prints: the read + unpack's wall and CPU time."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    cpu, started = time.process_time(), time.perf_counter()
    records = baseline_restore(path)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": seconds,
        "cpu_s": time.process_time() - cpu,
        "system_s": after.ru_stime - before.ru_stime,
        "page_faults": after.ru_minflt - before.ru_minflt,
        "records": len(records),
    }


@dataclass
class Measured:
    """One timed step: its wall time, the CPU time of the process doing it, and how many
    CPUs were busy outside it and this process meanwhile, on average (other work, and the
    kernel writing back what the step wrote)."""

    seconds: float = 0.0
    cpu_s: float = 0.0
    system_s: float = 0.0
    other_cpus: float = 0.0


@contextlib.contextmanager
def measure(pid: int | Sequence[int]) -> Iterator[Measured]:
    """Time the block; `pid` is the process that does the work (this one, or a worker),
    or several (the workers of a server): their CPU times are summed."""
    pids = [pid] if isinstance(pid, int) else list(pid)
    measured = Measured()
    me = os.getpid()

    def cpu(system_only: bool = False) -> float:
        return sum(cpu_seconds(p, system_only) for p in pids)

    ticks, used, own, system = cpu_ticks(), cpu(), cpu_seconds(me), cpu(system_only=True)
    started = time.perf_counter()
    yield measured
    measured.seconds = time.perf_counter() - started
    busy = (cpu_ticks()[0] - ticks[0]) / os.sysconf("SC_CLK_TCK")
    measured.cpu_s = cpu() - used
    measured.system_s = cpu(system_only=True) - system
    ours = measured.cpu_s + (cpu_seconds(me) - own if me not in pids else 0.0)
    measured.other_cpus = max(busy - ours, 0.0) / measured.seconds


# One repetition


@dataclass(frozen=True)
class Scale:
    sessions: int
    episodes: int
    state_bytes: int
    step_ms: float

    @property
    def segment_bytes(self) -> int:
        """About what a commit writes (each record adds ~100 B to its state)."""
        return (self.sessions + self.episodes) * (self.state_bytes + 128)


def idle_pairs(control: Control, prefix: str, rounds: int) -> dict[str, list[float]]:
    """`rounds` interleaved (status, prepare) round trips; each prepare is resumed."""
    status_s: list[float] = []
    prepare_s: list[float] = []
    resume_s: list[float] = []
    for number in range(rounds):
        status_s.append(control.call("status")[1])
        checkpoint_id = f"{prefix}-{number}"
        answer, seconds = control.call(
            "prepare", checkpoint_id=checkpoint_id, deadline_s=PREPARE_DEADLINE_S
        )
        if answer["state"] != "prepared":
            raise RuntimeError(f"an idle prepare answered {answer}")
        prepare_s.append(seconds)
        resume_s.append(control.call("resume", checkpoint_id=checkpoint_id)[1])
    return {"status_s": status_s, "prepare_s": prepare_s, "resume_s": resume_s}


def checkpoint_round(
    work: Path, root: Path, rep: int, scale: Scale, records: list[dict[str, Any]], profile: bool
) -> tuple[dict[str, Any], str]:
    """Server A: idle prepares, fill, episodes, prepare, then the commit and the baseline
    commit back to back (their order alternating by repetition), resume. Returns the
    figures and the checkpoint ID (published with CHECKPOINT.json)."""
    server = start_server(work, f"a{rep}", root)
    checkpoint_id = f"bench-{rep}"
    try:
        control = server.control()
        control.call("status")
        idle_pairs(control, f"warm-{rep}", 3)
        empty = idle_pairs(control, f"idle-{rep}", IDLE_ROUNDS)
        filled, fill_s = control.ok(
            "POST", "/bench/sessions", {"n": scale.sessions, "size": scale.state_bytes}
        )
        digest, _ = control.ok("GET", "/bench/digest")
        full = idle_pairs(control, f"full-{rep}", FULL_ROUNDS)
        started, start_s = control.ok(
            "POST",
            "/bench/episodes",
            {"n": scale.episodes, "size": scale.state_bytes, "step_ms": scale.step_ms},
        )
        control.ok("POST", "/bench/parks")
        time.sleep(2 * scale.step_ms / 1000)  # every episode has stepped at least once
        pid = server.worker_pid
        with sampled(pid, work / f"prepare-{rep}.txt", profile):
            before = time.monotonic()
            prepared, prepare_s = control.call(
                "prepare", checkpoint_id=checkpoint_id, deadline_s=PREPARE_DEADLINE_S
            )
            answered = time.monotonic()
        if prepared["state"] != "prepared":
            raise RuntimeError(f"the prepare answered {prepared}")

        def commit_call() -> tuple[Any, Measured]:
            with sampled(pid, work / f"commit-{rep}.txt", profile), measure(pid) as commit:
                manifest, _ = control.call("commit", checkpoint_id=checkpoint_id)
            return manifest, commit

        (manifest, commit), baseline = beside_baseline(work, rep, scale, records, commit_call)
        publish(root, checkpoint_id, server)
        _, resume_s = control.call("resume", checkpoint_id=checkpoint_id)
        parks, _ = control.ok("POST", "/bench/parks")
        logged = server.events("checkpoint_committed")
    finally:
        stopped = server.stop()
    [segment] = manifest["segments"]
    figures = {
        "server_start_s": server.started_s,
        "empty": empty,
        "fill_s": fill_s,
        "sessions": filled["sessions"],
        "digest": digest["digest"],
        "full": full,
        "episodes_started": started["episodes"],
        "episodes_start_s": start_s,
        "prepare_s": prepare_s,
        "episodes_parked": parks["parks"],
        "prepare_wait_for_last_park_s": (parks["last"] - before) if parks["last"] else None,
        "prepare_after_last_park_s": (answered - parks["last"]) if parks["last"] else None,
        "commit_s": commit.seconds,
        "commit_logged_s": logged[-1]["seconds"] if logged else None,
        "commit_worker_cpu_s": commit.cpu_s,
        "commit_worker_system_s": commit.system_s,
        "commit_other_cpus": commit.other_cpus,
        "baseline_commit": baseline,
        "resume_s": resume_s,
        "segment_bytes": segment["bytes"],
        "records": manifest["records"],
        "stop": stopped,
    }
    return figures, checkpoint_id


def restore_round(
    work: Path, root: Path, rep: int, checkpoint_id: str, profile: bool
) -> dict[str, Any]:
    """Server B: the baseline restore, then restore + resume through the control API.
    Server C: `--restore`."""
    fresh = start_server(work, f"b{rep}", root)
    try:
        control = fresh.control()
        pid = fresh.worker_pid
        # Always first: on this VM a process that faults in memory right after another
        # one took ~1 GB pays 3-4x the system time for its page faults (0.8-0.9 s instead
        # of 0.25 s for the baseline), while the restore's own stays 0.3-0.4 s either way.
        baseline = baseline_restore_fresh(work / f"baseline-{rep}.msgpack")
        with sampled(pid, work / f"restore-{rep}.txt", profile), measure(pid) as restore:
            answer, _ = control.call("restore", checkpoint_id=checkpoint_id)
        _, resume_s = control.call("resume", checkpoint_id=checkpoint_id)
        status, _ = control.call("status")
        digest, _ = control.ok("GET", "/bench/digest")
    finally:
        fresh_stop = fresh.stop()
    held = answer["held_episodes"]
    figures: dict[str, Any] = {
        "fresh_start_s": fresh.started_s,
        "restore_s": restore.seconds,
        "resume_s": resume_s,
        "restore_worker_cpu_s": restore.cpu_s,
        "restore_worker_system_s": restore.system_s,
        "restore_other_cpus": restore.other_cpus,
        "baseline_restore": baseline,
        "installed_sessions": answer["installed_sessions"],
        "held_episodes": len(held),
        "held_attempts_ok": all(h["attempt_to_send"] == 2 for h in held),
        "phase_after_resume": status["phase"],
        "digest": digest["digest"],
        "sessions_after": digest["sessions"],
        "stop": fresh_stop,
    }
    if profile:
        return figures
    restored = start_server(work, f"c{rep}", root, restore=checkpoint_id)
    try:
        control = restored.control()
        status, _ = control.call("status")
        digest, _ = control.ok("GET", "/bench/digest")
    finally:
        restored_stop = restored.stop()
    figures["cli"] = {
        "start_s": restored.started_s,
        "phase": status["phase"],
        "held_episodes": len(status["held_episodes"]),
        "digest": digest["digest"],
        "sessions": digest["sessions"],
        "stop": restored_stop,
    }
    return figures


def _busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The machine's CPUs' busy share between two `cpu_ticks()` readings."""
    total = after[1] - before[1]
    return round((after[0] - before[0]) / total, 3) if total else 0.0


# The run


def build_records(scale: Scale) -> list[dict[str, Any]]:
    """The records tether writes, built here for the baseline (the episodes parked after
    one step; the app's park after a few, a byte or so of difference)."""
    return [session_record(i, scale.state_bytes) for i in range(scale.sessions)] + [
        episode_record(i, scale.state_bytes) for i in range(scale.episodes)
    ]


def run(reps: int, scale: Scale, profile: bool) -> dict[str, Any]:
    load_before = [round(v, 2) for v in os.getloadavg()]
    ticks_before = cpu_ticks()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tether-bench-checkpoint-"))
    root = work / "root"
    rounds: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    try:
        records = build_records(scale)
        for rep in range(reps):
            tether, checkpoint_id = checkpoint_round(work, root, rep, scale, records, False)
            restored = restore_round(work, root, rep, checkpoint_id, False)
            shutil.rmtree(root / checkpoint_id)
            (work / f"baseline-{rep}.msgpack").unlink()
            rounds.append({"tether": tether, "restore": restored})
            print(
                f"repetition {rep + 1}/{reps}: commit {tether['commit_s']:.2f} s "
                f"(baseline {tether['baseline_commit']['seconds']:.2f} s), restore "
                f"{restored['restore_s']:.2f} s "
                f"(baseline {restored['baseline_restore']['seconds']:.2f} s)",
                file=sys.stderr,
                flush=True,
            )
        if profile:
            _, checkpoint_id = checkpoint_round(work, root, reps, scale, records, True)
            restore_round(work, root, reps, checkpoint_id, True)
            for phase in ("prepare", "commit", "restore"):
                profiles[phase] = profile_summary(work / f"{phase}-{reps}.txt")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ticks_after = cpu_ticks()
    return {
        "benchmark": "checkpoint",
        "command": command_line(reps, scale, profile),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            **machine(PACKAGES),
            "load_average_before": load_before,
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
            "machine_busy_share": _busy(ticks_before, ticks_after),
        },
        "setup": {
            "server": f"tether serve {APP} --workers 1 --checkpoint-root DIR --name {NAME} "
            "--port 0 --log-format json",
            "scale": scale.__dict__,
            "repetitions": reps,
            "episodes": "background tasks in the app, through participant.episode() and "
            "boundary(), stepping every step_ms at spread phases",
            "baseline_commit": "this process: one msgpack.Packer, one buffered file "
            f"({WRITE_BUFFER} B buffer), fsync",
            "baseline_restore": "a fresh Python process, as the fresh server: the "
            "baseline's file through a streaming msgpack.Unpacker, every record kept in a "
            "list",
            "timings": "wall time of each HTTP call over a kept-alive connection, from "
            "this process; the commit baseline runs right before or after the commit "
            "(alternating) while the server sits prepared, the restore baseline right "
            "before the restore call on the fresh server (see the module docstring)",
        },
        "work_dir_removed": not work.exists(),
        "seconds": round(time.perf_counter() - started, 1),
        "rounds": rounds,
        "profile": profiles or None,
    }


RATIOS = (
    "commit_throughput_ratio",
    "restore_throughput_ratio",
    "idle_prepare_round_trips",
    "full_idle_prepare_round_trips",
)


def derived(r: dict[str, Any]) -> dict[str, float]:
    """One repetition's figures (seconds unless named otherwise), ratios included."""
    t, b = r["tether"], r["restore"]
    c, load = t["baseline_commit"], b["baseline_restore"]
    med = statistics.median
    restore_s = b["restore_s"] + b["resume_s"]
    figures = {
        "segment_bytes": t["segment_bytes"],
        "baseline_bytes": c["bytes"],
        "commit_s": t["commit_s"],
        "commit_logged_s": t["commit_logged_s"] or 0.0,
        "commit_worker_cpu_s": t["commit_worker_cpu_s"],
        "commit_other_cpus": t["commit_other_cpus"],
        "baseline_commit_other_cpus": c["other_cpus"],
        "baseline_commit_s": c["seconds"],
        "commit_mb_s": t["segment_bytes"] / t["commit_s"] / 1e6,
        "baseline_commit_mb_s": c["bytes"] / c["seconds"] / 1e6,
        "restore_call_s": b["restore_s"],
        "restore_resume_s": b["resume_s"],
        "restore_s": restore_s,
        "restore_worker_cpu_s": b["restore_worker_cpu_s"],
        "restore_other_cpus": b["restore_other_cpus"],
        "baseline_restore_other_cpus": load["other_cpus"],
        "baseline_restore_s": load["seconds"],
        "restore_mb_s": t["segment_bytes"] / restore_s / 1e6,
        "baseline_restore_mb_s": load["bytes"] / load["seconds"] / 1e6,
        "fresh_start_s": b["fresh_start_s"],
        "cli_restore_start_s": b["cli"]["start_s"],
        "cli_restore_extra_s": b["cli"]["start_s"] - b["fresh_start_s"],
        "empty_status_ms": 1e3 * med(t["empty"]["status_s"]),
        "empty_prepare_ms": 1e3 * med(t["empty"]["prepare_s"]),
        "full_status_ms": 1e3 * med(t["full"]["status_s"]),
        "full_prepare_ms": 1e3 * med(t["full"]["prepare_s"]),
        "prepare_episodes_s": t["prepare_s"],
        "prepare_wait_for_last_park_s": t["prepare_wait_for_last_park_s"] or 0.0,
        "prepare_after_last_park_s": t["prepare_after_last_park_s"] or 0.0,
        "commit_resume_ms": 1e3 * t["resume_s"],
        "fill_s": t["fill_s"],
    }
    figures["commit_throughput_ratio"] = figures["commit_mb_s"] / figures["baseline_commit_mb_s"]
    figures["restore_throughput_ratio"] = figures["restore_mb_s"] / figures["baseline_restore_mb_s"]
    figures["idle_prepare_round_trips"] = figures["empty_prepare_ms"] / figures["empty_status_ms"]
    figures["full_idle_prepare_round_trips"] = (
        figures["full_prepare_ms"] / figures["full_status_ms"]
    )
    return figures


def summarize(result: dict[str, Any]) -> None:
    """Add medians over the repetitions (each ratio taken within its repetition first),
    the targets and the checks to `result`."""
    each = [derived(r) for r in result["rounds"]]
    medians = {name: statistics.median(e[name] for e in each) for name in each[0]}
    ratios = {name: round(medians.pop(name), 3) for name in RATIOS}
    targets = {}
    for name, limit in TARGETS.items():
        at_most = name == "idle_prepare_round_trips"
        targets[name] = {
            "target": f"{'≤' if at_most else '≥'} {limit:g}",
            "value": ratios[name],
            "pass": ratios[name] <= limit if at_most else ratios[name] >= limit,
        }
    result["figures"] = {name: round(value, 4) for name, value in medians.items()}
    result["ratios"] = ratios
    result["per_repetition"] = [{k: round(v, 4) for k, v in e.items()} for e in each]
    result["targets"] = targets
    result["checks"] = checks(result)


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """Did every repetition do what it claims, and leave nothing behind?"""
    scale = result["setup"]["scale"]
    problems: list[str] = []
    for number, r in enumerate(result["rounds"]):
        t, b = r["tether"], r["restore"]
        expect = {"sessions": scale["sessions"], "episodes": scale["episodes"]}
        if t["records"] != expect:
            problems.append(f"rep {number}: the manifest holds {t['records']}, not {expect}")
        if t["episodes_parked"] < scale["episodes"]:
            problems.append(f"rep {number}: {t['episodes_parked']} episodes parked")
        if b["installed_sessions"] != scale["sessions"] or b["digest"] != t["digest"]:
            problems.append(f"rep {number}: the restored sessions differ")
        if b["held_episodes"] != scale["episodes"] or not b["held_attempts_ok"]:
            problems.append(f"rep {number}: the restore holds {b['held_episodes']} episodes")
        if b["baseline_restore"]["records"] != expect["sessions"] + expect["episodes"]:
            problems.append(f"rep {number}: the baseline read {b['baseline_restore']['records']}")
        if b["phase_after_resume"] != "open":
            problems.append(f"rep {number}: phase {b['phase_after_resume']} after resume")
        cli = b["cli"]
        if cli["digest"] != t["digest"] or cli["held_episodes"] != scale["episodes"]:
            problems.append(f"rep {number}: `--restore` restored something else")
        for stop in (t["stop"], b["stop"], cli["stop"]):
            if stop["exit_code"] != 0 or stop["left_over"]:
                problems.append(f"rep {number}: a server stopped with {stop}")
    if not result["work_dir_removed"]:
        problems.append("the temporary directory is still there")
    return {"ok": not problems, "problems": problems}


# Reporting


PACKAGES = ("msgpack", "uvicorn", "starlette", "httptools", "uvloop", "structlog")


def command_line(
    reps: int, scale: Scale, profile: bool, workers: int = 1, onto: Sequence[int] = ()
) -> str:
    defaults = Scale(100_000, 10_000, 2048, 500.0)
    parts = [COMMAND]
    if workers != 1:
        parts.append(f"--workers {workers}")
    if onto and list(onto) != [workers]:
        parts.append(f"--restore-onto {','.join(str(m) for m in onto)}")
    if reps != 3:
        parts.append(f"--reps {reps}")
    for name, flag in (
        ("sessions", "--sessions"),
        ("episodes", "--episodes"),
        ("state_bytes", "--state-bytes"),
        ("step_ms", "--step-ms"),
    ):
        if getattr(scale, name) != getattr(defaults, name):
            parts.append(f"{flag} {getattr(scale, name):g}")
    if profile:
        parts.append("--profile")
    return " ".join(parts)


def table(result: dict[str, Any]) -> str:
    f, r, t = result["figures"], result["ratios"], result["targets"]
    scale = result["setup"]["scale"]
    mib = f["segment_bytes"] / 2**20
    records = scale["sessions"] + scale["episodes"]

    def verdict(name: str) -> str:
        return "pass" if t[name]["pass"] else "FAIL"

    lines = [
        "| step | tether | baseline (same run) | tether ÷ baseline throughput | target | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| commit ({mib:.0f} MiB, {records:,} records) "
        f"| {f['commit_s']:.2f} s, {f['commit_mb_s']:.0f} MB/s "
        f"| {f['baseline_commit_s']:.2f} s, {f['baseline_commit_mb_s']:.0f} MB/s "
        f"| {r['commit_throughput_ratio']:.2f} | ≥ 0.5 | {verdict('commit_throughput_ratio')} |",
        f"| restore + resume (fresh server) | {f['restore_s']:.2f} s, "
        f"{f['restore_mb_s']:.0f} MB/s | {f['baseline_restore_s']:.2f} s, "
        f"{f['baseline_restore_mb_s']:.0f} MB/s | {r['restore_throughput_ratio']:.2f} "
        f"| ≥ 0.4 | {verdict('restore_throughput_ratio')} |",
        "",
        "| prepare | prepare | `GET /_tether/status` | prepare ÷ status | target | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| idle, empty server | {f['empty_prepare_ms']:.2f} ms | {f['empty_status_ms']:.2f} ms "
        f"| {r['idle_prepare_round_trips']:.2f} | a few round trips (≤ 4) "
        f"| {verdict('idle_prepare_round_trips')} |",
        f"| idle, holding every session | {f['full_prepare_ms']:.2f} ms "
        f"| {f['full_status_ms']:.2f} ms | {r['full_idle_prepare_round_trips']:.2f} | | |",
        "",
        "| other timings (medians) | seconds |",
        "| --- | ---: |",
        f"| prepare with {scale['episodes']:,} running episodes | {f['prepare_episodes_s']:.3f} |",
        f"| … of which waiting for the last episode to reach a boundary "
        f"(steps every {scale['step_ms']:g} ms) "
        f"| {f['prepare_wait_for_last_park_s']:.3f} |",
        f"| … of which after the last park | {f['prepare_after_last_park_s']:.3f} |",
        f"| commit as the worker logs it (`checkpoint_committed`) | {f['commit_logged_s']:.3f} |",
        f"| worker CPU during the commit | {f['commit_worker_cpu_s']:.2f} |",
        f"| CPUs busy outside the measured process (other work, kernel writeback) "
        f"during the commit / its baseline "
        f"| {f['commit_other_cpus']:.2f} / {f['baseline_commit_other_cpus']:.2f} |",
        f"| resume after the commit | {f['commit_resume_ms'] / 1e3:.3f} |",
        f"| restore call alone | {f['restore_call_s']:.3f} |",
        f"| worker CPU during the restore call | {f['restore_worker_cpu_s']:.2f} |",
        f"| … during the restore / its baseline "
        f"| {f['restore_other_cpus']:.2f} / {f['baseline_restore_other_cpus']:.2f} |",
        f"| resume after the restore | {f['restore_resume_s']:.3f} |",
        f"| start of a fresh server (to its serving line) | {f['fresh_start_s']:.2f} |",
        f"| start with `--restore ID` (to its serving line) | {f['cli_restore_start_s']:.2f} |",
        f"| … what `--restore` adds to the start | {f['cli_restore_extra_s']:.2f} |",
    ]
    return "\n".join(lines)


def profile_table(result: dict[str, Any]) -> str:
    profiles = result.get("profile") or {}
    lines = []
    for phase, summary in profiles.items():
        if not summary:
            continue
        lines.append(f"{phase}: share of the worker's busy samples ({summary['busy_samples']})")
        for name, share in summary["inclusive_share"].items():
            lines.append(f"  {share:6.1%}  {name}")
    return "\n".join(lines)


DOC_FIGURES = (
    "segment_bytes",
    "commit_mb_s",
    "baseline_commit_mb_s",
    "restore_mb_s",
    "baseline_restore_mb_s",
    "empty_prepare_ms",
    "empty_status_ms",
)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The key figures (the JSON kept in the doc)."""
    return {
        "timestamp": result["timestamp"],
        "scale": result["setup"]["scale"],
        "repetitions": result["setup"]["repetitions"],
        "figures": {name: result["figures"][name] for name in DOC_FIGURES},
        "ratios": result["ratios"],
        "targets_pass": {name: t["pass"] for name, t in result["targets"].items()},
        "checks_ok": result["checks"]["ok"],
    }


def _generated_section(result: dict[str, Any]) -> str:
    m = result["machine"]
    fields = [f'  "{key}": {json.dumps(value)}' for key, value in summary(result).items()]
    body = "{\n" + ",\n".join(fields) + "\n}"
    return "\n".join(
        [
            "<!-- checkpoint:generated:begin (written by the benchmark; edit outside it) -->",
            f"Latest run: {result['timestamp']}, `{result['command']}`, "
            f"{result['setup']['repetitions']} repetitions (medians), {m['nproc']} CPUs "
            f"({m['cpu_model']}), Python {m['python']}, msgpack {m['packages'].get('msgpack')}; "
            f"load average {m['load_average_before'][0]} before, {m['load_average_after'][0]} "
            f"after; the CPUs were {100 * m['machine_busy_share']:.0f}% busy over the run.",
            "",
            table(result),
            "",
            "JSON summary (the full result is in `e2e/bench/results/checkpoint.json`):",
            "",
            "```json",
            body,
            "```",
            "<!-- checkpoint:generated:end -->",
        ]
    )


_GENERATED = re.compile(
    r"<!-- checkpoint:generated:begin.*?<!-- checkpoint:generated:end -->", re.S
)


def update_doc(result: dict[str, Any], path: Path) -> None:
    """Rewrite the generated part of the Checkpoints section (re-reading the file just
    before, so other sections written meanwhile are kept)."""
    generated = _generated_section(result)
    text = (
        path.read_text(encoding="utf-8")
        if path.exists()
        else ("# Benchmarks\n\nEach benchmark in `e2e/bench/` is one command; see its docstring.\n")
    )
    if _GENERATED.search(text):
        text = _GENERATED.sub(lambda _: generated, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## Checkpoints\n\n{generated}\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.bench.checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    parser.add_argument("--sessions", type=int, default=100_000, help="sessions (100000)")
    parser.add_argument("--episodes", type=int, default=10_000, help="episodes (10000)")
    parser.add_argument(
        "--state-bytes", type=int, default=2048, help="packed bytes of each state, about (2048)"
    )
    parser.add_argument(
        "--step-ms", type=float, default=500.0, help="an episode's step between boundaries (500)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="add an unmeasured repetition sampled by py-spy"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="workers of the checkpointed server (1)"
    )
    parser.add_argument(
        "--restore-onto",
        type=_counts,
        help="worker counts to restore onto, e.g. 4,2,6 (the same count as --workers)",
    )
    parser.add_argument(
        "--output", type=Path, help="the JSON result (results/checkpoint.json, -wN at N)"
    )
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc to update")
    parser.add_argument("--no-doc", action="store_true", help="leave the doc alone")
    parser.add_argument("--baseline-restore", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_restore is not None:  # the restore baseline's own fresh process
        print(json.dumps(timed_baseline_restore(args.baseline_restore)))
        return 0
    if args.reps < 1 or args.sessions < 1 or args.episodes < 1 or args.state_bytes < 200:
        parser.error(
            "--reps, --sessions and --episodes must be positive, --state-bytes at least 200"
        )
    onto = args.restore_onto or [args.workers]
    if args.workers < 1 or min(onto) < 1:
        parser.error("--workers and --restore-onto take positive counts")
    if args.workers == 1 and onto != [1]:
        parser.error("--restore-onto needs --workers N > 1 (at one worker it restores onto 1)")
    if args.workers > 1 and args.profile:
        parser.error("--profile samples the one worker: use it without --workers")
    scale = Scale(args.sessions, args.episodes, args.state_bytes, args.step_ms)
    if args.workers > 1:
        from e2e.bench import checkpoint_workers  # it builds on this module

        return checkpoint_workers.main(args, scale, onto)
    if args.output is None:
        args.output = RESULTS
    result = run(args.reps, scale, args.profile)
    summarize(result)
    print(table(result))
    if result["profile"]:
        print("\n" + profile_table(result))
    busy = result["machine"]["machine_busy_share"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"\nwrote {args.output}", file=sys.stderr)
    if not args.no_doc:
        update_doc(result, args.doc)
        print(f"updated {args.doc}", file=sys.stderr)
    if not result["checks"]["ok"]:
        for problem in result["checks"]["problems"]:
            print(f"check failed: {problem}", file=sys.stderr)
        return 1
    if busy > 0.9:
        print(f"note: the CPUs were {busy:.0%} busy over the run", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
