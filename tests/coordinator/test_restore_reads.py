"""What each worker reads at a restore: only the segments holding sessions placed on it
(issue #5: whole segments for owner groups, nothing for a worker placed nothing)."""

from __future__ import annotations

from pathlib import Path

from tether.checkpoint.segments import IndexEntry
from tether.checkpoint.store import Checkpoint, Segment
from tether.coordinator.fleet import _reads
from tether.coordinator.placement import place
from tether.routing.types import SessionId, WorkerId, new_worker_id


def checkpoint_of(segments: dict[str, list[tuple[str, str | None]]]) -> Checkpoint:
    """A loaded checkpoint whose segment `name` holds sessions (id, owner), in order."""
    return Checkpoint(
        checkpoint_id="c1", participant="p", directory=Path("/c1/p"), manifest={},
        checkpoint={},
        segments=[
            Segment(worker=name, path=Path(f"/c1/p/segment-{name}.msgpack"), bytes=0,
                    records=len(sessions), digest="",
                    entries=[IndexEntry("session", sid, owner, None, 0, 1)
                             for sid, owner in sessions])
            for name, sessions in segments.items()
        ],
    )


def test_owner_groups_are_read_whole_by_one_worker_each_and_spare_workers_read_nothing() -> None:
    old = sorted(new_worker_id() for _ in range(4))
    checkpoint = checkpoint_of({o: [(f"{o[:4]}-{n}", o) for n in range(25)] for o in old})
    new = sorted(WorkerId(new_worker_id()) for _ in range(6))
    sessions = [(SessionId(e.id), WorkerId(e.owner or ""))
                for s in checkpoint.segments for e in s.entries]
    placement = place(sessions, new, [WorkerId(o) for o in old], {})
    reads = _reads(checkpoint, placement.sessions)
    assert sorted(len(paths) for paths in reads.values()) == [1, 1, 1, 1]
    assert len(set(new) - set(reads)) == 2  # placed nothing, read nothing
    for worker, [path] in reads.items():
        [segment] = [s for s in checkpoint.segments if str(s.path) == path]
        assert {placement.sessions[SessionId(e.id)] for e in segment.entries} == {worker}


def test_ownerless_sessions_spread_over_workers_make_each_read_every_segment_it_has_some_of(
) -> None:
    checkpoint = checkpoint_of({"a": [(f"a-{n}", None) for n in range(10)],
                                "b": [(f"b-{n}", None) for n in range(10)]})
    new = sorted(WorkerId(new_worker_id()) for _ in range(2))
    sessions = [(SessionId(e.id), None) for s in checkpoint.segments for e in s.entries]
    placement = place(sessions, new, [], {})
    reads = _reads(checkpoint, placement.sessions)
    for worker, paths in reads.items():
        holding = {str(s.path) for s in checkpoint.segments
                   if any(placement.sessions[SessionId(e.id)] == worker for e in s.entries)}
        assert set(paths) == holding
