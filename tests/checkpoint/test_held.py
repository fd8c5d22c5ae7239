"""Held episode records (SPEC 5.8, 5.9): every call of the pure lifecycle object from every
state a record can be in, as a table, then the sequences that matter. No I/O: records
are known by a made-up location, and reads go through a reader the test supplies."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tether.checkpoint.held import Held, HeldRecords, check_claim, least_loaded
from tether.checkpoint.segments import IndexEntry
from tether.routing.errors import TetherError

ENTRY = IndexEntry("episode", "e", None, 1, 0, 10)
SEGMENT = Path("/nowhere/segment-w0.msgpack")
RECORD = Held("e", 1, SEGMENT, ENTRY)
"""Attempt 1's record of episode `e`, parked in a segment: attempt 2 may claim it."""


def records_in(state: str) -> HeldRecords:
    """A server whose record of `e` is `absent`, `held`, `claimed` or `done` (by w1)."""
    records = HeldRecords()
    if state == "absent":
        return records
    records.hold(RECORD)
    if state in ("claimed", "done"):
        records.claim("e", 2, "w1")
    if state == "done":
        records.done("e", "w1")
    return records


def state_of(records: HeldRecords) -> str:
    """`absent`, `held`, `claimed:<worker>` or `done:<worker>`."""
    held = records.get("e")
    if held is None:
        return "absent"
    if held.claimed_by is None:
        assert not held.done
        return "held"
    return f"{'done' if held.done else 'claimed'}:{held.claimed_by}"


def answer(call: Callable[[HeldRecords], Any], records: HeldRecords) -> Any:
    """What the call returns, or the code of the error it raises."""
    try:
        result = call(records)
    except TetherError as refusal:
        return refusal.code
    if isinstance(result, Held):
        return "record"
    if isinstance(result, list):
        return [getattr(item, "episode_id", item) for item in result]
    return result


def claim(attempt: int, worker: str = "w2") -> Callable[[HeldRecords], Any]:
    return lambda r: r.claim("e", attempt, worker)


def hand_back(worker: str | None) -> Callable[[HeldRecords], Any]:
    return lambda r: r.hand_back(RECORD, worker)


LOST = {"episode_id": "e", "attempt": 2, "worker": "w1"}

TABLE: list[tuple[str, str, Callable[[HeldRecords], Any], Any, str]] = [
    # start, name, call, answer (a return value or an error's code), end state
    ("held", "claim 2", claim(2), "record", "claimed:w2"),
    ("held", "claim 0", claim(0), "stale_attempt", "held"),
    ("held", "claim 1", claim(1), "stale_attempt", "held"),
    ("held", "claim 3", claim(3), "attempt_mismatch", "held"),
    ("claimed", "claim 2", claim(2), "episode_claimed", "claimed:w1"),
    ("claimed", "claim 2 again", claim(2, "w1"), "episode_claimed", "claimed:w1"),
    ("claimed", "claim 1", claim(1), "stale_attempt", "claimed:w1"),
    ("claimed", "claim 3", claim(3), "attempt_mismatch", "claimed:w1"),
    ("done", "claim 2", claim(2), "episode_claimed", "done:w1"),
    ("absent", "claim 2", claim(2), None, "absent"),
    ("held", "done", lambda r: r.done("e", "w1"), None, "held"),
    ("claimed", "done", lambda r: r.done("e", "w1"), None, "done:w1"),
    ("claimed", "done by another", lambda r: r.done("e", "w2"), None, "claimed:w1"),
    ("claimed", "hand back", hand_back("w1"), True, "held"),
    ("claimed", "hand back unchecked", hand_back(None), True, "held"),
    ("claimed", "hand back by another", hand_back("w2"), "episode_claimed", "claimed:w1"),
    ("held", "hand back again", hand_back("w1"), True, "held"),
    ("absent", "hand back", hand_back("w1"), True, "held"),
    ("claimed", "worker_left", lambda r: r.worker_left("w1"), [LOST], "absent"),
    ("claimed", "another left", lambda r: r.worker_left("w2"), [], "claimed:w1"),
    ("done", "worker_left", lambda r: r.worker_left("w1"), [], "done:w1"),
    ("held", "worker_left", lambda r: r.worker_left("w1"), [], "held"),
    ("held", "retire 1", lambda r: r.retire("e", 1), 0, "held"),
    ("held", "retire 2", lambda r: r.retire("e", 2), 1, "absent"),
    ("held", "retire 5", lambda r: r.retire("e", 5), 1, "absent"),
    ("claimed", "retire 2", lambda r: r.retire("e", 2), 0, "claimed:w1"),
    ("done", "retire 2", lambda r: r.retire("e", 2), 0, "absent"),
    ("held", "retire another", lambda r: r.retire("f", 9), 0, "held"),
    ("held", "drop outside {}", lambda r: r.drop_outside(frozenset()), ["e"], "absent"),
    ("held", "drop outside {e}", lambda r: r.drop_outside(frozenset({"e"})), [], "held"),
    ("claimed", "drop outside {}", lambda r: r.drop_outside(frozenset()), [], "claimed:w1"),
    ("done", "drop outside {}", lambda r: r.drop_outside(frozenset()), [], "done:w1"),
    ("held", "carry all", lambda r: r.carry(None), ["e"], "held"),
    ("held", "carry {e}", lambda r: r.carry(frozenset({"e"})), ["e"], "held"),
    ("held", "carry {}", lambda r: r.carry(frozenset()), [], "held"),
    ("claimed", "carry all", lambda r: r.carry(None), [], "claimed:w1"),
    ("done", "carry all", lambda r: r.carry(None), [], "done:w1"),
    ("held", "clear", lambda r: r.clear(), None, "absent"),
    ("claimed", "clear", lambda r: r.clear(), None, "absent"),
]


