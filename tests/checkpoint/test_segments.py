"""Segment files: streaming writes, index-only reads, record reads and every corruption."""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import stat
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.checkpoint.segments import (
    DIGEST_ALGORITHM,
    SYNC_AHEAD,
    IndexEntry,
    SegmentWriter,
    read_index,
    read_records,
    verify,
)
from tether.routing.errors import TetherError
from tether.routing.types import new_worker_id

OWNER = new_worker_id()


def session(sid: str, state: Any = None, owner: str | None = OWNER) -> dict[str, Any]:
    return {"kind": "session", "id": sid, "open": True, "owner": owner, "state": state}


def episode(eid: str, attempt: int = 1, state: Any = None) -> dict[str, Any]:
    return {"kind": "episode", "episode_id": eid, "attempt": attempt, "state": state}


def write(path: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    with SegmentWriter(path) as writer:
        for record in records:
            writer.add(record)
        return dict(writer.close())


def raw_segment(
    path: Path, records: list[bytes], index: Any, index_offset: int | None = None
) -> None:
    """A hand-built segment: packed records, then `index` packed, then the trailer."""
    body = b"".join(records)
    offset = len(body) if index_offset is None else index_offset
    path.write_bytes(body + msgpack.packb(index) + offset.to_bytes(8, "big"))


def corrupt_detail(call: Any, *args: Any) -> str:
    """The detail of the `corrupt_checkpoint` that `call` raises (iterating its result)."""

    def run() -> None:
        result = call(*args)
        if hasattr(result, "__next__"):
            list(result)

    with pytest.raises(TetherError) as caught:
        run()
    assert caught.value.code == "corrupt_checkpoint"
    return str(caught.value.detail)


# -- round trips ----------------------------------------------------------------------


def test_sessions_and_episodes_round_trip_in_order(tmp_path: Path) -> None:
    records = [
        session("s1", {"count": 3, "history": [1, 2, 3]}),
        episode("e1", 2, {"step": 7, "blob": b"\x00\xff"}),
        session("s2", None, owner=None),
        session("s3", {"nested": {"a": [None, True, 1.5]}}),
    ]
    path = tmp_path / "segment.msgpack"
    write(path, records)
    assert list(read_records(path)) == records


def test_index_entries_name_kind_id_owner_or_attempt_and_tile_the_file(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    write(path, [session("s1", "x" * 10), episode("e1", 4, [1]), session("s2", None, None)])
    entries = read_index(path)
    assert [(e.kind, e.id, e.owner, e.attempt) for e in entries] == [
        ("session", "s1", OWNER, None),
        ("episode", "e1", None, 4),
        ("session", "s2", None, None),
    ]
    assert entries[0].offset == 0
    assert all(a.offset + a.length == b.offset for a, b in itertools.pairwise(entries))
    data = path.read_bytes()
    index_offset = int.from_bytes(data[-8:], "big")
    assert entries[-1].offset + entries[-1].length == index_offset


def test_close_reports_name_size_count_and_the_whole_files_digest(tmp_path: Path) -> None:
    path = tmp_path / "segment-w.msgpack"
    info = write(path, [session(f"s{i}", i) for i in range(5)])
    data = path.read_bytes()
    assert info == {
        "file": "segment-w.msgpack",
        "bytes": len(data),
        "records": 5,
        "digest": xxhash.xxh3_128(data).hexdigest(),
    }
    assert DIGEST_ALGORITHM == "xxh3_128"
    verify(path, info["digest"], info["bytes"], info["records"])


def test_an_empty_segment_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    info = write(path, [])
    assert read_index(path) == []
    assert list(read_records(path)) == []
    assert info["records"] == 0 and info["bytes"] == path.stat().st_size


def test_a_32_mib_record_round_trips_between_small_ones(tmp_path: Path) -> None:
    big = os.urandom(32 * 1024 * 1024)
    records = [session("small-1", 1), session("big", {"blob": big}), session("small-2", 2)]
    path = tmp_path / "segment.msgpack"
    info = write(path, records)
    assert list(read_records(path)) == records
    verify(path, info["digest"], info["bytes"], 3)


def test_read_records_reads_only_the_chosen_entries_in_the_order_given(tmp_path: Path) -> None:
    records = [session(f"s{i}", i) for i in range(10)]
    path = tmp_path / "segment.msgpack"
    write(path, records)
    entries = read_index(path)
    chosen = [entries[7], entries[2], entries[3]]
    assert [r["id"] for r in read_records(path, chosen)] == ["s7", "s2", "s3"]


def test_states_may_use_int_and_str_map_keys(tmp_path: Path) -> None:
    records = [session("s1", {1: "one", "two": 2, 3: {4: [5]}})]
    path = tmp_path / "segment.msgpack"
    write(path, records)
    assert list(read_records(path)) == records


def test_read_index_never_touches_the_records_region(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    write(path, [session("s1", "a" * 100), episode("e1", 1, "b" * 100)])
    data = bytearray(path.read_bytes())
    index_offset = int.from_bytes(data[-8:], "big")
    data[:index_offset] = b"\xc1" * index_offset  # 0xc1 is never valid msgpack
    path.write_bytes(bytes(data))
    assert [e.id for e in read_index(path)] == ["s1", "e1"]
    assert "not valid msgpack" in corrupt_detail(read_records, path)


# -- writing refusals -----------------------------------------------------------------


def test_the_segment_file_is_created_0600_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    write(path, [session("s1")])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(TetherError) as caught:
        SegmentWriter(path)
    assert caught.value.code == "commit_failed"


@pytest.mark.parametrize(
    ("record", "named"),
    [
        ({"kind": "session", "id": "s9", "open": True, "owner": None}, "session 's9'"),
        (session("s9", owner="not-a-worker"), "session 's9'"),
        (session("s9", {"bad": object()}), "session 's9'"),
        (session("\n"), "session '\\n'"),
        (episode("e9", -1), "episode 'e9' attempt -1"),
        ({"kind": "other"}, "record"),
        (session("s1", 2), "session 's1' is exported twice"),
    ],
)
def test_a_record_that_cannot_be_written_is_commit_failed_naming_it(
    tmp_path: Path, record: dict[str, Any], named: str
) -> None:
    path = tmp_path / "segment.msgpack"
    with SegmentWriter(path) as writer:
        writer.add(session("s1", 1))
        with pytest.raises(TetherError) as caught:
            writer.add(record)
        assert caught.value.code == "commit_failed"
        assert named in str(caught.value.detail)
        writer.add(session("s2", 2))
        writer.close()
    assert [r["id"] for r in read_records(path)] == ["s1", "s2"]


def test_a_record_over_the_size_limit_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    with SegmentWriter(path, max_record_bytes=1000) as writer:
        writer.add(session("fits", "x" * 900))
        with pytest.raises(TetherError) as caught:
            writer.add(session("too-big", "x" * 1000))
        writer.close()
    assert caught.value.code == "commit_failed"
    assert "too-big" in str(caught.value.detail) and "1000-byte limit" in str(caught.value.detail)
    assert [e.id for e in read_index(path)] == ["fits"]


def test_a_write_that_fails_in_the_writer_thread_is_commit_failed_and_removes_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "segment.msgpack"
    writer = SegmentWriter(path)
    writer.add(session("s1", "x" * 100))
    read_only = os.open(os.devnull, os.O_RDONLY)
    os.dup2(read_only, writer._fd)  # type: ignore[arg-type]  # its descriptor goes read-only:
    os.close(read_only)  # the writer thread's next write fails (EBADF)
    with pytest.raises(TetherError) as caught:
        writer.close()
    assert caught.value.code == "commit_failed"
    assert "cannot write" in str(caught.value.detail)
    assert not path.exists()


def test_an_exception_inside_the_writer_block_removes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"

    def export_then_fail() -> None:
        with SegmentWriter(path) as writer:
            writer.add(session("s1"))
            raise RuntimeError("export failed")

    with pytest.raises(RuntimeError):
        export_then_fail()
    assert not path.exists()


# -- corruption -----------------------------------------------------------------------


def test_a_flipped_byte_in_a_record_fails_the_digest(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    info = write(path, [session("s1", "a" * 100), session("s2", "b" * 100)])
    data = bytearray(path.read_bytes())
    data[read_index(path)[1].offset + 50] ^= 0x01
    path.write_bytes(bytes(data))
    detail = corrupt_detail(verify, path, info["digest"], info["bytes"], info["records"])
    assert "digest" in detail and str(path) in detail


def test_a_truncated_segment_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    info = write(path, [session("s1", "a" * 100), session("s2", "b" * 100)])
    data = path.read_bytes()
    path.write_bytes(data[:-20])
    assert "bytes" in corrupt_detail(verify, path, info["digest"], info["bytes"], 2)
    assert "index offset" in corrupt_detail(read_index, path)
    path.write_bytes(data[:5])
    assert "shorter than the 8-byte trailer" in corrupt_detail(read_index, path)


def test_reading_records_of_a_file_cut_short_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    write(path, [session(f"s{i}", "x" * 100) for i in range(4)])
    entries = read_index(path)
    path.write_bytes(path.read_bytes()[: entries[2].offset + 10])
    assert "truncated" in corrupt_detail(read_records, path, entries)
    assert "truncated" in corrupt_detail(read_records, path, entries[3:])


def test_a_record_count_that_differs_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    info = write(path, [session("s1")])
    assert "holds 1 records" in corrupt_detail(verify, path, info["digest"], info["bytes"], 2)


def test_a_missing_segment_is_corrupt(tmp_path: Path) -> None:
    assert "missing" in corrupt_detail(read_index, tmp_path / "nope.msgpack")
    assert "missing" in corrupt_detail(verify, tmp_path / "nope.msgpack", "0" * 64, 9, 0)


def entry(sid: str, offset: int, length: int) -> list[Any]:
    return ["session", sid, None, None, offset, length]


def test_index_entries_that_overlap_are_corrupt(tmp_path: Path) -> None:
    a, b = msgpack.packb(session("s1", 1)), msgpack.packb(session("s2", 2))
    path = tmp_path / "segment.msgpack"
    raw_segment(path, [a, b], [entry("s1", 0, len(a)), entry("s2", len(a) - 1, len(b) + 1)])
    assert "overlaps" in corrupt_detail(read_index, path)


def test_index_entries_that_point_outside_the_records_are_corrupt(tmp_path: Path) -> None:
    a = msgpack.packb(session("s1", 1))
    path = tmp_path / "segment.msgpack"
    raw_segment(path, [a], [entry("s1", 0, len(a) + 5)])
    assert "outside the records region" in corrupt_detail(read_index, path)
    raw_segment(path, [a], [entry("s1", 10_000, 5)])
    assert "outside the records region" in corrupt_detail(read_index, path)


@pytest.mark.parametrize(
    ("index", "what"),
    [
        ({"not": "a list"}, "not a list"),
        (["session"], "not a 6-element array"),
        ([["session", "s1", "owner?", None, 0, 10]], "malformed owner"),
        ([["session", "", None, None, 0, 10]], "malformed session ID"),
        ([["episode", "e1", None, "1", 0, 10]], "malformed episode"),
        ([["thing", "s1", None, None, 0, 10]], "unknown kind"),
        ([["session", "s1", None, None, 0, 0]], "malformed offset or length"),
        ([["session", "s1", None, None, 0, 4]], "covers 4"),
        ([["session", "s1", None, None, 2, 8]], "gap"),
    ],
)
def test_a_malformed_index_is_corrupt_and_says_why(tmp_path: Path, index: Any, what: str) -> None:
    path = tmp_path / "segment.msgpack"
    raw_segment(path, [b"\x80" * 10], index)
    assert what in corrupt_detail(read_index, path)


def test_bytes_after_the_index_are_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    records = msgpack.packb(session("s1"))
    index = msgpack.packb([entry("s1", 0, len(records))])
    path.write_bytes(records + index + b"\x00" + len(records).to_bytes(8, "big"))
    assert "not valid msgpack" in corrupt_detail(read_index, path)


def test_a_record_that_differs_from_its_index_entry_is_corrupt(tmp_path: Path) -> None:
    a = msgpack.packb(session("s1", 1))
    path = tmp_path / "segment.msgpack"
    raw_segment(path, [a], [entry("other", 0, len(a))])
    assert "does not match its index entry" in corrupt_detail(read_records, path)
    raw_segment(path, [a], [["episode", "s1", None, 1, 0, len(a)]])
    assert "the index says episode" in corrupt_detail(read_records, path)


def test_a_record_that_is_not_a_record_map_is_corrupt(tmp_path: Path) -> None:
    a = msgpack.packb([1, 2, 3])
    path = tmp_path / "segment.msgpack"
    raw_segment(path, [a], [entry("s1", 0, len(a))])
    assert "not a map" in corrupt_detail(read_records, path)


# -- property -------------------------------------------------------------------------

_ids = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40)
_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary()
_floats = st.floats(allow_nan=False)
_states = st.recursive(
    _scalars | _floats,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-1000, 1000), inner, max_size=4)
    ),
    max_leaves=12,
)
_records = st.one_of(
    st.builds(session, _ids, _states, st.sampled_from([None, OWNER])),
    st.builds(episode, _ids, st.integers(0, 2**31), _states),
)


