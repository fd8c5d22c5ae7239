"""Episodes on one in-process worker: parking at boundaries, exactly-once continuation
after a restore, attempts, hand-back, retire and forget (SPEC 5.1, 5.8, 5.9)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx

from tests.checkpoint.conftest import Node, Nodes, assert_error, eventually
from tether.checkpoint.segments import read_records
from tether.examples import episodes

STEPS = 60


async def run(
    node: Node, episode_id: str, attempt: int, steps: int = STEPS, step_ms: float = 5
) -> httpx.Response:
    body = {"episode_id": episode_id, "attempt": attempt, "steps": steps, "step_ms": step_ms}
    return await node.http.post("/run", json=body)


def finished(reply: httpx.Response, episode_id: str, attempt: int, resumed_from: int) -> bool:
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["episode_id"] == episode_id
    assert (body["attempt"], body["steps_done"], body["resumed_from"]) == (
        attempt, STEPS, resumed_from
    ), body
    assert len(body["workers"]) == STEPS
    return True


async def start_runs(node: Node, ids: list[str], step_ms: float) -> list[asyncio.Task[Any]]:
    """Start attempt 1 of each episode and wait until each passed a few boundaries."""
    runs = [asyncio.create_task(run(node, e, 1, step_ms=step_ms)) for e in ids]
    await eventually(
        lambda: len(node.participant.episodes) == len(ids)
        and all(ep.boundaries >= 3 for ep in node.participant.episodes.values()),
        what="every run is a few steps in",
    )
    return runs


async def checkpoint_running(nodes: Nodes, ids: list[str]) -> tuple[Node, dict[str, int]]:
    """Run the episodes on a node, checkpoint them mid-run (published as the controller
    would), let the runs finish, and crash the node. Returns it and each parked step."""
    a = await nodes.start(episodes.create_app)
    runs = await start_runs(a, ids, step_ms=5)
    await a.prepared("c1")
    manifest = await a.ok("commit", checkpoint_id="c1")
    a.publish("c1")
    await a.ok("resume", checkpoint_id="c1")
    for reply, episode_id in zip(await asyncio.gather(*runs), ids, strict=True):
        assert finished(reply, episode_id, 1, 0)
    records = read_records(a.root / "c1" / "episodes" / manifest["segments"][0]["file"])
    steps = {r["episode_id"]: r["state"]["step"] for r in records}
    assert sorted(steps) == sorted(ids)
    assert all(0 < step < STEPS for step in steps.values()), steps
    await a.stop()
    return a, steps


async def restored(nodes: Nodes, ids: list[str]) -> tuple[Node, Node, dict[str, int]]:
    """`checkpoint_running`, then a new node restored from the latest checkpoint."""
    a, steps = await checkpoint_running(nodes, ids)
    b = await nodes.start(episodes.create_app)
    answer = await b.restore_latest()
    assert sorted(answer["held_episodes"], key=lambda h: h["episode_id"]) == [
        {"episode_id": e, "attempt_to_send": 2} for e in sorted(ids)
    ]
    return a, b, steps


# Done when 2 -----------------------------------------------------------------------------


async def test_a_checkpoint_parks_running_episodes_commits_and_resumes_them(
    nodes: Nodes,
) -> None:
    a = await nodes.start(episodes.create_app)
    ids = [f"ep-{i:02d}" for i in range(20)]
    runs = await start_runs(a, ids, step_ms=10)

    await a.prepared("c1", deadline_s=5)
    parked = {eid: ep.state["step"] for (eid, _), ep in a.participant.episodes.items()}
    assert all(ep.parked for ep in a.participant.episodes.values())
    assert_error(await run(a, "new", 1), 503, "checkpoint_parked")
    manifest = await a.ok("commit", checkpoint_id="c1")
    assert manifest["records"] == {"sessions": 0, "episodes": 20}
    records = read_records(a.root / "c1" / "episodes" / manifest["segments"][0]["file"])
    assert {r["episode_id"]: (r["attempt"], r["state"]["step"]) for r in records} == {
        eid: (1, step) for eid, step in parked.items()
    }
    assert not any(task.done() for task in runs)
    # Still parked after the commit: nothing moved past its boundary.
    assert {eid: ep.state["step"] for (eid, _), ep in a.participant.episodes.items()} == parked

    await a.ok("resume", checkpoint_id="c1")
    replies = await asyncio.wait_for(asyncio.gather(*runs), 10)
    for reply, episode_id in zip(replies, ids, strict=True):
        assert finished(reply, episode_id, 1, 0)


async def test_restored_episodes_continue_exactly_once_from_their_checkpointed_step(
    nodes: Nodes,
) -> None:
    ids = [f"ep-{i:02d}" for i in range(20)]
    a, b, steps = await restored(nodes, ids)
    first = ids[0]

    long = asyncio.create_task(run(b, first, 2, step_ms=20))
    await eventually(lambda: (first, 2) in b.participant.episodes, what="attempt 2 claimed it")
    assert first not in {h["episode_id"] for h in (await b.status())["held_episodes"]}
    claimed = assert_error(await run(b, first, 2), 409, "episode_claimed")
    assert claimed["detail"]["worker"] == b.routing.id
    assert_error(await run(b, first, 1), 409, "stale_attempt")
    beyond = assert_error(await run(b, first, 3), 409, "attempt_mismatch")
    assert beyond["detail"]["expected"] == 2

    reply = await asyncio.wait_for(long, 10)
    assert finished(reply, first, 2, steps[first])
    k = steps[first]
    assert reply.json()["workers"] == [a.routing.id] * k + [b.routing.id] * (STEPS - k)

    others = await asyncio.gather(*(run(b, e, 2) for e in ids[1:]))
    for reply, episode_id in zip(others, ids[1:], strict=True):
        assert finished(reply, episode_id, 2, steps[episode_id])
    assert (await b.status())["held_episodes"] == []


async def test_an_older_attempt_stays_stale_after_the_record_was_continued(
    nodes: Nodes,
) -> None:
    _, b, steps = await restored(nodes, ["ep"])
    assert finished(await run(b, "ep", 2), "ep", 2, steps["ep"])
    # SPEC 5.8: for an episode parked under attempt 1, attempt <= 1 gets stale_attempt;
    # the record having been continued does not make attempt 1 new work.
    assert_error(await run(b, "ep", 1), 409, "stale_attempt")


async def test_a_claimed_request_that_disconnects_before_its_first_boundary_hands_back(
    nodes: Nodes,
) -> None:
    _, b, steps = await restored(nodes, ["ep"])
    body = json.dumps({"episode_id": "ep", "attempt": 2, "steps": STEPS, "step_ms": 2000})
    _, writer = await asyncio.open_connection(*b.listener.getsockname()[:2])
    writer.write(
        f"POST /run HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n{body}".encode()
    )
    await writer.drain()
    await eventually(lambda: ("ep", 2) in b.participant.episodes, what="attempt 2 claimed it")
    assert (await b.status())["held_episodes"] == []

    writer.transport.abort()  # the client goes away before the first boundary
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    await eventually(
        lambda: _held(b), within=3, what="the record is held again for attempt 2"
    )
    assert (await b.status())["held_episodes"] == [{"episode_id": "ep", "attempt_to_send": 2}]
    assert finished(await run(b, "ep", 2), "ep", 2, steps["ep"])


async def test_a_claimed_record_that_cannot_be_read_is_handed_back_for_a_retry(
    nodes: Nodes,
) -> None:
    _, b, steps = await restored(nodes, ["ep"])
    [segment] = (b.root / "c1" / "episodes").glob("segment-*.msgpack")
    away = segment.with_name("away")
    segment.rename(away)  # the disk loses the segment under the restored server
    reply = await run(b, "ep", 2)
    assert reply.status_code == 422 and reply.json()["code"] == "corrupt_checkpoint", reply.text
    assert (await b.status())["held_episodes"] == [{"episode_id": "ep", "attempt_to_send": 2}]

    away.rename(segment)
    assert finished(await run(b, "ep", 2), "ep", 2, steps["ep"])


async def _held(node: Node) -> bool:
    return bool((await node.status())["held_episodes"])


async def test_restore_answers_only_held_episodes_in_its_scope(nodes: Nodes) -> None:
    _, steps = await checkpoint_running(nodes, ["keep", "drop"])
    b = await nodes.start(episodes.create_app)
    answer = await b.restore("c1", scope=["keep"])
    assert answer["held_episodes"] == [{"episode_id": "keep", "attempt_to_send": 2}]
    await b.ok("resume", checkpoint_id="c1")
    assert finished(await run(b, "keep", 2), "keep", 2, steps["keep"])


# Done when 9: retire and forget -------------------------------------------------------------


async def test_retire_stops_a_running_attempt_and_refuses_it_and_older_ones(
    nodes: Nodes,
) -> None:
    a = await nodes.start(episodes.create_app)
    running = asyncio.create_task(run(a, "ep", 2, step_ms=200))
    await eventually(lambda: ("ep", 2) in a.participant.episodes, what="attempt 2 runs")

    answer = await a.ok("retire", episode_id="ep", attempt=2)
    assert answer == {
        "retired": [{"episode_id": "ep", "attempt": 2, "stopped": 1, "dropped_held": 0}]
    }
    assert_error(await asyncio.wait_for(running, 5), 409, "stale_attempt")
    assert ("ep", 2) not in a.participant.episodes
    assert (await a.status())["workers"][0]["episodes"] == 0
    for attempt in (1, 2):
        assert_error(await run(a, "ep", attempt), 409, "stale_attempt")
    assert (await run(a, "ep", 3, steps=2)).status_code == 200
    assert (await run(a, "other", 1, steps=2)).status_code == 200

    assert await a.ok("forget", episode_ids=["ep", "never-retired"]) == {"forgotten": ["ep"]}
    assert (await run(a, "ep", 2, steps=2)).status_code == 200


async def test_retiring_the_attempt_that_continues_a_restored_record_drops_the_record(
    nodes: Nodes,
) -> None:
    """SPEC 5.9: the stopped request hands the record back, but no attempt may claim it
    any more, so it is not held again (nor exported by the next checkpoint)."""
    _, b, _ = await restored(nodes, ["ep"])
    running = asyncio.create_task(run(b, "ep", 2, step_ms=200))
    await eventually(lambda: ("ep", 2) in b.participant.episodes, what="attempt 2 claimed it")
    answer = await b.ok("retire", episode_id="ep", attempt=2)
    assert answer["retired"][0]["stopped"] == 1
    assert_error(await asyncio.wait_for(running, 5), 409, "stale_attempt")
    assert (await b.status())["held_episodes"] == []
    assert_error(await run(b, "ep", 2), 409, "stale_attempt")


async def test_retire_answers_once_the_attempt_has_stopped_and_its_state_is_freed(
    nodes: Nodes,
) -> None:
    a = await nodes.start(episodes.create_app)
    running = asyncio.create_task(run(a, "ep", 1, step_ms=2000))
    await eventually(lambda: ("ep", 1) in a.participant.episodes, what="attempt 1 runs")

    await a.ok("retire", episode_id="ep", attempt=1)
    # SPEC 5.9: retire stops that attempt's work and frees its state, then answers.
    try:
        assert ("ep", 1) not in a.participant.episodes
        assert (await a.status())["workers"][0]["episodes"] == 0
    finally:
        reply = await asyncio.wait_for(running, 5)
    assert_error(reply, 409, "stale_attempt")


async def test_retire_drops_a_held_record_it_covers(nodes: Nodes) -> None:
    _, b, _ = await restored(nodes, ["kept", "dropped"])
    answer = await b.ok("retire", episode_id="kept", attempt=1)
    assert answer["retired"] == [
        {"episode_id": "kept", "attempt": 1, "stopped": 0, "dropped_held": 0}
    ]
    answer = await b.ok("retire", episode_id="dropped", attempt=2)
    assert answer["retired"] == [
        {"episode_id": "dropped", "attempt": 2, "stopped": 0, "dropped_held": 1}
    ]
    assert (await b.status())["held_episodes"] == [{"episode_id": "kept", "attempt_to_send": 2}]
    assert_error(await run(b, "dropped", 2), 409, "stale_attempt")
    assert finished(await run(b, "dropped", 3), "dropped", 3, 0)


async def test_retire_during_an_open_checkpoint_is_invalid_phase(nodes: Nodes) -> None:
    a = await nodes.start(episodes.create_app)
    await a.prepared("c1")
    assert_error(await a.control("retire", episode_id="ep", attempt=1), 409, "invalid_phase")
    await a.ok("commit", checkpoint_id="c1")
    assert_error(await a.control("retire", episode_id="ep", attempt=1), 409, "invalid_phase")
    await a.ok("resume", checkpoint_id="c1")
    assert (await a.ok("retire", episode_id="ep", attempt=1))["retired"][0]["attempt"] == 1


async def test_an_expired_lease_lets_parked_episodes_go_on(nodes: Nodes) -> None:
    a = await nodes.start(episodes.create_app)
    [runner] = await start_runs(a, ["ep"], step_ms=5)
    await a.prepared("c1", deadline_s=0.2, lease_s=0.3)
    assert all(ep.parked for ep in a.participant.episodes.values())
    assert finished(await asyncio.wait_for(runner, 5), "ep", 1, 0)
    assert (await a.status())["phase"] == "open"
