"""Placement as a pure function: properties that must hold for any input."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from tether.coordinator.placement import place
from tether.routing.types import SessionId, WorkerId

worker_ids = st.text("0123456789abcdef", min_size=32, max_size=32).map(WorkerId)
owners = st.one_of(st.none(), st.sampled_from([WorkerId(c * 32) for c in "abcdef"]))
session_lists = st.lists(
    st.tuples(st.text(min_size=1, max_size=8).map(SessionId), owners),
    unique_by=lambda pair: pair[0],
    max_size=60,
)


@given(session_lists, st.lists(worker_ids, min_size=1, max_size=6, unique=True))
def test_every_session_is_placed_exactly_once_on_a_live_worker(
    sessions: list[tuple[SessionId, WorkerId | None]], workers: list[WorkerId]
) -> None:
    placement = place(sessions, workers)
    assert set(placement.sessions) == {sid for sid, _ in sessions}
    assert set(placement.sessions.values()) <= set(workers)


@given(session_lists, st.lists(worker_ids, min_size=1, max_size=6, unique=True))
def test_all_sessions_of_one_owner_land_on_one_worker(
    sessions: list[tuple[SessionId, WorkerId | None]], workers: list[WorkerId]
) -> None:
    placement = place(sessions, workers)
    for owner in {o for _, o in sessions if o is not None}:
        targets = {placement.sessions[sid] for sid, o in sessions if o == owner}
        assert targets == {placement.aliases[owner]}


@given(session_lists, st.lists(worker_ids, min_size=1, max_size=6, unique=True), st.randoms())
def test_the_same_output_for_any_input_order(
    sessions: list[tuple[SessionId, WorkerId | None]], workers: list[WorkerId], rnd: random.Random
) -> None:
    shuffled_sessions, shuffled_workers = list(sessions), list(workers)
    rnd.shuffle(shuffled_sessions)
    rnd.shuffle(shuffled_workers)
    assert place(sessions, workers) == place(shuffled_sessions, shuffled_workers)


@given(st.lists(st.text(min_size=1, max_size=8).map(SessionId), unique=True, max_size=80),
       st.lists(worker_ids, min_size=1, max_size=6, unique=True))
def test_ownerless_sessions_spread_within_one(
    sessions: list[SessionId], workers: list[WorkerId]
) -> None:
    placement = place([(sid, None) for sid in sessions], workers)
    counts = [list(placement.sessions.values()).count(w) for w in workers]
    assert max(counts) - min(counts) <= 1


@given(session_lists, st.lists(worker_ids, min_size=1, max_size=6, unique=True))
def test_spread_of_owner_groups_is_at_most_the_largest_group(
    sessions: list[tuple[SessionId, WorkerId | None]], workers: list[WorkerId]
) -> None:
    owned = [(sid, o) for sid, o in sessions if o is not None]
    placement = place(owned, workers)
    counts = [list(placement.sessions.values()).count(w) for w in workers]
    largest = max((sum(1 for _, o in owned if o == g) for g in {o for _, o in owned}), default=0)
    assert max(counts) - min(counts) <= largest


def test_owners_without_sessions_and_inherited_aliases_resolve_to_live_workers() -> None:
    a, b = WorkerId("a" * 32), WorkerId("b" * 32)
    old, idle, older = WorkerId("1" * 32), WorkerId("2" * 32), WorkerId("3" * 32)
    placement = place([(SessionId("s"), old)], [a, b], known=[old, idle], inherited={older: old})
    assert placement.aliases[old] == placement.sessions[SessionId("s")]
    assert placement.aliases[idle] in (a, b)
    assert placement.aliases[older] == placement.aliases[old]
