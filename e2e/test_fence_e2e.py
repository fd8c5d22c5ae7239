"""The counter's session fence through a real 4-worker server (SPEC 4.6, 10): each
request below goes out on a new connection, so it lands on any worker and must be routed
to the one that saw the session."""

from __future__ import annotations

import secrets

import pytest

from e2e.conftest import Serve
from e2e.harness import COUNTER_APP, CounterSession, Http, bounded, session_cookie

pytestmark = pytest.mark.e2e

TRIES = 12  # requests per check, so that several workers receive one


async def test_a_late_seed_after_a_close_gets_409_session_closed(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        session = CounterSession(http, f"late-{secrets.token_hex(4)}")
        assert (await session.seed()).status == 200
        assert (await session.seed()).status == 200, "a seed is idempotent while open"
        assert (await session.close()).status == 200

        late = await bounded(
            [session.seed() for _ in range(TRIES)]
            + [session.seed(cookie=session.cookie) for _ in range(TRIES)]
        )
        wrong = [r for r in late if r.status != 409 or r.code != "session_closed"]
        assert not wrong, wrong[:3]


async def test_a_close_without_cookie_releases_the_state_by_the_bodys_id(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        session = CounterSession(http, f"nocookie-{secrets.token_hex(4)}")
        assert (await session.seed()).status == 200
        assert (await session.increment()).json["count"] == 1

        closed = await session.close(with_cookie=False)
        assert closed.status == 200 and closed.json == {"session_id": session.id, "closed": True}

        after = await bounded(session.count() for _ in range(TRIES))
        wrong = [r for r in after if r.status != 404 or r.code != "session_lost"]
        assert not wrong, wrong[:3]
        assert after[0].json["failure_kind"] == "session_lost"


async def test_a_verify_of_a_lost_session_is_masked(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4)
    async with Http(server.url) as http:
        session = CounterSession(http, f"lost-{secrets.token_hex(4)}")
        assert (await session.seed()).status == 200
        assert (await session.increment()).json["count"] == 1
        assert (await session.close(with_cookie=False)).status == 200
        never = CounterSession(http, f"never-{secrets.token_hex(4)}")
        never.cookie = session_cookie({"session_id": never.id})

        for lost in (session, never):
            for _ in range(TRIES):
                reply = await lost.verify()
                assert reply.status == 200, reply
                assert reply.json["reward"] == 0
                assert reply.json["masked"] is True
                assert reply.json["failure_kind"] == "session_lost"
                assert reply.json["session_id"] == lost.id
                assert "count" not in reply.json
