"""The coordinator across N workers: episodes continued exactly once after a restore,
unclaimed records carried into the next checkpoint, and fail-closed checkpoints and
restores when workers die (SPEC 5.2, 5.5, 5.6, 5.8).

SIGKILL of the main process making every worker exit within 5 s (SPEC 3) is
`test_sigkill_of_the_main_process_makes_every_worker_exit_within_5_s` in
test_serve_e2e.py; it is not repeated here.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.conftest import Serve
from e2e.harness import COUNTER_APP, Http, Reply, Server, bounded, eventually
from e2e.test_rescale_e2e import (
    ckpt_args,
    control,
    live_workers,
    ok,
    read_and_count_on,
    restore_args,
    seeded,
    status,
    take_checkpoint,
)
from tether.coordinator.controller import Controller, new_checkpoint_id
from tether.coordinator.controller import Server as Target

pytestmark = pytest.mark.e2e

EPISODES_APP = "tether.examples.episodes:app"
EPISODES_NAME = "episodes"
EPISODES = 30
STEPS = 40
STEP_MS = 20
RACE_ATTEMPTS = 6


# Episodes (SPEC 5.8) -------------------------------------------------------------------------


async def run(http: Http, episode_id: str, attempt: int, worker: str | None = None) -> Reply:
    """POST /run on a new connection; `worker` names the worker (x-tether-worker)."""
    body = {"episode_id": episode_id, "attempt": attempt, "steps": STEPS, "step_ms": STEP_MS}
    headers = {"x-tether-worker": worker} if worker else None
    return await http.request("POST", "/run", json=body, headers=headers)


def held(answer: dict[str, Any]) -> list[tuple[str, int]]:
    return sorted((h["episode_id"], h["attempt_to_send"]) for h in answer["held_episodes"])


def continued(reply: Reply, earlier: set[str], worker: str) -> bool:
    """A run that went on from its checkpointed boundary on `worker` to the end."""
    body = reply.json
    if reply.status != 200 or not isinstance(body, dict):
        return False
    start = body["resumed_from"]
    steps = body["workers"]
    return bool(
        0 < start < STEPS
        and body["steps_done"] == STEPS
        and len(steps) == STEPS
        and set(steps[:start]) <= earlier
        and set(steps[start:]) == {worker}
    )


async def parked_and_restored(
    serve: Serve, root: Path, onto: int
) -> tuple[Server, list[str], list[str]]:
    """EPISODES runs of attempt 1 on 2 workers, parked by a checkpoint (prepare and
    commit, no resume), SIGKILL of the group, `--restore latest` onto `onto` workers.
    Returns the new server, the old workers' IDs and the episode IDs."""
    first = serve(EPISODES_APP, 2, *ckpt_args(root, name=EPISODES_NAME))
    tag = secrets.token_hex(3)
    episodes = [f"ep-{tag}-{i:02d}" for i in range(EPISODES)]
    async with Http(first.url, limit=EPISODES + 10) as http:
        old = [w["id"] for w in (await status(first, http))["workers"]]
        runs = [asyncio.ensure_future(run(http, e, 1)) for e in episodes]
        try:

            async def running() -> bool:
                answer = await status(first, http)
                return bool(sum(w["episodes"] for w in answer["workers"]) == EPISODES)

            await eventually(running, 20, f"{EPISODES} episodes run")
            target = Target(EPISODES_NAME, first.url, first.token)
            async with Controller([target], root) as controller:
                cid = new_checkpoint_id()
                prepared = await controller.prepare(cid, deadline_s=10)
                assert prepared[EPISODES_NAME]["state"] == "prepared", prepared
                summary = await controller.commit(cid)
            records = summary["servers"][0]["records"]
            assert records == {"sessions": 0, "episodes": EPISODES}, summary
        finally:
            await first.crash()
            outcomes = await asyncio.gather(*runs, return_exceptions=True)
    finished = [o for o in outcomes if not isinstance(o, aiohttp.ClientError)]
    assert not finished, f"runs of attempt 1 ended before the crash: {finished[:3]}"
    return serve(EPISODES_APP, onto, *restore_args(root, name=EPISODES_NAME)), old, episodes


