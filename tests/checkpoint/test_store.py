"""The checkpoint store: layout, commit, manifests, CHECKPOINT.json, restore checks, `latest`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tether.checkpoint.segments import SegmentWriter, read_index, read_records
from tether.checkpoint.store import (
    CHECKPOINT_NAME,
    FAULT_ENV,
    FAULT_POINTS,
    MANIFEST_NAME,
    begin_commit,
    encode_manifest,
    list_checkpoints,
    load_checkpoint,
    manifest_digest,
    read_manifest_digest,
    resolve_latest,
    sweep_temp,
    validate_checkpoint_id,
    validate_participant,
    verify_segments,
    write_checkpoint_json,
)
from tether.routing.errors import TetherError
from tether.routing.types import new_worker_id

W1, W2 = sorted(str(new_worker_id()) for _ in range(2))
T0 = 1_800_000_000.0
ROOT = Path(__file__).resolve().parents[2]


def session(sid: str, state: Any = None, owner: str | None = W1) -> dict[str, Any]:
    return {"kind": "session", "id": sid, "open": True, "owner": owner, "state": state}


def episode(eid: str, attempt: int = 1, state: Any = None) -> dict[str, Any]:
    return {"kind": "episode", "episode_id": eid, "attempt": attempt, "state": state}


def default_segments() -> dict[str, list[dict[str, Any]]]:
    return {
        W1: [session("a", {"n": 1}), episode("e1", 2, {"step": 3}), session("b", [1, 2])],
        W2: [session("c", "x" * 500, owner=W2), episode("e2", 1, None)],
    }


def commit(
    root: Path,
    checkpoint_id: str,
    participant: str = "srv",
    segments: dict[str, list[dict[str, Any]]] | None = None,
    *,
    at: float = T0,
    check_indexes: bool = True,
) -> dict[str, Any]:
    """A whole participant commit: one segment per worker, then publish."""
    segments = default_segments() if segments is None else segments
    pending = begin_commit(root, checkpoint_id, participant)
    infos: list[Any] = []
    for worker, records in segments.items():
        with SegmentWriter(pending.segment_path(worker)) as writer:
            for record in records:
                writer.add(record)
            infos.append({**writer.close(), "worker": worker})
    every = [r for records in segments.values() for r in records]
    return pending.publish(
        {
            "workers": list(segments),
            "owner_aliases": {new_worker_id(): W1},
            "state_version": "v1",
            "records": {
                "sessions": sum(r["kind"] == "session" for r in every),
                "episodes": sum(r["kind"] == "episode" for r in every),
            },
            "segments": infos,
        },
        clock=lambda: at,
        check_indexes=check_indexes,
    )


def complete(
    root: Path, checkpoint_id: str, participants: Iterable[str] = ("srv",), *, at: float = T0
) -> dict[str, Any]:
    """The controller's last step: CHECKPOINT.json listing each participant's manifest."""
    return write_checkpoint_json(
        root,
        checkpoint_id,
        [
            {
                "name": p,
                "url": f"http://{p}:8000",
                "manifest_digest": read_manifest_digest(root, checkpoint_id, p),
            }
            for p in participants
        ],
        ["e1"],
        {"step": 12},
        clock=lambda: at,
    )


def rewrite_manifest(
    root: Path, checkpoint_id: str, change: Callable[[dict[str, Any]], None]
) -> None:
    """Edit srv's manifest and list its new digest, as a lying (but complete) checkpoint."""
    path = root / checkpoint_id / "srv" / MANIFEST_NAME
    manifest = json.loads(path.read_bytes())
    change(manifest)
    path.write_bytes(encode_manifest(manifest))
    (root / checkpoint_id / CHECKPOINT_NAME).unlink()
    complete(root, checkpoint_id)


