"""The checkpoint store: layout, commit, manifests, CHECKPOINT.json, restore reads, `latest`.

Layout under a checkpoint root (SPEC 5.10, ``docs/format.md``)::

    <root>/<checkpoint_id>/<participant>/segment-<worker>.msgpack   one per worker
    <root>/<checkpoint_id>/<participant>/MANIFEST.json              the coordinator's
    <root>/<checkpoint_id>/CHECKPOINT.json                          the controller's, last

A commit writes into ``<root>/<id>/.<participant>.tmp-<random>/`` (`begin_commit`);
workers stream their segments there in parallel (`PendingCommit.segment_path`,
`segments.SegmentWriter`); the coordinator then writes the manifest and renames the
directory into place (`PendingCommit.publish`). The controller writes CHECKPOINT.json
last (`write_checkpoint_json`). A checkpoint is *complete* for participant P when its
CHECKPOINT.json lists P and the digest of P's MANIFEST.json file matches the one listed;
anything less does not exist for restore (`no_checkpoint`). `resolve_latest` is the one
definition of `latest`. Directories are created 0700 and files 0600.

Test-only fault hook: when the environment variable ``TETHER_TEST_FAULT`` names one of
`FAULT_POINTS`, the process reaching that point ends at once with ``os._exit(99)``, as a
crash would (no cleanup, no flush), so end-to-end tests can kill a commit exactly there:

- ``after_segments``: in `PendingCommit.publish`, before the manifest is written;
- ``after_manifest``: in `PendingCommit.publish`, after the participant directory is
  published (renamed and its parent fsynced), before it returns;
- ``before_checkpoint_rename``: in `write_checkpoint_json`, after the temporary
  CHECKPOINT.json is written and fsynced, before it is moved into place.

Never set it outside tests.

Every function here is blocking file I/O, meant to run in a thread.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TypedDict

from tether.checkpoint.segments import (
    DIGEST_ALGORITHM,
    DIGEST_HEX_LENGTH,
    IndexEntry,
    SegmentInfo,
    read_index,
    verify,
)
from tether.routing.errors import ErrorCode, TetherError
from tether.routing.types import worker_id_or_none

__all__ = [
    "CHECKPOINT_NAME",
    "FAULT_ENV",
    "FAULT_POINTS",
    "FORMAT",
    "MANIFEST_NAME",
    "PARTICIPANT_NAME",
    "Checkpoint",
    "ManifestFields",
    "ManifestSegment",
    "ParticipantEntry",
    "PendingCommit",
    "RecordCounts",
    "Segment",
    "begin_commit",
    "encode_manifest",
    "list_checkpoints",
    "load_checkpoint",
    "manifest_digest",
    "read_manifest_digest",
    "resolve_latest",
    "sweep_temp",
    "validate_checkpoint_id",
    "validate_participant",
    "verify_segments",
    "write_checkpoint_json",
]

FORMAT = 1
MANIFEST_NAME = "MANIFEST.json"
CHECKPOINT_NAME = "CHECKPOINT.json"
FAULT_ENV = "TETHER_TEST_FAULT"
FAULT_EXIT_CODE = 99
FAULT_POINTS = ("after_segments", "after_manifest", "before_checkpoint_rename")
# Manifests and CHECKPOINT.json are small; anything bigger is not one of ours.
_MAX_JSON_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PARTICIPANT_NAME = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(@[A-Za-z0-9][A-Za-z0-9._-]{0,62})?"
)
"""A name, or a cluster host's `<service>@<host_id>`."""
_HEX_DIGEST = re.compile(r"[0-9a-f]+")
# Readers need these keys and ignore any others, in every JSON object of the format.
_SEGMENT_KEYS = frozenset({"file", "bytes", "records", "digest", "worker"})
_PARTICIPANT_KEYS = frozenset({"name", "url", "manifest_digest"})

StrPath = str | os.PathLike[str]


class RecordCounts(TypedDict):
    """Records of each kind across a participant's segments."""

    sessions: int
    episodes: int


