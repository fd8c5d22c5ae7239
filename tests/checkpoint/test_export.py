"""A participant's export (SPEC 5.6, 5.10): every state packed on the loop as the app
hands it over, full chunks written behind in a thread, and nothing left of a failed one.

A real `Participant` and real segment files; the app here is a dict of states an app
author could register, with hooks to misbehave the way apps do.
"""

from __future__ import annotations

import asyncio
import errno
import os
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.checkpoint.participant import EXPORT_BATCH, WRITE_AHEAD, Participant
from tether.checkpoint.segments import SegmentWriter, read_index, read_records
from tether.routing.errors import TetherError
from tether.routing.types import new_worker_id

STATE_BYTES = 2048
SESSIONS = 8 * EXPORT_BATCH + 7  # several batches, several writes behind the packing


class States:
    """Session states in a dict; `export` can fail at one session or run a callback."""

    def __init__(self, count: int) -> None:
        self.states: dict[str, Any] = {
            f"s{number:05d}": {"n": number, "text": "x" * STATE_BYTES} for number in range(count)
        }
        self.fail_at: str | None = None
        self.exported: list[str] = []

    def sessions(self) -> Iterable[str]:
        return self.states.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.states

    def export(self, session_id: str) -> Any:
        if session_id == self.fail_at:
            raise RuntimeError(f"cannot export {session_id}")
        self.exported.append(session_id)
        return self.states[session_id]  # the live object, as many apps hand it over

    async def install(self, session_id: str, state: Any) -> None:
        self.states[session_id] = state

    async def release(self, session_id: str) -> None:
        self.states.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False


def participant_with(states: States) -> Participant:
    participant = Participant(state_version="export/1")
    participant.register_sessions(states)
    participant.close_admission()
    return participant


def is_open(session_id: str) -> bool:
    return not session_id.endswith("3")


async def test_every_session_is_written_once_with_its_state_and_open_flag(
    tmp_path: Path,
) -> None:
    states = States(SESSIONS)
    path = tmp_path / "segment.msgpack"
    owner = new_worker_id()
    exported = await participant_with(states).export(path, None, owner, is_open)
    assert SESSIONS * STATE_BYTES > 2 * WRITE_AHEAD  # writes went on behind the packing
    assert (exported["sessions"], exported["episodes"], exported["records"]) == (SESSIONS, 0,
                                                                              SESSIONS)
    records = list(read_records(path))
    assert [r["id"] for r in records] == list(states.states)
    assert all(r["state"] == states.states[r["id"]] for r in records)
    assert all(r["open"] == is_open(r["id"]) and r["owner"] == owner for r in records)
    assert exported["bytes"] == path.stat().st_size


async def test_each_state_is_the_one_the_app_handed_over_even_if_it_changes_later(
    tmp_path: Path,
) -> None:
    """The app keeps running while the export yields between batches; a state it
    changes after handing it over must be written as it was handed over."""
    states = States(SESSIONS)
    stop = asyncio.Event()

    async def app_keeps_working() -> None:
        while not stop.is_set():
            for session_id in list(states.exported):
                states.states[session_id]["n"] = -1  # after its export: must not show
            await asyncio.sleep(0)

    worker = asyncio.create_task(app_keeps_working())
    try:
        await participant_with(states).export(tmp_path / "s.msgpack", None, None, is_open)
    finally:
        stop.set()
        await worker
    numbers = [r["state"]["n"] for r in read_records(tmp_path / "s.msgpack")]
    assert numbers == list(range(SESSIONS))


async def test_an_export_that_fails_midway_removes_its_segment_and_raises(
    tmp_path: Path,
) -> None:
    states = States(SESSIONS)
    states.fail_at = f"s{SESSIONS - 5:05d}"  # after several chunks were written behind
    path = tmp_path / "segment.msgpack"
    with pytest.raises(RuntimeError, match="cannot export"):
        await participant_with(states).export(path, None, None, is_open)
    assert not path.exists()


async def test_a_disk_that_fails_a_write_behind_the_packing_fails_the_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "segment.msgpack"
    real = os.write

    def full_disk(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path) and os.fstat(fd).st_size > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(TetherError) as caught:
        await participant_with(States(SESSIONS)).export(path, None, None, is_open)
    assert caught.value.code == "commit_failed" and "No space left" in caught.value.detail
    assert not path.exists()


async def test_a_session_id_the_app_lists_twice_fails_the_export(tmp_path: Path) -> None:
    class Twice(States):
        def sessions(self) -> Iterable[str]:
            return [*self.states, "s00001"]

    path = tmp_path / "segment.msgpack"
    with pytest.raises(TetherError) as caught:
        await participant_with(Twice(3)).export(path, None, None, is_open)
    assert caught.value.code == "commit_failed"
    assert "'s00001' is exported twice" in str(caught.value.detail)
    assert not path.exists()


_ids = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40)
_states = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(session_id=_ids, is_open_=st.booleans(), owned=st.booleans(), state=_states)
def test_add_session_writes_the_bytes_of_the_record_map(
    tmp_path_factory: pytest.TempPathFactory,
    session_id: str,
    is_open_: bool,
    owned: bool,
    state: Any,
) -> None:
    owner = new_worker_id() if owned else None
    record = {"kind": "session", "id": session_id, "open": is_open_, "owner": owner,
              "state": state}
    path = tmp_path_factory.mktemp("add") / "segment.msgpack"
    with SegmentWriter(path) as writer:
        writer.add_session(session_id, is_open_, owner, state)
        writer.close()
    [entry] = read_index(path)
    data = path.read_bytes()[entry.offset : entry.offset + entry.length]
    assert data == msgpack.packb(record, use_bin_type=True)


async def test_an_export_of_big_states_writes_them_out_as_it_goes(tmp_path: Path) -> None:
    """Packed bytes go to the writer once `WRITE_AHEAD` (4 MiB) wait, not only every
    `EXPORT_BATCH` records: 96 states of 1 MiB never sit packed in memory all at once."""
    states = States(0)
    states.states = {f"big{n:03d}": bytes([n]) * (1 << 20) for n in range(96)}
    participant = participant_with(states)
    tracemalloc.start()
    try:
        await participant.export(tmp_path / "segment.msgpack", None, None, is_open)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB packed at once"  # 96 MiB in all
    assert [r["state"][0] for r in read_records(tmp_path / "segment.msgpack")] == list(range(96))