@pytest.mark.parametrize(
    ("start", "call", "expected", "end"),
    [pytest.param(start, call, expected, end, id=f"{start}-{name}")
     for start, name, call, expected, end in TABLE],
)
def test_each_call_from_each_state(
    start: str, call: Callable[[HeldRecords], Any], expected: Any, end: str
) -> None:
    records = records_in(start)
    assert answer(call, records) == expected
    assert state_of(records) == end


@pytest.mark.parametrize("start", ["absent", "held", "claimed", "done"])
def test_a_refused_call_changes_nothing(start: str) -> None:
    for call in (claim(1), claim(3), hand_back("w9")):
        records = records_in(start)
        before = (state_of(records), records.held_episodes(), dict(records.retired))
        try:
            call(records)
        except TetherError:
            assert (state_of(records), records.held_episodes(), dict(records.retired)) == before


def test_the_refusals_carry_the_details_spec_names() -> None:
    records = records_in("claimed")
    with pytest.raises(TetherError) as claimed:
        records.claim("e", 2, "w2")
    assert claimed.value.detail == {"worker": "w1"}
    with pytest.raises(TetherError) as mismatch:
        records.claim("e", 4, "w2")
    assert mismatch.value.detail["expected"] == 2


@pytest.mark.parametrize(
    ("attempt", "code"),
    [(0, "stale_attempt"), (1, "stale_attempt"), (2, None), (3, "attempt_mismatch")],
)
def test_check_claim_is_the_attempt_rule_alone(attempt: int, code: str | None) -> None:
    assert answer(lambda _: check_claim(RECORD, "e", attempt), HeldRecords()) == code


# Sequences ---------------------------------------------------------------------------


def test_a_handed_back_record_is_claimable_again_by_the_same_attempt_only() -> None:
    records = records_in("claimed")
    assert records.hand_back(RECORD, "w1")
    assert records.held_episodes() == [{"episode_id": "e", "attempt_to_send": 2}]
    with pytest.raises(TetherError, match="attempt_mismatch"):
        records.claim("e", 3, "w2")
    claimed = records.claim("e", 2, "w2")
    assert claimed is not None and claimed.claimed_by == "w2"