def error_of(code: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(TetherError) as caught:
        call(*args, **kwargs)
    assert caught.value.code == code, caught.value
    return str(caught.value.detail)


# -- names ----------------------------------------------------------------------------


@pytest.mark.parametrize("good", ["c1", "2026-11-29T08.40.00Z", "A", "a" * 128, "x_y-z.1"])
def test_valid_checkpoint_ids_are_accepted(good: str) -> None:
    assert validate_checkpoint_id(good) == good
    assert validate_participant(good) == good


@pytest.mark.parametrize("bad", ["", "latest", ".hidden", "-x", "a" * 129, "a/b", "a b", "é", 7])
def test_bad_checkpoint_ids_are_invalid_checkpoint_id(bad: Any) -> None:
    error_of("invalid_checkpoint_id", validate_checkpoint_id, bad)


@pytest.mark.parametrize("bad", ["", ".srv", "a/b", "..", "a" * 129])
def test_bad_participant_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="bad participant name"):
        validate_participant(bad)


# -- commit ---------------------------------------------------------------------------


def test_commit_publishes_segments_and_the_manifest_under_the_participant(tmp_path: Path) -> None:
    manifest = commit(tmp_path, "c1")
    directory = tmp_path / "c1" / "srv"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [MANIFEST_NAME, f"segment-{W1}.msgpack", f"segment-{W2}.msgpack"]
    )
    assert [p.name for p in (tmp_path / "c1").iterdir()] == ["srv"]  # no temp dir left
    assert json.loads((directory / MANIFEST_NAME).read_bytes()) == manifest
    assert (directory / MANIFEST_NAME).read_bytes() == encode_manifest(manifest)


def test_the_manifest_has_exactly_the_contract_fields(tmp_path: Path) -> None:
    manifest = commit(tmp_path, "c1")
    assert set(manifest) == {
        "format", "tether_version", "participant", "checkpoint_id", "created_at", "workers",
        "owner_aliases", "digest_algorithm", "records", "state_version", "segments",
    }  # fmt: skip
    assert manifest["format"] == 1
    assert isinstance(manifest["tether_version"], str)
    assert (manifest["participant"], manifest["checkpoint_id"]) == ("srv", "c1")
    assert manifest["created_at"] == "2027-01-15T08:00:00.000000Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", manifest["created_at"])
    assert manifest["workers"] == [W1, W2]
    assert manifest["digest_algorithm"] == "xxh3_128"
    assert manifest["records"] == {"sessions": 3, "episodes": 2}
    assert manifest["state_version"] == "v1"
    assert [set(s) for s in manifest["segments"]] == [
        {"file", "bytes", "records", "digest", "worker"}
    ] * 2
    assert [(s["worker"], s["records"]) for s in manifest["segments"]] == [(W1, 3), (W2, 2)]


