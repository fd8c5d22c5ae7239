"""Fault injection against real `tether serve` process groups, at 1 and at 4 workers
(issue 12, SPEC 5.4-5.6, 5.8): SIGKILL a worker while prepared, the worker that relays a
commit or a restore in the middle of it, another worker mid-install, the whole group
mid-commit and mid-restore, and the controller (a lease that runs out).

After each fault three things must hold:

- nothing lost: every session as of the last complete checkpoint restores with its
  count, and every parked episode continues exactly once (one attempt 2 wins, a second
  gets `episode_claimed`);
- nothing stuck: the server serves again by itself (within the lease), or answers a code
  of SPEC 6's table (`e2e.harness.SPEC_ERRORS`): never a 5xx outside it, never a hang;
- nothing twice: a retried commit answers the one manifest on disk, a session lives on
  one worker, an episode record is continued once.

The app is `e2e/apps/faults.py`: the counter and long episodes in one participant, with
file gates that hold an export or an install on the workers a test names. The worker a
control call lands on is the one that accepted its connection (`harness.Connection`
finds it in /proc), so a test can kill exactly the relaying worker. Clients open a new
connection per request otherwise (`harness.Http`). The tests play the controller:
control calls over HTTP and CHECKPOINT.json written as the controller writes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.apps.gated import GATES_ENV
from e2e.conftest import Serve
from e2e.harness import (
    Connection,
    CounterSession,
    Http,
    Reply,
    Server,
    bounded,
    eventually,
)
from tether.checkpoint.segments import read_index, read_records
from tether.checkpoint.store import read_manifest_digest, resolve_latest, write_checkpoint_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

FAULTS_APP = "e2e.apps.faults:app"
NAME = "faults"
EPISODES = 6
STEPS = 400
STEP_MS = 15
LEASE_S = 3.0
"""Leases of the checkpoints a test abandons: short, so the server frees itself soon."""
SETTLE_S = 40.0
"""How long a server may take to serve again after a fault (a replacement registers)."""

parametrize_workers = pytest.mark.parametrize("workers", [1, 4], ids=["1_worker", "4_workers"])
four_workers = pytest.mark.parametrize("workers", [4], ids=["4_workers"])


# Control calls ---------------------------------------------------------------------------------


def args(root: Path, *extra: str) -> tuple[str, ...]:
    return ("--checkpoint-root", str(root), "--name", NAME, *extra)


def auth(server: Server) -> dict[str, str]:
    return {"authorization": f"Bearer {server.token}"}


async def control(server: Server, http: Http, route: str, **body: Any) -> Reply:
    if route == "status":
        return await http.request("GET", "/_tether/status", headers=auth(server))
    return await http.request("POST", f"/_tether/{route}", json=body, headers=auth(server))


async def ok(server: Server, http: Http, route: str, **body: Any) -> Any:
    reply = await control(server, http, route, **body)
    assert reply.status == 200, reply
    return reply.json


async def status(server: Server, http: Http) -> dict[str, Any]:
    answer: dict[str, Any] = await ok(server, http, "status")
    return answer


def publish(root: Path, server: Server, checkpoint_id: str) -> None:
    """CHECKPOINT.json, as the controller writes it once every participant committed."""
    entry: Any = {"name": NAME, "url": server.url,
                  "manifest_digest": read_manifest_digest(root, checkpoint_id, NAME)}
    write_checkpoint_json(root, checkpoint_id, [entry], None, None)


async def prepared(server: Server, http: Http, checkpoint_id: str, **options: Any) -> Any:
    answer = await ok(server, http, "prepare", checkpoint_id=checkpoint_id,
                      **{"deadline_s": 10, **options})
    assert answer["state"] == "prepared", answer
    return answer


async def checkpoint(root: Path, server: Server, http: Http, checkpoint_id: str) -> Any:
    """prepare → commit → CHECKPOINT.json → resume; the manifest."""
    await prepared(server, http, checkpoint_id)
    manifest = await ok(server, http, "commit", checkpoint_id=checkpoint_id)
    publish(root, server, checkpoint_id)
    await ok(server, http, "resume", checkpoint_id=checkpoint_id)
    return manifest


def blocker_kinds(answer: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(b["kind"], b["worker"]) for b in answer.get("blockers", [])]


def refused_for_worker_lost(reply: Reply, worker: str) -> bool:
    """A commit refused because `worker` was lost: 409 `not_ready` naming it among the
    blockers, or 503 `worker_lost`."""
    if (reply.status, reply.code) == (503, "worker_lost"):
        return True
    detail = reply.json.get("detail") if isinstance(reply.json, dict) else None
    blockers = detail.get("blockers", []) if isinstance(detail, dict) else []
    return (reply.status, reply.code) == (409, "not_ready") and any(
        (b["kind"], b["worker"]) == ("worker_lost", worker) for b in blockers
    )


def on_the_table(*clients: Http) -> None:
    """Every error any of `clients` received is a code of SPEC 6's table."""
    wrong = [reply for http in clients for reply in http.off_the_table()]
    assert not wrong, f"{len(wrong)} replies off the table: {wrong[:5]}"


