"""Checkpoint, SIGKILL, restore onto another worker count: old cookies keep counting
(SPEC 3, 4.2, 5.6, 5.7, 8).

Each test plays the controller through the Python API (`Controller.checkpoint`), kills
the whole process group as a crash would, and starts `tether serve --workers M
--restore latest`. Every request of the tests opens a new connection.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    CounterSession,
    Http,
    Reply,
    Server,
    bounded,
    eventually,
)
from tether.coordinator.controller import Controller
from tether.coordinator.controller import Server as Target

pytestmark = pytest.mark.e2e

NAME = "counter"
SESSIONS = 200
CONCURRENCY = 50
INCREMENTS = 7  # session i is incremented i % INCREMENTS times before the checkpoint
COVERAGE_ROUNDS = 10


# Helpers (also used by test_coordinator_e2e) --------------------------------------------


def ckpt_args(root: Path, *extra: str, name: str = NAME) -> tuple[str, ...]:
    return ("--checkpoint-root", str(root), "--name", name, *extra)


def restore_args(root: Path, *extra: str, name: str = NAME) -> tuple[str, ...]:
    return ckpt_args(root, "--restore", "latest", *extra, name=name)


async def control(server: Server, http: Http, route: str, **body: Any) -> Reply:
    """One control call on a new connection."""
    headers = {"authorization": f"Bearer {server.token}"}
    if route == "status":
        return await http.request("GET", "/_tether/status", headers=headers)
    return await http.request("POST", f"/_tether/{route}", json=body, headers=headers)


async def ok(server: Server, http: Http, route: str, **body: Any) -> Any:
    reply = await control(server, http, route, **body)
    assert reply.status == 200, reply
    return reply.json


async def status(server: Server, http: Http) -> dict[str, Any]:
    found: dict[str, Any] = await ok(server, http, "status")
    return found


async def take_checkpoint(
    server: Server, root: Path, name: str = NAME, scope: Sequence[str] | None = None
) -> dict[str, Any]:
    """A whole checkpoint through the controller's Python API; its summary."""
    async with Controller([Target(name, server.url, server.token)], root) as controller:
        summary: dict[str, Any] = await controller.checkpoint(scope=scope)
    return summary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def live_workers(server: Server, http: Http, count: int, without: str) -> dict[str, Any]:
    """Poll status until `count` workers are registered and `without` is not one of
    them (a replacement registered); that status."""

    async def check() -> dict[str, Any] | None:
        found = await status(server, http)
        ids = {w["id"] for w in found["workers"]}
        return found if len(ids) == count and without not in ids else None

    found: dict[str, Any] = await eventually(check, 30, f"{count} workers, {without} not one")
    return found


class Counted:
    """A counter session, what it should read, and the worker that held it before."""

    def __init__(self, session: CounterSession, count: int) -> None:
        self.session = session
        self.count = count
        self.owner: str | None = session.worker

    def via(self, http: Http) -> CounterSession:
        """The same session (ID and cookie) sent through `http`."""
        copy = CounterSession(http, self.session.id)
        copy.cookie = self.session.cookie
        return copy


async def seeded(http: Http, prefix: str, sessions: int = SESSIONS) -> list[Counted]:
    """`sessions` counter sessions, session i incremented i % INCREMENTS times."""
    run = secrets.token_hex(3)

    async def one(index: int) -> Counted:
        session = CounterSession(http, f"{prefix}-{run}-{index:04d}")
        reply = await session.seed()
        assert reply.status == 200 and session.cookie is not None, reply
        for n in range(1, index % INCREMENTS + 1):
            reply = await session.increment()
            assert (reply.status, reply.json["count"]) == (200, n), reply
        return Counted(session, index % INCREMENTS)

    return await bounded((one(i) for i in range(sessions)), CONCURRENCY)