def test_a_record_whose_claiming_attempt_was_retired_is_dropped_when_handed_back() -> None:
    records = records_in("claimed")
    assert records.retire("e", 2) == 0  # claimed: its request is being stopped
    assert not records.hand_back(RECORD, "w1")
    assert state_of(records) == "absent"
    with pytest.raises(TetherError, match="stale_attempt"):
        records.claim("e", 2, "w2")
    assert records.claim("e", 3, "w2") is None  # a later attempt starts anew


def test_retire_marks_only_grow_and_forget_drops_them() -> None:
    records = HeldRecords()
    records.retire("e", 3)
    records.retire("e", 1)
    records.inherit({"e": 2, "f": 1})
    assert dict(records.retired) == {"e": 3, "f": 1}
    with pytest.raises(TetherError, match="stale_attempt"):
        records.check_attempt("e", 3)
    records.check_attempt("e", 4)
    assert records.forget(["e", "never"]) == ["e"]
    records.check_attempt("e", 1)


def test_a_lost_record_is_listed_once_with_the_attempt_it_expected() -> None:
    records = records_in("claimed")
    records.worker_left("w1")
    records.worker_left("w1")
    assert records.lost_episodes() == [LOST]
    assert records.held_episodes() == []
    assert records.claim("e", 2, "w2") is None


def test_a_lost_record_is_listed_until_a_retire_covers_its_attempt() -> None:
    records = records_in("claimed")
    records.worker_left("w1")
    records.retire("e", 1)  # older than the attempt that was lost
    records.retire("other", 5)
    assert records.lost_episodes() == [LOST]
    records.retire("e", 2)
    assert records.lost_episodes() == []


def test_carrying_leaves_the_record_held_so_a_retried_commit_carries_it_again() -> None:
    records = records_in("held")
    assert records.carry(None) == records.carry(None) == [RECORD]
    assert records.carry(None)[0].attempt == 1  # the writer relabels it to attempt 2


def test_a_record_handed_back_in_memory_loads_without_reading() -> None:
    records = records_in("claimed")
    records.hand_back(Held("e", 1, state={"step": 4}), "w1")
    held = records.get("e")
    assert held is not None

    def never(path: Path, entries: list[IndexEntry]) -> Iterable[Mapping[str, Any]]:
        raise AssertionError("read")

    assert held.load(never) == {"step": 4}


def test_a_record_on_disk_loads_through_the_reader_it_is_given() -> None:
    reads: list[tuple[Path, list[IndexEntry]]] = []

    def reader(path: Path, entries: list[IndexEntry]) -> Iterable[Mapping[str, Any]]:
        reads.append((path, entries))
        return [{"kind": "episode", "episode_id": "e", "attempt": 1, "state": {"step": 3}}]

    assert RECORD.load(reader) == {"step": 3}
    assert reads == [(SEGMENT, [ENTRY])]


def test_a_record_crosses_the_channel_by_location() -> None:
    body = RECORD.body()
    assert body == {"episode_id": "e", "attempt": 1, "path": str(SEGMENT), "entry": list(ENTRY)}
    assert Held(body["episode_id"], body["attempt"], Path(body["path"]),
                IndexEntry(*body["entry"])) == RECORD


def test_what_status_lists() -> None:
    records = HeldRecords()
    records.hold(Held("a", 1, SEGMENT, ENTRY))
    records.hold(Held("b", 4, SEGMENT, ENTRY))
    records.claim("b", 5, "w1")
    assert records.held_episodes() == [{"episode_id": "a", "attempt_to_send": 2}]
    assert len(records) == 2 and set(records.records) == {"a", "b"}


@pytest.mark.parametrize(
    ("loads", "carrier"),
    [
        ({"w2": 0, "w1": 0}, "w1"),
        ({"w1": 3, "w2": 1}, "w2"),
        ({"w1": float("inf"), "w2": 7}, "w2"),  # a worker that did not report its load
        ({"w1": float("inf")}, "w1"),
    ],
)
def test_the_least_loaded_worker_carries_ties_to_the_lowest_id(
    loads: dict[str, float], carrier: str
) -> None:
    assert least_loaded(loads) == carrier