# Processes ----------------------------------------------------------------------------------


def gates_for(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    gates = tmp_path / "gates"
    gates.mkdir(exist_ok=True)
    return gates, {GATES_ENV: str(gates)}


async def relaying(server: Server, http: Http) -> tuple[Connection, dict[str, Any]]:
    """A kept-alive connection and the status row of the worker that accepted it: every
    control call sent on it is relayed by that worker."""
    rows = (await status(server, http))["workers"]
    connection = await Connection.open(*server.host_port)
    pid = await connection.owner(row["pid"] for row in rows)
    [row] = [row for row in rows if row["pid"] == pid]
    return connection, row


async def cut_off(connection: Connection) -> Reply | None:
    """The reply on a connection whose worker was killed: None once it is closed."""
    try:
        return await connection.reply(within=20)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    finally:
        await connection.close()


async def replaced(server: Server, http: Http, gone: str) -> dict[str, Any]:
    """Status once every configured worker is registered again and `gone` is not one."""

    async def check() -> dict[str, Any] | None:
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited ({server.proc.returncode}) instead of replacing "
                        f"worker {gone}")
        answer = await status(server, http)
        ids = {w["id"] for w in answer["workers"]}
        return answer if len(ids) == server.workers and gone not in ids else None

    answer: dict[str, Any] = await eventually(check, SETTLE_S, f"worker {gone} is replaced")
    return answer


def temp_dirs(root: Path, checkpoint_id: str) -> list[Path]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(p for p in (root / checkpoint_id).iterdir() if ".tmp-" in p.name)
    return []


def segment_written(root: Path, checkpoint_id: str, worker: str, pid: int) -> bool:
    """Whether `worker` (process `pid`) wrote its whole segment into the commit's temp
    dir and closed it: the trailer is in place and the process holds no descriptor of it."""
    for temp in temp_dirs(root, checkpoint_id):
        path = temp / f"segment-{worker}.msgpack"
        try:
            read_index(path)
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except Exception:  # not there yet, or its index not written yet (reads as corrupt)
            continue
        return str(path) not in links
    return False


# Sessions -------------------------------------------------------------------------------------