async def read_and_count_on(http: Http, counted: list[Counted]) -> list[str]:
    """Each session reads its count, then one more increment; the problems, and each
    session's holder in `holders`."""
    problems: list[str] = []

    async def one(item: Counted) -> None:
        session = item.via(http)
        read = await session.count()
        if read.status != 200 or read.json["count"] != item.count:
            problems.append(f"{session.id} should read {item.count}: {read}")
            return
        bumped = await session.increment()
        if bumped.status != 200 or bumped.json["count"] != item.count + 1:
            problems.append(f"{session.id} should count on to {item.count + 1}: {bumped}")
            return
        if bumped.json["worker"] != read.json["worker"]:
            problems.append(f"{session.id} answered from {read} and {bumped}")
            return
        item.count += 1
        item.owner = bumped.json["worker"]

    await bounded((one(item) for item in counted), CONCURRENCY)
    return problems


def by_id(workers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in workers}


def received(
    before: list[dict[str, Any]], after: list[dict[str, Any]], served: Counter[str]
) -> dict[str, int]:
    """Requests each worker accepted on the shared port between two statuses: those it
    forwarded, plus those it served that no other worker forwarded to it."""
    old, new = by_id(before), by_id(after)
    counts = {}
    for worker, row in new.items():
        prior = old.get(worker, {"forwarded": 0, "served_forwarded": 0})
        forwarded = row["forwarded"] - prior["forwarded"]
        served_forwarded = row["served_forwarded"] - prior["served_forwarded"]
        counts[worker] = forwarded + served[worker] - served_forwarded
    return counts


# 1. The rescale matrix -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [(1, 4), (4, 2), (2, 5), (3, 1), (4, 4), (4, 8)],
    ids=lambda n: str(n),
)
async def test_every_old_cookie_reads_its_count_and_counts_on_after_a_rescale(
    serve: Serve, tmp_path: Path, before: int, after: int
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, before, *ckpt_args(root))
    async with Http(first.url, limit=CONCURRENCY) as http:
        counted = await seeded(http, f"r{before}{after}")
        old_ids = {w["id"] for w in (await status(first, http))["workers"]}
    assert {c.owner for c in counted} <= old_ids
    summary = await take_checkpoint(first, root)
    assert summary["servers"][0]["records"] == {"sessions": SESSIONS, "episodes": 0}
    await first.crash()

    second = serve(COUNTER_APP, after, *restore_args(root))
    old_owner = {c.session.id: c.owner for c in counted}
    async with Http(second.url, limit=CONCURRENCY) as http:
        start = (await status(second, http))["workers"]
        assert len(start) == after
        live = {w["id"] for w in start}
        assert sum(w["sessions"] for w in start) == SESSIONS, start

        problems = await read_and_count_on(http, counted)
        assert not problems, f"{len(problems)} sessions went wrong, e.g. {problems[:3]}"
        served = Counter(c.owner for c in counted for _ in range(2) if c.owner)
        holder = {c.session.id: c.owner for c in counted if c.owner is not None}
        assert len(holder) == SESSIONS

        # Requests on new connections until every worker accepted some (bounded).
        middle = (await status(second, http))["workers"]
        coverage = received(start, middle, served)
        rounds = 0
        while after > 1 and min(coverage.values()) == 0 and rounds < COVERAGE_ROUNDS:
            rounds += 1
            replies = await bounded((c.via(http).count() for c in counted), CONCURRENCY)
            for item, reply in zip(counted, replies, strict=True):
                assert reply.status == 200, reply
                assert reply.json["count"] == item.count, reply
                assert reply.json["worker"] == holder[item.session.id], reply
                served[reply.json["worker"]] += 1
            coverage = received(start, (await status(second, http))["workers"], served)
        end = (await status(second, http))["workers"]

    assert set(coverage) == live
    idle = [w for w, n in coverage.items() if n == 0]
    assert not idle, f"workers that accepted no request after {rounds} extra rounds: {coverage}"
    assert set(holder.values()) <= live

    # The replies' worker is the holder: it holds exactly the sessions that answer from it.
    holds = Counter(holder.values())
    assert {w["id"]: w["sessions"] for w in end} == {w: holds.get(w, 0) for w in live}
    # Placement (SPEC 5.7): whatever the counts before and after, the restored sessions
    # spread over every worker within one, and an old owner's sessions are split over
    # few new workers (one contiguous run of placement's order each).
    loads = [holds.get(w, 0) for w in live]
    assert max(loads) - min(loads) <= 1, loads
    groups: defaultdict[str | None, set[str]] = defaultdict(set)
    for session_id, worker in holder.items():
        groups[old_owner[session_id]].add(worker)
    pairs = sum(len(targets) for targets in groups.values())
    assert pairs <= len(groups) + after - 1, groups