def test_directories_are_0700_and_files_0600(tmp_path: Path) -> None:
    root = tmp_path / "root"
    commit(root, "c1")
    complete(root, "c1")
    for path in [root, root / "c1", root / "c1" / "srv"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    files = [*(root / "c1" / "srv").iterdir(), root / "c1" / CHECKPOINT_NAME]
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    pending = begin_commit(root, "c2", "srv")
    assert stat.S_IMODE(pending.temp_dir.stat().st_mode) == 0o700
    assert pending.temp_dir.name.startswith(".srv.tmp-")
    pending.abort()


def test_commit_to_a_published_participant_is_stale(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    error_of("stale_checkpoint", begin_commit, tmp_path, "c1", "srv")
    commit(tmp_path, "c1", "other")  # another participant of the same checkpoint is fine


def test_a_participant_published_meanwhile_makes_publish_stale_and_removes_the_temp_dir(
    tmp_path: Path,
) -> None:
    late = begin_commit(tmp_path, "c1", "srv")
    commit(tmp_path, "c1")
    with pytest.raises(TetherError) as caught:
        late.publish(
            {"workers": [], "owner_aliases": {}, "state_version": None,
             "records": {"sessions": 0, "episodes": 0}, "segments": []}
        )  # fmt: skip
    assert caught.value.code == "stale_checkpoint"
    assert not late.temp_dir.exists()
    assert (tmp_path / "c1" / "srv" / MANIFEST_NAME).exists()


def test_abort_removes_the_temp_dir_and_its_segments(tmp_path: Path) -> None:
    pending = begin_commit(tmp_path, "c1", "srv")
    with SegmentWriter(pending.segment_path(W1)) as writer:
        writer.add(session("a"))
        writer.close()
    pending.abort()
    assert not pending.temp_dir.exists()
    assert list((tmp_path / "c1").iterdir()) == []


def test_an_exception_in_the_commit_block_aborts_it(tmp_path: Path) -> None:
    def commit_then_fail() -> None:
        with begin_commit(tmp_path, "c1", "srv") as pending:
            pending.segment_path(W1).write_bytes(b"partial")
            raise RuntimeError("worker lost")

    with pytest.raises(RuntimeError):
        commit_then_fail()
    assert list((tmp_path / "c1").iterdir()) == []


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda f: f["records"].update(sessions=4), "add up"),
        (
            lambda f: (f["segments"].pop(), f["records"].update(sessions=2, episodes=1)),
            "differ from the manifest",
        ),
        (lambda f: f["segments"][0].update(bytes=1), "manifest says 1"),
        (lambda f: f["workers"].remove(W2), "not in `workers`"),
        (lambda f: f.update(owner_aliases={"x": W1}), "owner_aliases"),
    ],
)
def test_publish_refuses_fields_that_disagree_with_the_segments(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], what: str
) -> None:
    pending = begin_commit(tmp_path, "c1", "srv")
    infos: list[Any] = []
    for worker, records in default_segments().items():
        with SegmentWriter(pending.segment_path(worker)) as writer:
            for record in records:
                writer.add(record)
            infos.append({**writer.close(), "worker": worker})
    fields: Any = {
        "workers": [W1, W2], "owner_aliases": {}, "state_version": None,
        "records": {"sessions": 3, "episodes": 2}, "segments": infos,
    }  # fmt: skip
    change(fields)
    assert what in error_of("commit_failed", pending.publish, fields)
    assert not pending.temp_dir.exists()
    assert not (tmp_path / "c1" / "srv").exists()


def test_publish_refuses_a_session_held_by_two_workers(tmp_path: Path) -> None:
    segments = {W1: [session("same")], W2: [session("same", owner=W2)]}
    detail = error_of("commit_failed", commit, tmp_path, "c1", segments=segments)
    assert "'same'" in detail


def test_sweep_temp_removes_crashed_commits_of_that_participant_only(tmp_path: Path) -> None:
    crashed = [begin_commit(tmp_path, "c1", "srv") for _ in range(2)]
    other = begin_commit(tmp_path, "c1", "other")
    commit(tmp_path, "c1")
    assert sweep_temp(tmp_path, "c1", "srv") == 2
    assert not any(p.temp_dir.exists() for p in crashed)
    assert other.temp_dir.exists()
    assert (tmp_path / "c1" / "srv" / MANIFEST_NAME).exists()
    assert sweep_temp(tmp_path, "missing", "srv") == 0


def test_sweep_temp_without_an_id_removes_crashed_commits_of_every_checkpoint(
    tmp_path: Path,
) -> None:
    crashed = [begin_commit(tmp_path, checkpoint_id, "srv") for checkpoint_id in ("c1", "c2")]
    other = begin_commit(tmp_path, "c2", "other")
    assert sweep_temp(tmp_path, None, "srv") == 2
    assert not any(p.temp_dir.exists() for p in crashed)
    assert other.temp_dir.exists()
    assert sweep_temp(tmp_path / "no-root-yet", None, "srv") == 0


# -- CHECKPOINT.json ------------------------------------------------------------------