class ManifestSegment(SegmentInfo):
    """A manifest's entry for one segment: its `SegmentInfo` and the worker that wrote it."""

    worker: str


class ManifestFields(TypedDict):
    """What the coordinator supplies to `PendingCommit.publish`; the store adds the rest."""

    workers: list[str]
    owner_aliases: dict[str, str]
    state_version: str | None
    records: RecordCounts
    segments: list[ManifestSegment]


class ParticipantEntry(TypedDict):
    """One participant as CHECKPOINT.json lists it."""

    name: str
    url: str
    manifest_digest: str


# -- names, time, files ---------------------------------------------------------------


def validate_checkpoint_id(value: object) -> str:
    """`value` if it is a valid checkpoint ID, else 422 `invalid_checkpoint_id`."""
    if isinstance(value, str) and _NAME.fullmatch(value) and value != "latest":
        return value
    raise TetherError("invalid_checkpoint_id", f"bad checkpoint ID {value!r}")


def validate_participant(value: object) -> str:
    """`value` if it is a valid participant name (a directory name), else ValueError."""
    if isinstance(value, str) and PARTICIPANT_NAME.fullmatch(value):
        return value
    raise ValueError(f"bad participant name {value!r}: must match {PARTICIPANT_NAME.pattern}")


def _fault(point: str) -> None:
    """Test-only: end the process at once, as a crash would, if TETHER_TEST_FAULT names it."""
    if os.environ.get(FAULT_ENV) == point:
        os._exit(FAULT_EXIT_CODE)


@functools.cache
def _tether_version() -> str:
    try:
        return importlib.metadata.version("tether")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.astimezone(UTC) if parsed.tzinfo is not None else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(path: Path, data: bytes) -> None:
    """Create `path` (0600, must not exist), write `data` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_json(path: Path) -> Any:
    """The file's decoded JSON; ValueError if it is not JSON or too big."""
    with open(path, "rb") as file:
        data = file.read(_MAX_JSON_BYTES + 1)
    if len(data) > _MAX_JSON_BYTES:
        raise ValueError(f"over {_MAX_JSON_BYTES} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _fail(code: ErrorCode, detail: str) -> NoReturn:
    raise TetherError(code, detail)


# -- manifests ------------------------------------------------------------------------


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """MANIFEST.json's bytes: canonical JSON (sorted keys, 2-space indent, ASCII, newline)."""
    return json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=True).encode() + b"\n"


