"""Restore on one in-process worker: only on a fresh server, all or nothing, refusing
corrupt checkpoints, dry runs and abort_restore (SPEC 5.6, 5.10)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.checkpoint.conftest import Node, Nodes, assert_error
from tether.checkpoint.segments import SegmentWriter, file_digest, read_index
from tether.checkpoint.store import (
    CHECKPOINT_NAME,
    MANIFEST_NAME,
    encode_manifest,
    read_manifest_digest,
    write_checkpoint_json,
)
from tether.examples import episodes
from tether.routing.errors import ERRORS

COUNTS = {"a": 1, "b": 2, "c": 3}


async def committed(nodes: Nodes) -> tuple[Node, dict[str, str]]:
    """A stopped node whose sessions `COUNTS` are in the complete checkpoint "good"."""
    a = await nodes.start()
    cookies = {}
    for session_id, count in COUNTS.items():
        cookies[session_id] = await a.seed(session_id)
        for _ in range(count):
            assert (await a.post("/increment", cookies[session_id])).status_code == 200
    await a.checkpoint("good")
    await a.stop()
    return a, cookies


async def holds_nothing(node: Node) -> None:
    assert node.app.state.counters.counts == {}
    status = await node.status()
    assert (status["phase"], status["checkpoint_id"]) == ("open", None)
    assert status["workers"][0]["sessions"] == 0


async def restores_good(node: Node, cookies: dict[str, str]) -> None:
    """The node is still fresh: the intact checkpoint restores, and every cookie reads."""
    answer = await node.restore("good")
    assert answer == {"installed_sessions": 3, "held_episodes": [], "placed_sessions": 0,
                      "owner_aliases": 0}
    await node.ok("resume", checkpoint_id="good")
    for session_id, count in COUNTS.items():
        reply = await node.get("/count", cookies[session_id])
        assert (reply.status_code, reply.json()["count"]) == (200, count)


# Forged checkpoints ---------------------------------------------------------------------


def session(session_id: str, state: Any) -> dict[str, Any]:
    return {"kind": "session", "id": session_id, "open": True, "owner": None, "state": state}


def forge(
    root: Path,
    target: str,
    *,
    records: list[dict[str, Any]] | None = None,
    raw_records: list[dict[str, Any]] | None = None,
    segment: Callable[[Path], None] | None = None,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Copy the "good" checkpoint to `target`, consistent in every way (its manifest
    names `target`, CHECKPOINT.json lists the manifest's digest) except what the edits
    change: new `records` (written as a valid segment the manifest describes), or
    `raw_records` written byte by byte past the writer's checks, a byte-level
    `segment` edit, a `manifest` edit, a `checkpoint` (CHECKPOINT.json) edit."""
    directory = root / target / "counter"
    shutil.copytree(root / "good" / "counter", directory)
    path = directory / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["checkpoint_id"] = target
    segment_path = directory / doc["segments"][0]["file"]
    if records is not None:
        segment_path.unlink()
        with SegmentWriter(segment_path) as writer:
            for record in records:
                writer.add(record)
            info = writer.close()
        doc["segments"][0].update(info)
        doc["records"] = {"sessions": len(records), "episodes": 0}
    if raw_records is not None:
        write_raw_segment(segment_path, raw_records)
        digest, size = file_digest(segment_path)
        doc["segments"][0].update(bytes=size, records=len(raw_records), digest=digest)
        doc["records"] = {"sessions": len(raw_records), "episodes": 0}
    if segment is not None:
        segment(segment_path)
    if manifest is not None:
        manifest(doc)
    path.write_bytes(encode_manifest(doc))
    entry = {"name": "counter", "url": "http://x",
             "manifest_digest": read_manifest_digest(root, target, "counter")}
    written = write_checkpoint_json(root, target, [entry], None, None)  # type: ignore[list-item]
    if checkpoint is not None:
        checkpoint(written)
        (root / target / CHECKPOINT_NAME).write_text(json.dumps(written))


