"""Segment files: one worker's records, then an index, then the index's offset.

A segment is written by exactly one worker, streaming, and read back either by its
index alone (placement never reads states) or record by record (install)::

    offset 0          records   one msgpack map per record, back to back
    index_offset      index     a msgpack list of entries, one per record, in file order
    size - 8          trailer   index_offset as an unsigned 64-bit big-endian integer

An index entry is a 6-element array ``[kind, id, owner, attempt, offset, length]``, the
fields of `IndexEntry` in order: ``["session", id, owner | nil, nil, offset, length]`` or
``["episode", episode_id, nil, attempt, offset, length]``. (Arrays, not maps: a large
index reads about twice as fast and is 30% smaller.) The entries tile the records
region exactly: the first starts at 0, each starts where the one before ends, and the
last ends at ``index_offset``. The whole-file digest (`DIGEST_ALGORITHM`) is computed
while the file is written, so a commit never reads its segment back; a background
``fdatasync`` every `SYNC_AHEAD` bytes leaves `close` only the tail to flush.

Reading, `SegmentWriter.write` and `close` are blocking file I/O meant to run in a thread
(``asyncio.to_thread``); packing records does no I/O. A malformed file raises
``TetherError("corrupt_checkpoint")`` naming the file and the check that failed; a record
that cannot be written raises ``TetherError("commit_failed")``.
The format is described in ``docs/format.md``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple, NoReturn, Protocol, TypedDict

import msgpack
import xxhash

from tether.checkpoint import gcpause
from tether.routing.errors import TetherError
from tether.routing.types import worker_id_or_none

__all__ = [
    "DIGESTS",
    "DIGEST_ALGORITHM",
    "MAX_RECORD_BYTES",
    "IndexEntry",
    "SegmentInfo",
    "SegmentWriter",
    "file_digest",
    "read_index",
    "read_records",
    "verify",
]


class _Hash(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


DIGESTS: dict[str, Callable[[], _Hash]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""The algorithms a manifest may name, each a constructor. Digests detect corruption, not
tampering (docs/format.md); sha256 is read for checkpoints written before xxh3_128."""
DIGEST_HEX_LENGTH = {"xxh3_128": 32, "sha256": 64}
DIGEST_ALGORITHM = "xxh3_128"
"""What new segments are hashed with: 20 GB/s against sha256's 1.8 on the development
machine, where sha256 was 0.14 s of a 100,000-session commit (docs/format.md)."""
SYNC_AHEAD = 32 * 1024 * 1024
"""Bytes written between background ``fdatasync`` calls while a segment is written."""
MAX_RECORD_BYTES = 256 * 1024 * 1024
TRAILER_SIZE = 8
# Records are gathered into chunks of about this size; bigger records go out alone.
WRITE_BUFFER = 1024 * 1024

RecordKind = Literal["session", "episode"]
_SESSION_KEYS = frozenset({"kind", "id", "open", "owner", "state"})
_EPISODE_KEYS = frozenset({"kind", "episode_id", "attempt", "state"})


class SegmentInfo(TypedDict):
    """What a closed segment is, as the manifest lists it (without `worker`)."""

    file: str
    bytes: int
    records: int
    digest: str


class IndexEntry(NamedTuple):
    """Where one record lies in its segment, and what placement needs to know of it.

    `owner` is set for sessions only (a worker ID or None), `attempt` for episodes only.
    """

    kind: RecordKind
    id: str
    owner: str | None
    attempt: int | None
    offset: int
    length: int


# -- records --------------------------------------------------------------------------


def _is_session_id(value: Any) -> bool:
    # The same rule as routing.types.session_id_or_none, without a regex: for ASCII,
    # isprintable() is exactly the range 0x20-0x7e.
    return type(value) is str and 0 < len(value) <= 256 and value.isascii() and value.isprintable()


