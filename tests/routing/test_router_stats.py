"""What each worker's router counts (`RouterStats`), for the main process's
`tether_requests_total{outcome}` and `tether_forward_seconds` (SPEC 9): every decision
is counted where it is made, by the router that makes it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tests.routing.apps import session_app
from tests.routing.conftest import Cluster
from tether.routing.errors import TetherError
from tether.routing.forward import ClaimantUnavailable
from tether.routing.router import FORWARD_BUCKETS, REFUSALS, RouterStats
from tether.routing.types import SessionId


def refused(stats: RouterStats) -> dict[str, int]:
    return {outcome: count for outcome, count in stats.refused.items() if count}


async def test_requests_served_here_count_local_and_a_hop_counts_at_both_ends(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "s"})
        assert (await ca.get("/touch")).status_code == 200  # no cookie: a new session here
    async with b.client(cookies=seeded.cookies) as cb:
        for _ in range(3):
            assert (await cb.get("/touch")).status_code == 200
    sa, sb = a.routing.router.stats, b.routing.router.stats
    assert (sa.local, sa.forwarded, sa.served_forwarded) == (2, 0, 3)
    assert (sb.local, sb.forwarded, sb.served_forwarded) == (0, 3, 0)
    assert refused(sa) == refused(sb) == {}
    # The receiving worker timed each hop; the holder times none.
    assert sum(sb.forward_buckets) == 3 and sb.forward_seconds > 0
    assert sum(sa.forward_buckets) == 0 and sa.forward_seconds == 0
    report = b.routing.metrics()
    assert report["requests"] == {"local": 0, "forwarded": 3, "served_forwarded": 0,
                                  "gone": 0, "conflict": 0, "unavailable": 0, "parked": 0,
                                  "mismatch": 0}
    assert len(report["forward_buckets"]) == len(FORWARD_BUCKETS) + 1
    assert report["forwarded"] == 3 and report["id"] == b.id  # its line in status too


async def test_control_routes_count_under_no_outcome(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    async with a.client() as client:
        await client.get("/_tether/status")
    stats = a.routing.router.stats
    assert (stats.local, stats.forwarded, refused(stats)) == (0, 0, {})


async def test_a_request_for_a_dead_workers_session_counts_gone(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "orphan"})
    await cluster.kill(a)
    async with b.client(cookies=seeded.cookies) as cb:
        assert (await cb.get("/touch")).status_code == 410
    stats = b.routing.router.stats
    assert refused(stats) == {"gone": 1}
    assert (stats.local, stats.forwarded) == (0, 0)


async def test_a_hop_that_finds_its_holder_gone_counts_forwarded_and_gone(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "refused"})
    await a.routing.stop()  # its socket is gone while b still thinks it is live
    async with b.client(cookies=seeded.cookies) as cb:
        assert (await cb.get("/touch")).status_code == 410
    stats = b.routing.router.stats
    assert stats.forwarded == 1 and refused(stats) == {"gone": 1}


async def test_a_hop_that_fails_for_now_counts_forwarded_and_unavailable(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "busy"})

    async def unavailable(*args: Any, **kwargs: Any) -> None:
        raise ClaimantUnavailable("the claimant closed the connection")

    assert b.routing.forwarder is not None
    monkeypatch.setattr(b.routing.forwarder, "forward", unavailable)
    async with b.client(cookies=seeded.cookies) as cb:
        assert (await cb.get("/touch")).status_code == 503
    stats = b.routing.router.stats
    assert stats.forwarded == 1 and refused(stats) == {"unavailable": 1}


async def test_cookie_and_body_naming_two_sessions_counts_mismatch(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    async with a.client() as client:
        await client.post("/seed_session", json={"session_id": "one"})
        other = await client.post("/seed_session", json={"session_id": "two"})
    assert other.status_code == 409
    stats = a.routing.router.stats
    assert stats.local == 1 and refused(stats) == {"mismatch": 1}


class Parked:
    """Admission while a checkpoint is open: every request is refused."""

    def admit(
        self, session_id: SessionId | None, stateless: bool, background: bool
    ) -> Callable[[], None] | None:
        raise TetherError("checkpoint_parked", "a checkpoint is open")

    async def enter(
        self, session_id: SessionId | None, stateless: bool, background: bool
    ) -> Callable[[], None] | None:
        raise TetherError("checkpoint_parked", "a checkpoint is open")


async def test_a_request_admission_refuses_counts_parked_not_local(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "p"})
    a.routing.router.admission = Parked()
    async with a.client(cookies=seeded.cookies) as ca:
        assert (await ca.get("/touch")).status_code == 503
    async with b.client(cookies=seeded.cookies) as cb:
        assert (await cb.get("/touch")).status_code == 503  # parked on its holder
    sa, sb = a.routing.router.stats, b.routing.router.stats
    assert (sa.local, sa.served_forwarded, refused(sa)) == (1, 1, {"parked": 2})
    assert (sb.forwarded, refused(sb)) == (1, {})


async def test_a_claim_lost_at_the_replys_first_byte_counts_local_and_conflict(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "race"})
        assert a.routing.claims is not None
        await a.routing.claims.drop(SessionId("race"))  # as if its window had passed
        async with b.client(cookies=seeded.cookies) as cb:
            pending = asyncio.create_task(cb.get("/touch", params={"gate": "g"}))
            await asyncio.wait_for(b.app.state.entered.setdefault("g", asyncio.Event()).wait(), 5)
            assert await a.routing.claims.claim(SessionId("race")) == a.id  # a claims it meanwhile
            b.app.state.gates.setdefault("g", asyncio.Event()).set()
            assert (await pending).status_code == 409
    stats = b.routing.router.stats
    assert stats.local == 1 and refused(stats) == {"conflict": 1}


def test_every_refusal_counted_is_an_outcome_of_the_spec() -> None:
    assert set(REFUSALS.values()) == {"gone", "conflict", "unavailable", "parked", "mismatch"}
    assert set(RouterStats().refused) == set(REFUSALS.values())


def test_a_forward_lands_in_the_first_bucket_whose_bound_holds_it() -> None:
    stats = RouterStats()
    for seconds in (0.0001, FORWARD_BUCKETS[0], FORWARD_BUCKETS[0] * 1.01, 1e6):
        stats.observe_forward(seconds)
    assert stats.forward_buckets[:2] == [2, 1]
    assert stats.forward_buckets[-1] == 1  # +Inf
    assert sum(stats.forward_buckets) == 4
