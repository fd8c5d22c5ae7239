"""Checkpoints of real `tether serve --workers 1` process groups: a SIGKILL of the whole
group and `--restore latest`, commits killed at each crash window by the test-only fault
hook, and `--restore` at start-up (SPEC 5.2, 5.6, 5.10, 8).

The tests play the controller themselves: control calls over HTTP, and CHECKPOINT.json
written here (it is the controller's file), or not written to play a controller that
died before it could.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    REPO,
    TOKEN_ENV,
    CounterSession,
    Http,
    Reply,
    Server,
    bounded,
    eventually,
    tether_command,
)
from tether.checkpoint.store import (
    CHECKPOINT_NAME,
    FAULT_ENV,
    read_manifest_digest,
    resolve_latest,
    write_checkpoint_json,
)

pytestmark = pytest.mark.e2e

NAME = "counter"
FAULT_EXIT = 99


def checkpoint_args(root: Path, *extra: str) -> tuple[str, ...]:
    return ("--checkpoint-root", str(root), "--name", NAME, *extra)


async def control(server: Server, http: Http, route: str, **body: Any) -> Reply:
    headers = {"authorization": f"Bearer {server.token}"}
    if route == "status":
        return await http.request("GET", "/_tether/status", headers=headers)
    return await http.request("POST", f"/_tether/{route}", json=body, headers=headers)


async def ok(server: Server, http: Http, route: str, **body: Any) -> Any:
    reply = await control(server, http, route, **body)
    assert reply.status == 200, reply
    return reply.json


def publish(root: Path, server: Server, checkpoint_id: str) -> None:
    """What the controller writes after every participant committed."""
    entry: Any = {"name": NAME, "url": server.url,
                  "manifest_digest": read_manifest_digest(root, checkpoint_id, NAME)}
    write_checkpoint_json(root, checkpoint_id, [entry], None, None)


async def checkpoint(root: Path, server: Server, http: Http, checkpoint_id: str) -> Any:
    """prepare → commit → CHECKPOINT.json → resume; the manifest."""
    prepared = await ok(server, http, "prepare", checkpoint_id=checkpoint_id, deadline_s=10)
    assert prepared["state"] == "prepared", prepared
    manifest = await ok(server, http, "commit", checkpoint_id=checkpoint_id)
    publish(root, server, checkpoint_id)
    await ok(server, http, "resume", checkpoint_id=checkpoint_id)
    return manifest


async def seeded(http: Http, prefix: str, counts: list[int]) -> list[CounterSession]:
    """Sessions `prefix-i`, each incremented `counts[i]` times."""
    sessions = [CounterSession(http, f"{prefix}-{i:03d}") for i in range(len(counts))]

    async def one(session: CounterSession, times: int) -> None:
        assert (await session.seed()).status == 200
        for _ in range(times):
            assert (await session.increment()).status == 200

    await bounded(one(s, n) for s, n in zip(sessions, counts, strict=True))
    return sessions


def moved(sessions: list[CounterSession], http: Http) -> list[CounterSession]:
    """The same sessions (IDs and cookies), sent through another client."""
    copies = []
    for session in sessions:
        copy = CounterSession(http, session.id)
        copy.cookie = session.cookie
        copies.append(copy)
    return copies


async def counts_of(sessions: list[CounterSession]) -> list[tuple[int, Any]]:
    replies = await bounded(s.count() for s in sessions)
    return [(r.status, r.json.get("count") if r.status == 200 else r.code) for r in replies]


async def commit_that_kills_the_worker(server: Server, http: Http, checkpoint_id: str) -> None:
    """Commit on a server whose fault hook ends the committing process (the main
    process, which runs the checkpointer) during the commit: the relaying worker loses
    its coordinator and says so, or its connection goes with it."""
    try:
        reply = await control(server, http, "commit", checkpoint_id=checkpoint_id)
    except (aiohttp.ClientError, TimeoutError):
        return
    if (reply.status, reply.code) != (503, "worker_unreported"):
        pytest.fail(f"the commit answered instead of crashing the server: {reply}")


async def replaced(server: Server, http: Http, old_pid: int) -> dict[str, Any]:
    """Wait until the supervisor's new worker answers status; that status. Fails at once
    if the whole server exited instead."""

    async def status() -> dict[str, Any] | None:
        if server.proc.poll() is not None:
            events = [(r.get("event"), r.get("code")) for r in server.logs()][-4:]
            pytest.fail(f"the server exited ({server.proc.returncode}) instead of replacing "
                        f"its worker; last events: {events}")
        try:
            reply = await control(server, http, "status")
        except aiohttp.ClientError:
            return None
        workers = reply.json["workers"] if reply.status == 200 else []
        return reply.json if workers and workers[0]["pid"] != old_pid else None

    found: dict[str, Any] = await eventually(status, 20, "a replacement worker serves")
    return found


async def committer_died(server: Server) -> None:
    """Wait until the main process, which commits, ended with the fault hook's exit code."""
    assert await server.exit_code(within=10) == FAULT_EXIT