def manifest_digest(manifest_bytes: bytes) -> str:
    """The digest CHECKPOINT.json lists for a MANIFEST.json file: sha256 hex of its bytes."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(manifest: Any, checkpoint_id: str, participant: str) -> str | None:
    """Why `manifest` is not a well-formed format-1 manifest of this checkpoint, or None."""
    if not isinstance(manifest, dict):
        return "manifest is not a JSON object"
    version = manifest.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        return "manifest `format` is missing or not an int"
    if version != FORMAT:
        return f"unknown manifest format version {version} (this tether reads {FORMAT})"
    if not isinstance(manifest.get("tether_version"), str):
        return "manifest `tether_version` is missing or not a string"
    if manifest.get("participant") != participant:
        return f"manifest `participant` is {manifest.get('participant')!r}, not {participant!r}"
    if manifest.get("checkpoint_id") != checkpoint_id:
        return f"manifest `checkpoint_id` is {manifest.get('checkpoint_id')!r}"
    if _parse_time(manifest.get("created_at")) is None:
        return "manifest `created_at` is missing or not an RFC 3339 time with a zone"
    workers = manifest.get("workers")
    if not isinstance(workers, list) or any(worker_id_or_none(w) is None for w in workers):
        return "manifest `workers` is not a list of worker IDs"
    if len(set(workers)) != len(workers):
        return "manifest `workers` lists a worker twice"
    aliases = manifest.get("owner_aliases")
    if not isinstance(aliases, dict) or any(
        worker_id_or_none(old) is None or worker_id_or_none(new) is None
        for old, new in aliases.items()
    ):
        return "manifest `owner_aliases` is not a map of worker IDs to worker IDs"
    algorithm = manifest.get("digest_algorithm")
    if not isinstance(algorithm, str) or algorithm not in DIGEST_HEX_LENGTH:
        return f"manifest `digest_algorithm` is {algorithm!r}"
    records = manifest.get("records")
    if (
        not isinstance(records, dict)
        or set(records) != {"sessions", "episodes"}
        or not all(_is_count(n) for n in records.values())
    ):
        return "manifest `records` is not {sessions: n, episodes: n}"
    state_version = manifest.get("state_version", 0)
    if state_version is not None and not isinstance(state_version, str):
        return "manifest `state_version` is missing or neither a string nor null"
    segments = manifest.get("segments")
    if not isinstance(segments, list):
        return "manifest `segments` is missing or not a list"
    files: set[str] = set()
    for number, segment in enumerate(segments):
        if (
            not isinstance(segment, dict)
            or not segment.keys() >= _SEGMENT_KEYS
            or not _is_count(segment["bytes"])
            or not _is_count(segment["records"])
            or not isinstance(segment["digest"], str)
            or len(segment["digest"]) != DIGEST_HEX_LENGTH[algorithm]
            or not _HEX_DIGEST.fullmatch(segment["digest"])
        ):
            return f"manifest segment {number} is malformed"
        if segment["worker"] not in workers:
            return f"manifest segment {number} names a worker not in `workers`"
        if segment["file"] != f"segment-{segment['worker']}.msgpack" or segment["file"] in files:
            return f"manifest segment {number} has a bad or repeated file name"
        files.add(segment["file"])
    if sum(s["records"] for s in segments) != records["sessions"] + records["episodes"]:
        return "manifest `records` do not add up to its segments' record counts"
    return None


def _count_records(
    directory: Path, segments: Sequence[ManifestSegment], read_indexes: bool = True
) -> tuple[list[list[IndexEntry]], RecordCounts]:
    """Every segment's index, checked against the manifest's sizes and counts.

    Raises `corrupt_checkpoint` on a missing file, a size or count that differs, a
    malformed index, or a session or episode ID held twice. Without `read_indexes`, checks sizes
    only and returns no indexes and zero counts.
    """
    indexes: list[list[IndexEntry]] = []
    counts = RecordCounts(sessions=0, episodes=0)
    seen: dict[str | tuple[str, str], str] = {}  # session IDs, ("episode", ID)s
    for segment in segments:
        path = directory / segment["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            _fail("corrupt_checkpoint", f"{path}: segment file is missing")
        except OSError as exc:
            _fail("corrupt_checkpoint", f"{path}: cannot be read: {exc}")
        if size != segment["bytes"]:
            _fail(
                "corrupt_checkpoint", f"{path}: is {size} bytes, manifest says {segment['bytes']}"
            )
        if not read_indexes:
            continue
        entries = read_index(path)
        if len(entries) != segment["records"]:
            _fail(
                "corrupt_checkpoint",
                f"{path}: holds {len(entries)} records, manifest says {segment['records']}",
            )
        for entry in entries:
            if entry.kind == "session":
                counts["sessions"] += 1
                if entry.id in seen:
                    _fail(
                        "corrupt_checkpoint",
                        f"session {entry.id!r} is held twice: in {seen[entry.id]} "
                        f"and in {segment['file']}",
                    )
                seen[entry.id] = segment["file"]
            else:
                counts["episodes"] += 1
                if ("episode", entry.id) in seen:
                    _fail(
                        "corrupt_checkpoint",
                        f"episode {entry.id!r} is held twice: in "
                        f"{seen['episode', entry.id]} and in {segment['file']}",
                    )
                seen["episode", entry.id] = segment["file"]
        indexes.append(entries)
    return indexes, counts


# -- commit ---------------------------------------------------------------------------


class PendingCommit:
    """A participant's commit in progress: a private temp dir, published by `publish`.

    Used as a context manager, an exception before `publish` succeeds removes the temp
    dir and everything in it.
    """

    def __init__(self, root: Path, checkpoint_id: str, participant: str, temp_dir: Path) -> None:
        self.root = root
        self.checkpoint_id = checkpoint_id
        self.participant = participant
        self.temp_dir = temp_dir
        self.target = root / checkpoint_id / participant
        self.manifest: dict[str, Any] | None = None

    def __enter__(self) -> PendingCommit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.manifest is None:
            self.abort()

    def segment_path(self, worker_id: str) -> Path:
        """Where worker `worker_id` writes its segment (with `segments.SegmentWriter`)."""
        if worker_id_or_none(worker_id) is None:
            raise ValueError(f"bad worker ID {worker_id!r}")
        return self.temp_dir / f"segment-{worker_id}.msgpack"

    def publish(
        self,
        fields: ManifestFields,
        *,
        check_indexes: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> dict[str, Any]:
        """Write MANIFEST.json, move the temp dir into place, and return the manifest.

        Checks the fields and the segment files first (listed files present and no
        others, sizes; with `check_indexes`, also every index, the per-kind counts and no
        session twice, about 0.15 s per 100,000 records). Any failure removes the temp
        dir and raises `commit_failed`, or `stale_checkpoint` if the participant
        directory exists. Publishing again returns the same manifest.
        """
        if self.manifest is not None:
            return self.manifest
        try:
            manifest = self._publish(fields, check_indexes, clock)
        except BaseException:
            self.abort()
            raise
        self.manifest = manifest
        _fault("after_manifest")
        return manifest

    def _publish(
        self, fields: ManifestFields, check_indexes: bool, clock: Callable[[], float]
    ) -> dict[str, Any]:
        _fault("after_segments")
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "tether_version": _tether_version(),
            "participant": self.participant,
            "checkpoint_id": self.checkpoint_id,
            "created_at": _timestamp(clock()),
            "workers": fields["workers"],
            "owner_aliases": fields["owner_aliases"],
            "digest_algorithm": DIGEST_ALGORITHM,
            "records": fields["records"],
            "state_version": fields["state_version"],
            "segments": fields["segments"],
        }
        problem = _manifest_problem(manifest, self.checkpoint_id, self.participant)
        if problem is not None:
            _fail("commit_failed", problem)
        try:
            present = {path.name for path in self.temp_dir.iterdir()}
            listed = {segment["file"] for segment in fields["segments"]}
            if present != listed:
                _fail(
                    "commit_failed",
                    f"segments on disk {sorted(present)} differ from the manifest's "
                    f"{sorted(listed)}",
                )
            try:
                _, counts = _count_records(self.temp_dir, fields["segments"], check_indexes)
            except TetherError as exc:
                _fail("commit_failed", str(exc.detail))
            if check_indexes and counts != fields["records"]:
                _fail("commit_failed", f"segments hold {counts}, manifest says {fields['records']}")
            _write_new_file(self.temp_dir / MANIFEST_NAME, encode_manifest(manifest))
            _fsync_dir(self.temp_dir)
            if self.target.exists():
                self._stale()
            try:
                os.rename(self.temp_dir, self.target)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    self._stale()
                raise
            _fsync_dir(self.target.parent)
        except OSError as exc:
            _fail("commit_failed", f"cannot publish {self.target}: {exc}")
        return manifest

    def _stale(self) -> NoReturn:
        _fail("stale_checkpoint", f"{self.target} is already published")

    def abort(self) -> None:
        """Remove the temp dir and everything in it; nothing once published."""
        if self.manifest is None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def begin_commit(root: StrPath, checkpoint_id: str, participant: str) -> PendingCommit:
    """Start a participant's commit: a fresh ``<root>/<id>/.<participant>.tmp-*`` dir.

    409 `stale_checkpoint` if the participant's directory for this ID is published.
    """
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    participant = validate_participant(participant)
    root = Path(root)
    directory = root / checkpoint_id
    if (directory / participant).exists():
        _fail("stale_checkpoint", f"{directory / participant} is already published")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not directory.is_dir():
            directory.mkdir(mode=0o700, exist_ok=True)
            _fsync_dir(root)
        temp_dir = Path(tempfile.mkdtemp(prefix=f".{participant}.tmp-", dir=directory))
    except OSError as exc:
        _fail("commit_failed", f"cannot create a commit directory in {directory}: {exc}")
    return PendingCommit(root, checkpoint_id, participant, temp_dir)


def sweep_temp(root: StrPath, checkpoint_id: str | None, participant: str) -> int:
    """Remove a participant's temp dirs left by crashed commits of `checkpoint_id` (of
    every checkpoint under `root` if None); returns how many.

    Call it only when no commit of this participant is running (its temp dir would go).
    """
    root = Path(root)
    prefix = f".{validate_participant(participant)}.tmp-"
    if checkpoint_id is not None:
        directories = [root / validate_checkpoint_id(checkpoint_id)]
    else:
        try:
            directories = [path for path in root.iterdir() if not path.name.startswith(".")]
        except FileNotFoundError:
            return 0
    removed = 0
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            # Exactly this participant's: mkdtemp's suffix has no dot, so the dirs of a
            # participant named "<participant>.tmp-x" do not match.
            rest = path.name[len(prefix) :]
            if path.name.startswith(prefix) and "." not in rest and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    return removed


def read_manifest_digest(root: StrPath, checkpoint_id: str, participant: str) -> str:
    """The `manifest_digest` of a published participant; 404 `no_checkpoint` if none."""
    path = Path(root) / validate_checkpoint_id(checkpoint_id)
    path = path / validate_participant(participant) / MANIFEST_NAME
    try:
        return manifest_digest(path.read_bytes())
    except OSError:
        _fail("no_checkpoint", f"{path} does not exist")


# -- CHECKPOINT.json ------------------------------------------------------------------


def _checkpoint_problem(doc: Any, checkpoint_id: str) -> str | None:
    """Why `doc` is not a well-formed format-1 CHECKPOINT.json of this ID, or None."""
    if not isinstance(doc, dict):
        return "CHECKPOINT.json is not a JSON object"
    version = doc.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        return "CHECKPOINT.json `format` is missing or not an int"
    if version != FORMAT:
        return f"unknown CHECKPOINT.json format version {version} (this tether reads {FORMAT})"
    if doc.get("checkpoint_id") != checkpoint_id:
        return f"CHECKPOINT.json `checkpoint_id` is {doc.get('checkpoint_id')!r}"
    if _parse_time(doc.get("created_at")) is None:
        return "CHECKPOINT.json `created_at` is missing or not an RFC 3339 time with a zone"
    return _participants_problem(doc.get("participants")) or _scope_problem(doc.get("scope", 0))


def _participants_problem(participants: Any) -> str | None:
    if not isinstance(participants, list) or not participants:
        return "`participants` is not a non-empty list"
    names: set[str] = set()
    for item in participants:
        if (
            not isinstance(item, dict)
            or not item.keys() >= _PARTICIPANT_KEYS
            or not isinstance(item["name"], str)
            or not PARTICIPANT_NAME.fullmatch(item["name"])
            or not isinstance(item["url"], str)
            or not isinstance(item["manifest_digest"], str)
            or len(item["manifest_digest"]) != DIGEST_HEX_LENGTH["sha256"]
            or not _HEX_DIGEST.fullmatch(item["manifest_digest"])
        ):
            return f"participant {item!r} is not {{name, url, manifest_digest}}"
        if item["name"] in names:
            return f"participant {item['name']!r} is listed twice"
        names.add(item["name"])
    return None


def _scope_problem(scope: Any) -> str | None:
    if scope is None or (isinstance(scope, list) and all(isinstance(e, str) and e for e in scope)):
        return None
    return "`scope` is neither null nor a list of episode IDs"


def write_checkpoint_json(
    root: StrPath,
    checkpoint_id: str,
    participants: Sequence[ParticipantEntry],
    scope: Sequence[str] | None,
    controller_state: Any,
    *,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """Write ``<root>/<id>/CHECKPOINT.json`` atomically, last of all; return what it holds.

    Every participant's MANIFEST.json must be published with the digest listed
    (`commit_failed` otherwise); an existing CHECKPOINT.json is 409 `stale_checkpoint`.
    Bad arguments are 422 `invalid_request`.
    """
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    directory = Path(root) / checkpoint_id
    doc: dict[str, Any] = {
        "format": FORMAT,
        "checkpoint_id": checkpoint_id,
        "created_at": _timestamp(clock()),
        "participants": list(participants),
        "scope": None if scope is None else list(scope),
        "controller_state": controller_state,
    }
    problem = _participants_problem(doc["participants"]) or _scope_problem(doc["scope"])
    if problem is not None:
        _fail("invalid_request", problem)
    doc["participants"] = [
        {k: p[k] for k in ("name", "url", "manifest_digest")} for p in participants
    ]
    try:
        data = json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        _fail("invalid_request", f"controller_state is not JSON: {exc}")
    for participant in participants:
        try:
            digest = read_manifest_digest(root, checkpoint_id, participant["name"])
        except TetherError:
            digest = None
        if digest != participant["manifest_digest"]:
            _fail(
                "commit_failed",
                f"participant {participant['name']!r} has no published manifest with digest "
                f"{participant['manifest_digest']}",
            )
    final = directory / CHECKPOINT_NAME
    temp = directory / f".{CHECKPOINT_NAME}.tmp-{secrets.token_hex(8)}"
    try:
        _write_new_file(temp, data)
        _fault("before_checkpoint_rename")
        try:
            # A hard link, not a rename: it refuses to replace an existing CHECKPOINT.json.
            os.link(temp, final)
        except FileExistsError:
            _fail("stale_checkpoint", f"{final} already exists")
        finally:
            temp.unlink(missing_ok=True)
        _fsync_dir(directory)
    except OSError as exc:
        _fail("commit_failed", f"cannot write {final}: {exc}")
    return doc


# -- reading for restore ------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One segment of a loaded checkpoint: its file, what the manifest says, its index."""

    worker: str
    path: Path
    bytes: int
    records: int
    digest: str
    entries: list[IndexEntry]


