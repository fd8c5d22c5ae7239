"""The file claim store, on a real directory. Its coroutines never suspend, so the tests
run each to completion on a loop of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import struct
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tether.routing.claims import FileClaimStore
from tether.routing.dirwatch import IN_CREATE, IN_DELETE, IN_IGNORED, IN_Q_OVERFLOW, changed_names
from tether.routing.errors import TetherError
from tether.routing.types import SessionId, WorkerId

A = WorkerId("a" * 32)
B = WorkerId("b" * 32)
run = asyncio.run


def test_first_claim_wins_and_later_claims_name_the_winner(short_tmp: Path) -> None:
    store = FileClaimStore(str(short_tmp / "claims"))
    assert run(store.claim(SessionId("s"), A)) == A
    assert run(store.claim(SessionId("s"), B)) == A
    assert run(store.claimant(SessionId("s"))) == A


def test_two_stores_claiming_the_same_1000_ids_at_once_have_one_winner_each(
    short_tmp: Path,
) -> None:
    one = FileClaimStore(str(short_tmp / "claims"))
    two = FileClaimStore(str(short_tmp / "claims"))
    ids = [SessionId(f"session-{i}") for i in range(1000)]

    def claim_all(store: FileClaimStore, worker: WorkerId) -> list[WorkerId]:
        return [run(store.claim(sid, worker)) for sid in ids]

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(claim_all, one, A)
        b = pool.submit(claim_all, two, B)
        results_a, results_b = a.result(), b.result()
    assert results_a == results_b  # both agree on the winner of every ID
    assert {run(one.claimant(sid)) for sid in ids} <= {A, B}
    assert [run(one.claimant(sid)) for sid in ids] == results_a
    leftovers = [name for name in os.listdir(short_tmp / "claims") if name.endswith(".tmp")]
    assert leftovers == []


def test_only_the_claimant_removes_its_claim(short_tmp: Path) -> None:
    store = FileClaimStore(str(short_tmp / "claims"))
    run(store.claim(SessionId("s"), A))
    run(store.release(SessionId("s"), B))
    assert run(store.claimant(SessionId("s"))) == A
    run(store.release(SessionId("s"), A))
    assert run(store.claimant(SessionId("s"))) is None


def test_claim_files_are_private_and_name_worker_and_session(short_tmp: Path) -> None:
    store = FileClaimStore(str(short_tmp / "claims"))
    run(store.claim(SessionId("my session"), A))
    [name] = os.listdir(short_tmp / "claims")
    path = short_tmp / "claims" / name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == f"{A}\nmy session"


def test_a_hash_collision_is_detected_not_routed(short_tmp: Path) -> None:
    store = FileClaimStore(str(short_tmp / "claims"))
    run(store.claim(SessionId("real"), A))
    [name] = os.listdir(short_tmp / "claims")
    (short_tmp / "claims" / name).write_text(f"{A}\nanother session")
    with pytest.raises(TetherError) as caught:
        run(store.claimant(SessionId("real")))
    assert caught.value.code == "session_conflict"


def test_a_claim_file_that_names_no_worker_is_a_conflict_not_a_loop(short_tmp: Path) -> None:
    store = FileClaimStore(str(short_tmp))
    run(store.claim(SessionId("s"), WorkerId("a" * 32)))
    (path,) = [p for p in short_tmp.iterdir() if not p.name.endswith(".tmp")]
    path.write_text("not-a-worker\ns")
    with pytest.raises(TetherError) as raised:
        run(store.claim(SessionId("s"), WorkerId("b" * 32)))
    assert raised.value.code == "session_conflict"
    assert [p.name for p in short_tmp.iterdir()] == [path.name], "no temp file is left"


C = WorkerId("c" * 32)


async def _until(check: Callable[[], bool]) -> None:
    """Let the loop turn until `check` holds (the watch's events arrive through it)."""
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the watched store never saw the change")


@contextlib.asynccontextmanager
async def _watched(directory: str) -> AsyncIterator[tuple[FileClaimStore, FileClaimStore]]:
    """A store watched on the running loop, and another writing the same claims."""
    reader, writer = FileClaimStore(directory), FileClaimStore(directory)
    reader.watch(asyncio.get_running_loop())
    try:
        yield reader, writer
    finally:
        reader.close()


async def test_a_watched_store_remembers_a_claimant_until_its_claim_file_changes(
    short_tmp: Path,
) -> None:
    async with _watched(str(short_tmp / "claims")) as (reader, writer):
        session = SessionId("s")
        await writer.claim(session, A)
        assert reader.claimant_now(session) == A
        await writer.release(session, A)
        await writer.claim(session, C)  # released and claimed again, in one turn
        assert reader.claimant_now(session) == A  # remembered: the file was not read
        await _until(lambda: reader.claimant_now(session) == C)
        await writer.release(session, C)
        await _until(lambda: reader.claimant_now(session) is None)
        assert await reader.claimant(session) is None


async def test_a_watched_store_never_remembers_a_session_nobody_claims(
    short_tmp: Path,
) -> None:
    async with _watched(str(short_tmp / "claims")) as (reader, writer):
        assert reader.claimant_now(SessionId("s")) is None
        await writer.claim(SessionId("s"), B)
        assert reader.claimant_now(SessionId("s")) == B  # read at once, no turn waited


async def test_a_closed_watch_reads_every_claimant_again(short_tmp: Path) -> None:
    directory = str(short_tmp / "claims")
    reader, writer = FileClaimStore(directory), FileClaimStore(directory)
    reader.watch(asyncio.get_running_loop())
    await writer.claim(SessionId("s"), A)
    assert reader.claimant_now(SessionId("s")) == A
    reader.close()
    await writer.release(SessionId("s"), A)
    await writer.claim(SessionId("s"), B)
    assert reader.claimant_now(SessionId("s")) == B


async def test_a_watched_store_whose_directory_is_replaced_stops_remembering(
    short_tmp: Path,
) -> None:
    directory = short_tmp / "claims"
    reader = FileClaimStore(str(directory))
    reader.watch(asyncio.get_running_loop())
    try:
        await FileClaimStore(str(directory)).claim(SessionId("s"), A)
        assert reader.claimant_now(SessionId("s")) == A
        for name in os.listdir(directory):
            os.unlink(directory / name)
        os.rmdir(directory)
        await FileClaimStore(str(directory)).claim(SessionId("s"), B)  # a new directory
        await _until(lambda: reader.claimant_now(SessionId("s")) == B)
        await FileClaimStore(str(directory)).release(SessionId("s"), B)
        assert reader.claimant_now(SessionId("s")) is None  # unwatched: read every time
    finally:
        reader.close()


def test_inotify_events_name_the_changed_files_and_flag_an_overflow() -> None:
    def event(mask: int, name: bytes = b"") -> bytes:
        padded = name + b"\0" * (-len(name) % 16) if name else b""
        return struct.pack("iIII", 1, mask, 0, len(padded)) + padded

    names, flags = changed_names(event(IN_CREATE, b"ab12") + event(IN_DELETE, b"cd34"))
    assert (names, flags) == ({"ab12", "cd34"}, 0)
    names, flags = changed_names(event(IN_DELETE, b"ab12") + event(IN_Q_OVERFLOW))
    assert names == {"ab12"} and flags == IN_Q_OVERFLOW
    assert changed_names(event(IN_IGNORED))[1] == IN_IGNORED
