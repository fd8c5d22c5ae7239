"""Claim lifetimes with an injected clock: no sockets, no sleeps."""

from __future__ import annotations

import os

import pytest

from tether.routing.claims import FileClaimStore, WorkerClaims
from tether.routing.lifetimes import Lifetimes
from tether.routing.types import SessionId, WorkerId

ME = WorkerId("a" * 32)
S = SessionId("s1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(
    short_tmp: object, window: float = 10.0, holder: object = None
) -> tuple[WorkerClaims, Clock]:
    clock = Clock()
    store = FileClaimStore(f"{short_tmp}/claims")
    return WorkerClaims(store, ME, Lifetimes(window, holder), clock), clock  # type: ignore[arg-type]


async def serve(claims: WorkerClaims, role: str, ok: bool = True, sid: SessionId = S) -> None:
    await claims.claim(sid)
    claims.begin(sid)
    claims.end(sid, role, ok)  # type: ignore[arg-type]


async def test_open_session_keeps_its_claim_past_any_window(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "start")
    clock.now += 10_000
    assert await claims.sweep() == []
    assert await claims.store.claimant(S) == ME


async def test_closed_session_loses_its_claim_one_window_after_its_last_request(
    short_tmp: object,
) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "start")
    clock.now += 5
    await serve(claims, "end")
    clock.now += 9.9
    assert await claims.sweep() == []
    clock.now += 0.2
    assert await claims.sweep() == [S]
    assert await claims.store.claimant(S) is None
    assert not claims.mine(S)


async def test_a_later_request_pushes_the_window_out(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "end")
    clock.now += 8
    await serve(claims, "other")
    clock.now += 8
    assert await claims.sweep() == []
    clock.now += 3
    assert await claims.sweep() == [S]


async def test_failed_seed_keeps_its_claim_only_for_the_window(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "start", ok=False)
    clock.now += 11
    assert await claims.sweep() == [S]


async def test_never_seeded_session_loses_its_claim_after_the_window(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "other")
    clock.now += 11
    assert await claims.sweep() == [S]


async def test_failed_close_of_an_open_session_leaves_it_open(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "start")
    await serve(claims, "end", ok=False)
    clock.now += 100
    assert await claims.sweep() == []


async def test_ended_closes_an_open_session(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "start")
    claims.ended(S)
    clock.now += 11
    assert await claims.sweep() == [S]


async def test_a_session_the_app_ends_while_its_start_route_runs_is_not_opened_by_it(
    short_tmp: object,
) -> None:
    """`ended` called from a seed's handler (a one-shot session), or while a seed runs:
    the seed's end does not open the session again, which would keep its claim until an
    end route; a later seed opens it as usual."""
    claims, clock = make(short_tmp)
    await claims.claim(S)
    claims.begin(S)
    claims.ended(S)
    claims.end(S, "start", True)
    clock.now += 11
    assert await claims.sweep() == [S]

    await serve(claims, "start")
    clock.now += 100
    assert await claims.sweep() == []


async def test_a_release_that_fails_in_a_sweep_is_tried_again_with_those_after_it(
    short_tmp: object,
) -> None:
    """A claim file that cannot be read or removed now (here: something else at its
    path; a full file table would do the same) fails the sweep, and that claim and every
    one after it are tried again a window later, not forgotten with their claims kept."""
    claims, clock = make(short_tmp)
    first, *later = (SessionId(f"s{n}") for n in range(3))
    await serve(claims, "other", sid=first)
    clock.now += 1  # its deadline comes first
    for sid in later:
        await serve(claims, "other", sid=sid)
    path = claims.store._path(first)  # type: ignore[attr-defined]
    os.unlink(path)
    os.mkdir(path)
    clock.now += 11
    with pytest.raises(IsADirectoryError):
        await claims.sweep()
    os.rmdir(path)
    assert all(claims.mine(sid) for sid in (first, *later))

    clock.now += 11
    assert sorted(await claims.sweep()) == [first, *later]


async def test_rotated_session_keeps_its_lifetime_and_its_old_id_ends_as_closed(
    short_tmp: object,
) -> None:
    new = SessionId("s2")
    for opened in (True, False):
        claims, clock = make(short_tmp, window=10.0)
        await serve(claims, "start" if opened else "other")
        await claims.claim(new)
        claims.begin(new)
        clock.now += 5
        claims.end(new, "other", True)  # as the router records the rotating request
        claims.renamed(S, new)
        clock.now += 9.9
        assert await claims.sweep() == []
        clock.now += 0.2
        assert await claims.sweep() == ([S] if opened else [S, new])
        clock.now += 10_000
        assert await claims.sweep() == []
        assert claims.mine(new) is opened
        await claims.drop(new)