@dataclass(frozen=True)
class Checkpoint:
    """A participant's complete, checked checkpoint: what restore places and installs."""

    checkpoint_id: str
    participant: str
    directory: Path
    manifest: dict[str, Any]
    checkpoint: dict[str, Any]
    segments: list[Segment]


def _load_checkpoint_json(directory: Path, checkpoint_id: str) -> dict[str, Any]:
    path = directory / CHECKPOINT_NAME
    try:
        doc = _read_json(path)
    except FileNotFoundError:
        _fail("no_checkpoint", f"checkpoint {checkpoint_id!r} has no {CHECKPOINT_NAME}")
    except (OSError, ValueError) as exc:
        _fail("corrupt_checkpoint", f"{path}: cannot be read as JSON: {exc}")
    problem = _checkpoint_problem(doc, checkpoint_id)
    if problem is not None:
        _fail("corrupt_checkpoint", f"{path}: {problem}")
    return doc  # type: ignore[no-any-return]


def _listed_manifest(directory: Path, doc: dict[str, Any], participant: str) -> bytes | None:
    """P's MANIFEST.json bytes if `doc` lists P with their digest, else None (incomplete)."""
    for item in doc["participants"]:
        if item["name"] == participant:
            try:
                data = (directory / participant / MANIFEST_NAME).read_bytes()
            except OSError:
                return None
            return data if manifest_digest(data) == item["manifest_digest"] else None
    return None