def write_raw_segment(path: Path, records: list[dict[str, Any]]) -> None:
    """Session records, their index and the trailer, as docs/format.md lays them out,
    with none of `SegmentWriter`'s checks (which refuse a session twice)."""
    packed = [msgpack.packb(record) for record in records]
    index, offset = [], 0
    for record, data in zip(records, packed, strict=True):
        index.append(["session", record["id"], record["owner"], None, offset, len(data)])
        offset += len(data)
    path.write_bytes(b"".join(packed) + msgpack.packb(index) + offset.to_bytes(8, "big"))


def flip_a_state_byte(path: Path) -> None:
    """Change the first record's state (its last byte, a msgpack fixint) and nothing
    else: it still decodes, so only the digest can tell."""
    first = read_index(path)[0]
    data = bytearray(path.read_bytes())
    data[first.offset + first.length - 1] ^= 0x04
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1])


def lie_about_digest(manifest: dict[str, Any]) -> None:
    digest = manifest["segments"][0]["digest"]
    manifest["segments"][0]["digest"] = ("0" if digest[0] != "0" else "1") + digest[1:]


def lie_about_segment_count(manifest: dict[str, Any]) -> None:
    manifest["segments"][0]["records"] += 1
    manifest["records"]["sessions"] += 1


def lie_about_kind_counts(manifest: dict[str, Any]) -> None:
    manifest["records"] = {"sessions": 2, "episodes": 1}


def lie_about_bytes(manifest: dict[str, Any]) -> None:
    manifest["segments"][0]["bytes"] += 1


def unknown_manifest_format(manifest: dict[str, Any]) -> None:
    manifest["format"] = 2


def unknown_checkpoint_format(doc: dict[str, Any]) -> None:
    doc["format"] = 2


CORRUPTIONS: dict[str, dict[str, Any]] = {
    "flipped-byte": {"segment": flip_a_state_byte},
    "truncated-segment": {"segment": truncate},
    "manifest-digest-lies": {"manifest": lie_about_digest},
    "manifest-count-lies": {"manifest": lie_about_segment_count},
    "manifest-kind-counts-lie": {"manifest": lie_about_kind_counts},
    "manifest-bytes-lie": {"manifest": lie_about_bytes},
    "duplicate-session": {
        "raw_records": [session("a", 1), session("dup", 2), session("dup", 3)]
    },
    "manifest-format-2": {"manifest": unknown_manifest_format},
    "checkpoint-json-format-2": {"checkpoint": unknown_checkpoint_format},
}


async def test_an_intact_forged_copy_restores(nodes: Nodes) -> None:
    """The forging itself is sound: with no edit, the copy restores."""
    _, cookies = await committed(nodes)
    forge(nodes.root, "copy")
    b = await nodes.start()
    assert (await b.restore("copy"))["installed_sessions"] == 3
    await b.ok("resume", checkpoint_id="copy")
    reply = await b.get("/count", cookies["c"])
    assert (reply.status_code, reply.json()["count"]) == (200, 3)


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
async def test_a_corrupt_checkpoint_is_refused_and_installs_nothing(
    nodes: Nodes, corruption: str
) -> None:
    _, cookies = await committed(nodes)
    forge(nodes.root, "bad", **CORRUPTIONS[corruption])
    b = await nodes.start()
    assert_error(await b.control("restore", checkpoint_id="bad"), 422, "corrupt_checkpoint")
    assert_error(await b.control("restore", checkpoint_id="bad", dry_run=True), 422,
                 "corrupt_checkpoint")
    await holds_nothing(b)
    await restores_good(b, cookies)


async def test_an_install_that_fails_midway_releases_everything_and_stays_fresh(
    nodes: Nodes,
) -> None:
    _, cookies = await committed(nodes)
    # Well-formed on disk, but the counter cannot install "x" (`int("x")` raises).
    forge(nodes.root, "bad", records=[session("a", 1), session("b", "x"), session("c", 3)])
    b = await nodes.start()
    reply = await b.control("restore", checkpoint_id="bad")
    # SPEC names no code for an app that fails to install; any contract error will do.
    assert reply.headers["content-type"] == "application/json", (reply.status_code, reply.text)
    assert reply.status_code >= 400 and reply.json()["code"] in ERRORS, reply.text
    await holds_nothing(b)
    await restores_good(b, cookies)