def exits(server: Server, pid: int) -> list[Any]:
    return [r.get("code") for r in server.logs()
            if r.get("event") == "worker_exited" and r.get("pid") == pid]


def temp_dirs(root: Path, checkpoint_id: str) -> list[str]:
    return sorted(p.name for p in (root / checkpoint_id).iterdir() if ".tmp-" in p.name)


# (a) Done when 1, end to end ---------------------------------------------------------------


async def test_counter_survives_a_sigkill_of_the_group_through_restore_latest(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, 1, *checkpoint_args(root))
    checkpointed = [i % 4 for i in range(200)]
    async with Http(first.url) as http:
        sessions = await seeded(http, "kill", checkpointed)
        manifest = await checkpoint(root, first, http, "c1")
        assert manifest["records"] == {"sessions": 200, "episodes": 0}
        await bounded(s.increment() for s in sessions)
        assert await counts_of(sessions) == [(200, n + 1) for n in checkpointed]

    os.killpg(first.pid, signal.SIGKILL)
    await first.group_gone()

    second = serve(COUNTER_APP, 1, *checkpoint_args(root, "--restore", "latest"))
    assert [r["checkpoint_id"] for r in second.logs() if r.get("event") == "restored"] == ["c1"]
    async with Http(second.url) as http:
        sessions = moved(sessions, http)
        status = await ok(second, http, "status")
        assert (status["phase"], status["workers"][0]["sessions"]) == ("open", 200)
        assert await counts_of(sessions) == [(200, n) for n in checkpointed]
        counted = await bounded(s.increment() for s in sessions)
        assert [(r.status, r.json["count"]) for r in counted] == [
            (200, n + 1) for n in checkpointed
        ]
        # The controller's resume of the restored ID answers 200 afterwards (SPEC 8).
        assert await ok(second, http, "resume", checkpoint_id="c1") == {"phase": "open"}


# (b) Crash windows of a commit ----------------------------------------------------------------


