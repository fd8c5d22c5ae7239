"""A claimed record whose request ends while a checkpoint is open (SPEC 5.8): it stays
claimed by its worker, that worker's export carries it exactly once, and it is held
again, with its last boundary state, once admission opens.

A real `Participant` holding a restored record the way one worker does; the request is
a task inside `episode()`, ended the way a server ends one (cancelled).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.checkpoint.conftest import eventually
from tether.checkpoint.participant import Held, Participant
from tether.checkpoint.segments import read_records

RESTORED = {"step": 3}


def holding() -> Participant:
    """One worker holding attempt 1's record of episode `e`, parked at step 3."""
    participant = Participant()
    participant.records.hold(Held("e", 1, state=RESTORED))
    return participant


async def run_attempt_2(participant: Participant, gate: asyncio.Event) -> None:
    """Attempt 2: continue from the held record, take one step when `gate` opens,
    then keep stepping (parking at each boundary while a checkpoint is open)."""
    async with participant.episode("e", 2) as episode:
        state: dict[str, Any] = dict(episode.state)
        await gate.wait()
        while True:
            state = {"step": state["step"] + 1}
            await episode.boundary(state)
            await asyncio.sleep(0.01)


async def parked_at_step_4(participant: Participant) -> asyncio.Task[None]:
    """Attempt 2's request, stepped to 4 and parked there as a checkpoint opened."""
    gate = asyncio.Event()
    request = asyncio.create_task(run_attempt_2(participant, gate))
    await eventually(lambda: ("e", 2) in participant.episodes, 5, "attempt 2 claimed")
    participant.close_admission()
    gate.set()
    await eventually(lambda: participant.episodes[("e", 2)].parked, 5, "attempt 2 parked")
    assert participant.episodes[("e", 2)].state == {"step": 4}
    return request


async def parked_then_ended(participant: Participant) -> None:
    """Attempt 2 steps to 4, parks as a checkpoint opens, and its request is ended."""
    request = await parked_at_step_4(participant)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    assert ("e", 2) not in participant.episodes


async def test_a_record_whose_request_ends_during_a_checkpoint_stays_claimed_until_it_closes(
    tmp_path: Path,
) -> None:
    participant = holding()
    await parked_then_ended(participant)
    assert participant.held["e"].claimed_by is not None, "handed back while the checkpoint is open"

    exported = await participant.export(tmp_path / "segment.msgpack", None, None, lambda _: True)
    records = list(read_records(tmp_path / "segment.msgpack"))
    assert exported["episodes"] == 1
    assert [(r["episode_id"], r["attempt"], r["state"]) for r in records] == [
        ("e", 2, {"step": 4})
    ]

    participant.open_admission()
    await eventually(lambda: participant.held["e"].claimed_by is None, 5, "held again")
    held = participant.held["e"]
    assert (held.attempt, held.load(read_records)) == (1, {"step": 4})
    gate = asyncio.Event()
    retry = asyncio.create_task(run_attempt_2(participant, gate))
    try:
        await eventually(
            lambda: ("e", 2) in participant.episodes
            and participant.episodes[("e", 2)].state == {"step": 4},
            5,
            "the retry continues from step 4",
        )
    finally:
        retry.cancel()
        await asyncio.gather(retry, return_exceptions=True)


async def test_a_stopping_worker_hands_back_what_waits_for_admission_to_open() -> None:
    participant = holding()
    await parked_then_ended(participant)
    await participant.hand_back_all()
    assert participant.held["e"].claimed_by is None
    assert participant.held["e"].load(read_records) == {"step": 4}


async def test_a_worker_that_stops_as_it_cancels_a_parked_request_hands_its_record_back() -> None:
    """uvicorn cancels what still runs and starts the lifespan shutdown in the same turn:
    the request hands back only as it unwinds, after the shutdown began."""
    participant = holding()
    request = await parked_at_step_4(participant)
    request.cancel()
    await participant.hand_back_all()
    assert participant.held["e"].claimed_by is None
    assert participant.held["e"].load(read_records) == {"step": 4}
    await asyncio.gather(request, return_exceptions=True)