async def test_each_parked_episode_continues_exactly_once_when_two_workers_race_for_it(
    serve: Serve, tmp_path: Path
) -> None:
    server, old, episodes = await parked_and_restored(serve, tmp_path / "ckpt", onto=3)
    async with Http(server.url, limit=2 * EPISODES + 10) as http:
        answer = await status(server, http)
        live = [w["id"] for w in answer["workers"]]
        assert len(live) == 3
        assert held(answer) == [(e, 2) for e in episodes]

        stale = await bounded(run(http, e, 1) for e in episodes)
        assert {(r.status, r.code) for r in stale} == {(409, "stale_attempt")}, stale[:3]
        ahead = await bounded(run(http, e, 3) for e in episodes)
        assert {(r.status, r.code) for r in ahead} == {(409, "attempt_mismatch")}, ahead[:3]
        assert {r.json["detail"]["expected"] for r in ahead} == {2}

        async def race(index: int, episode: str) -> tuple[list[Reply], list[str]]:
            named = [live[index % 3], live[(index + 1) % 3]]
            replies = await asyncio.gather(*(run(http, episode, 2, w) for w in named))
            return list(replies), named

        raced = await bounded((race(i, e) for i, e in enumerate(episodes)), EPISODES)
        wrong = []
        winners: dict[str, str] = {}
        for episode, (replies, named) in zip(episodes, raced, strict=True):
            won = [(r, w) for r, w in zip(replies, named, strict=True) if r.status == 200]
            lost = [r for r in replies if r.status != 200]
            if len(won) != 1 or len(lost) != 1:
                wrong.append(f"{episode}: {replies}")
                continue
            [(reply, worker)] = won
            winners[episode] = worker
            if not continued(reply, set(old), worker):
                wrong.append(f"{episode} did not continue on {worker}: {reply}")
            [loser] = lost
            by = loser.json["detail"]["worker"] if loser.code == "episode_claimed" else None
            if (loser.status, by) != (409, worker):
                wrong.append(f"{episode}: the other request got {loser}, not claimed by {worker}")
        assert not wrong, f"{len(wrong)} of {EPISODES} episodes went wrong: {wrong[:3]}"

        after = await status(server, http)
        assert (after["held_episodes"], after["lost_episodes"]) == ([], [])
        assert sum(w["episodes"] for w in after["workers"]) == 0
        # Continued once: a repeated attempt 2 is still refused, naming the winner.
        again = await bounded(run(http, e, 2) for e in episodes)
        assert {(r.status, r.code) for r in again} == {(409, "episode_claimed")}, again[:3]
        assert [r.json["detail"]["worker"] for r in again] == [winners[e] for e in episodes]


