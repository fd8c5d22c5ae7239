"""What each worker reads at a restore: only the segments holding sessions placed on it
(issue #5), and with placement cutting the owner-ordered sessions into runs (issue #13),
few of them."""

from __future__ import annotations

from pathlib import Path

import pytest

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
                    entries=[IndexEntry("session", sid, owner, None, n * 2200, 2200)
                             for n, (sid, owner) in enumerate(sessions)])
            for name, sessions in segments.items()
        ],
    )


def segments_holding(checkpoint: Checkpoint, placed: dict[SessionId, WorkerId],
                     worker: WorkerId) -> set[str]:
    return {str(s.path) for s in checkpoint.segments
            if any(placed[SessionId(e.id)] == worker for e in s.entries)}


@pytest.mark.parametrize(("old_count", "new_count"), [(4, 6), (4, 2), (4, 3), (4, 4)])
def test_every_worker_reads_the_few_segments_holding_its_sessions_and_only_those(
    old_count: int, new_count: int
) -> None:
    old = sorted(new_worker_id() for _ in range(old_count))
    checkpoint = checkpoint_of({o: [(f"{o[:4]}-{n}", o) for n in range(25)] for o in old})
    new = sorted(WorkerId(new_worker_id()) for _ in range(new_count))
    sessions = [(SessionId(e.id), WorkerId(e.owner or ""), e.offset)
                for s in checkpoint.segments for e in s.entries]
    placement = place(sessions, new, [WorkerId(o) for o in old], {})
    reads = _reads(checkpoint, placement.sessions)
    assert set(reads) == set(new), "every worker was placed some sessions"
    for worker, paths in reads.items():
        assert set(paths) == segments_holding(checkpoint, placement.sessions, worker)
    # Each old owner's sessions are one run of the placement order: at most
    # old + new - 1 segment reads in all, where a hash over every ID makes old x new.
    assert sum(len(paths) for paths in reads.values()) <= old_count + new_count - 1


def test_ownerless_sessions_spread_over_workers_make_each_read_every_segment_it_has_some_of(
) -> None:
    checkpoint = checkpoint_of({"a": [(f"a-{n}", None) for n in range(10)],
                                "b": [(f"b-{n}", None) for n in range(10)]})
    new = sorted(WorkerId(new_worker_id()) for _ in range(2))
    sessions = [(SessionId(e.id), None, e.offset) for s in checkpoint.segments for e in s.entries]
    placement = place(sessions, new, [], {})
    reads = _reads(checkpoint, placement.sessions)
    for worker, paths in reads.items():
        assert set(paths) == segments_holding(checkpoint, placement.sessions, worker)