def _session_ids(record: dict[str, Any]) -> object:
    """Sessions are unique by ID within a segment, and so are episodes (the writer
    refuses an episode twice)."""
    return (record["kind"], record["id"] if record["kind"] == "session" else record["episode_id"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(_records, max_size=20, unique_by=_session_ids))
def test_any_records_read_back_equal_and_index_entries_match(
    tmp_path_factory: pytest.TempPathFactory, records: list[dict[str, Any]]
) -> None:
    path = tmp_path_factory.mktemp("prop") / "segment.msgpack"
    info = write(path, records)
    assert list(read_records(path)) == records
    entries = read_index(path)
    expected = [
        ("session", r["id"], r["owner"], None)
        if r["kind"] == "session"
        else ("episode", r["episode_id"], None, r["attempt"])
        for r in records
    ]
    assert [(e.kind, e.id, e.owner, e.attempt) for e in entries] == expected
    assert all(isinstance(e, IndexEntry) for e in entries)
    verify(path, info["digest"], info["bytes"], len(records))


def test_verify_checks_a_segment_with_the_algorithm_its_manifest_names(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    info = write(path, [session("s1", 1)])
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    verify(path, sha256, info["bytes"], 1, "sha256")
    detail = corrupt_detail(verify, path, info["digest"], info["bytes"], 1, "sha256")
    assert "sha256 digest" in detail


def big_sessions(count: int) -> list[dict[str, Any]]:
    return [session(f"big{n}", bytes([n]) * (1 << 20)) for n in range(count)]


def test_a_long_segment_is_flushed_in_the_background_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every `SYNC_AHEAD` bytes a thread flushes what is written, so that close's fsync
    has only the tail left; close waits for it."""
    synced: list[int] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    path = tmp_path / "segment.msgpack"
    records = big_sessions(3 * SYNC_AHEAD >> 20)
    with SegmentWriter(path) as writer:
        writer.add_all(records)
        info = writer.close()
    assert synced and all(size >= SYNC_AHEAD for size in synced)
    assert not [t for t in threading.enumerate() if t.name == "tether-segment-sync"]
    verify(path, info["digest"], info["bytes"], len(records))


def test_a_background_flush_that_fails_fails_the_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    path = tmp_path / "segment.msgpack"
    def write_past_a_sync() -> None:
        with SegmentWriter(path) as writer:
            writer.add_all(big_sessions((SYNC_AHEAD >> 20) + 2))
            writer.close()

    with pytest.raises(TetherError) as caught:
        write_past_a_sync()
    assert caught.value.code == "commit_failed" and "Input/output error" in caught.value.detail
    assert not path.exists()


def test_add_sessions_keeps_the_records_before_a_failing_one(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    states: dict[str, Any] = {"a": 1, "b": object(), "c": 3}
    with SegmentWriter(path) as writer:
        with pytest.raises(TetherError) as caught:
            writer.add_sessions(list(states), states.__getitem__, lambda _: True, OWNER)
        assert "session 'b' cannot be packed" in caught.value.detail
        writer.close()
    assert [(r["id"], r["state"]) for r in read_records(path)] == [("a", 1)]


def test_add_sessions_stops_once_as_many_bytes_as_asked_wait_to_be_written(
    tmp_path: Path,
) -> None:
    """A caller packing big states bounds what sits packed in memory at once."""
    states = {f"big{n}": bytes([n]) * (1 << 20) for n in range(10)}
    with SegmentWriter(tmp_path / "segment.msgpack") as writer:
        added = writer.add_sessions(list(states), states.__getitem__, lambda _: True, None,
                                    until_full=3 << 20)
        assert added == 3 and writer.full_bytes >= 3 << 20
        writer.write(writer.take())
        rest = list(states)[added:]
        assert writer.add_sessions(rest, states.__getitem__, lambda _: True, None) == 7
        writer.close()


def test_an_episode_added_twice_is_refused_and_the_segment_kept(tmp_path: Path) -> None:
    path = tmp_path / "segment.msgpack"
    with SegmentWriter(path) as writer:
        writer.add_episode("e", 2, {"step": 1})
        with pytest.raises(TetherError) as caught:
            writer.add_episode("e", 2, {"step": 1})
        assert caught.value.code == "commit_failed" and "exported twice" in caught.value.detail
        writer.close()
    assert [e.id for e in read_index(path)] == ["e"]
