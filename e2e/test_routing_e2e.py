"""Routing through a real `tether serve`: every request of a session reaches the worker
that holds it, whichever worker accepted its connection (SPEC 3, 4.2, 4.5)."""

from __future__ import annotations

import os
import secrets
import signal
from collections import Counter, defaultdict

import pytest

from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    CounterSession,
    Http,
    alive,
    bounded,
    eventually,
    failed,
    run_episode,
)

pytestmark = pytest.mark.e2e

SESSIONS = 500


async def test_500_concurrent_sessions_on_4_workers_all_count_to_5(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    run = secrets.token_hex(4)
    async with Http(server.url) as http:
        episodes = await bounded(
            run_episode(CounterSession(http, f"c4-{run}-{i}")) for i in range(SESSIONS)
        )
        status = await server.status(http)

    wrong = failed(episodes)
    assert not wrong, f"{len(wrong)} of {SESSIONS} sessions went wrong, e.g. {wrong[:3]}"
    split = [e for e in episodes if len(e.workers) != 1]
    assert not split, f"sessions served by more than one worker: {split[:3]}"
    holders = Counter(worker for e in episodes for worker in e.workers)
    assert len(holders) >= 3, f"sessions were held by too few workers: {holders}"
    workers = status["workers"]
    assert len(workers) == 4
    assert set(holders) <= {w["id"] for w in workers}
    not_forwarded_to = [w for w in workers if not w["served_forwarded"]]
    assert not not_forwarded_to, f"workers that served no forwarded request: {workers}"
    assert sum(w["forwarded"] for w in workers) == sum(w["served_forwarded"] for w in workers)


async def test_500_sessions_on_1_worker_leave_no_claim_and_no_private_socket(
    serve: Serve,
) -> None:
    server = serve(COUNTER_APP, 1)
    run = secrets.token_hex(4)
    async with Http(server.url) as http:
        held_open = CounterSession(http, f"open-{run}")
        assert (await held_open.seed()).status == 200
        episodes = await bounded(
            run_episode(CounterSession(http, f"c1-{run}-{i}")) for i in range(SESSIONS)
        )
        assert (await held_open.count()).json["count"] == 0

        wrong = failed(episodes)
        assert not wrong, f"{len(wrong)} of {SESSIONS} sessions went wrong, e.g. {wrong[:3]}"
        assert server.runtime_dir.is_dir(), "the server is still running"
        assert server.claim_files() == []
        assert server.sockets() == []
        (worker,) = (await server.status(http))["workers"]
        assert worker["forwarded"] == worker["served_forwarded"] == 0


async def test_sigkill_of_a_worker_answers_410_for_exactly_its_sessions(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    run = secrets.token_hex(4)
    async with Http(server.url) as http:
        before = {w["id"]: w["pid"] for w in (await server.status(http))["workers"]}
        assert len(before) == 4
        sessions: list[CounterSession] = []
        for batch in range(10):  # until at least two workers hold sessions
            more = [CounterSession(http, f"k-{run}-{batch}-{i}") for i in range(100)]
            seeds = await bounded(s.seed() for s in more)
            assert all(r.status == 200 for r in seeds), [r for r in seeds if r.status != 200]
            sessions += more
            if len({s.worker for s in sessions}) >= 2:
                break
        increments = await bounded(s.increment() for s in sessions)
        assert all(r.status == 200 and r.json["count"] == 1 for r in increments)

        by_worker: dict[str, list[CounterSession]] = defaultdict(list)
        for session in sessions:
            assert session.worker is not None
            by_worker[session.worker].append(session)
        victim = max(by_worker, key=lambda w: len(by_worker[w]))
        doomed = by_worker[victim]
        survivors = [s for s in sessions if s.worker != victim]
        assert doomed and survivors

        os.kill(before[victim], signal.SIGKILL)
        await eventually(lambda: not alive(before[victim]), 10, "the killed worker is gone")

        # Every request of the dead worker's sessions, its close included: 410.
        gone = await bounded(
            request
            for session in doomed
            for request in (
                session.increment(),
                session.count(),
                session.verify(),
                session.close(),
                session.close(with_cookie=False),
            )
        )
        wrong = [r for r in gone if r.status != 410 or r.code != "session_gone"]
        assert not wrong, f"{len(wrong)} of {len(gone)} requests were not 410: {wrong[:5]}"

        # Every other session goes on as if nothing happened.
        counts = await bounded(s.increment() for s in survivors)
        wrong = [r for r in counts if r.status != 200 or r.json["count"] != 2]
        assert not wrong, wrong[:5]

        # A replacement registers under a new ID and serves new sessions.
        async def replaced() -> str | None:
            ids = {w["id"] for w in (await server.status(http))["workers"]}
            new = ids - set(before)
            return new.pop() if len(ids) == 4 and victim not in ids and len(new) == 1 else None

        newcomer = await eventually(replaced, 30, "a replacement worker registers")
        fresh: list[CounterSession] = []
        for batch in range(10):
            more = [CounterSession(http, f"n-{run}-{batch}-{i}") for i in range(40)]
            seeded = await bounded(s.seed() for s in more)
            assert all(r.status == 200 for r in seeded), [r for r in seeded if r.status != 200]
            fresh += more
            if any(s.worker == newcomer for s in fresh):
                break
        assert any(s.worker == newcomer for s in fresh), "the new worker got no session"

        # A burst on new connections to live sessions: no 410, no lost increment.
        live = survivors + fresh
        expected = {s.id: (2 if s in survivors else 0) for s in live}
        burst = [live[i % len(live)] for i in range(2000)]
        for session in burst:
            expected[session.id] += 1
        replies = await bounded(s.increment() for s in burst)
        wrong = [r for r in replies if r.status != 200]
        assert not wrong, f"{len(wrong)} of 2000 burst requests failed: {wrong[:5]}"
        finals = await bounded(s.count() for s in live)
        assert {r.json["session_id"]: r.json["count"] for r in finals} == expected
        ends = await bounded(s.close() for s in live)
        assert all(r.status == 200 for r in ends)