# 1b. A chain of rescales spreads the sessions every time (issue #13) -----------------------

SPREAD_SESSIONS = 1_200


@pytest.mark.timeout(240)
async def test_a_chain_of_rescales_spreads_the_sessions_over_every_worker_each_time(
    serve: Serve, tmp_path: Path
) -> None:
    """1,200 sessions at 4 workers, then 3, 5 and 2: each time checkpointed, stopped
    gracefully and restored with `--restore latest`, every count continues, and the
    status' per-worker session counts differ by at most one (SPEC 5.7)."""
    root = tmp_path / "ckpt"
    server = serve(COUNTER_APP, 4, *ckpt_args(root))
    async with Http(server.url, limit=CONCURRENCY) as http:
        counted = await seeded(http, "spread", SPREAD_SESSIONS)
    for count in (3, 5, 2):
        summary = await take_checkpoint(server, root)
        assert summary["servers"][0]["records"] == {"sessions": SPREAD_SESSIONS, "episodes": 0}
        server.terminate()
        assert await server.exit_code() == 0
        server = serve(COUNTER_APP, count, *restore_args(root))
        async with Http(server.url, limit=CONCURRENCY) as http:
            restored = (await status(server, http))["workers"]
            held = {w["id"]: w["sessions"] for w in restored}
            assert len(held) == count, restored
            assert sum(held.values()) == SPREAD_SESSIONS, held
            assert max(held.values()) - min(held.values()) <= 1, f"onto {count}: {held}"

            problems = await read_and_count_on(http, counted)
            assert not problems, f"onto {count}: {len(problems)} went wrong: {problems[:3]}"
            # Each session answered from the worker status says holds it: nothing moved.
            answered = Counter(c.owner for c in counted)
            assert answered == Counter(held), f"onto {count}: {answered} vs {held}"
            after = {w["id"]: w["sessions"] for w in (await status(server, http))["workers"]}
            assert after == held


# 2. Two crashes in a row ---------------------------------------------------------------------


async def test_two_crashes_in_a_row_keep_every_session_and_the_owner_alias_chain(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, 1, *ckpt_args(root))
    async with Http(first.url, limit=CONCURRENCY) as http:
        counted = await seeded(http, "twice")
        [single] = [w["id"] for w in (await status(first, http))["workers"]]
    await take_checkpoint(first, root)
    await first.crash()

    # Restore onto 3; checkpoint again before any session was touched.
    middle = serve(COUNTER_APP, 3, *restore_args(root))
    async with Http(middle.url) as http:
        workers = (await status(middle, http))["workers"]
    three = [w["id"] for w in workers]
    assert len(three) == 3
    assert [w["claims"] for w in workers] == [0, 0, 0], "no session was touched yet"
    assert sum(w["sessions"] for w in workers) == SESSIONS
    summary = await take_checkpoint(middle, root)
    assert summary["servers"][0]["records"] == {"sessions": SESSIONS, "episodes": 0}
    await middle.crash()

    last = serve(COUNTER_APP, 2, *restore_args(root))
    async with Http(last.url, limit=CONCURRENCY) as http:
        problems = await read_and_count_on(http, counted)
        assert not problems, f"{len(problems)} sessions went wrong, e.g. {problems[:3]}"

        # x-tether-worker with any old worker ID reaches a live worker (SPEC 4.2, 5.7).
        async def named(worker: str) -> Reply:
            return await http.request("GET", "/health", headers={"x-tether-worker": worker})

        unknown = await named(secrets.token_hex(16))
        assert (unknown.status, unknown.code) == (410, "worker_gone"), unknown
        for worker in three:  # one restore back
            reply = await named(worker)
            assert reply.status == 200, f"{worker} (one restore back): {reply}"
        reply = await named(single)  # two restores back
        assert reply.status == 200, f"{single} (the one worker two restores back): {reply}"


# 6. Old cookies during a restore at start-up ------------------------------------------------