def load_checkpoint(
    root: StrPath, checkpoint_id: str, participant: str, *, verify_digests: bool = True
) -> Checkpoint:
    """Load participant `participant`'s part of a checkpoint, reading indexes, not states.

    404 `no_checkpoint` unless the checkpoint is complete for the participant. 422
    `corrupt_checkpoint` on an unknown format, a malformed manifest, a segment missing or
    differing from the manifest in size or record count, a malformed index, a session ID
    held twice, or per-kind counts that differ. With `verify_digests` (the default) every
    segment's whole-file digest is checked too (`verify_segments`); pass False to do that
    separately, e.g. one segment per thread.
    """
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    participant = validate_participant(participant)
    directory = Path(root) / checkpoint_id
    doc = _load_checkpoint_json(directory, checkpoint_id)
    data = _listed_manifest(directory, doc, participant)
    if data is None:
        _fail(
            "no_checkpoint",
            f"checkpoint {checkpoint_id!r} is not complete for participant {participant!r}",
        )
    path = directory / participant / MANIFEST_NAME
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:
        _fail("corrupt_checkpoint", f"{path}: is not JSON: {exc}")
    problem = _manifest_problem(manifest, checkpoint_id, participant)
    if problem is not None:
        _fail("corrupt_checkpoint", f"{path}: {problem}")
    indexes, counts = _count_records(directory / participant, manifest["segments"])
    if counts != manifest["records"]:
        _fail("corrupt_checkpoint", f"{path}: segments hold {counts}, not {manifest['records']}")
    checkpoint = Checkpoint(
        checkpoint_id=checkpoint_id,
        participant=participant,
        directory=directory / participant,
        manifest=manifest,
        checkpoint=doc,
        segments=[
            Segment(
                worker=item["worker"],
                path=directory / participant / item["file"],
                bytes=item["bytes"],
                records=item["records"],
                digest=item["digest"],
                entries=entries,
            )
            for item, entries in zip(manifest["segments"], indexes, strict=True)
        ],
    )
    if verify_digests:
        verify_segments(checkpoint)
    return checkpoint


