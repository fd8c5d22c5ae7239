"""A claimed record whose request ends while a checkpoint is open, at several workers
(SPEC 5.8): it stays claimed by its worker until admission opens, so the coordinator
never carries it and its worker's export holds it, once; then it is held again.

Before, the worker handed it back at once: if that reached the coordinator after the
commit had chosen what to carry itself, and after the worker had listed its parked
episodes, the record was in no segment. Composed from the real pieces of `tether serve
--workers 2`, as in `test_claim_race` (whose helpers this reuses).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.checkpoint.conftest import eventually
from tests.coordinator.test_claim_race import (
    BOUND,
    EPISODE,
    SHORT_DEADLINE_S,
    STEPS,
    HeldReads,
    Server,
    episode_entries,
    restored_after_attempt_1,
    started,
)
from tether.checkpoint import participant as participant_module


async def attempt_2_stepping_on_a(
    base: Path, root: Path, servers: list[Server], pending: list[asyncio.Task[Any]]
) -> Server:
    """A server restored with attempt 1's record held, and attempt 2 continuing it on
    worker A past its first boundary (its request added to `pending`)."""
    second, _ = await restored_after_attempt_1(base, root, servers)
    a = second.workers[0]
    pending.append(asyncio.create_task(a.run(2)))
    await eventually(
        lambda: any(e.boundaries for e in a.participant.episodes.values()),
        BOUND,
        "attempt 2 continued on worker A",
    )
    return second


async def test_an_episode_ended_during_an_open_checkpoint_is_exported_once_by_its_worker(
    short_tmp: Path,
) -> None:
    root = short_tmp / "ckpt"
    async with started() as (servers, pending):
        second = await attempt_2_stepping_on_a(short_tmp, root, servers, pending)
        a, b = second.workers
        prepared = await b.ok("prepare", checkpoint_id="c2", deadline_s=BOUND)
        assert prepared["state"] == "prepared", prepared
        episode = a.participant.episodes[(EPISODE, 2)]
        assert episode.parked
        parked_at = episode.state["step"]

        assert episode.task is not None
        episode.task.cancel()  # the server ends the request (a shutdown, a watchdog)
        await eventually(
            lambda: (EPISODE, 2) not in a.participant.episodes, BOUND, "the request ended"
        )
        assert second.fleet.held[EPISODE].claimed_by == a.id, "handed back while open"

        manifest = await second.checkpoint("c2", via=b)  # commit, CHECKPOINT.json, resume
        assert [(worker, e.attempt) for worker, e in episode_entries(root, "c2", manifest)] == [
            (a.id, 2)
        ]
        await eventually(
            lambda: second.fleet.held[EPISODE].claimed_by is None,
            BOUND,
            "handed back once admission opened",
        )
        done = (await b.run(2)).json()
        assert (done["attempt"], done["resumed_from"], done["steps_done"]) == (
            2,
            parked_at,
            STEPS,
        )


async def test_a_hand_back_in_flight_holds_a_prepare_until_it_lands(short_tmp: Path) -> None:
    """The request ends with admission open, and its hand-back is still writing the
    boundary state to a file when a prepare starts: until it lands (or stays, claimed,
    for this worker's export) the record is in no one's export, so the prepare waits."""
    writes = HeldReads(participant_module._write_one)
    asyncio.get_running_loop().set_default_executor(writes)
    root = short_tmp / "ckpt"
    async with started() as (servers, pending):
        try:
            second = await attempt_2_stepping_on_a(short_tmp, root, servers, pending)
            a, b = second.workers
            episode = a.participant.episodes[(EPISODE, 2)]
            assert episode.task is not None
            episode.task.cancel()
            await eventually(writes.requested.is_set, BOUND, "A writes the boundary state")
            at_cancel = episode.state["step"]

            blocked = await b.ok("prepare", checkpoint_id="c2", deadline_s=SHORT_DEADLINE_S)
            assert blocked["state"] == "blocked", blocked
            assert [(x["kind"], x["worker"], x["id"]) for x in blocked["blockers"]] == [
                ("episode_running", a.id, EPISODE)
            ], blocked

            writes.release.set()
            prepared = await b.ok("prepare", checkpoint_id="c2", deadline_s=BOUND)
            assert prepared["state"] == "prepared", prepared
            manifest = await second.checkpoint("c2", via=b)
            [(_, entry)] = episode_entries(root, "c2", manifest)  # exactly once, wherever
            assert entry.attempt == 2
            done = (await b.run(2)).json()
            assert (done["resumed_from"], done["steps_done"]) == (at_cancel, STEPS)
        finally:
            writes.release.set()
