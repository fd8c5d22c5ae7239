"""Checkpoints of one in-process worker over real sockets: the counter's round trip
through a crash, admission while a checkpoint is open, readiness, the lease, and large
records (SPEC 5.1-5.4, 5.6)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from e2e.apps.blobs import blob_app, blob_bytes
from tests.checkpoint.conftest import (
    HOLD_HEADER,
    Gate,
    Node,
    Nodes,
    assert_error,
    eventually,
    gather_bounded,
    silently_busy,
    stop_promptly,
)
from tether.checkpoint.fleet import LocalFleet
from tether.checkpoint.segments import read_records
from tether.checkpoint.store import ManifestSegment, PendingCommit, RecordCounts
from tether.routing.errors import TetherError
from tether.routing.kinds import declare, declared_kind
from tether.routing.types import SessionId


async def increments(node: Node, cookie: str, times: int) -> int | None:
    """`times` increments of one session, one after another; the last count."""
    count = None
    for _ in range(times):
        reply = await node.post("/increment", cookie)
        assert reply.status_code == 200, reply.text
        count = reply.json()["count"]
    return count


def segment_records(node: Node, checkpoint_id: str, manifest: dict[str, Any]) -> list[Any]:
    """Every record of a committed checkpoint's segments, read back from disk."""
    directory = node.root / checkpoint_id / node.name
    return [r for s in manifest["segments"] for r in read_records(directory / s["file"])]


def temp_dirs(root: Path, checkpoint_id: str) -> list[str]:
    directory = root / checkpoint_id
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


# Done when 1: the counter round trip through a crash ------------------------------------


async def test_counter_sessions_restore_to_their_checkpointed_counts_and_keep_counting(
    nodes: Nodes,
) -> None:
    a = await nodes.start()
    ids = [f"s-{i:03d}" for i in range(200)]
    cookies = dict(zip(ids, await gather_bounded(a.seed(s) for s in ids), strict=True))
    checkpointed = {s: i % 4 for i, s in enumerate(ids)}
    await gather_bounded(increments(a, cookies[s], n) for s, n in checkpointed.items())

    manifest = await a.checkpoint("c1")
    assert manifest["records"] == {"sessions": 200, "episodes": 0}
    later = {s: i % 2 + 1 for i, s in enumerate(ids)}
    counts = await gather_bounded(increments(a, cookies[s], n) for s, n in later.items())
    assert counts == [checkpointed[s] + later[s] for s in ids]
    late_cookie = await a.seed("after-the-checkpoint")
    await a.stop()

    b = await nodes.start()
    answer = await b.restore_latest()
    assert answer["installed_sessions"] == 200
    assert answer["held_episodes"] == []

    read = await gather_bounded(b.get("/count", cookies[s]) for s in ids)
    assert [(r.status_code, r.json()["count"]) for r in read] == [
        (200, checkpointed[s]) for s in ids
    ]
    assert {r.json()["worker"] for r in read} == {b.routing.id}
    counted = await gather_bounded(increments(b, cookies[s], 1) for s in ids)
    assert counted == [checkpointed[s] + 1 for s in ids]
    assert_error(await b.get("/count", late_cookie), 404, "session_lost")


# Done when 3: admission while a checkpoint is open ---------------------------------------


async def test_an_open_checkpoint_parks_new_seeds_without_a_claim_and_serves_health(
    nodes: Nodes,
) -> None:
    a = await nodes.start(claims=True)
    assert a.routing.claims is not None
    cookie = await a.seed("old")
    await a.prepared("c1")

    seed = await a.http.post("/seed_session", json={"session_id": "new"})
    assert_error(seed, 503, "checkpoint_parked")
    assert seed.headers["retry-after"] == "1"
    assert "set-cookie" not in seed.headers
    minted = await a.post("/increment")  # no session: the router would mint one
    assert_error(minted, 503, "checkpoint_parked")
    assert await a.routing.claims.lookup(SessionId("new")) is None
    assert await a.routing.claims.lookup(SessionId("old")) == a.routing.id
    assert len(a.routing.claims) == 1
    assert not a.app.state.counters.holds("new")

    for health in (await a.get("/health"), await a.get("/health", cookie)):
        assert (health.status_code, health.json()) == (200, {"ok": True})

    await a.ok("resume", checkpoint_id="c1")
    assert (await a.http.post("/seed_session", json={"session_id": "new"})).status_code == 200


