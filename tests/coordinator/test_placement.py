"""Placement as a pure function (SPEC 5.7): properties that must hold for any input, and
the rescales of issue #13 that grouping by old owner got wrong."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.coordinator.placement import STRETCH_BYTES, Placement, place, stretch_rank
from tether.routing.types import SessionId, WorkerId

Sessions = list[tuple[SessionId, WorkerId | None, int]]

worker_ids = st.text("0123456789abcdef", min_size=32, max_size=32).map(WorkerId)
live_workers = st.lists(worker_ids, min_size=1, max_size=8, unique=True)
OLD = [WorkerId(c * 32) for c in "abcdef"]
owners = st.one_of(st.none(), st.sampled_from(OLD))
# Offsets from a few stretches, so that stretches hold several sessions.
offsets = st.integers(0, 6 * STRETCH_BYTES)
session_lists = st.lists(
    st.tuples(st.text(min_size=1, max_size=8).map(SessionId), owners, offsets),
    unique_by=lambda entry: entry[0],
    max_size=200,
)
older_ids = st.sampled_from([WorkerId(c * 32) for c in "0123456789"])
inherited_maps = st.dictionaries(older_ids, st.sampled_from(OLD), max_size=5)


def counts(placement: Placement, workers: list[WorkerId]) -> list[int]:
    """Sessions per live worker, zeros included."""
    held = Counter(placement.sessions.values())
    return [held[w] for w in workers]


def segment(owner: str | None, count: int, record_bytes: int = 2200) -> Sessions:
    """`count` sessions of one old owner, back to back in its segment as an export
    writes them."""
    tag = (owner or "none")[:4]
    return [(SessionId(f"{tag}-{n}"), WorkerId(owner) if owner else None, n * record_bytes)
            for n in range(count)]


def live(count: int, first: int = 0) -> list[WorkerId]:
    return sorted(WorkerId(f"{n:x}" * 32) for n in range(first, first + count))


# Properties --------------------------------------------------------------------------


@given(session_lists, live_workers)
def test_every_session_is_placed_exactly_once_on_a_live_worker(
    sessions: Sessions, workers: list[WorkerId]
) -> None:
    placement = place(sessions, workers)
    assert set(placement.sessions) == {sid for sid, _, _ in sessions}
    assert set(placement.sessions.values()) <= set(workers)


@given(session_lists, live_workers)
def test_sessions_per_worker_differ_by_at_most_one_for_any_mix_of_owners(
    sessions: Sessions, workers: list[WorkerId]
) -> None:
    found = counts(place(sessions, workers), workers)
    assert max(found) - min(found) <= 1, found


@given(session_lists, live_workers, st.lists(st.sampled_from(OLD)), inherited_maps,
       st.randoms())
def test_the_same_placement_and_aliases_for_any_input_order(
    sessions: Sessions,
    workers: list[WorkerId],
    known: list[WorkerId],
    inherited: dict[WorkerId, WorkerId],
    rnd: random.Random,
) -> None:
    entries, named, old, chains = (
        list(sessions), list(workers), list(known), list(inherited.items())
    )
    rnd.shuffle(entries)
    rnd.shuffle(named)
    rnd.shuffle(old)
    rnd.shuffle(chains)
    again = place(entries, named, old, dict(chains))
    assert again == place(sessions, workers, known, inherited)


@given(session_lists, live_workers, st.lists(st.sampled_from(OLD)), inherited_maps)
def test_aliases_cover_every_owner_known_worker_and_inherited_alias_and_point_at_live_workers(
    sessions: Sessions,
    workers: list[WorkerId],
    known: list[WorkerId],
    inherited: dict[WorkerId, WorkerId],
) -> None:
    placement = place(sessions, workers, known, inherited)
    owners_seen = {o for _, o, _ in sessions if o is not None}
    expected = owners_seen | set(known) | set(inherited) | set(inherited.values())
    assert set(placement.aliases) == expected
    assert set(placement.aliases.values()) <= set(workers)
    for older, old in inherited.items():
        if older not in owners_seen and older not in known:
            assert placement.aliases[older] == placement.aliases[old]  # the chain


@given(session_lists, live_workers)
def test_each_old_owner_points_at_the_worker_holding_most_of_its_sessions(
    sessions: Sessions, workers: list[WorkerId]
) -> None:
    placement = place(sessions, workers)
    for owner in {o for _, o, _ in sessions if o is not None}:
        held = Counter(placement.sessions[sid] for sid, o, _ in sessions if o == owner)
        most = max(held.values())
        assert placement.aliases[owner] == min(w for w, n in held.items() if n == most)


@given(session_lists, live_workers)
def test_each_worker_takes_whole_old_owners_and_at_most_two_partial_ones(
    sessions: Sessions, workers: list[WorkerId]
) -> None:
    """What keeps restore reads few: an old owner is one segment, and N owners over M
    workers make at most N + M - 1 (owner, worker) pairs, each a segment read."""
    placement = place(sessions, workers)
    pairs = {(o, placement.sessions[sid]) for sid, o, _ in sessions}
    owners_seen = {o for _, o, _ in sessions}
    assert len(pairs) <= len(owners_seen) + len(workers) - 1 or not sessions


@given(st.integers(1, 400), st.integers(1, 8), st.sampled_from([700, 2200, 9000]))
def test_a_workers_share_of_a_segment_is_whole_stretches_read_in_one_piece_each(
    count: int, workers_count: int, record_bytes: int
) -> None:
    """Within each 1 MiB stretch of a segment a worker holds one contiguous range of
    records (all of them, or a piece at the end of its run), so it reads its share in
    at most one piece per stretch it holds, never one read per record."""
    sessions = segment("a" * 32, count, record_bytes)
    placement = place(sessions, live(workers_count))
    in_stretch: defaultdict[int, list[WorkerId]] = defaultdict(list)
    for sid, _, offset in sessions:  # in file order
        in_stretch[offset // STRETCH_BYTES].append(placement.sessions[sid])
    for holders in in_stretch.values():
        pieces = [w for n, w in enumerate(holders) if n == 0 or holders[n - 1] != w]
        assert len(pieces) == len(set(pieces)), f"a worker's records are scattered: {holders}"


# The rescales of issue #13 --------------------------------------------------------------


@pytest.mark.parametrize(("old", "new"), [(2, 4), (4, 3), (4, 6), (3, 5), (1, 4), (6, 2)])
def test_a_rescale_leaves_no_worker_empty_and_spreads_within_one(old: int, new: int) -> None:
    """2 → 4 with grouping by owner left two workers empty; 4 → 3 loaded them 2:1:1."""
    sessions = [s for o in live(old, first=8) for s in segment(o, 300)]
    workers = live(new)
    found = counts(place(sessions, workers), workers)
    assert min(found) > 0, found
    assert max(found) - min(found) <= 1, found


def test_a_rescale_onto_as_many_workers_keeps_every_equal_owner_whole() -> None:
    old, workers = live(4), live(4, first=10)
    sessions = [s for o in old for s in segment(o, 250)]
    placement = place(sessions, workers)
    for owner in old:
        targets = {placement.sessions[sid] for sid, o, _ in sessions if o == owner}
        assert targets == {placement.aliases[owner]}
    assert sorted(placement.aliases.values()) == workers


def test_a_split_owner_is_dealt_out_by_stretch_not_oldest_first() -> None:
    """A one-worker checkpoint restored onto 2: each worker gets stretches from all over
    the segment (the hash), not the older and the newer half of it."""
    sessions = segment(None, 4000)  # 8.4 MiB: 9 stretches
    workers = live(2)
    placement = place(sessions, workers)
    first = {offset // STRETCH_BYTES for sid, _, offset in sessions
             if placement.sessions[sid] == workers[0]}
    assert first != set(range(len(first))), "the first worker got the oldest stretches"
    assert counts(placement, workers) == [2000, 2000]


def test_ownerless_and_owned_sessions_share_out_together() -> None:
    sessions = segment(None, 7) + segment("a" * 32, 10)
    workers = live(3)
    assert counts(place(sessions, workers), workers) == [6, 6, 5]


def test_owners_without_sessions_go_round_robin_and_inherited_aliases_chain() -> None:
    workers = live(2)
    busy, idle = WorkerId("a" * 32), [WorkerId(c * 32) for c in "bcd"]
    older = WorkerId("e" * 32)
    placement = place(segment(busy, 4), workers, known=[busy, *idle],
                      inherited={older: idle[1]})
    assert [placement.aliases[w] for w in idle] == [workers[0], workers[1], workers[0]]
    assert placement.aliases[older] == placement.aliases[idle[1]]
    assert placement.aliases[busy] == workers[0]  # two each: the tie goes to the lower ID


def test_a_session_id_given_twice_is_refused() -> None:
    twice = [(SessionId("s"), WorkerId("a" * 32), 0), (SessionId("s"), WorkerId("b" * 32), 0)]
    with pytest.raises(ValueError, match="twice"):
        place(twice, live(2))


def test_placement_needs_a_live_worker() -> None:
    with pytest.raises(ValueError, match="live worker"):
        place(segment("a" * 32, 1), [])


def test_the_stretch_order_is_a_fixed_hash() -> None:
    """Pinned (xxh3_64): every process of every run places one index the same way, so
    it is never Python's salted `hash`."""
    assert stretch_rank(None, 0) == 0x4F66E1ADB893D661
    assert stretch_rank(WorkerId("a" * 32), 3) == 0x871943241C24936E