def verify_segments(checkpoint: Checkpoint) -> None:
    """Check every segment's size, whole-file digest and record count (reads every byte)."""
    algorithm = checkpoint.manifest["digest_algorithm"]
    for segment in checkpoint.segments:
        verify(segment.path, segment.digest, segment.bytes, segment.records, algorithm)


# -- listing and `latest` -------------------------------------------------------------


@dataclass(frozen=True)
class _Summary:
    checkpoint_id: str
    created_at: datetime | None
    participants: list[str]
    complete_for: frozenset[str]

    @property
    def complete(self) -> bool:
        return bool(self.participants) and self.complete_for == set(self.participants)


def _summaries(root: Path) -> list[_Summary]:
    """Every checkpoint directory under `root`, newest first (undated ones last)."""
    found: list[_Summary] = []
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir())
    except OSError:
        return []
    for name in names:
        if not _NAME.fullmatch(name) or name == "latest":
            continue
        try:
            doc = _load_checkpoint_json(root / name, name)
        except TetherError:
            found.append(_Summary(name, None, [], frozenset()))
            continue
        listed = [item["name"] for item in doc["participants"]]
        complete_for = frozenset(
            p for p in listed if _listed_manifest(root / name, doc, p) is not None
        )
        found.append(_Summary(name, _parse_time(doc["created_at"]), listed, complete_for))
    epoch = datetime.min.replace(tzinfo=UTC)
    found.sort(key=lambda s: (s.created_at or epoch, s.checkpoint_id), reverse=True)
    return found


def resolve_latest(root: StrPath, participant: str | None = None) -> str | None:
    """The ID `latest` means: the complete checkpoint with the greatest `created_at`.

    Ties go to the greater ID. With `participant`, complete for that participant; without,
    complete for every participant its CHECKPOINT.json lists. None if there is none. Used
    by both `tether ctl` and `tether serve --restore latest`.
    """
    if participant is not None:
        participant = validate_participant(participant)
    for summary in _summaries(Path(root)):
        if summary.created_at is None:
            continue
        if summary.complete if participant is None else participant in summary.complete_for:
            return summary.checkpoint_id
    return None


def list_checkpoints(root: StrPath) -> list[dict[str, Any]]:
    """Every checkpoint under `root`, newest first: `{id, created_at, participants, complete}`.

    `created_at` is null and `complete` false when CHECKPOINT.json is missing or unreadable.
    """
    return [
        {
            "id": s.checkpoint_id,
            "created_at": s.created_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if s.created_at else None,
            "participants": s.participants,
            "complete": s.complete,
        }
        for s in _summaries(Path(root))
    ]