async def test_an_unclaimed_episode_is_relabelled_in_the_next_checkpoint_or_dropped_by_scope(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    server, old, episodes = await parked_and_restored(serve, root, onto=3)
    kept, dropped, rest = episodes[0], episodes[1], episodes[2:]
    async with Http(server.url, limit=EPISODES + 10) as http:
        middle = [w["id"] for w in (await status(server, http))["workers"]]
        done = await bounded(run(http, e, 2) for e in rest)
        assert all(r.status == 200 and r.json["resumed_from"] > 0 for r in done), done[:3]
        assert held(await status(server, http)) == sorted([(kept, 2), (dropped, 2)])
    # A commit whose scope keeps only `kept`: `dropped` is forgotten.
    summary = await take_checkpoint(server, root, name=EPISODES_NAME, scope=[kept])
    assert summary["servers"][0]["records"] == {"sessions": 0, "episodes": 1}, summary
    await server.crash()

    last = serve(EPISODES_APP, 2, *restore_args(root, name=EPISODES_NAME))
    async with Http(last.url) as http:
        assert held(await status(last, http)) == [(kept, 3)]
        reply = await run(http, kept, 2)
        assert (reply.status, reply.code) == (409, "stale_attempt"), reply
        reply = await run(http, kept, 4)
        assert (reply.status, reply.code) == (409, "attempt_mismatch"), reply
        assert reply.json["detail"]["expected"] == 3
        live = [w["id"] for w in (await status(last, http))["workers"]]
        reply = await run(http, kept, 3, live[0])
        assert continued(reply, set(old), live[0]), reply
        reply = await run(http, dropped, 2)
        assert (reply.status, reply.json["resumed_from"]) == (200, 0), reply

        # Owner aliases are inherited: worker IDs from one and two restores back still
        # reach a live worker (SPEC 5.7).
        for worker in [*middle, *old]:
            reply = await http.request("GET", "/health", headers={"x-tether-worker": worker})
            assert reply.status == 200, f"{worker}: {reply}"


# Fail closed (SPEC 5.5) ------------------------------------------------------------------------


async def test_a_worker_lost_during_an_open_checkpoint_blocks_it_until_resume(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve(COUNTER_APP, 4, *ckpt_args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        await seeded(http, "lost", 20)
        prepared = await ok(server, http, "prepare", checkpoint_id="lost-1", deadline_s=10)
        assert prepared["state"] == "prepared", prepared
        victim = (await status(server, http))["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        after = await live_workers(server, http, 4, without=victim["id"])
        assert (after["phase"], after["checkpoint_id"]) == ("prepared", "lost-1")
        # Status shows the blockers a commit would find (issue 12, point 7).
        assert [b["kind"] for b in after["blockers"]] == ["worker_lost"], after

        # Even with four workers registered again, the checkpoint stays blocked.
        again = await ok(server, http, "prepare", checkpoint_id="lost-1", deadline_s=0.5)
        assert again["state"] == "blocked", again
        lost = [b for b in again["blockers"] if b["kind"] == "worker_lost"]
        assert [b["worker"] for b in lost] == [victim["id"]], again
        reply = await control(server, http, "commit", checkpoint_id="lost-1")
        assert (reply.status, reply.code) == (409, "not_ready"), reply

        # Until resume: the next checkpoint is not blocked by it.
        assert await ok(server, http, "resume", checkpoint_id="lost-1") == {"phase": "open"}
        fresh = await ok(server, http, "prepare", checkpoint_id="lost-2", deadline_s=10)
        assert fresh["state"] == "prepared", fresh
        await ok(server, http, "resume", checkpoint_id="lost-2")


async def test_a_prepare_waiting_on_workers_is_told_by_their_reports_not_by_polling(
    serve: Serve, tmp_path: Path
) -> None:
    """Workers push numbered readiness reports while admission is closed; a prepare that
    waits 2 s on a running episode moves about 2 KB on the channels, where asking every
    worker each 50 ms moved ~18 KB (more with long blocker lists; issue 12, point 7)."""
    server = serve(EPISODES_APP, 4, *ckpt_args(tmp_path / "ckpt", name=EPISODES_NAME))
    async with Http(server.url) as http:
        run = asyncio.create_task(http.request(
            "POST", "/run", json={"episode_id": "slow", "attempt": 1, "steps": 1,
                                  "step_ms": 4000}))
        await eventually(lambda: episodes_running(server, http), 10, "the episode runs")
        before = (await status(server, http))["channel_bytes"]
        waited = await ok(server, http, "prepare", checkpoint_id="quiet", deadline_s=2)
        after = (await status(server, http))["channel_bytes"]
        assert waited["state"] == "blocked"
        assert [b["kind"] for b in waited["blockers"]] == ["episode_running"], waited
        assert after - before < 8_000, after - before  # measured: ~2 KB; polling: ~18 KB
        # The episode parks at its boundary: its worker reports it, the prepare sees it.
        ready = await ok(server, http, "prepare", checkpoint_id="quiet", deadline_s=10)
        assert ready["state"] == "prepared", ready
        await ok(server, http, "resume", checkpoint_id="quiet")
        assert (await run).status == 200


async def episodes_running(server: Server, http: Http) -> bool:
    return any(w["episodes"] for w in (await status(server, http))["workers"])


async def test_fewer_registered_workers_than_configured_block_prepare(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve(COUNTER_APP, 4, *ckpt_args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        blocked: dict[str, Any] | None = None
        for attempt in range(RACE_ATTEMPTS):
            cid = f"missing-{attempt}"
            missing = await one_worker_short(server, http)
            if missing is None:
                continue  # the replacement registered before we could look
            answer = await ok(server, http, "prepare", checkpoint_id=cid, deadline_s=0.05)
            if answer["state"] == "blocked":
                blocked = answer
                break
            await ok(server, http, "resume", checkpoint_id=cid)  # the replacement won
        assert blocked is not None, f"no replacement was slow enough in {RACE_ATTEMPTS} tries"
        assert missing is not None
        kinds = [b["kind"] for b in blocked["blockers"]]
        assert kinds.count("worker_missing") == 1, blocked
        assert "worker_lost" not in kinds, blocked  # it left before the checkpoint opened

        # Once the replacement registered, the same checkpoint is ready.
        await live_workers(server, http, 4, without=missing)
        answer = await ok(server, http, "prepare", checkpoint_id=cid, deadline_s=10)
        assert answer["state"] == "prepared", answer
        await ok(server, http, "resume", checkpoint_id=cid)


async def one_worker_short(server: Server, http: Http) -> str | None:
    """SIGKILL one worker and wait until the coordinator dropped it; its ID, or None if
    its replacement had already registered by then."""
    victim = (await status(server, http))["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)

    async def dropped() -> dict[str, Any] | None:
        answer = await status(server, http)
        return answer if victim["id"] not in {w["id"] for w in answer["workers"]} else None

    answer = await eventually(dropped, 10, f"worker {victim['id']} is dropped")
    return victim["id"] if len(answer["workers"]) == 3 else None


async def test_a_restore_without_enough_workers_by_its_deadline_is_workers_missing_and_stays_fresh(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, 2, *ckpt_args(root))
    async with Http(first.url) as http:
        counted = await seeded(http, "deadline", 20)
    cid = (await take_checkpoint(first, root))["checkpoint_id"]
    await first.crash()

    # A race: the killed worker's replacement must still be starting when the restore's
    # deadline passes. One that registered in time lets the restore succeed; that server
    # is restored, so the next try takes a fresh one.
    reply = missing = None
    for _ in range(RACE_ATTEMPTS):
        server = serve(COUNTER_APP, 4, *ckpt_args(root))
        async with Http(server.url) as http:
            missing = await one_worker_short(server, http)
            if missing is not None:
                reply = await control(server, http, "restore", checkpoint_id=cid, deadline_s=0.05)
                if reply.status != 200:
                    break
        await server.crash()
        reply = missing = None
    assert reply is not None, f"no replacement was slow enough in {RACE_ATTEMPTS} tries"
    assert missing is not None
    async with Http(server.url) as http:
        await live_workers(server, http, 4, without=missing)
        # Whatever it answered, the server stays fresh and restores once all are back.
        answer = await ok(server, http, "restore", checkpoint_id=cid, deadline_s=30)
        assert answer["installed_sessions"] == 20
        await ok(server, http, "resume", checkpoint_id=cid)
        problems = await read_and_count_on(http, counted)
        assert not problems, problems[:3]
    # SPEC 5.6: 503 workers_missing when the workers do not register within the deadline.
    assert (reply.status, reply.code) == (503, "workers_missing"), reply


async def test_two_workers_exporting_one_session_block_the_commit_with_session_duplicate(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve("e2e.apps.adopt:app", 2, "--checkpoint-root", str(tmp_path), "--name", "dup")
    async with Http(server.url) as http:
        workers = [w["id"] for w in (await server.status(http))["workers"]]
        assert len(workers) == 2
        for worker in workers:
            adopted = await http.request(
                "POST", "/adopt", json={"session_id": "twice"}, headers={"x-tether-worker": worker}
            )
            assert adopted.status == 200
        control = {"authorization": f"Bearer {server.token}"}
        prepared = await http.request(
            "POST", "/_tether/prepare", json={"checkpoint_id": "d1"}, headers=control
        )
        assert prepared.json["state"] == "prepared"
        committed = await http.request(
            "POST", "/_tether/commit", json={"checkpoint_id": "d1"}, headers=control
        )
        assert committed.status == 409
        assert committed.code == "not_ready"
        blockers = committed.json["detail"]["blockers"]
        assert [(b["kind"], b["id"]) for b in blockers] == [("session_duplicate", "twice")]
        assert not (tmp_path / "d1" / "dup").exists()  # nothing published
        resumed = await http.request(
            "POST", "/_tether/resume", json={"checkpoint_id": "d1"}, headers=control
        )
        assert resumed.status == 200


@pytest.mark.timeout(240)
async def test_100000_sessions_checkpointed_at_4_workers_leave_the_channel_under_1_mb(
    serve: Serve, tmp_path: Path
) -> None:
    """Records never cross the channel: each worker writes its own segment. The bytes
    the coordinator's channels carry during the checkpoint stay under 1 MB while the
    segments hold ~200 MB."""
    server = serve("e2e.bench.state_app:app", 4, "--checkpoint-root", str(tmp_path),
                   "--name", "bench")
    control = {"authorization": f"Bearer {server.token}"}
    async with Http(server.url) as http:
        workers = [w["id"] for w in (await server.status(http))["workers"]]
        for index, worker in enumerate(workers):
            filled = await http.request(
                "POST", "/bench/sessions", headers={"x-tether-worker": worker},
                json={"n": 25_000, "size": 2048, "start": index * 25_000},
            )
            assert filled.status == 200
        before = (await server.status(http))["channel_bytes"]
        for route in ("prepare", "commit", "resume"):
            reply = await http.request(
                "POST", f"/_tether/{route}", json={"checkpoint_id": "big"}, headers=control
            )
            assert reply.status == 200, reply.json
            if route == "commit":
                manifest = reply.json
        after = (await server.status(http))["channel_bytes"]
    assert manifest["records"] == {"sessions": 100_000, "episodes": 0}
    written = sum(segment["bytes"] for segment in manifest["segments"])
    assert written > 200_000_000
    print(f"channel bytes during the checkpoint: {after - before}, segments: {written}")
    assert after - before < 1_000_000, f"{after - before} bytes crossed the channel"
