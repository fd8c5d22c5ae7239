"""Claim lifetimes through a real server with a one-second close window (SPEC 4.4).

The claims of sessions closed *later* serve as clocks: each worker sweeps its expired
claims in deadline order, so once a later-closed session's claim on the same worker is
gone, an earlier session's claim would be gone too had its window started earlier.
"""

from __future__ import annotations

import secrets

import pytest

from e2e.conftest import Serve
from e2e.harness import COUNTER_APP, CounterSession, Http, bounded, eventually

pytestmark = pytest.mark.e2e


async def test_claims_end_a_window_after_close_and_open_sessions_keep_theirs(
    serve: Serve,
) -> None:
    server = serve(COUNTER_APP, 4, "--close-window", "1")
    run = secrets.token_hex(4)
    async with Http(server.url) as http:
        held_open = CounterSession(http, f"open-{run}")
        assert (await held_open.seed()).status == 200
        follows = CounterSession(http, f"follows-{run}")
        assert (await follows.seed()).status == 200
        assert (await follows.increment()).json["count"] == 1
        verified = await follows.verify(close_follows=True)
        assert verified.status == 200, verified
        assert verified.json["count"] == 1 and not verified.json.get("masked")

        closed = [CounterSession(http, f"closed-{run}-{i}") for i in range(50)]
        assert all(r.status == 200 for r in await bounded(s.seed() for s in closed))
        # Clocks on the workers of both sessions under watch (a busy machine may hand
        # all 50 connections to fewer workers): seed and close more until there are.
        for batch in range(20):
            if {held_open.worker, follows.worker} <= {s.worker for s in closed}:
                break
            more = [CounterSession(http, f"closed-{run}-{batch}-{i}") for i in range(10)]
            assert all(r.status == 200 for r in await bounded(s.seed() for s in more))
            closed += more
        assert {held_open.worker, follows.worker} <= {s.worker for s in closed}
        assert all(r.status == 200 for r in await bounded(s.close() for s in closed))
        claims = server.claims()
        assert {s.id for s in closed} <= set(claims), "closed sessions keep their claim a while"

        # Every closed session's claim ends with no further request.
        await eventually(
            lambda: not {s.id for s in closed} & set(server.claims()),
            10,
            "the closed sessions' claims are gone",
        )
        claims = server.claims()
        assert claims.get(held_open.id) == held_open.worker, "an open session keeps its claim"
        # The verify came before every close, yet its session is still open.
        assert claims.get(follows.id) == follows.worker, "close-follows keeps the session open"

        # The close that follows works, and its claim then ends a window later.
        count = await follows.count()
        assert count.status == 200 and count.json["count"] == 1
        ended = await follows.close()
        assert ended.status == 200 and ended.json["closed"] is True
        await eventually(
            lambda: follows.id not in server.claims(), 10, "the verified session's claim is gone"
        )
        assert server.claims() == {held_open.id: held_open.worker}
        assert (await held_open.count()).json["count"] == 0