class Sessions:
    """Counter sessions and the count each should have."""

    def __init__(self) -> None:
        self.sessions: dict[str, CounterSession] = {}
        self.counts: dict[str, int] = {}

    async def seed(self, http: Http, prefix: str, count: int) -> None:
        """`count` sessions `prefix-i`, session i incremented i % 3 times."""

        async def one(index: int) -> None:
            session = CounterSession(http, f"{prefix}-{index:03d}")
            assert (await session.seed()).status == 200
            for _ in range(index % 3):
                assert (await session.increment()).status == 200
            self.sessions[session.id], self.counts[session.id] = session, index % 3

        await bounded(one(i) for i in range(count))

    async def everywhere(self, server: Server, http: Http, prefix: str) -> None:
        """Seed in rounds until every worker holds a session."""
        for index in range(20):
            await self.seed(http, f"{prefix}{index}", 6)
            if all(w["sessions"] for w in (await status(server, http))["workers"]):
                return
        raise AssertionError(f"some worker of {server.url} was never given a session")

    async def bump(self) -> None:
        """Increment every session once more (not in a checkpoint until the next one)."""
        replies = await bounded(s.increment() for s in self.sessions.values())
        assert all(r.status == 200 for r in replies), [r for r in replies if r.status != 200][:3]

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)

    def after_bump(self) -> None:
        for session_id in self.counts:
            self.counts[session_id] += 1

    def on(self, http: Http, ids: Iterable[str] | None = None) -> list[CounterSession]:
        """The sessions (IDs and cookies), sent through `http`."""
        copies = []
        for session_id in self.sessions if ids is None else ids:
            copy = CounterSession(http, session_id)
            copy.cookie = self.sessions[session_id].cookie
            copies.append(copy)
        return copies

    def held_by(self, worker: str) -> list[str]:
        return [sid for sid, s in self.sessions.items() if s.worker == worker]


async def counts_read(http: Http, sessions: list[CounterSession]) -> dict[str, Any]:
    replies = await bounded(s.count() for s in sessions)
    return {s.id: (r.json["count"] if r.status == 200 else (r.status, r.code))
            for s, r in zip(sessions, replies, strict=True)}


async def restores_with_counts(
    http: Http, sessions: Sessions, expected: dict[str, int]
) -> None:
    """Every session of `expected` reads its count through its old cookie."""
    found = await counts_read(http, sessions.on(http, expected))
    wrong = {sid: (found[sid], count) for sid, count in expected.items() if found[sid] != count}
    assert not wrong, f"{len(wrong)} of {len(expected)} sessions wrong (read, expected): " \
        f"{dict(list(wrong.items())[:5])}"


# Episodes -------------------------------------------------------------------------------------


async def run(http: Http, episode_id: str, attempt: int, steps: int = STEPS,
              step_ms: float = STEP_MS) -> Reply:
    body = {"episode_id": episode_id, "attempt": attempt, "steps": steps, "step_ms": step_ms}
    return await http.request("POST", "/run", json=body)


def start_runs(http: Http, ids: list[str]) -> list[asyncio.Future[Reply]]:
    return [asyncio.ensure_future(run(http, e, 1)) for e in ids]


async def all_running(server: Server, http: Http, count: int,
                      runs: list[asyncio.Future[Reply]]) -> None:
    async def check() -> bool:
        ended = [r.result() for r in runs if r.done() and not r.exception()]
        assert not ended, f"runs ended before the checkpoint: {ended[:3]}"
        answer = await status(server, http)
        return bool(sum(w["episodes"] for w in answer["workers"]) == count)

    await eventually(check, 20, f"{count} episodes run")


async def stop(runs: Sequence[asyncio.Future[Reply]]) -> list[Any]:
    for task in runs:
        task.cancel()
    return await asyncio.gather(*runs, return_exceptions=True)


def parked_steps(root: Path, manifest: dict[str, Any]) -> dict[str, int]:
    """The step each episode record of a committed checkpoint was parked at."""
    directory = root / manifest["checkpoint_id"] / NAME
    records = [r for s in manifest["segments"] for r in read_records(directory / s["file"])]
    return {r["episode_id"]: r["state"]["step"] for r in records if r["kind"] == "episode"}