async def test_claim_is_not_released_while_a_request_is_in_progress(short_tmp: object) -> None:
    claims, clock = make(short_tmp)
    await serve(claims, "end")
    claims.begin(S)
    clock.now += 100
    assert await claims.sweep() == []
    claims.end(S, "other", True)
    assert await claims.sweep() == []
    clock.now += 11
    assert await claims.sweep() == [S]


async def test_holder_keeps_the_claim_exactly_while_it_holds(short_tmp: object) -> None:
    held: set[str] = {S}

    class Holder:
        def holds(self, session_id: SessionId) -> bool:
            return session_id in held

    claims, clock = make(short_tmp, holder=Holder())
    await serve(claims, "other")
    clock.now += 10_000
    assert await claims.sweep() == []
    held.clear()
    claims.begin(S)
    assert await claims.sweep() == []  # in progress
    claims.end(S, "other", True)
    assert await claims.sweep() == [S]


def test_many_sessions_expire_in_deadline_order() -> None:
    lifetimes = Lifetimes(10.0)
    for i in range(1000):
        lifetimes.served(SessionId(f"s{i}"), "end", True, now=float(i))
    due = lifetimes.due(505.0, set())
    assert due == [SessionId(f"s{i}") for i in range(496)]
    assert len(lifetimes) == 504


def test_a_session_served_many_times_keeps_one_queued_deadline_and_expires_at_the_last() -> None:
    lifetimes = Lifetimes(10.0)
    for i in range(10_000):
        lifetimes.served(S, "other", True, now=i / 100)
    assert lifetimes.queued() == 1
    assert lifetimes.due(50.0, set()) == []  # its first deadline came up: queued again
    assert lifetimes.queued() == 1
    assert lifetimes.due(109.98, set()) == []
    assert lifetimes.due(109.99, set()) == [S]
    assert lifetimes.queued() == 0 and len(lifetimes) == 0


def test_a_session_opened_after_its_deadline_was_queued_is_never_due() -> None:
    lifetimes = Lifetimes(10.0)
    lifetimes.served(S, "other", True, now=0.0)
    lifetimes.served(S, "start", True, now=1.0)
    assert lifetimes.due(1_000.0, set()) == []
    lifetimes.served(S, "end", True, now=2_000.0)
    assert lifetimes.due(2_009.0, set()) == []
    assert lifetimes.due(2_010.0, set()) == [S]


def test_with_a_holder_no_deadline_is_queued() -> None:
    class Holder:
        def holds(self, session_id: SessionId) -> bool:
            return False

    lifetimes = Lifetimes(10.0, Holder())
    for i in range(1_000):
        lifetimes.served(SessionId(f"s{i}"), "other", True, now=float(i))
    assert lifetimes.queued() == 0


def test_a_session_forgotten_and_served_again_expires_one_window_after_its_last_request() -> None:
    lifetimes = Lifetimes(10.0)
    lifetimes.served(S, "other", True, now=0.0)
    lifetimes.forget(S)
    lifetimes.served(S, "other", True, now=5.0)  # its first entry is still queued
    assert lifetimes.due(10.0, set()) == []  # that entry came up: queued again for 15
    assert lifetimes.queued() == 1
    assert lifetimes.due(15.0, set()) == [S]


async def test_a_restored_session_keeps_the_lifetime_it_was_checkpointed_with(
    short_tmp: object,
) -> None:
    """Adopted at a restore: one that was open stays held past any window; one that was
    not ends one close window after the restore, unless a request comes."""
    claims, clock = make(short_tmp)
    opened, closed = SessionId("was-open"), SessionId("was-closed")
    taken_over: list[object] = []

    async def take_over(
        worker: WorkerId, sessions: list[tuple[SessionId, WorkerId | None]]
    ) -> dict[SessionId, WorkerId | None]:
        taken_over.append((worker, sessions))
        for session_id, _ in sessions:
            await claims.store.claim(session_id, worker)
        return {}  # nobody else holds them

    assert await claims.adopt([(opened, None, True), (closed, ME, False)], take_over) == {}

    assert taken_over == [(ME, [(opened, None), (closed, ME)])]
    clock.now += 10.1
    assert await claims.sweep() == [closed]
    clock.now += 10_000
    assert await claims.sweep() == []
    assert claims.mine(opened) and await claims.store.claimant(opened) == ME