async def test_a_request_of_a_held_session_waits_through_the_checkpoint_and_then_succeeds(
    nodes: Nodes,
) -> None:
    a = await nodes.start()
    cookie = await a.seed("old")
    assert await increments(a, cookie, 1) == 1
    await a.prepared("c1")

    waiting = asyncio.create_task(a.post("/increment", cookie))
    done, _ = await asyncio.wait({waiting}, timeout=0.3)
    assert not done, "a request of a held session went through an open checkpoint"
    # Requests waiting at admission do not count against readiness, and do not get in.
    assert (await a.prepared("c1"))["blockers"] == []
    manifest = await a.ok("commit", checkpoint_id="c1")
    [record] = segment_records(a, "c1", manifest)
    assert (record["id"], record["state"]) == ("old", 1)
    assert not waiting.done()

    await a.ok("resume", checkpoint_id="c1")
    reply = await asyncio.wait_for(waiting, 5)
    assert (reply.status_code, reply.json()["count"]) == (200, 2)


# Done when 4: readiness ------------------------------------------------------------------


async def test_a_session_request_in_progress_blocks_prepare_until_it_finishes(
    nodes: Nodes,
) -> None:
    gates: list[Gate] = []

    def gated(app: Any) -> Gate:
        gates.append(Gate(app))
        return gates[-1]

    a = await nodes.start(wrap=gated)
    [gate] = gates
    cookie = await a.seed("busy")
    held = asyncio.create_task(a.post("/increment", cookie, headers={HOLD_HEADER: "1"}))
    await eventually(lambda: gate.waiting == 1, what="the request is in progress")

    started = time.monotonic()
    answer = await a.ok("prepare", checkpoint_id="c1", deadline_s=0.3)
    assert time.monotonic() - started >= 0.3, "blocked before its deadline"
    assert answer["state"] == "blocked"
    assert answer["blockers_total"] == 1
    [blocker] = answer["blockers"]
    assert {k: blocker[k] for k in ("kind", "worker", "id")} == {
        "kind": "session_busy", "worker": a.routing.id, "id": "busy"
    }
    status = await a.status()
    assert (status["phase"], status["checkpoint_id"]) == ("preparing", "c1")
    assert status["blockers_total"] == 1
    # Blocked stays closed: new work is parked, and commit is not allowed yet.
    assert_error(await a.http.post("/seed_session", json={"session_id": "x"}), 503,
                 "checkpoint_parked")
    assert_error(await a.control("commit", checkpoint_id="c1"), 409, "invalid_phase")

    gate.open.set()
    reply = await asyncio.wait_for(held, 5)
    assert (reply.status_code, reply.json()["count"]) == (200, 1)
    again = await a.ok("prepare", checkpoint_id="c1", deadline_s=5)
    assert (again["state"], again["blockers"], again["blockers_total"]) == ("prepared", [], 0)
    manifest = await a.ok("commit", checkpoint_id="c1")
    assert [r["state"] for r in segment_records(a, "c1", manifest)] == [1]


async def test_readiness_that_changes_without_a_notification_is_noticed_by_the_poll(
    nodes: Nodes,
) -> None:
    a = await nodes.start(setup=silently_busy)
    await a.seed("s")
    a.app.state.busy.busy_ids.add("s")
    prepare = asyncio.create_task(a.ok("prepare", checkpoint_id="c1", deadline_s=30))
    await eventually(lambda: a.participant.admission_closed, what="prepare closes admission")
    status = await eventually(
        lambda: _with_blockers(a), what="status lists the busy session"
    )
    assert status["blockers"][0]["kind"] == "session_busy"
    assert not prepare.done()

    a.app.state.busy.busy_ids.clear()  # the app tells tether nothing
    answer = await asyncio.wait_for(prepare, 3)  # far before its 30 s deadline
    assert answer["state"] == "prepared"
    await a.ok("resume", checkpoint_id="c1")