async def continue_exactly_once(server: Server, http: Http, steps: dict[str, int]) -> None:
    """Every held record is sent attempt 2 twice at once: one continues it from its
    parked step to the end, the other gets `episode_claimed`; a third is refused too."""
    assert {h["episode_id"]: h["attempt_to_send"]
            for h in (await status(server, http))["held_episodes"]} == dict.fromkeys(steps, 2)

    async def twice(episode_id: str) -> list[Reply]:
        return list(await asyncio.gather(run(http, episode_id, 2, step_ms=1),
                                         run(http, episode_id, 2, step_ms=1)))

    raced = await bounded(twice(e) for e in steps)
    wrong = []
    for (episode_id, step), replies in zip(steps.items(), raced, strict=True):
        won = [r for r in replies if r.status == 200]
        lost = [r for r in replies if r.status != 200]
        if len(won) != 1 or [r.code for r in lost] != ["episode_claimed"]:
            wrong.append(f"{episode_id}: {replies}")
        elif (won[0].json["resumed_from"], won[0].json["steps_done"]) != (step, STEPS):
            wrong.append(f"{episode_id} did not continue from step {step}: {won[0]}")
    assert not wrong, f"{len(wrong)} of {len(steps)} episodes went wrong: {wrong[:3]}"
    again = await bounded(run(http, e, 2, steps=1) for e in steps)
    assert {r.code for r in again} == {"episode_claimed"}, again[:3]
    after = await status(server, http)
    assert (after["held_episodes"], after["lost_episodes"]) == ([], [])


async def checkpoint_with_parked_episodes(
    root: Path, server: Server, http: Http, checkpoint_id: str, prefix: str
) -> tuple[dict[str, Any], list[asyncio.Future[Reply]]]:
    """Start EPISODES runs of attempt 1 and take a whole checkpoint while they run (they
    are parked in it); the manifest and the runs, which go on after the resume."""
    ids = [f"{prefix}-{i}" for i in range(EPISODES)]
    runs = start_runs(http, ids)
    await all_running(server, http, EPISODES, runs)
    manifest = await checkpoint(root, server, http, checkpoint_id)
    assert manifest["records"]["episodes"] == EPISODES, manifest
    return manifest, runs


# A worker killed while prepared -------------------------------------------------------------


