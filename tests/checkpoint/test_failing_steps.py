"""A protocol step whose app code or disk fails, or outlives its deadline, at the worst
moment: the phase machine still learns how it ended, admission never stays closed for
good, and what is on disk is what the answer says (issue 12's promise, on one worker)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import tether.checkpoint.store as store_module
from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.fleet import LocalFleet
from tether.checkpoint.participant import APP_SCAN_S, Participant
from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json
from tether.routing.errors import TetherError

NAME = "svc"


class Sessions:
    """An app's session state whose `busy` and `release` raise when told to."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state: dict[str, Any] = dict(state or {})
        self.busy_fails = 0
        self.release_fails = False

    def sessions(self) -> Iterator[str]:
        return iter(list(self.state))

    def holds(self, session_id: str) -> bool:
        return session_id in self.state

    def export(self, session_id: str) -> Any:
        return self.state[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        self.state[session_id] = state

    async def release(self, session_id: str) -> None:
        if self.release_fails:
            raise RuntimeError("the app's release failed")
        self.state.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        if self.busy_fails:
            self.busy_fails -= 1
            raise KeyError(session_id)
        return False


class Node:
    """One worker's participant and checkpointer on a checkpoint root."""

    def __init__(self, root: Path, sessions: Sessions) -> None:
        self.sessions = sessions
        self.participant = Participant()
        self.participant.register_sessions(sessions)
        self.checkpointer = Checkpointer(LocalFleet(self.participant), name=NAME, root=str(root))

    async def call(self, route: str, **body: Any) -> Any:
        return await self.checkpointer.call(route, body)


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        await node.checkpointer.stop()


async def start(nodes: list[Node], root: Path, sessions: Sessions) -> Node:
    node = Node(root, sessions)
    node.checkpointer.start()
    nodes.append(node)
    return node


async def test_a_commit_whose_readiness_check_raises_fails_and_can_be_retried(
    nodes: list[Node], tmp_path: Path
) -> None:
    """The commit's fresh readiness check runs the app's `busy`: one that raises fails
    that commit (500 `commit_failed`), it does not leave the commit marked running, so
    a retry commits and resume reopens admission."""
    node = await start(nodes, tmp_path, Sessions({"s1": 1}))
    assert (await node.call("prepare", checkpoint_id="c1"))["state"] == "prepared"
    await asyncio.sleep(APP_SCAN_S * 2)  # the commit's check scans the app again
    node.sessions.busy_fails = 1

    with pytest.raises(TetherError) as failed:
        await node.call("commit", checkpoint_id="c1")

    assert failed.value.code == "commit_failed"
    assert "KeyError" in str(failed.value.detail)
    manifest = await node.call("commit", checkpoint_id="c1")
    assert manifest["records"]["sessions"] == 1
    assert await node.call("resume", checkpoint_id="c1") == {"phase": "open"}
    assert not node.participant.admission_closed


async def test_an_abort_restore_whose_release_raises_still_reopens_admission(
    nodes: list[Node], tmp_path: Path
) -> None:
    """The app's `release` raising during abort_restore is the call's answer (500
    `internal_error`), and admission opens all the same: the phase is open, and a
    request is admitted, not parked until another checkpoint happens to reopen it."""
    first = await start(nodes, tmp_path, Sessions({"s1": 1}))
    await first.call("prepare", checkpoint_id="c1")
    await first.call("commit", checkpoint_id="c1")
    digest = read_manifest_digest(tmp_path, "c1", NAME)
    write_checkpoint_json(tmp_path, "c1", [{"name": NAME, "url": "x", "manifest_digest": digest}],
                          None, None)
    await first.call("resume", checkpoint_id="c1")
    second = await start(nodes, tmp_path, Sessions())
    await second.call("restore", checkpoint_id="c1")
    assert second.participant.admission_closed
    second.sessions.release_fails = True

    with pytest.raises(TetherError) as failed:
        await second.call("abort_restore", checkpoint_id="c1")

    assert failed.value.code == "internal_error"
    assert "release" in str(failed.value.detail)
    assert (await second.call("status"))["phase"] == "open"
    assert not second.participant.admission_closed
    assert second.participant.admit(None, False, False) is None  # admitted, not parked


async def test_a_commit_whose_publish_outlives_its_deadline_answers_what_it_published(
    nodes: list[Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline bounds the export; a publish that has begun (a slow disk's fsync
    after the rename) is waited for, so the commit answers the manifest it published,
    not 504 with the checkpoint on disk and every retry 409 `stale_checkpoint`."""
    slow_fsync = store_module._fsync_dir

    def fsync_dir(path: Path) -> None:
        if path == tmp_path / "c1" and (path / NAME).exists():
            time.sleep(0.6)  # (in the publishing thread, after the rename)
        slow_fsync(path)

    monkeypatch.setattr(store_module, "_fsync_dir", fsync_dir)
    node = await start(nodes, tmp_path, Sessions({"s1": 1, "s2": 2}))
    await node.call("prepare", checkpoint_id="c1")

    manifest = await node.call("commit", checkpoint_id="c1", deadline_s=0.2)

    assert manifest["records"]["sessions"] == 2
    assert (tmp_path / "c1" / NAME / "MANIFEST.json").exists()
    assert await node.call("commit", checkpoint_id="c1") == manifest  # a retry reads it
    assert [p.name for p in (tmp_path / "c1").iterdir()] == [NAME]  # no temp dir left
    assert await node.call("resume", checkpoint_id="c1") == {"phase": "open"}