def test_checkpoint_json_lists_participants_scope_and_controller_state(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    doc = complete(tmp_path, "c1", at=T0 + 1)
    assert json.loads((tmp_path / "c1" / CHECKPOINT_NAME).read_bytes()) == doc
    manifest_bytes = (tmp_path / "c1" / "srv" / MANIFEST_NAME).read_bytes()
    assert doc == {
        "format": 1,
        "checkpoint_id": "c1",
        "created_at": "2027-01-15T08:00:01.000000Z",
        "participants": [
            {
                "name": "srv",
                "url": "http://srv:8000",
                "manifest_digest": manifest_digest(manifest_bytes),
            }
        ],
        "scope": ["e1"],
        "controller_state": {"step": 12},
    }
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == [CHECKPOINT_NAME, "srv"]


def test_checkpoint_json_is_written_once(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    error_of("stale_checkpoint", complete, tmp_path, "c1")
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == [CHECKPOINT_NAME, "srv"]


def test_checkpoint_json_refuses_a_manifest_digest_that_does_not_match(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    participants: Any = [{"name": "srv", "url": "u", "manifest_digest": "0" * 64}]
    error_of("commit_failed", write_checkpoint_json, tmp_path, "c1", participants, None, None)
    participants[0]["name"] = "absent"
    error_of("commit_failed", write_checkpoint_json, tmp_path, "c1", participants, None, None)
    assert not (tmp_path / "c1" / CHECKPOINT_NAME).exists()


@pytest.mark.parametrize(
    ("participants", "scope", "state"),
    [
        ([], None, None),
        (None, [""], None),
        (None, None, {"bad": {1, 2}}),
        (None, None, float("nan")),
    ],
)
def test_checkpoint_json_refuses_bad_arguments(
    tmp_path: Path, participants: Any, scope: Any, state: Any
) -> None:
    commit(tmp_path, "c1")
    if participants is None:
        participants = [
            {
                "name": "srv",
                "url": "u",
                "manifest_digest": read_manifest_digest(tmp_path, "c1", "srv"),
            }
        ]
    error_of("invalid_request", write_checkpoint_json, tmp_path, "c1", participants, scope, state)


# -- loading for restore --------------------------------------------------------------


def test_a_complete_checkpoint_loads_with_indexes_and_reads_back(tmp_path: Path) -> None:
    manifest = commit(tmp_path, "c1")
    doc = complete(tmp_path, "c1")
    checkpoint = load_checkpoint(tmp_path, "c1", "srv")
    assert checkpoint.manifest == manifest and checkpoint.checkpoint == doc
    assert [s.worker for s in checkpoint.segments] == [W1, W2]
    assert [[e.id for e in s.entries] for s in checkpoint.segments] == [
        ["a", "e1", "b"],
        ["c", "e2"],
    ]
    for segment, records in zip(checkpoint.segments, default_segments().values(), strict=True):
        assert segment.entries == read_index(segment.path)
        assert list(read_records(segment.path, segment.entries)) == records


@pytest.mark.parametrize(
    "make",
    [
        lambda root: None,  # nothing at all
        lambda root: commit(root, "c1"),  # manifest but no CHECKPOINT.json
        lambda root: (
            commit(root, "c1"),
            commit(root, "c1", "other"),
            complete(root, "c1", ["other"]),
        ),
        lambda root: (
            commit(root, "c1"),
            complete(root, "c1"),
            (root / "c1" / "srv" / MANIFEST_NAME).write_bytes(b'{"changed": true}\n'),
        ),
        lambda root: (
            commit(root, "c1"),
            complete(root, "c1"),
            (root / "c1" / "srv" / MANIFEST_NAME).unlink(),
        ),
    ],
    ids=["missing", "no-checkpoint-json", "not-listed", "wrong-manifest-digest", "no-manifest"],
)
def test_an_incomplete_checkpoint_is_no_checkpoint(
    tmp_path: Path, make: Callable[[Path], Any]
) -> None:
    make(tmp_path)
    error_of("no_checkpoint", load_checkpoint, tmp_path, "c1", "srv")


def test_a_flipped_byte_in_a_record_is_corrupt_by_digest(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    path = tmp_path / "c1" / "srv" / f"segment-{W2}.msgpack"
    data = bytearray(path.read_bytes())
    data[read_index(path)[0].offset + 400] ^= 0x20
    path.write_bytes(bytes(data))
    assert "digest" in error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")
    checkpoint = load_checkpoint(tmp_path, "c1", "srv", verify_digests=False)
    assert str(path) in error_of("corrupt_checkpoint", verify_segments, checkpoint)


def test_a_truncated_segment_is_corrupt(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    path = tmp_path / "c1" / "srv" / f"segment-{W1}.msgpack"
    path.write_bytes(path.read_bytes()[:-3])
    detail = error_of(
        "corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv", verify_digests=False
    )
    assert str(path) in detail and "bytes" in detail


def test_a_missing_segment_is_corrupt(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    (tmp_path / "c1" / "srv" / f"segment-{W1}.msgpack").unlink()
    assert "missing" in error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda m: m["segments"][0].update(digest="0" * 32), "digest"),
        (lambda m: m["segments"][0].update(digest="0" * 64), "segment 0 is malformed"),
        (lambda m: m["segments"][0].update(bytes=m["segments"][0]["bytes"] + 1), "bytes"),
        (
            lambda m: (m["segments"][0].update(records=4), m["records"].update(sessions=4)),
            "holds 3",
        ),
        (lambda m: m["records"].update(sessions=2, episodes=3), "segments hold"),
        (lambda m: m.update(format=2), "unknown manifest format version 2"),
        (lambda m: m.pop("state_version"), "state_version"),
        (lambda m: m.update(workers="w"), "workers"),
        (lambda m: m.update(digest_algorithm="md5"), "digest_algorithm"),
        (lambda m: m.update(participant="someone"), "participant"),
        (lambda m: m.update(created_at="yesterday"), "created_at"),
        (lambda m: m["segments"][1].update(file="../x.msgpack"), "file name"),
    ],
    ids=[
        "digest",
        "digest-length",
        "bytes",
        "count",
        "kinds",
        "format",
        "missing-field",
        "ill-typed",
        "algorithm",
        "participant",
        "created-at",
        "file-name",
    ],
)
def test_a_manifest_that_lies_or_is_malformed_is_corrupt(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], what: str
) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    rewrite_manifest(tmp_path, "c1", change)
    assert what in error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")


def test_a_checkpoint_written_with_sha256_digests_still_loads(tmp_path: Path) -> None:
    """Checkpoints from before xxh3_128 name sha256; the reader checks them with it."""
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    directory = tmp_path / "c1" / "srv"

    def to_sha256(manifest: dict[str, Any]) -> None:
        manifest["digest_algorithm"] = "sha256"
        for segment in manifest["segments"]:
            data = (directory / segment["file"]).read_bytes()
            segment["digest"] = hashlib.sha256(data).hexdigest()

    rewrite_manifest(tmp_path, "c1", to_sha256)
    checkpoint = load_checkpoint(tmp_path, "c1", "srv")
    assert checkpoint.manifest["digest_algorithm"] == "sha256"
    # and the sha256 digests are really checked: one flipped byte is corrupt
    segment = directory / f"segment-{W1}.msgpack"
    data = bytearray(segment.read_bytes())
    data[0] ^= 1
    segment.write_bytes(data)
    assert "sha256 digest" in error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")


def test_unknown_manifest_fields_are_ignored_for_forward_compatibility(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    rewrite_manifest(tmp_path, "c1", lambda m: m.update(added_later={"x": 1}))
    assert load_checkpoint(tmp_path, "c1", "srv").manifest["added_later"] == {"x": 1}


def test_a_session_id_in_two_segments_is_corrupt(tmp_path: Path) -> None:
    segments = {W1: [session("same"), session("a")], W2: [session("same", owner=W2)]}
    commit(tmp_path, "c1", segments=segments, check_indexes=False)
    complete(tmp_path, "c1")
    detail = error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")
    assert "'same'" in detail and W1 in detail and W2 in detail


def test_an_episode_in_two_segments_is_corrupt(tmp_path: Path) -> None:
    segments = {W1: [episode("same", 2)], W2: [episode("same", 2)]}
    commit(tmp_path, "c1", segments=segments, check_indexes=False)
    complete(tmp_path, "c1")
    detail = error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")
    assert "episode 'same' is held twice" in detail and W1 in detail and W2 in detail


def test_an_unknown_checkpoint_json_format_is_corrupt(tmp_path: Path) -> None:
    commit(tmp_path, "c1")
    complete(tmp_path, "c1")
    path = tmp_path / "c1" / CHECKPOINT_NAME
    doc = json.loads(path.read_bytes())
    path.write_text(json.dumps({**doc, "format": 7}))
    assert "format version 7" in error_of(
        "corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv"
    )
    path.write_text("{not json")
    error_of("corrupt_checkpoint", load_checkpoint, tmp_path, "c1", "srv")


# -- latest ---------------------------------------------------------------------------


def test_latest_is_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    for cid, at in [("b-old", T0), ("a-new", T0 + 20), ("c-mid", T0 + 10)]:
        commit(tmp_path, cid)
        complete(tmp_path, cid, at=at)
    assert resolve_latest(tmp_path) == "a-new"
    assert resolve_latest(tmp_path, "srv") == "a-new"
    assert [c["id"] for c in list_checkpoints(tmp_path)] == ["a-new", "c-mid", "b-old"]


def test_latest_skips_incomplete_checkpoints(tmp_path: Path) -> None:
    commit(tmp_path, "done")
    complete(tmp_path, "done", at=T0)
    commit(tmp_path, "no-json", at=T0 + 30)  # manifest but no CHECKPOINT.json
    segments_only = begin_commit(tmp_path, "segments-only", "srv")
    with SegmentWriter(segments_only.segment_path(W1)) as writer:
        writer.add(session("a"))
        writer.close()
    assert resolve_latest(tmp_path) == "done"
    assert resolve_latest(tmp_path, "srv") == "done"
    listed = {c["id"]: c for c in list_checkpoints(tmp_path)}
    assert listed["done"]["complete"] is True
    assert listed["no-json"] == {
        "id": "no-json",
        "created_at": None,
        "participants": [],
        "complete": False,
    }
    assert listed["segments-only"]["complete"] is False


def test_latest_breaks_created_at_ties_by_the_greater_id(tmp_path: Path) -> None:
    for cid in ["tie-a", "tie-b"]:
        commit(tmp_path, cid)
        complete(tmp_path, cid, at=T0)
    assert resolve_latest(tmp_path) == "tie-b"


def test_latest_for_a_participant_needs_only_that_participant_complete(tmp_path: Path) -> None:
    commit(tmp_path, "old", "alpha")
    commit(tmp_path, "old", "beta")
    complete(tmp_path, "old", ["alpha", "beta"], at=T0)
    commit(tmp_path, "new", "alpha")
    commit(tmp_path, "new", "beta")
    complete(tmp_path, "new", ["alpha", "beta"], at=T0 + 5)
    (tmp_path / "new" / "beta" / MANIFEST_NAME).write_bytes(b"{}")  # beta's part is now incomplete
    assert resolve_latest(tmp_path, "alpha") == "new"
    assert resolve_latest(tmp_path, "beta") == "old"
    assert resolve_latest(tmp_path) == "old"
    assert resolve_latest(tmp_path, "gamma") is None


def test_latest_of_an_empty_or_missing_root_is_none(tmp_path: Path) -> None:
    assert resolve_latest(tmp_path / "missing") is None
    assert list_checkpoints(tmp_path / "missing") == []
    (tmp_path / ".tether-token").write_text("secret")
    assert resolve_latest(tmp_path) is None


# -- the test-only fault hook ---------------------------------------------------------

FAULT_SCRIPT = """
import sys
from pathlib import Path
from tether.checkpoint.segments import SegmentWriter
from tether.checkpoint.store import begin_commit, read_manifest_digest, write_checkpoint_json
root, worker = Path(sys.argv[1]), sys.argv[2]
pending = begin_commit(root, "c1", "srv")
with SegmentWriter(pending.segment_path(worker)) as writer:
    writer.add({"kind": "session", "id": "s1", "open": True, "owner": None, "state": 1})
    info = writer.close()
pending.publish({"workers": [worker], "owner_aliases": {}, "state_version": None,
                 "records": {"sessions": 1, "episodes": 0},
                 "segments": [{**info, "worker": worker}]})
digest = read_manifest_digest(root, "c1", "srv")
write_checkpoint_json(root, "c1", [{"name": "srv", "url": "u", "manifest_digest": digest}],
                      None, None)
"""


def run_until_fault(root: Path, point: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if point is not None:
        env[FAULT_ENV] = point
    result = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT, str(root), W1],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode in (0, 99), result.stderr
    return result.returncode


def test_fault_points_are_the_documented_three() -> None:
    assert FAULT_POINTS == ("after_segments", "after_manifest", "before_checkpoint_rename")


def test_without_a_fault_the_commit_completes(tmp_path: Path) -> None:
    assert run_until_fault(tmp_path, None) == 0
    assert resolve_latest(tmp_path) == "c1"


def test_a_crash_after_segments_leaves_only_a_temp_dir(tmp_path: Path) -> None:
    assert run_until_fault(tmp_path, "after_segments") == 99
    [temp] = (tmp_path / "c1").iterdir()
    assert temp.name.startswith(".srv.tmp-")
    assert [p.name for p in temp.iterdir()] == [f"segment-{W1}.msgpack"]
    error_of("no_checkpoint", load_checkpoint, tmp_path, "c1", "srv")
    assert resolve_latest(tmp_path) is None
    assert sweep_temp(tmp_path, "c1", "srv") == 1
    commit(tmp_path, "c1")  # the ID is still free: nothing was published


def test_a_crash_after_the_manifest_publishes_an_incomplete_checkpoint(tmp_path: Path) -> None:
    assert run_until_fault(tmp_path, "after_manifest") == 99
    assert sorted(p.name for p in (tmp_path / "c1" / "srv").iterdir()) == [
        MANIFEST_NAME, f"segment-{W1}.msgpack"
    ]  # fmt: skip
    error_of("no_checkpoint", load_checkpoint, tmp_path, "c1", "srv")
    assert resolve_latest(tmp_path) is None
    error_of("stale_checkpoint", begin_commit, tmp_path, "c1", "srv")


def test_a_crash_before_the_checkpoint_json_rename_leaves_it_absent(tmp_path: Path) -> None:
    assert run_until_fault(tmp_path, "before_checkpoint_rename") == 99
    names = sorted(p.name for p in (tmp_path / "c1").iterdir())
    assert names[0].startswith(f".{CHECKPOINT_NAME}.tmp-") and names[1:] == ["srv"]
    error_of("no_checkpoint", load_checkpoint, tmp_path, "c1", "srv")
    assert resolve_latest(tmp_path) is None


def test_sweep_temp_leaves_the_temp_dirs_of_a_participant_whose_name_extends_this_one(
    tmp_path: Path,
) -> None:
    crashed = begin_commit(tmp_path, "c1", "srv")
    other = begin_commit(tmp_path, "c1", "srv.tmp-x")
    assert sweep_temp(tmp_path, None, "srv") == 1
    assert not crashed.temp_dir.exists()
    assert other.temp_dir.exists()