async def test_a_missing_or_incomplete_checkpoint_is_no_checkpoint(nodes: Nodes) -> None:
    a = await nodes.start()
    await a.seed("s")
    await a.prepared("unpublished")
    await a.ok("commit", checkpoint_id="unpublished")  # no CHECKPOINT.json: incomplete
    await a.ok("resume", checkpoint_id="unpublished")
    await a.stop()
    b = await nodes.start()
    for checkpoint_id in ("nope", "unpublished"):
        assert_error(await b.control("restore", checkpoint_id=checkpoint_id), 404,
                     "no_checkpoint")
    await holds_nothing(b)


async def test_a_checkpoint_of_another_state_version_is_incompatible(nodes: Nodes) -> None:
    await committed(nodes)
    b = await nodes.start(episodes.create_app, name="counter")
    assert_error(await b.control("restore", checkpoint_id="good"), 422, "incompatible_state")
    assert (await b.status())["phase"] == "open"


# Only on a fresh server ---------------------------------------------------------------------


async def test_restoring_twice_is_not_fresh(nodes: Nodes) -> None:
    _, cookies = await committed(nodes)
    b = await nodes.start()
    await b.restore("good")
    assert_error(await b.control("restore", checkpoint_id="good"), 409, "not_fresh")
    await b.ok("resume", checkpoint_id="good")
    assert_error(await b.control("restore", checkpoint_id="good"), 409, "not_fresh")
    assert_error(await b.control("restore", checkpoint_id="good", dry_run=True), 409,
                 "not_fresh")
    reply = await b.get("/count", cookies["b"])
    assert (reply.status_code, reply.json()["count"]) == (200, 2)


async def test_a_server_that_served_a_session_is_not_fresh(nodes: Nodes) -> None:
    _, cookies = await committed(nodes)
    b = await nodes.start()
    mine = await b.seed("mine")
    assert_error(await b.control("restore", checkpoint_id="good"), 409, "not_fresh")
    assert_error(await b.control("restore", checkpoint_id="good", dry_run=True), 409,
                 "not_fresh")
    assert_error(await b.get("/count", cookies["a"]), 404, "session_lost")
    assert (await b.get("/count", mine)).json()["count"] == 0


async def test_in_restored_only_resume_renew_abort_and_status_are_accepted(
    nodes: Nodes,
) -> None:
    await committed(nodes)
    b = await nodes.start()
    await b.restore("good")
    assert (await b.status())["phase"] == "restored"
    assert_error(await b.control("prepare", checkpoint_id="good"), 409, "invalid_phase")
    assert_error(await b.control("commit", checkpoint_id="good"), 409, "invalid_phase")
    assert_error(await b.control("retire", episode_id="e", attempt=1), 409, "invalid_phase")
    assert (await b.ok("renew", checkpoint_id="good", lease_s=5))["lease_expires_at"] > 0
    assert await b.ok("resume", checkpoint_id="good") == {"phase": "open"}


async def test_a_dry_run_checks_everything_and_installs_nothing(nodes: Nodes) -> None:
    _, cookies = await committed(nodes)
    b = await nodes.start()
    answer = await b.restore("good", dry_run=True)
    assert answer["installed_sessions"] == 3
    await holds_nothing(b)
    assert_error(await b.get("/count", cookies["a"]), 404, "session_lost")
    await restores_good(b, cookies)


async def test_abort_restore_releases_everything_and_returns_the_server_to_fresh(
    nodes: Nodes,
) -> None:
    _, cookies = await committed(nodes)
    b = await nodes.start()
    await b.restore("good")
    assert b.app.state.counters.counts == COUNTS
    assert await b.ok("abort_restore", checkpoint_id="good") == {"phase": "open", "fresh": True}
    assert await b.ok("abort_restore", checkpoint_id="good") == {"phase": "open", "fresh": True}
    await holds_nothing(b)
    assert_error(await b.get("/count", cookies["a"]), 404, "session_lost")
    await restores_good(b, cookies)