async def _with_blockers(node: Node) -> dict[str, Any] | None:
    status = await node.status()
    return status if status["blockers"] else None


# Done when 5: the lease --------------------------------------------------------------------


async def test_a_prepare_left_alone_resumes_by_itself_when_its_lease_runs_out(
    nodes: Nodes,
) -> None:
    a = await nodes.start()
    cookie = await a.seed("s")
    called = time.time()
    answer = await a.prepared("c1", deadline_s=0.2, lease_s=0.3)
    assert answer["lease_expires_at"] == pytest.approx(called + 0.5, abs=0.25)
    assert a.participant.admission_closed
    waiting = asyncio.create_task(a.post("/increment", cookie))

    # No control call meanwhile: the server's own lease timer must reopen admission.
    await eventually(lambda: not a.participant.admission_closed, within=5,
                     what="the lease expires by itself")
    assert time.time() >= answer["lease_expires_at"] - 0.05
    reply = await asyncio.wait_for(waiting, 5)
    assert (reply.status_code, reply.json()["count"]) == (200, 1)
    status = await a.status()
    assert (status["phase"], status["checkpoint_id"]) == ("open", None)
    assert (await a.http.post("/seed_session", json={"session_id": "t"})).status_code == 200

    assert_error(await a.control("commit", checkpoint_id="c1"), 409, "stale_checkpoint")
    assert_error(await a.control("prepare", checkpoint_id="c1"), 409, "stale_checkpoint")
    assert_error(await a.control("renew", checkpoint_id="c1"), 409, "stale_checkpoint")
    assert await a.ok("resume", checkpoint_id="c1") == {"phase": "open"}