def _is_attempt(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_episode_id(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _record_problem(record: Any, owners: set[str]) -> str | None:
    """Why `record` is not a well-formed session or episode record, or None.

    `owners` holds owners already found valid (a segment has only a few); valid new
    ones are added to it.
    """
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not a map"
    kind = record.get("kind")
    if kind == "session":
        if record.keys() != _SESSION_KEYS:
            return f"session record has keys {sorted(map(str, record))}"
        if not _is_session_id(record["id"]):
            return f"session ID {record['id']!r} is not 1 to 256 printable ASCII characters"
        if not isinstance(record["open"], bool):
            return "session `open` is not a bool"
        owner = record["owner"]
        if owner is not None and owner not in owners:
            if worker_id_or_none(owner) is None:
                return f"session owner {owner!r} is not a worker ID"
            owners.add(owner)
        return None
    if kind == "episode":
        if record.keys() != _EPISODE_KEYS:
            return f"episode record has keys {sorted(map(str, record))}"
        if not _is_episode_id(record["episode_id"]):
            return "episode_id is not a non-empty string"
        if not _is_attempt(record["attempt"]):
            return "episode attempt is not a non-negative int"
        return None
    return f"unknown record kind {kind!r}"


def _describe(record: Any) -> str:
    if isinstance(record, dict):
        if record.get("kind") == "session":
            return f"session {record.get('id')!r}"
        if record.get("kind") == "episode":
            return f"episode {record.get('episode_id')!r} attempt {record.get('attempt')!r}"
    return "record"


# -- writing --------------------------------------------------------------------------


def _cannot_pack(record: dict[str, Any], error: Exception) -> NoReturn:
    raise TetherError("commit_failed", f"{_describe(record)} cannot be packed: {error}") from error


def _too_big(record: dict[str, Any], length: int, limit: int) -> NoReturn:
    raise TetherError(
        "commit_failed",
        f"{_describe(record)} is {length} bytes packed, over the {limit}-byte limit",
    )


class SegmentWriter:
    """Packs one worker's records into a new segment file (created 0600, never reused).

    Packing (`add`, `add_session`, `add_episode`) does no I/O, so it can run where the
    states live (the event loop); full chunks are handed out by `take` and hashed and
    written by `write`, in the order taken, in a thread, which starts a background
    ``fdatasync`` every `SYNC_AHEAD` bytes. `close` writes what is left, the index and the
    trailer, fsyncs, and returns the segment's `SegmentInfo`. A caller that adds many
    records calls ``write(take())`` now and then (`add_all` does). Used as a context
    manager, an exception before `close` discards the file. Not thread-safe: packing and
    writing may run in two threads, but one call of each at a time.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_record_bytes: int = MAX_RECORD_BYTES
    ) -> None:
        self.path = Path(path)
        self.max_record_bytes = max_record_bytes
        try:
            self._fd: int | None = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise TetherError("commit_failed", f"cannot create {self.path}: {exc}") from exc
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._hash = DIGESTS[DIGEST_ALGORITHM]()
        self._buffer = bytearray()
        self._full: list[bytes | bytearray] = []
        self.full_bytes = 0
        """Bytes in the chunks `take` would hand out."""
        self._index: list[tuple[Any, ...]] = []
        self._owners: set[str] = set()
        self._session_ids: set[str] = set()
        self._episode_ids: set[str] = set()
        self._offset = 0
        self._written = 0
        self._io = threading.RLock()  # a write in flight, and close or discard, in turn
        self._synced = 0  # bytes written when the last background sync started
        self._syncing: threading.Thread | None = None
        self._sync_error: OSError | None = None

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fd is not None:
            self.discard()

    @property
    def records(self) -> int:
        """Records added so far."""
        return len(self._index)

    @property
    def sessions(self) -> int:
        """Session records added so far (the rest are episodes)."""
        return len(self._session_ids)

    def add(self, record: dict[str, Any]) -> None:
        """Pack `record`; `commit_failed` naming it if it cannot be written.

        A record that fails (bad shape, a session ID added before, a state msgpack
        cannot pack, over `max_record_bytes`) leaves the segment as it was.
        """
        self._open_fd()
        problem = _record_problem(record, self._owners)
        if problem is not None:
            raise TetherError("commit_failed", f"{_describe(record)}: {problem}")
        if record["kind"] == "session":
            self.add_session(record["id"], record["open"], record["owner"], record["state"])
        else:
            self.add_episode(record["episode_id"], record["attempt"], record["state"])

    def add_session(self, session_id: str, is_open: bool, owner: str | None, state: Any) -> None:
        """`add` of the session record of these fields."""
        self.add_sessions([session_id], lambda _: state, lambda _: is_open, owner)

    def add_sessions(
        self,
        session_ids: Sequence[str],
        export: Callable[[str], Any],
        is_open: Callable[[str], bool],
        owner: str | None,
        until_full: int | None = None,
    ) -> int:
        """`add_session` of each ID in turn, its state taken from `export` just before it
        is packed; how many were added: all, or fewer once `until_full` bytes wait for
        `take`. A record that fails raises; the ones before it stay added.

        A commit runs this loop once per session: the checks are one expression (the
        slow path says what is wrong) and packing and buffering are inlined, 5-10% faster
        than a call of `add_session` each.
        """
        pack, limit, seen, index = self._pack, self.max_record_bytes, self._session_ids, self._index
        buffer, offset, added = self._buffer, self._offset, 0
        try:
            for session_id in session_ids:
                state = export(session_id)
                opened = is_open(session_id)
                if (
                    type(session_id) is not str
                    or not 0 < len(session_id) <= 256
                    or not session_id.isascii()
                    or not session_id.isprintable()
                    or session_id in seen
                    or type(opened) is not bool
                    or (owner is not None and owner not in self._owners)
                    or self._fd is None
                ):
                    self._check_session(session_id, opened, owner)
                record = {"kind": "session", "id": session_id, "open": opened, "owner": owner,
                          "state": state}
                try:
                    packed = pack(record)
                except (TypeError, ValueError, OverflowError) as exc:
                    _cannot_pack(record, exc)
                length = len(packed)
                if length > limit:
                    _too_big(record, length, limit)
                seen.add(session_id)
                index.append(("session", session_id, owner, None, offset, length))
                offset += length
                added += 1
                if length < WRITE_BUFFER:
                    buffer += packed
                    if len(buffer) < WRITE_BUFFER:
                        continue
                    packed = b""
                self._buffer = buffer
                self._seal(packed)
                buffer = self._buffer
                if until_full is not None and self.full_bytes >= until_full:
                    break
        finally:
            self._buffer, self._offset = buffer, offset
        return added

    def add_episode(self, episode_id: str, attempt: int, state: Any) -> None:
        """`add` of the episode record of these fields, its checks kept to one expression."""
        if (
            type(episode_id) is not str
            or not episode_id
            or episode_id in self._episode_ids
            or type(attempt) is not int
            or attempt < 0
            or self._fd is None
        ):
            self._check_episode(episode_id, attempt)
        record = {"kind": "episode", "episode_id": episode_id, "attempt": attempt,
                  "state": state}
        packed = self._packed(record)
        self._episode_ids.add(episode_id)
        self._append(packed, ("episode", episode_id, None, attempt, self._offset, len(packed)))

    def add_all(self, records: Iterable[dict[str, Any]]) -> None:
        """`add` each record, writing full chunks as it goes (for callers in a thread)."""
        for record in records:
            self.add(record)
            if self._full:
                self.write(self.take())

    def take(self) -> list[bytes | bytearray]:
        """The full chunks packed since the last `take`, for `write`."""
        full, self._full = self._full, []
        self.full_bytes = 0
        return full

    def write(self, chunks: list[bytes | bytearray]) -> None:
        """Hash and write `chunks` (blocking); a failed write discards the file."""
        with self._io:
            self._write(chunks)

    def _write(self, chunks: list[bytes | bytearray]) -> None:
        fd = self._open_fd()
        for chunk in chunks:
            self._hash.update(chunk)
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                self.discard()
                raise TetherError("commit_failed", f"cannot write {self.path}: {exc}") from exc
            self._written += len(chunk)
        if self._written - self._synced >= SYNC_AHEAD and not self._sync_running():
            syncing = threading.Thread(target=self._sync, args=(fd,), name="tether-segment-sync")
            syncing.start()  # first: a thread that failed to start is never joined
            self._synced, self._syncing = self._written, syncing

    def _sync(self, fd: int) -> None:
        """Flush what is written so far (the background sync's thread)."""
        try:
            os.fdatasync(fd)
        except OSError as exc:
            # This fd's next fsync would not report it again: close raises it.
            self._sync_error = exc

    def _sync_running(self) -> bool:
        """Whether a background sync runs; a finished one's failure fails the segment."""
        if self._syncing is not None and self._syncing.is_alive():
            return True
        self._join_sync()
        return False

    def _join_sync(self) -> None:
        """Wait for the background sync (if any); raise what it failed with."""
        if self._syncing is not None:
            self._syncing.join()
            self._syncing = None
        if self._sync_error is not None:
            error, self._sync_error = self._sync_error, None
            self.discard()
            raise TetherError("commit_failed", f"cannot write {self.path}: {error}") from error

    def close(self) -> SegmentInfo:
        """Write the rest, the index and the trailer, fsync and close; the segment's info."""
        with self._io:
            return self._close()

    def _close(self) -> SegmentInfo:
        fd = self._open_fd()
        tail = self._pack(self._index) + self._offset.to_bytes(TRAILER_SIZE, "big")
        self._write([*self.take(), self._buffer, tail])
        self._buffer = bytearray()
        self._join_sync()
        try:
            os.fsync(fd)
        except OSError as exc:
            self.discard()
            raise TetherError("commit_failed", f"cannot write {self.path}: {exc}") from exc
        os.close(fd)
        self._fd = None
        return {
            "file": self.path.name,
            "bytes": self._written,
            "records": len(self._index),
            "digest": self._hash.hexdigest(),
        }

    def discard(self) -> None:
        """Close the file if open and remove it; safe to call more than once. Waits for
        a write in flight in another thread."""
        with self._io:
            if self._syncing is not None:
                self._syncing.join()  # it still uses the fd
                self._syncing = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self.path.unlink(missing_ok=True)

    def _open_fd(self) -> int:
        if self._fd is None:
            raise TetherError("commit_failed", f"{self.path} is already closed")
        return self._fd

    def _check_session(self, session_id: Any, is_open: Any, owner: Any) -> None:
        """Raise `commit_failed` saying what is wrong with a session record's fields, or
        note its owner as checked if that was all."""
        self._open_fd()
        if not _is_session_id(session_id):
            raise TetherError("commit_failed", f"session {session_id!r}: the ID is not 1 to "
                              "256 printable ASCII characters")
        if session_id in self._session_ids:
            raise TetherError("commit_failed", f"session {session_id!r} is exported twice")
        if type(is_open) is not bool:
            raise TetherError("commit_failed", f"session {session_id!r}: `open` is not a bool")
        if owner is not None and worker_id_or_none(owner) is None:
            raise TetherError("commit_failed", f"session {session_id!r}: owner {owner!r} is "
                              "not a worker ID")
        self._owners.add(owner)

    def _check_episode(self, episode_id: Any, attempt: Any) -> None:
        """Raise `commit_failed` saying what is wrong with an episode record's fields."""
        self._open_fd()
        if not _is_episode_id(episode_id):
            raise TetherError("commit_failed", f"episode {episode_id!r}: episode_id is not a "
                              "non-empty string")
        if episode_id in self._episode_ids:
            raise TetherError("commit_failed", f"episode {episode_id!r} is exported twice")
        if not _is_attempt(attempt):
            raise TetherError("commit_failed", f"episode {episode_id!r}: attempt {attempt!r} "
                              "is not a non-negative int")

    def _packed(self, record: dict[str, Any]) -> bytes:
        """`record` packed and checked against the size limit; errors name it."""
        try:
            packed = self._pack(record)
        except (TypeError, ValueError, OverflowError) as exc:
            _cannot_pack(record, exc)
        if len(packed) > self.max_record_bytes:
            _too_big(record, len(packed), self.max_record_bytes)
        return packed

    def _append(self, packed: bytes, entry: tuple[Any, ...]) -> None:
        self._index.append(entry)
        self._offset += len(packed)
        if len(packed) < WRITE_BUFFER:
            self._buffer += packed
            if len(self._buffer) < WRITE_BUFFER:
                return
            packed = b""
        self._seal(packed)

    def _seal(self, alone: bytes = b"") -> None:
        """Hand the buffer, then `alone` (a record too big to share one), to `take`."""
        for chunk in (self._buffer, alone):
            if chunk:
                self._full.append(chunk)
                self.full_bytes += len(chunk)
        self._buffer = bytearray()


# -- reading --------------------------------------------------------------------------


def _corrupt(path: Path, what: str) -> NoReturn:
    raise TetherError("corrupt_checkpoint", f"{path}: {what}")


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack ext type {code} in an index")


def read_index(path: str | os.PathLike[str]) -> list[IndexEntry]:
    """The segment's index entries, in file order; reads only the trailer and index.

    Checks that the trailer fits, the index offset lies in the file, the index is a
    msgpack list of well-formed entries, and the entries tile the records region exactly.
    """
    with gcpause.paused():  # a big index is a burst of surviving containers
        return _read_index(Path(path))


def _read_index(path: Path) -> list[IndexEntry]:
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if size < TRAILER_SIZE:
                _corrupt(path, f"{size} bytes is shorter than the {TRAILER_SIZE}-byte trailer")
            trailer = os.pread(file.fileno(), TRAILER_SIZE, size - TRAILER_SIZE)
            index_offset = int.from_bytes(trailer, "big")
            if index_offset > size - TRAILER_SIZE:
                _corrupt(path, f"index offset {index_offset} is outside the file ({size} bytes)")
            index_size = size - TRAILER_SIZE - index_offset
            data = os.pread(file.fileno(), index_size, index_offset)
    except FileNotFoundError:
        _corrupt(path, "segment file is missing")
    except OSError as exc:
        _corrupt(path, f"cannot be read: {exc}")
    if len(data) != index_size:
        _corrupt(path, "index is truncated")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            max_ext_len=0,
        )
    except Exception as exc:  # unpackb raises several types on malformed input
        _corrupt(path, f"index is not valid msgpack: {exc!r}")
    if not isinstance(raw, list):
        _corrupt(path, f"index is a {type(raw).__name__}, not a list")
    return _check_index(path, raw, index_offset)


def _check_index(path: Path, raw: list[Any], index_offset: int) -> list[IndexEntry]:
    """The validated entries; they must tile ``[0, index_offset)`` exactly, in order."""
    entries: list[IndexEntry] = []
    owners: set[str] = set()  # owners already checked: a segment has only a few
    make = IndexEntry._make
    end = 0
    for number, item in enumerate(raw):
        if type(item) is not list or len(item) != 6:
            _corrupt(path, f"index entry {number} is not a 6-element array")
        kind, ident, owner, attempt, offset, length = item
        if kind == "session":
            # _is_session_id inlined: this loop runs once per record of a checkpoint.
            if (
                type(ident) is not str
                or not 0 < len(ident) <= 256
                or not ident.isascii()
                or not ident.isprintable()
            ):
                _corrupt(path, f"index entry {number} has a malformed session ID")
            if owner is not None and owner not in owners:
                if worker_id_or_none(owner) is None:
                    _corrupt(path, f"index entry {number} has a malformed owner")
                owners.add(owner)
            if attempt is not None:
                _corrupt(path, f"index entry {number} is a session with an attempt")
        elif kind == "episode":
            if not _is_episode_id(ident) or not _is_attempt(attempt) or owner is not None:
                _corrupt(path, f"index entry {number} is a malformed episode entry")
        else:
            _corrupt(path, f"index entry {number} has unknown kind {kind!r}")
        if type(offset) is not int or type(length) is not int or not 0 < length <= MAX_RECORD_BYTES:
            _corrupt(path, f"index entry {number} has a malformed offset or length")
        if offset + length > index_offset:
            _corrupt(path, f"index entry {number} points outside the records region")
        if offset != end:
            what = "overlaps the record before it" if offset < end else f"leaves a gap after {end}"
            _corrupt(path, f"index entry {number} at offset {offset} {what}")
        end = offset + length
        entries.append(make(item))
    if end != index_offset:
        _corrupt(path, f"records region ends at {index_offset} but the index covers {end}")
    return entries


def _check_record(
    path: Path, entry: IndexEntry, data: memoryview, owners: set[str]
) -> dict[str, Any]:
    where = f"record at offset {entry.offset}"
    try:
        # States are app data: map keys may be ints as well as strings (see docs/format.md).
        record = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # unpackb raises several types on malformed input
        _corrupt(path, f"{where} is not valid msgpack: {exc!r}")
    problem = _record_problem(record, owners)
    if problem is not None:
        _corrupt(path, f"{where} {problem}")
    if record["kind"] != entry.kind:
        _corrupt(path, f"{where} is a {record['kind']}, the index says {entry.kind}")
    if entry.kind == "session":
        if (record["id"], record["owner"]) != (entry.id, entry.owner):
            _corrupt(path, f"{where} does not match its index entry's session ID and owner")
    elif (record["episode_id"], record["attempt"]) != (entry.id, entry.attempt):
        _corrupt(path, f"{where} does not match its index entry's episode ID and attempt")
    return record  # type: ignore[no-any-return]


def read_records(
    path: str | os.PathLike[str], entries: Iterable[IndexEntry] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the records of `entries` (all of the segment's if None), in the order given.

    Each record must decode to a well-formed map that matches its index entry. Pass
    entries that came from `read_index` of the same file. Runs of adjacent entries are
    read in chunks of about `WRITE_BUFFER` bytes; a lone entry reads only its own bytes.
    """
    path = Path(path)
    chosen = read_index(path) if entries is None else list(entries)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        _corrupt(path, f"cannot be read: {exc}")
    owners: set[str] = set()
    chunk = memoryview(b"")
    chunk_start = chunk_end = 0  # the file range `chunk` holds
    try:
        for number, entry in enumerate(chosen):
            start, end = entry.offset, entry.offset + entry.length
            if start < chunk_start or end > chunk_end:
                chunk_start, chunk_end = start, _run_end(chosen, number)
                try:
                    chunk = memoryview(os.pread(fd, chunk_end - chunk_start, chunk_start))
                except OSError as exc:
                    _corrupt(path, f"cannot be read: {exc}")
                if len(chunk) < end - start:
                    _corrupt(path, f"record at offset {start} is truncated")
                chunk_end = chunk_start + len(chunk)
            data = chunk[start - chunk_start : end - chunk_start]
            yield _check_record(path, entry, data, owners)
    finally:
        os.close(fd)


def _run_end(entries: list[IndexEntry], first: int) -> int:
    """Where to stop reading from entry `first`: the end of the run of adjacent entries
    after it, up to about `WRITE_BUFFER` bytes (always at least the whole first entry)."""
    start = entries[first].offset
    end = start + entries[first].length
    for following in range(first + 1, len(entries)):
        entry = entries[following]
        if entry.offset != end or end + entry.length - start > WRITE_BUFFER:
            break
        end += entry.length
    return end


def file_digest(
    path: str | os.PathLike[str], algorithm: str = DIGEST_ALGORITHM
) -> tuple[str, int]:
    """The file's hex digest (`algorithm`, one of `DIGESTS`) and its size in bytes, in one
    read."""
    digest = DIGESTS[algorithm]()
    size = 0
    block = bytearray(WRITE_BUFFER)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(block):
            digest.update(memoryview(block)[:read])
            size += read
    return digest.hexdigest(), size


def verify(
    path: str | os.PathLike[str],
    expected_digest: str,
    expected_bytes: int,
    expected_records: int,
    algorithm: str = DIGEST_ALGORITHM,
) -> None:
    """Check the segment's size, whole-file digest (`algorithm`) and record count against
    its manifest."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size != expected_bytes:
            _corrupt(path, f"is {size} bytes, the manifest says {expected_bytes}")
        digest, read = file_digest(path, algorithm)
    except FileNotFoundError:
        _corrupt(path, "segment file is missing")
    except OSError as exc:
        _corrupt(path, f"cannot be read: {exc}")
    if read != expected_bytes:
        _corrupt(path, f"read {read} bytes, the manifest says {expected_bytes}")
    if digest != expected_digest:
        _corrupt(path, f"{algorithm} digest {digest} differs from the manifest's")
    count = len(read_index(path))
    if count != expected_records:
        _corrupt(path, f"holds {count} records, the manifest says {expected_records}")
