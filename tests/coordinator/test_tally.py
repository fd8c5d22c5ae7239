"""The coordinator's count of a commit's records from the workers' indexes: sessions two
workers hold are listed (they block the commit), an episode exported twice fails it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tether.checkpoint.segments import SegmentWriter
from tether.checkpoint.store import ManifestSegment
from tether.coordinator.fleet import _tally
from tether.routing.errors import TetherError
from tether.routing.types import new_worker_id


def segments(tmp_path: Path, records: list[list[dict[str, Any]]]) -> list[ManifestSegment]:
    """One segment per worker holding `records[n]`, as the workers would write them."""
    listed: list[ManifestSegment] = []
    for held in records:
        worker = new_worker_id()
        with SegmentWriter(tmp_path / f"segment-{worker}.msgpack") as writer:
            writer.add_all(held)
            info = writer.close()
        listed.append({**info, "worker": worker})  # type: ignore[typeddict-item]
    return listed


def session(sid: str) -> dict[str, Any]:
    return {"kind": "session", "id": sid, "open": True, "owner": None, "state": 1}


def episode(eid: str) -> dict[str, Any]:
    return {"kind": "episode", "episode_id": eid, "attempt": 2, "state": 1}


def test_records_are_counted_and_sessions_two_workers_hold_are_listed(tmp_path: Path) -> None:
    listed = segments(tmp_path, [[session("a"), session("b"), episode("e")], [session("a")]])
    counts, twice = _tally(tmp_path, listed)
    assert counts == {"sessions": 3, "episodes": 1} and twice == ["a"]


def test_an_episode_two_workers_exported_fails_the_commit(tmp_path: Path) -> None:
    listed = segments(tmp_path, [[episode("e")], [session("a"), episode("e")]])
    with pytest.raises(TetherError) as caught:
        _tally(tmp_path, listed)
    assert caught.value.code == "commit_failed"
    assert "episode 'e' was exported twice" in caught.value.detail
