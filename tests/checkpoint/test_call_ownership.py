"""A control call's work belongs to the checkpointer, not to its caller (issue 12, point
1): a caller that goes away (its relaying worker died, its client left) leaves the work to
end, and the phase machine learns how it ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from e2e.harness import eventually
from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.fleet import LocalFleet
from tether.checkpoint.participant import Participant


@pytest.fixture
async def checkpointer(tmp_path: Path) -> AsyncIterator[tuple[Checkpointer, Participant]]:
    participant = Participant()
    checkpointer = Checkpointer(LocalFleet(participant), name="own", root=str(tmp_path))
    checkpointer.start()
    yield checkpointer, participant
    await checkpointer.stop()


async def test_a_prepare_whose_caller_left_still_ends_prepared(
    checkpointer: tuple[Checkpointer, Participant],
) -> None:
    checkpointer_, participant = checkpointer
    step = asyncio.Event()

    async def run() -> int:
        async with participant.episode("e", 1) as episode:
            await step.wait()
            await episode.boundary({"step": 1})  # parks here while admission is closed
            return episode.boundaries

    running = asyncio.create_task(run())
    await eventually(lambda: participant.episodes, 2, "the episode runs")
    caller = asyncio.create_task(
        checkpointer_.call("prepare", {"checkpoint_id": "c1", "deadline_s": 30})
    )
    await eventually(lambda: checkpointer_.machine.phase == "preparing", 2, "preparing")
    caller.cancel()  # as the channel's close cancels a relayed call's handler
    await asyncio.gather(caller, return_exceptions=True)
    step.set()
    await eventually(lambda: checkpointer_.machine.phase == "prepared", 5, "prepared")
    again = await checkpointer_.call("prepare", {"checkpoint_id": "c1"})
    assert again["state"] == "prepared"
    await checkpointer_.call("resume", {"checkpoint_id": "c1"})
    assert await running == 1


async def test_a_commit_whose_caller_left_is_published_and_a_retry_reads_it(
    checkpointer: tuple[Checkpointer, Participant], tmp_path: Path
) -> None:
    checkpointer_, _ = checkpointer
    await checkpointer_.call("prepare", {"checkpoint_id": "c1"})
    caller = asyncio.create_task(checkpointer_.call("commit", {"checkpoint_id": "c1"}))
    await asyncio.sleep(0)  # the call has started
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    await eventually(lambda: checkpointer_.machine.phase == "committed", 5, "committed")
    manifest = await checkpointer_.call("commit", {"checkpoint_id": "c1"})
    assert manifest["checkpoint_id"] == "c1"
    assert (tmp_path / "c1" / "own" / "MANIFEST.json").exists()
    assert await checkpointer_.call("resume", {"checkpoint_id": "c1"}) == {"phase": "open"}