class GatedFleet(LocalFleet):
    """One in-process worker whose segment write waits for the test, and cannot be
    abandoned half way (a cancelled wait still waits for the gate, as a write in a
    thread or on another worker would)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def export(
        self, pending: PendingCommit, scope: frozenset[str] | None
    ) -> tuple[list[str], list[ManifestSegment], RecordCounts]:
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            await self.gate.wait()
            raise
        return await super().export(pending, scope)


async def test_a_lease_that_falls_inside_a_slow_commit_expires_only_after_it(
    nodes: Nodes,
) -> None:
    a = await nodes.start(fleet=GatedFleet)
    fleet = a.checkpointer.fleet
    assert isinstance(fleet, GatedFleet)
    await a.seed("s")
    await a.prepared("c1", deadline_s=0.2, lease_s=0.2)
    commit = asyncio.create_task(a.control("commit", checkpoint_id="c1", deadline_s=0.2))
    await asyncio.wait_for(fleet.entered.wait(), 5)
    lease = (await a.status())["lease_expires_at"]
    await eventually(lambda: time.time() > lease + 0.3, within=5, what="the lease is past")

    status = await a.status()
    assert (status["phase"], status["checkpoint_id"]) == ("prepared", "c1")
    assert a.participant.admission_closed
    assert not commit.done()

    fleet.gate.set()
    assert_error(await asyncio.wait_for(commit, 5), 504, "deadline_exceeded")
    await eventually(lambda: not a.participant.admission_closed, within=2,
                     what="the lease expires once the commit ended")
    assert (await a.status())["phase"] == "open"
    assert temp_dirs(a.root, "c1") == []
    assert not (a.root / "c1" / "counter").exists()
    assert_error(await a.control("prepare", checkpoint_id="c1"), 409, "stale_checkpoint")


async def test_the_lease_timer_stops_promptly_right_after_a_control_call(
    nodes: Nodes,
) -> None:
    """What a worker does when `--restore` fails at start-up: the call raises, and the
    worker stops its checkpointer at once to report the failure."""
    a = await nodes.start()
    with pytest.raises(TetherError) as refused:
        await a.checkpointer.call("restore", {"checkpoint_id": "missing"})
    assert refused.value.code == "no_checkpoint"
    assert await stop_promptly(a.checkpointer, within=2), "Checkpointer.stop() hung"


# Commit failures ------------------------------------------------------------------------------


async def test_a_commit_whose_export_fails_answers_commit_failed_and_stays_prepared(
    nodes: Nodes,
) -> None:
    a = await nodes.start(blob_app)
    await a.seed("good", size=10)
    await a.seed("bad", size=10)
    a.app.state.blobs.poisoned.add("bad")
    await a.prepared("c1")

    failed = await a.control("commit", checkpoint_id="c1")
    assert_error(failed, 500, "commit_failed")
    assert temp_dirs(a.root, "c1") == []
    assert not (a.root / "c1" / "blobs").exists()
    assert (await a.status())["phase"] == "prepared"
    assert a.participant.admission_closed

    a.app.state.blobs.poisoned.clear()
    manifest = await a.ok("commit", checkpoint_id="c1")
    assert manifest["records"] == {"sessions": 2, "episodes": 0}
    assert await a.ok("resume", checkpoint_id="c1") == {"phase": "open"}


# Done when 10: one large record ---------------------------------------------------------------


async def test_a_32_mib_record_round_trips_through_commit_and_restore(nodes: Nodes) -> None:
    size = 32 * 1024 * 1024
    a = await nodes.start(blob_app)
    big = await a.seed("big", size=size)
    small = await a.seed("small", size=3)
    manifest = await a.checkpoint("c1")
    [segment] = manifest["segments"]
    assert size < segment["bytes"] < size + 4096
    await a.stop()

    b = await nodes.start(blob_app)
    assert (await b.restore_latest())["installed_sessions"] == 2
    for cookie, session_id, length in ((big, "big", size), (small, "small", 3)):
        reply = await b.get("/blob", cookie)
        assert reply.status_code == 200, reply.text
        expected = hashlib.sha256(blob_bytes(session_id, length)).hexdigest()
        assert reply.json() == {"sha256": expected, "bytes": length}


# A standing stream of a background route does not hold a checkpoint up -------------------


def watched(background: bool) -> Callable[[Any], None]:
    """`setup` for a counter node: `GET /watch` streams a session's count until the client
    leaves, declared a background route of the app's kind (or not)."""

    def setup(app: Any) -> None:
        counters = app.state.counters

        async def watch(request: Request) -> StreamingResponse:
            session_id = request.session.get("session_id", "")

            async def counts() -> AsyncIterator[bytes]:
                while True:
                    yield f"{counters.counts.get(session_id)}\n".encode()
                    await asyncio.sleep(0.05)

            return StreamingResponse(counts())

        app.router.routes.append(Route("/watch", watch))
        kind = declared_kind(app)
        assert kind is not None
        declare(app, replace(kind, background=("GET /watch",) if background else ()))

    return setup


@pytest.mark.parametrize(("background", "state"), [(True, "prepared"), (False, "blocked")])
async def test_a_standing_stream_blocks_a_prepare_only_if_its_route_is_not_background(
    nodes: Nodes, background: bool, state: str
) -> None:
    """SPEC 5.2: requests of background routes (an MCP client's standing GET) are not in
    progress; the same stream on an ordinary route is, and blocks until it ends."""
    a = await nodes.start(setup=watched(background))
    cookie = await a.seed("watched")
    async with a.http.stream("GET", "/watch", headers={"cookie": cookie}) as stream:
        lines = stream.aiter_lines()  # kept: a dropped iterator would close the stream
        assert await anext(lines) == "0"
        answer = await a.ok("prepare", checkpoint_id="c1", deadline_s=0.3)
        assert answer["state"] == state, answer
        if not background:
            assert [b["id"] for b in answer["blockers"]] == ["watched"]
    await a.ok("resume", checkpoint_id="c1")