async def test_old_cookies_during_restore_latest_park_or_wait_never_meet_empty_state(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, 2, *ckpt_args(root))
    async with Http(first.url, limit=CONCURRENCY) as http:
        counted = await seeded(http, "early")
    await take_checkpoint(first, root)
    await first.crash()

    port = free_port()
    starting = asyncio.ensure_future(
        asyncio.to_thread(serve, COUNTER_APP, 4, *restore_args(root, "--port", str(port)))
    )
    seen: Counter[str] = Counter()
    wrong: list[str] = []
    try:
        async with Http(f"http://127.0.0.1:{port}", limit=20) as http:

            async def accepts() -> bool:
                if starting.done():
                    return True
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    return False
                writer.close()
                await writer.wait_closed()
                return True

            await eventually(accepts, 30, f"port {port} accepts connections")

            async def one(item: Counted) -> None:
                try:
                    reply = await item.via(http).count()
                except aiohttp.ClientError as error:
                    wrong.append(f"{item.session.id}: {error!r}")
                    return
                if reply.status == 200 and reply.json["count"] == item.count:
                    seen["right"] += 1
                elif (reply.status, reply.code) == (503, "checkpoint_parked"):
                    seen["parked"] += 1
                else:
                    wrong.append(f"{item.session.id} should read {item.count}: {reply}")

            batch = 0
            while not starting.done():
                picked = counted[batch % 10 :: 10]
                batch += 1
                await bounded((one(item) for item in picked), 20)
            server = await starting
            assert server.url == f"http://127.0.0.1:{port}"
            done_before = seen["right"]
            await bounded((one(item) for item in counted), 20)
    finally:
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)

    assert not wrong, f"{len(wrong)} replies during the restore were wrong: {wrong[:3]}"
    assert seen["parked"] > 0, f"no request arrived during the restore ({seen})"
    assert seen["right"] - done_before == SESSIONS


# 7. A worker registering after the restore ----------------------------------------------------


async def test_a_worker_registering_after_a_restore_routes_old_cookies_from_its_first_request(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, 4, *ckpt_args(root))
    async with Http(first.url, limit=CONCURRENCY) as http:
        counted = await seeded(http, "late")
    await take_checkpoint(first, root)
    await first.crash()

    server = serve(COUNTER_APP, 4, *restore_args(root))
    async with Http(server.url, limit=CONCURRENCY) as http:
        workers = (await status(server, http))["workers"]
        assert [w["claims"] for w in workers] == [0] * 4
        victim = max(workers, key=lambda w: w["sessions"])
        os.kill(victim["pid"], signal.SIGKILL)
        after = await live_workers(server, http, 4, without=victim["id"])
        [newcomer] = [w for w in after["workers"] if w["id"] not in by_id(workers)]
        assert newcomer["sessions"] == 0

        # The first request of each session since the restore: no claim exists, so every
        # router (the newcomer's too) must find it in the placed-session table.
        replies = await bounded((c.via(http).count() for c in counted), CONCURRENCY)
        final = await status(server, http)
    holders = {w["id"] for w in workers} - {victim["id"]}
    gone, right, other = 0, 0, []
    for item, reply in zip(counted, replies, strict=True):
        if (reply.status, reply.code) == (410, "session_gone"):
            gone += 1
        elif reply.status == 200 and reply.json["count"] == item.count:
            right += 1
            if reply.json["worker"] not in holders:
                other.append(reply)
        else:
            other.append(reply)
    assert not other, f"{len(other)} wrong replies, e.g. {other[:3]}"
    # SPEC 3: the dead worker's sessions answer 410; every other one reads right, from
    # the worker the restore placed it on.
    assert (gone, right) == (victim["sessions"], SESSIONS - victim["sessions"])
    row = by_id(final["workers"])[newcomer["id"]]
    assert row["forwarded"] > 0, f"no first request landed on the newcomer: {final['workers']}"

    async with Http(server.url, limit=CONCURRENCY) as http:
        alive = [c for c, r in zip(counted, replies, strict=True) if r.status == 200]
        problems = await read_and_count_on(http, alive)
    assert not problems, f"{len(problems)} sessions went wrong, e.g. {problems[:3]}"