async def test_a_commit_killed_after_its_segments_leaves_nothing_restorable_until_swept(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    faulty = serve(COUNTER_APP, 1, *checkpoint_args(root), env={FAULT_ENV: "after_segments"})
    async with Http(faulty.url) as http:
        await seeded(http, "seg", [2])
        assert (await ok(faulty, http, "prepare", checkpoint_id="c1"))["state"] == "prepared"
        await commit_that_kills_the_worker(faulty, http, "c1")
        await committer_died(faulty)
    await faulty.crash()

    # Only the dead commit's temp dir is on disk: nothing published, nothing latest.
    assert not (root / "c1" / NAME).exists()
    assert len(temp_dirs(root, "c1")) == 1
    assert resolve_latest(root, NAME) is None
    after = serve(COUNTER_APP, 1, *checkpoint_args(root))
    async with Http(after.url) as http:
        reply = await control(after, http, "restore", checkpoint_id="c1")
        assert (reply.status, reply.code) == (404, "no_checkpoint"), reply
        # The next commit of this participant removes what the dead one left.
        await checkpoint(root, after, http, "c2")
    assert temp_dirs(root, "c1") == []
    assert resolve_latest(root, NAME) == "c2"
    await after.crash()


async def test_a_single_worker_killed_while_prepared_is_replaced_and_the_phase_survives(
    serve: Serve, tmp_path: Path
) -> None:
    """With one worker the phase, the remembered IDs and the retire marks live in the main
    process: a replacement worker finds the checkpoint still open and blocked by
    `worker_lost` until resume, and a resumed ID stays stale (issue 12, point 3)."""
    root = tmp_path / "ckpt"
    server = serve(COUNTER_APP, 1, *checkpoint_args(root))
    async with Http(server.url) as http:
        [session] = await seeded(http, "replace", [2])
        pid = (await ok(server, http, "status"))["workers"][0]["pid"]
        assert (await ok(server, http, "prepare", checkpoint_id="c1"))["state"] == "prepared"
        os.kill(pid, signal.SIGKILL)
        # SPEC 3: a worker that dies is replaced by a new one with a new ID.
        status = await replaced(server, http, pid)
        assert (status["phase"], status["checkpoint_id"]) == ("prepared", "c1")
        assert [b["kind"] for b in status["blockers"]] == ["worker_lost"]
        reply = await control(server, http, "commit", checkpoint_id="c1")
        assert (reply.status, reply.code) == (409, "not_ready"), reply
        await ok(server, http, "resume", checkpoint_id="c1")
        reply = await control(server, http, "prepare", checkpoint_id="c1")
        assert (reply.status, reply.code) == (409, "stale_checkpoint"), reply
        # The dead worker's session is lost with it.
        reply = await session.count()
        assert (reply.status, reply.code) == (404, "session_lost"), reply
    await server.crash()


async def test_only_checkpoints_whose_checkpoint_json_was_written_are_restorable(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    good = serve(COUNTER_APP, 1, *checkpoint_args(root))
    async with Http(good.url) as http:
        sessions = await seeded(http, "good", [1, 2, 3])
        await checkpoint(root, good, http, "c1")
        # c3: committed, then the controller dies before CHECKPOINT.json is in place.
        assert (await ok(good, http, "prepare", checkpoint_id="c3"))["state"] == "prepared"
        await ok(good, http, "commit", checkpoint_id="c3")
        fault = "before_checkpoint_rename"
        assert controller_writes_checkpoint_json(root, good, "c3", fault) == FAULT_EXIT
        assert not (root / "c3" / CHECKPOINT_NAME).exists()
        assert temp_dirs(root, "c3") != []  # its temporary CHECKPOINT.json
        await ok(good, http, "resume", checkpoint_id="c3")
    await good.crash()

    # c2: the committer dies after publishing its participant directory, before answering.
    faulty = serve(COUNTER_APP, 1, *checkpoint_args(root), env={FAULT_ENV: "after_manifest"})
    async with Http(faulty.url) as http:
        await seeded(http, "faulty", [1])
        assert (await ok(faulty, http, "prepare", checkpoint_id="c2"))["state"] == "prepared"
        await commit_that_kills_the_worker(faulty, http, "c2")
        await committer_died(faulty)
    await faulty.crash()
    assert (root / "c2" / NAME / "MANIFEST.json").exists()
    assert not (root / "c2" / CHECKPOINT_NAME).exists()

    # `latest` skips both incomplete checkpoints; restoring either is no_checkpoint.
    assert resolve_latest(root, NAME) == "c1"
    after = serve(COUNTER_APP, 1, *checkpoint_args(root))
    async with Http(after.url) as http:
        for checkpoint_id in ("c2", "c3"):
            reply = await control(after, http, "restore", checkpoint_id=checkpoint_id)
            assert (reply.status, reply.code) == (404, "no_checkpoint"), reply
        # A published ID cannot be committed again, even by a server that never saw it.
        for route in ("prepare", "commit"):
            reply = await control(after, http, route, checkpoint_id="c2")
            assert (reply.status, reply.code) == (409, "stale_checkpoint"), reply
        # The complete one restores.
        answer = await ok(after, http, "restore", checkpoint_id="c1")
        assert answer["installed_sessions"] == 3
        await ok(after, http, "resume", checkpoint_id="c1")
        assert await counts_of(moved(sessions, http)) == [(200, 1), (200, 2), (200, 3)]
    await after.crash()

    # The controller, restarted, writes c3's CHECKPOINT.json: now it is complete and latest.
    assert controller_writes_checkpoint_json(root, good, "c3") == 0
    assert resolve_latest(root, NAME) == "c3"


def controller_writes_checkpoint_json(
    root: Path, server: Server, checkpoint_id: str, fault: str | None = None
) -> int:
    """Write CHECKPOINT.json from a child process (a controller), with the fault hook
    set to `fault` in its environment; its exit code."""
    script = (
        "import sys\n"
        "from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json\n"
        "root, url, cid, name = sys.argv[1:]\n"
        "entry = {'name': name, 'url': url,\n"
        "         'manifest_digest': read_manifest_digest(root, cid, name)}\n"
        "write_checkpoint_json(root, cid, [entry], None, None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), server.url, checkpoint_id, NAME],
        cwd=REPO,
        env={**env, **({FAULT_ENV: fault} if fault else {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode in (0, FAULT_EXIT), done.stderr
    return done.returncode


async def test_a_replaced_worker_does_not_silently_restore_the_checkpoint_again(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, 1, *checkpoint_args(root))
    async with Http(first.url) as http:
        [session] = await seeded(http, "again", [1])
        await checkpoint(root, first, http, "c1")
    await first.crash()

    server = serve(COUNTER_APP, 1, *checkpoint_args(root, "--restore", "latest"))
    async with Http(server.url) as http:
        [session] = moved([session], http)
        assert (await session.increment()).json["count"] == 2
        pid = (await ok(server, http, "status"))["workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        await replaced(server, http, pid)
        # SPEC 3: a replaced single worker's sessions answer 404 session_lost. Restoring
        # c1 again would silently roll the session back to 1 (and let each restored
        # episode record be continued a second time), on a server that was restored.
        reply = await session.count()
        assert (reply.status, reply.code) == (404, "session_lost"), reply
    await server.crash()


# (c) --restore at start-up ------------------------------------------------------------------


async def test_restore_latest_with_no_checkpoint_yet_starts_fresh(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    server = serve(COUNTER_APP, 1, *checkpoint_args(root, "--restore", "latest"))
    assert any(r.get("event") == "no_checkpoint_yet" for r in server.logs())
    async with Http(server.url) as http:
        status = await ok(server, http, "status")
        assert (status["phase"], status["workers"][0]["sessions"]) == ("open", 0)
        [session] = await seeded(http, "fresh", [1])
        assert (await session.count()).json["count"] == 1


async def test_restore_of_a_missing_or_incomplete_checkpoint_exits_before_serving(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    (root / "c1" / NAME).mkdir(parents=True)  # a participant directory, but no checkpoint
    runs = [start_tether(tmp_path / wanted, *checkpoint_args(root, "--restore", wanted))
            for wanted in ("missing", "c1")]
    try:
        await eventually(lambda: all(p.poll() is not None for p, _ in runs), 15,
                         "both servers exit")
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, out in runs:
        assert proc.returncode != 0
        assert "tether serving" not in out.read_text(), out.read_text()


def start_tether(base: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`tether serve COUNTER_APP --workers 1 ARGS` in its own process group."""
    runtime = base / "rt"
    runtime.mkdir(parents=True, mode=0o700)
    out = base / "stdout"
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [*tether_command(), "serve", COUNTER_APP, "--workers", "1", "--port", "0",
             "--log-format", "json", *args],
            cwd=REPO,
            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime), TOKEN_ENV: "t"},
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    return proc, out
