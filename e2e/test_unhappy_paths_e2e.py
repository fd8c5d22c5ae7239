"""Issue 12, one behaviour per point, against real `tether serve` process groups: the
checkpoint protocol's unhappy paths lose nothing, do nothing twice and leave nothing stuck.

Points 1, 2 and 7 are fault injections and live in e2e/test_faults_e2e.py:

1. `test_a_commit_whose_relaying_worker_dies_after_its_segment_finishes_and_publishes`,
   `test_a_commit_whose_relaying_worker_dies_mid_write_fails_and_the_server_resumes`,
   `test_a_restore_whose_relaying_worker_dies_mid_install_is_undone_and_can_be_retried`;
2. `test_a_worker_dying_during_another_workers_restore_is_503_worker_lost_and_keeps_nothing`;
7. `test_a_worker_killed_while_prepared_blocks_the_checkpoint_until_resume` (status lists
   the `worker_lost` blocker commit refuses for, at 1 and at 4 workers).

The rest are here, in the issue's order. Every reply any test gets is a code of SPEC 6's
table (`on_the_table`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import Serve
from e2e.harness import (
    TOKEN_ENV,
    Connection,
    CounterSession,
    Http,
    Reply,
    Server,
    bounded,
    eventually,
    off_the_table,
)
from e2e.test_faults_e2e import (
    FAULTS_APP,
    NAME,
    Sessions,
    args,
    auth,
    blocker_kinds,
    checkpoint,
    control,
    fresh_again,
    gates_for,
    ok,
    on_the_table,
    parametrize_workers,
    prepared,
    publish,
    relaying,
    replaced,
    restores_with_counts,
    status,
    stop,
)
from e2e.test_rescale_e2e import free_port
from tether.checkpoint.segments import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

EPISODES_APP = "tether.examples.episodes:app"
MCP_APP = "tether.examples.mcp_counter:app"
COUNTER_APP = "tether.examples.counter:app"


async def run(http: Http, episode_id: str, attempt: int, steps: int = 200,
              step_ms: float = 10, **extra: Any) -> Reply:
    body = {"episode_id": episode_id, "attempt": attempt, "steps": steps, "step_ms": step_ms,
            **extra}
    return await http.request("POST", "/run", json=body)


def held(answer: dict[str, Any]) -> dict[str, int]:
    return {h["episode_id"]: h["attempt_to_send"] for h in answer["held_episodes"]}


async def episodes_running(server: Server, http: Http, count: int) -> None:
    async def check() -> bool:
        answer = await status(server, http)
        return bool(sum(w["episodes"] for w in answer["workers"]) == count)

    await eventually(check, 20, f"{count} episodes run")


# 3. --workers 1: a replaced worker forgets nothing of the checkpoint protocol ------------------


async def test_a_single_replaced_worker_keeps_the_phase_the_remembered_ids_and_the_retire_marks(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve(EPISODES_APP, 1, *args(tmp_path / "ckpt"))
    problems: list[str] = []
    async with Http(server.url) as http:
        # An ID resumed before it was ever committed: only memory says it is stale.
        await prepared(server, http, "resumed-1")
        await ok(server, http, "resume", checkpoint_id="resumed-1")
        await ok(server, http, "retire", episode_id="retired-ep", attempt=1)
        await prepared(server, http, "c1", lease_s=60)
        victim = (await status(server, http))["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        after = await replaced(server, http, victim["id"])

        if (after["phase"], after["checkpoint_id"]) != ("prepared", "c1"):
            problems.append(f"phase after the SIGKILL: {after['phase']}, {after['checkpoint_id']}")
        if ("worker_lost", victim["id"]) not in blocker_kinds(after):
            problems.append(f"no worker_lost blocker: {after['blockers']}")
        reply = await control(server, http, "commit", checkpoint_id="c1")
        if reply.status == 200:
            problems.append(f"commit after losing the worker: {reply}")
        await ok(server, http, "resume", checkpoint_id="c1")

        reply = await control(server, http, "prepare", checkpoint_id="resumed-1", deadline_s=5)
        if (reply.status, reply.code) != (409, "stale_checkpoint"):
            problems.append(f"prepare of a resumed ID: {reply}")
            if reply.status == 200:
                await ok(server, http, "resume", checkpoint_id="resumed-1")
        reply = await run(http, "retired-ep", 1, steps=1)
        if (reply.status, reply.code) != (409, "stale_attempt"):
            problems.append(f"a retired attempt ran again: {reply}")
        on_the_table(http)
    assert not problems, problems


# 4. Restored sessions: admission closed until resume; abort releases claims too ---------------


async def restored_server(
    serve: Serve, tmp_path: Path, workers: int
) -> tuple[Server, Path, Sessions, dict[str, int]]:
    """Counter sessions on every worker checkpointed as c1, the group SIGKILLed, and a
    fresh server on the same root (nothing restored yet)."""
    root = tmp_path / "ckpt"
    first = serve(FAULTS_APP, workers, *args(root), env=gates_for(tmp_path)[1])
    sessions = Sessions()
    async with Http(first.url, limit=200) as http:
        await sessions.everywhere(first, http, "rst")
        await checkpoint(root, first, http, "c1")
    await first.crash()
    fresh = serve(FAULTS_APP, workers, *args(root), env=gates_for(tmp_path)[1])
    return fresh, root, sessions, sessions.snapshot()


async def served_while_restored(http: Http, sessions: Sessions) -> list[asyncio.Future[Reply]]:
    """Ask every restored session its count while the server is `restored`: none may be
    served (each waits for the resume, or is refused `checkpoint_parked`). Returns the
    requests still waiting after a bounded look."""
    asked = [asyncio.ensure_future(s.count()) for s in sessions.on(http)]
    done, waiting = await asyncio.wait(asked, timeout=2)
    served = [t.result() for t in done if t.exception() is None]
    wrong = [r for r in served if (r.status, r.code) != (503, "checkpoint_parked")]
    assert not wrong, f"{len(wrong)} requests served while restored: {wrong[:3]}"
    return list(waiting)


@parametrize_workers
async def test_restored_sessions_are_not_served_until_resume(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    server, _, sessions, counts = await restored_server(serve, tmp_path, workers)
    async with Http(server.url, limit=200) as http:
        await ok(server, http, "restore", checkpoint_id="c1")
        waiting = await served_while_restored(http, sessions)
        assert server.claims() == {}, "claims were made while restored"
        await ok(server, http, "resume", checkpoint_id="c1")
        late = await asyncio.wait_for(asyncio.gather(*waiting), 20)
        assert {r.status for r in late} <= {200}, late[:3]
        await restores_with_counts(http, sessions, counts)
        on_the_table(http)


@parametrize_workers
async def test_abort_restore_releases_the_claims_and_a_retried_restore_succeeds(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    server, _, sessions, counts = await restored_server(serve, tmp_path, workers)
    async with Http(server.url, limit=200) as http:
        await ok(server, http, "restore", checkpoint_id="c1")
        waiting = await served_while_restored(http, sessions)
        answer = await control(server, http, "abort_restore", checkpoint_id="c1")
        assert (answer.status, answer.json) == (200, {"phase": "open", "fresh": True}), answer
        # What waited through the restore ends without serving state that is gone, and
        # without claiming its session: the controller's retry needs a fresh server.
        ended = await asyncio.wait_for(asyncio.gather(*waiting), 20)
        assert not [r for r in ended if r.status == 200], ended[:3]
        await fresh_again(server, http)
        answer = await control(server, http, "restore", checkpoint_id="c1")
        assert answer.status == 200, answer
        await ok(server, http, "resume", checkpoint_id="c1")
        await restores_with_counts(http, sessions, counts)
        on_the_table(http)


# 5. --restore at start: status never says open before the server serves ---------------------


async def test_status_does_not_say_open_while_a_restore_at_start_still_parks_the_routes(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    gates, env = gates_for(tmp_path)
    first = serve(FAULTS_APP, 4, *args(root), env=env)
    sessions = Sessions()
    async with Http(first.url, limit=200) as http:
        await sessions.everywhere(first, http, "start")
        await checkpoint(root, first, http, "c1")
    await first.crash()

    (gates / "slow-install").write_text("")  # every worker
    # The URL and the token are known before the server says it serves: we pick them.
    port, token = free_port(), secrets.token_urlsafe(16)
    starting = asyncio.ensure_future(asyncio.to_thread(
        serve, FAULTS_APP, 4, *args(root, "--restore", "latest"), "--port", str(port),
        env={**env, TOKEN_ENV: token},
    ))
    try:
        async with Http(f"http://127.0.0.1:{port}") as http:

            async def installing() -> bool:
                if starting.done():
                    starting.result()  # it served before the install was let go: raises
                return len(list(gates.glob("installing-*"))) == 4

            await eventually(installing, 30, "every worker registered and installs")
            seed = await CounterSession(http, "during-restore").seed()
            assert (seed.status, seed.code) == (503, "checkpoint_parked"), seed
            # Status may refuse (a code of the table) or say something else than open.
            reply = await http.request("GET", "/_tether/status",
                                       headers={"authorization": f"Bearer {token}"})
            said = reply.json.get("phase") if reply.status == 200 else reply.code
            assert said != "open", f"status says {said} while app routes answer {seed}"
            (gates / "install-open").touch()
            server = await asyncio.wait_for(starting, 40)
            server.token = token
            assert (await status(server, http))["phase"] == "open"
            assert (await CounterSession(http, "after-restore").seed()).status == 200
            await restores_with_counts(http, sessions, sessions.snapshot())
            on_the_table(http)
    finally:
        (gates / "install-open").touch()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(starting, 60)


# 6. A request admitted before its session was held is tracked (a seed still building) -------


@parametrize_workers
async def test_a_seed_still_building_its_state_blocks_a_prepare_until_it_is_done(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, workers, *args(root), env=env)
    async with Http(server.url) as http:
        seeding = asyncio.ensure_future(http.request(
            "POST", "/seed_session", json={"session_id": "slow", "build": True}))
        try:
            await eventually(lambda: (gates / "seeding-slow").exists(), 20, "the seed runs")
            answer = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=1)
            assert answer["state"] == "blocked", answer
            assert [(b["kind"], b["id"]) for b in answer["blockers"]] == [
                ("session_busy", "slow")], answer
            (gates / "seeded-slow").touch()
            assert (await asyncio.wait_for(seeding, 20)).status == 200
        finally:
            (gates / "seeded-slow").touch()
            await asyncio.gather(seeding, return_exceptions=True)
        await prepared(server, http, "c1")
        manifest = await ok(server, http, "commit", checkpoint_id="c1")
        directory = root / "c1" / NAME
        states = {r["id"]: r["state"] for s in manifest["segments"]
                  for r in read_records(directory / s["file"]) if r["kind"] == "session"}
        assert states == {"slow": 0}, "the commit wrote a half-built state"
        await ok(server, http, "resume", checkpoint_id="c1")
        on_the_table(http)


# 8. A relayed call waits as long as its deadline says ---------------------------------------


@pytest.mark.timeout(300)
async def test_a_relayed_prepare_waits_out_a_deadline_longer_than_two_minutes(
    serve: Serve, tmp_path: Path
) -> None:
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, 4, *args(tmp_path / "ckpt"), env=env)
    async with Http(server.url) as http:
        # The app reports a session busy for as long as the test says: prepare waits
        # for its whole deadline, past the relay's old fixed 120 s.
        assert (await CounterSession(http, "busy").seed()).status == 200
        (gates / "busy-busy").touch()
        started = time.monotonic()
        connection = await Connection.open(*server.host_port)  # a client that waits long
        try:
            reply = await connection.request(
                "POST", "/_tether/prepare", json={"checkpoint_id": "long", "deadline_s": 125},
                headers=auth(server), within=200,
            )
        finally:
            took = time.monotonic() - started
            (gates / "busy-busy").unlink()
            await connection.close()
        assert not off_the_table(reply), f"after {took:.0f} s: {reply}"
        assert reply.status == 200, f"after {took:.0f} s: {reply}"
        assert (reply.json["state"], [b["kind"] for b in reply.json["blockers"]]) == (
            "blocked", ["session_busy"]), reply
        assert took >= 125, took
        await ok(server, http, "resume", checkpoint_id="long")
        on_the_table(http)


# 9. Retire keeps its deadline, and one worker can be unreported too -------------------------


@parametrize_workers
async def test_retire_of_an_attempt_that_will_not_stop_is_worker_unreported_at_its_deadline(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    gates, env = gates_for(tmp_path)
    server = serve(FAULTS_APP, workers, *args(tmp_path / "ckpt"), env=env)
    async with Http(server.url) as http:
        stuck = asyncio.ensure_future(run(http, "ep", 1, steps=3, step_ms=0, gate="step"))
        try:
            await episodes_running(server, http, 1)
            started = time.monotonic()
            reply = await control(server, http, "retire", episode_id="ep", attempt=1,
                                  deadline_s=0.5)
            took = time.monotonic() - started
            assert (reply.status, reply.code) == (503, "worker_unreported"), (took, reply)
            assert took < 3.5, f"retire with a 0.5 s deadline answered after {took:.1f} s"
            # The marks are kept: the attempt is refused on every worker.
            for _ in range(2 * workers):
                again = await run(http, "ep", 1, steps=1, step_ms=0)
                assert (again.status, again.code) == (409, "stale_attempt"), again
        finally:
            (gates / "step").touch()
        ended = await asyncio.wait_for(stuck, 20)
        assert (ended.status, ended.code) == (409, "stale_attempt"), ended
        on_the_table(http)


# 10. A commit's scope forgets the held records it drops ----------------------------------------


@parametrize_workers
async def test_a_commit_whose_scope_drops_a_held_record_forgets_it(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    first = serve(EPISODES_APP, workers, *args(root))
    async with Http(first.url) as http:
        runs = [asyncio.ensure_future(run(http, e, 1)) for e in ("keep", "drop")]
        try:
            await episodes_running(first, http, 2)
            await prepared(first, http, "c1")
            await ok(first, http, "commit", checkpoint_id="c1")
            publish(root, first, "c1")
            await first.crash()
        finally:
            await stop(runs)

    server = serve(EPISODES_APP, workers, *args(root, "--restore", "latest"))
    async with Http(server.url) as http:
        assert held(await status(server, http)) == {"keep": 2, "drop": 2}
        await prepared(server, http, "c2")
        manifest = await ok(server, http, "commit", checkpoint_id="c2", scope=["keep"])
        assert manifest["records"]["episodes"] == 1, manifest
        publish(root, server, "c2")
        await ok(server, http, "resume", checkpoint_id="c2")
        assert held(await status(server, http)) == {"keep": 2}
        dropped = await run(http, "drop", 2, step_ms=0)
        assert (dropped.status, dropped.json["resumed_from"]) == (200, 0), dropped
        kept = await run(http, "keep", 2, step_ms=0)
        assert kept.status == 200 and kept.json["resumed_from"] > 0, kept
        on_the_table(http)


# 11. /health is served during a checkpoint; the fence follows --close-window ----------------


@pytest.mark.parametrize(("app", "extra"), [(EPISODES_APP, ()), (MCP_APP, ("--sessions", "mcp"))],
                         ids=["no_kind", "mcp_preset"])
async def test_health_is_served_during_a_checkpoint(
    serve: Serve, tmp_path: Path, app: str, extra: tuple[str, ...]
) -> None:
    server = serve(app, 4, *args(tmp_path / "ckpt"), *extra)
    async with Http(server.url) as http:
        await prepared(server, http, "c1")
        replies = await bounded(http.request("GET", "/health") for _ in range(12))
        assert [r.status for r in replies] == [200] * 12, replies[:3]
        await ok(server, http, "resume", checkpoint_id="c1")
        on_the_table(http)


async def test_a_closed_session_can_be_seeded_again_once_its_close_window_passed(
    serve: Serve,
) -> None:
    server = serve(COUNTER_APP, 1, "--close-window", "2")
    async with Http(server.url) as http:
        session = CounterSession(http, "reopened")
        assert (await session.seed()).status == 200
        assert (await session.close()).status == 200
        reply = await session.seed()
        assert (reply.status, reply.code) == (409, "session_closed"), reply

        async def seeded() -> bool:
            return (await session.seed()).status == 200

        await eventually(seeded, 15, "the closed record outlives the 2 s window no more",
                         every=0.25)
        on_the_table(http)


# 12. Retry-After on every checkpoint_parked; only codes of the table; stale renew --------------


async def test_a_run_whose_episode_claim_meets_a_prepare_is_parked_with_retry_after(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve(EPISODES_APP, 4, *args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        # A connection to worker A, and A frozen: its request is read only after the
        # coordinator closed admission, while A itself has not heard of it yet, so its
        # episode claim reaches the coordinator during the checkpoint.
        connection, frozen = await relaying(server, http)
        os.kill(frozen["pid"], signal.SIGSTOP)
        try:
            connection.send("POST", "/run", json={"episode_id": "late", "attempt": 1,
                                                  "steps": 1, "step_ms": 0})
            preparing = asyncio.ensure_future(
                ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10))

            async def parked_elsewhere() -> bool:
                reply = await run(http, "probe", 1, steps=0)
                return reply.code == "checkpoint_parked"

            await eventually(parked_elsewhere, 20, "another worker parks new episodes")
        finally:
            os.kill(frozen["pid"], signal.SIGCONT)
        reply = await connection.reply("POST", "/run", within=30)
        await connection.close()
        assert (reply.status, reply.code) == (503, "checkpoint_parked"), reply
        assert reply.headers.get("retry-after") == "1", reply.headers
        assert (await asyncio.wait_for(preparing, 30))["state"] == "prepared"
        await ok(server, http, "resume", checkpoint_id="c1")
        parked = [r for r in http.replies if r.code == "checkpoint_parked"]
        assert all(r.headers.get("retry-after") == "1" for r in parked), parked
        assert (await run(http, "late", 1, steps=1, step_ms=0)).status == 200
        on_the_table(http)


@parametrize_workers
async def test_unknown_control_routes_and_methods_answer_codes_of_the_table(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    server = serve(COUNTER_APP, workers, *args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        for method, path in [("GET", "/_tether/nope"), ("POST", "/_tether/status"),
                             ("GET", "/_tether/prepare"), ("POST", "/_tether/"),
                             ("DELETE", "/_tether/commit")]:
            await http.request(method, path, headers=auth(server))
        on_the_table(http)


@parametrize_workers
async def test_renew_of_a_published_checkpoint_this_server_never_saw_is_stale_checkpoint(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, workers, *args(root))
    async with Http(first.url) as http:
        await checkpoint(root, first, http, "c1")
    await first.crash()
    second = serve(COUNTER_APP, workers, *args(root))
    async with Http(second.url) as http:
        for route in ("renew", "prepare", "commit"):
            reply = await control(second, http, route, checkpoint_id="c1")
            assert (reply.status, reply.code) == (409, "stale_checkpoint"), (route, reply)
        on_the_table(http)