@parametrize_workers
async def test_a_worker_killed_while_prepared_blocks_the_checkpoint_until_resume(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    server = serve(FAULTS_APP, workers, *args(root), env=gates_for(tmp_path)[1])
    sessions = Sessions()
    async with Http(server.url, limit=200) as http, Http(server.url) as runs_http:
        await sessions.everywhere(server, http, "prep")
        manifest, runs = await checkpoint_with_parked_episodes(root, server, runs_http, "c1", "ep")
        steps, at_c1 = parked_steps(root, manifest), sessions.snapshot()
        await sessions.bump()
        await prepared(server, http, "c2", lease_s=60)
        victim = (await status(server, http))["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        after = await replaced(server, http, victim["id"])

        # Status shows the blocker a commit would use, and commit refuses for it (5.5).
        assert (after["phase"], after["checkpoint_id"]) == ("prepared", "c2"), after
        assert ("worker_lost", victim["id"]) in blocker_kinds(after), after["blockers"]
        reply = await control(server, http, "commit", checkpoint_id="c2")
        assert refused_for_worker_lost(reply, victim["id"]), reply
        assert not (root / "c2" / NAME).exists()
        again = await ok(server, http, "prepare", checkpoint_id="c2", deadline_s=0.5)
        assert again["state"] == "blocked", again

        # Until resume: then the server serves, and checkpoints, again.
        assert await ok(server, http, "resume", checkpoint_id="c2") == {"phase": "open"}
        assert (await CounterSession(http, "after-resume").seed()).status == 200
        await checkpoint(root, server, http, "c3")
        survivors = [r for r in await stop(runs) if isinstance(r, Reply)]
        on_the_table(http)
        assert not [r for r in survivors if r.status >= 500], survivors
    await server.crash()

    # c1 (not c3, which lost the victim's sessions) holds every session and episode.
    fresh = serve(FAULTS_APP, workers, *args(root), env=gates_for(tmp_path)[1])
    async with Http(fresh.url, limit=200) as http:
        answer = await ok(fresh, http, "restore", checkpoint_id="c1")
        assert answer["installed_sessions"] == len(at_c1), answer
        await ok(fresh, http, "resume", checkpoint_id="c1")
        await restores_with_counts(http, sessions, at_c1)
        await continue_exactly_once(fresh, http, steps)
        on_the_table(http)


# The worker that relays a commit dies ---------------------------------------------------------


@four_workers
async def test_a_commit_whose_relaying_worker_dies_after_its_segment_finishes_and_publishes(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, workers, *args(root), env=env)
    sessions = Sessions()
    async with Http(server.url, limit=200) as http:
        await sessions.everywhere(server, http, "relay")
        await checkpoint(root, server, http, "c1")
        await sessions.bump()
        sessions.after_bump()
        at_c2 = sessions.snapshot()
        await prepared(server, http, "c2", lease_s=60)

        connection, relayer = await relaying(server, http)
        others = [w["id"] for w in (await status(server, http))["workers"]
                  if w["id"] != relayer["id"]]
        (gates / "slow-export").write_text("\n".join(others))
        connection.send("POST", "/_tether/commit", json={"checkpoint_id": "c2"},
                        headers=auth(server))
        await eventually(lambda: (gates / "exporting").exists(), 20, "another worker exports")
        await eventually(lambda: segment_written(root, "c2", relayer["id"], relayer["pid"]),
                         20, "the relaying worker has written its segment")
        os.kill(relayer["pid"], signal.SIGKILL)
        assert await cut_off(connection) is None
        (gates / "export-open").touch()

        # The coordinator finishes the commit it was given: committed and published.
        async def committed() -> dict[str, Any] | None:
            answer = await status(server, http)
            return answer if answer["phase"] == "committed" else None

        after = await eventually(committed, SETTLE_S, "the commit of c2 finishes")
        assert after["checkpoint_id"] == "c2"
        on_disk = json.loads((root / "c2" / NAME / "MANIFEST.json").read_text())
        assert on_disk["records"] == {"sessions": len(at_c2), "episodes": 0}, on_disk
        assert relayer["id"] in {s["worker"] for s in on_disk["segments"]}
        # Retried through another worker: the same manifest, not a second commit.
        assert await ok(server, http, "commit", checkpoint_id="c2") == on_disk
        assert temp_dirs(root, "c2") == []
        publish(root, server, "c2")
        assert await ok(server, http, "resume", checkpoint_id="c2") == {"phase": "open"}
        assert (await CounterSession(http, "after-commit").seed()).status == 200
        on_the_table(http)
    await server.crash()

    restored = serve(FAULTS_APP, workers, *args(root, "--restore", "latest"), env=env)
    async with Http(restored.url, limit=200) as http:
        await restores_with_counts(http, sessions, at_c2)
        on_the_table(http)


@parametrize_workers
async def test_a_commit_whose_relaying_worker_dies_mid_write_fails_and_the_server_resumes(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, workers, *args(root), env=env)
    sessions = Sessions()
    async with Http(server.url, limit=200) as http:
        await sessions.everywhere(server, http, "mid")
        await checkpoint(root, server, http, "c1")
        at_c1 = sessions.snapshot()
        await sessions.bump()
        await prepared(server, http, "c2", lease_s=60)

        connection, relayer = await relaying(server, http)
        (gates / "slow-export").write_text(relayer["id"])
        connection.send("POST", "/_tether/commit", json={"checkpoint_id": "c2"},
                        headers=auth(server))
        await eventually(lambda: (gates / "exporting").exists(), 20, "the relayer exports")
        os.kill(relayer["pid"], signal.SIGKILL)
        assert await cut_off(connection) is None
        (gates / "export-open").touch()
        after = await replaced(server, http, relayer["id"])

        # The commit failed cleanly: still prepared, blocked by the lost worker, no files.
        async def settled() -> dict[str, Any] | None:
            answer = await status(server, http)
            return answer if not temp_dirs(root, "c2") else None

        after = await eventually(settled, SETTLE_S, "the failed commit's files are removed")
        assert (after["phase"], after["checkpoint_id"]) == ("prepared", "c2"), after
        assert ("worker_lost", relayer["id"]) in blocker_kinds(after), after["blockers"]
        assert not (root / "c2" / NAME).exists()
        reply = await control(server, http, "commit", checkpoint_id="c2")
        assert refused_for_worker_lost(reply, relayer["id"]), reply
        assert await ok(server, http, "resume", checkpoint_id="c2") == {"phase": "open"}

        # The server serves and checkpoints again; the dead worker's sessions are gone.
        assert (await CounterSession(http, "after-fail").seed()).status == 200
        dead = sessions.held_by(relayer["id"])
        assert dead
        gone = await counts_read(http, sessions.on(http, dead))
        assert set(gone.values()) <= {(410, "session_gone"), (404, "session_lost")}, gone
        await checkpoint(root, server, http, "c3")
        on_the_table(http)
    await server.crash()
    assert resolve_latest(root, NAME) == "c3"

    fresh = serve(FAULTS_APP, workers, *args(root), env=env)
    async with Http(fresh.url, limit=200) as http:
        answer = await ok(fresh, http, "restore", checkpoint_id="c1")
        assert answer["installed_sessions"] == len(at_c1), answer
        await ok(fresh, http, "resume", checkpoint_id="c1")
        await restores_with_counts(http, sessions, at_c1)
        on_the_table(http)


# The worker that relays a restore dies; another worker dies mid-install -----------------------


async def checkpointed_server(
    serve: Serve, tmp_path: Path, workers: int
) -> tuple[Path, Sessions, dict[str, int], dict[str, int]]:
    """A server with sessions on every worker and parked episodes, checkpointed as c1 and
    SIGKILLed; the root, the sessions, their counts in c1 and the episodes' parked steps."""
    root = tmp_path / "ckpt"
    first = serve(FAULTS_APP, workers, *args(root), env=gates_for(tmp_path)[1])
    sessions = Sessions()
    async with Http(first.url, limit=200) as http, Http(first.url) as runs_http:
        await sessions.everywhere(first, http, "rs")
        manifest, runs = await checkpoint_with_parked_episodes(root, first, runs_http, "c1", "ep")
        await first.crash()
        await stop(runs)
    return root, sessions, sessions.snapshot(), parked_steps(root, manifest)


async def fresh_again(server: Server, http: Http) -> dict[str, Any]:
    """Status once the server holds nothing again: open, no sessions, claims, held
    records or tables (a failed restore is undone, all of it)."""
    seen: list[Any] = []

    async def check() -> dict[str, Any] | None:
        answer = await status(server, http)
        holds = {(w["sessions"], w["claims"]) for w in answer["workers"]}
        state = {"phase": answer["phase"], "checkpoint_id": answer["checkpoint_id"],
                 "held_episodes": answer["held_episodes"], "tables": answer["tables"],
                 "workers": len(answer["workers"]), "sessions_claims": sorted(holds),
                 "claim_files": len(server.claims())}
        seen[:] = [state]
        wanted = {"phase": "open", "checkpoint_id": None, "held_episodes": [],
                  "tables": {"placed_sessions": 0, "owner_aliases": 0},
                  "workers": server.workers, "sessions_claims": [(0, 0)], "claim_files": 0}
        return answer if state == wanted else None

    try:
        found: dict[str, Any] = await eventually(check, SETTLE_S, "the server is fresh again")
    except AssertionError as error:
        raise AssertionError(f"{error}; last seen: {seen}") from None
    return found


async def restore_then_continue(
    server: Server, http: Http, sessions: Sessions, counts: dict[str, int], steps: dict[str, int]
) -> None:
    answer = await ok(server, http, "restore", checkpoint_id="c1", deadline_s=30)
    assert answer["installed_sessions"] == len(counts), answer
    await ok(server, http, "resume", checkpoint_id="c1")
    await restores_with_counts(http, sessions, counts)
    await continue_exactly_once(server, http, steps)


@parametrize_workers
async def test_a_restore_whose_relaying_worker_dies_mid_install_is_undone_and_can_be_retried(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root, sessions, counts, steps = await checkpointed_server(serve, tmp_path, workers)
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, workers, *args(root), env=env)
    async with Http(server.url, limit=200) as http:
        connection, relayer = await relaying(server, http)
        (gates / "slow-install").write_text(relayer["id"])
        connection.send("POST", "/_tether/restore",
                        json={"checkpoint_id": "c1", "deadline_s": 30}, headers=auth(server))
        await eventually(lambda: (gates / f"installing-{relayer['id']}").exists(), 20,
                         "the relaying worker installs")
        os.kill(relayer["pid"], signal.SIGKILL)
        assert await cut_off(connection) is None
        (gates / "slow-install").unlink()
        (gates / "install-open").touch()

        # The coordinator failed the restore, released every installed record, and the
        # server is fresh: the retry restores it all.
        await replaced(server, http, relayer["id"])
        await fresh_again(server, http)
        await restore_then_continue(server, http, sessions, counts, steps)
        on_the_table(http)


@four_workers
async def test_a_worker_dying_during_another_workers_restore_is_503_worker_lost_and_keeps_nothing(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root, sessions, counts, steps = await checkpointed_server(serve, tmp_path, workers)
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, workers, *args(root), env=env)
    async with Http(server.url, limit=200) as http:
        connection, relayer = await relaying(server, http)
        victim = next(w for w in (await status(server, http))["workers"]
                      if w["id"] != relayer["id"])
        (gates / "slow-install").write_text(victim["id"])
        connection.send("POST", "/_tether/restore",
                        json={"checkpoint_id": "c1", "deadline_s": 30}, headers=auth(server))
        await eventually(lambda: (gates / f"installing-{victim['id']}").exists(), 20,
                         "the victim installs")
        os.kill(victim["pid"], signal.SIGKILL)
        reply = await connection.reply("POST", "/_tether/restore", within=SETTLE_S)
        await connection.close()
        # The checkpoint is intact: the restore is retryable, not corrupt (issue 12, 2).
        assert (reply.status, reply.code) == (503, "worker_lost"), reply
        assert reply.headers.get("retry-after") == "1", reply.headers
        (gates / "slow-install").unlink()
        (gates / "install-open").touch()

        await replaced(server, http, victim["id"])
        await fresh_again(server, http)
        await restore_then_continue(server, http, sessions, counts, steps)
        on_the_table(http)


# The whole group dies mid-commit, then mid-restore -----------------------------------------


@parametrize_workers
async def test_a_group_killed_mid_commit_and_then_mid_restore_restores_the_last_complete_checkpoint(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    gates, env = gates_for(tmp_path)
    first = serve(FAULTS_APP, workers, *args(root), env=env)
    sessions = Sessions()
    async with Http(first.url, limit=200) as http, Http(first.url) as runs_http:
        await sessions.everywhere(first, http, "group")
        manifest, runs = await checkpoint_with_parked_episodes(root, first, runs_http, "c1", "ep")
        counts, steps = sessions.snapshot(), parked_steps(root, manifest)
        await sessions.bump()
        await prepared(first, http, "c2")
        (gates / "slow-export").write_text("")  # every worker
        commit = asyncio.ensure_future(control(first, runs_http, "commit", checkpoint_id="c2"))
        await eventually(lambda: (gates / "exporting").exists(), 20, "the commit exports")
        await first.crash()
        outcome = (await asyncio.gather(commit, return_exceptions=True))[0]
        assert isinstance(outcome, aiohttp.ClientError | asyncio.TimeoutError), outcome
        await stop(runs)
    (gates / "slow-export").unlink()
    # Nothing of c2 is restorable; c1 is the latest.
    assert not (root / "c2" / NAME / "MANIFEST.json").exists()
    assert resolve_latest(root, NAME) == "c1"

    second = serve(FAULTS_APP, workers, *args(root), env=env)
    async with Http(second.url, limit=200) as http:
        (gates / "slow-install").write_text("")  # every worker
        restore = asyncio.ensure_future(control(second, http, "restore", checkpoint_id="c1"))
        await eventually(lambda: any(gates.glob("installing-*")), 20, "the restore installs")
        await second.crash()
        outcome = (await asyncio.gather(restore, return_exceptions=True))[0]
        assert isinstance(outcome, aiohttp.ClientError | asyncio.TimeoutError), outcome
    (gates / "slow-install").unlink()

    third = serve(FAULTS_APP, workers, *args(root, "--restore", "latest"), env=env)
    assert [r["checkpoint_id"] for r in third.logs() if r.get("event") == "restored"] == ["c1"]
    async with Http(third.url, limit=200) as http:
        await restores_with_counts(http, sessions, counts)
        await continue_exactly_once(third, http, steps)
        # c2, never published, can be taken again; the dead commit's files are swept.
        await checkpoint(root, third, http, "c2")
        assert temp_dirs(root, "c2") == []
        on_the_table(http)


# The controller dies: the lease runs out -------------------------------------------------------


@parametrize_workers
async def test_a_controller_that_never_resumes_is_outlived_by_the_lease(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    server = serve(FAULTS_APP, workers, *args(root), env=gates_for(tmp_path)[1])
    sessions = Sessions()
    async with Http(server.url, limit=200) as http, Http(server.url) as runs_http:
        await sessions.everywhere(server, http, "lease")
        ids = [f"lease-ep-{i}" for i in range(EPISODES)]
        runs = start_runs(runs_http, ids)
        try:
            await all_running(server, runs_http, EPISODES, runs)
            for checkpoint_id, then in (("c1", None), ("c2", "commit")):
                await prepared(server, http, checkpoint_id, deadline_s=LEASE_S, lease_s=LEASE_S)
                if then == "commit":
                    await ok(server, http, "commit", checkpoint_id=checkpoint_id,
                             deadline_s=LEASE_S)
                # Held sessions wait, new ones are parked, episodes are parked.
                waiting = asyncio.ensure_future(next(iter(sessions.on(http))).count())
                reply = await CounterSession(http, f"new-{checkpoint_id}").seed()
                assert (reply.status, reply.code) == (503, "checkpoint_parked"), reply
                assert not waiting.done() and not any(r.done() for r in runs)

                # The controller is gone: the server resumes by itself, once the lease is up.
                async def expired(checkpoint_id: str = checkpoint_id) -> bool:
                    return bool((await status(server, http))["phase"] == "open")

                await eventually(expired, 4 * LEASE_S + 10, f"{checkpoint_id}'s lease expires")
                assert any(r.get("event") == "lease_expired" and
                           r.get("checkpoint_id") == checkpoint_id for r in server.logs())
                counted = await asyncio.wait_for(waiting, 10)
                assert counted.status == 200, counted
                assert (await CounterSession(http, f"new-{checkpoint_id}").seed()).status == 200
                # The ID is remembered: a late controller cannot reopen it.
                reply = await control(server, http, "prepare", checkpoint_id=checkpoint_id)
                assert (reply.status, reply.code) == (409, "stale_checkpoint"), reply
                assert await ok(server, http, "resume", checkpoint_id=checkpoint_id) == {
                    "phase": "open"}
            # Each parked episode went on after the expiry, once, to its end.
            finished = await asyncio.wait_for(asyncio.gather(*runs), 60)
        finally:
            await stop(runs)
        assert [(r.status, r.json["steps_done"], r.json["resumed_from"]) for r in finished] == [
            (200, STEPS, 0)] * EPISODES, finished[:2]
        # c2 was committed but never published: it does not exist for restore.
        assert resolve_latest(root, NAME) is None
        on_the_table(http, runs_http)
