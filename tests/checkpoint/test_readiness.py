"""A participant's readiness report (SPEC 5.2): what blocks, what is listed, what is
counted, and how often the app's own busy flags are polled.

These drive a real `Participant` with real episodes (tasks inside `episode()`), the way
an app's handlers do; no sockets are needed for what a worker reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest

from tether.checkpoint.participant import LISTED_BLOCKERS, Participant


class Flags:
    """Sessions whose busy flags the app flips without telling tether; counts polls."""

    def __init__(self, ids: Iterable[str]) -> None:
        self.states = dict.fromkeys(ids, 0)
        self.busy_ids: set[str] = set()
        self.polls = 0

    def sessions(self) -> Iterable[str]:
        return self.states.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.states

    def export(self, session_id: str) -> int:
        return self.states[session_id]

    async def install(self, session_id: str, state: int) -> None:
        self.states[session_id] = state

    async def release(self, session_id: str) -> None:
        self.states.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        self.polls += 1
        return session_id in self.busy_ids


class Stepper:
    """Episodes that step when told and park at a boundary once admission closes."""

    def __init__(self, participant: Participant) -> None:
        self.participant = participant
        self.go = asyncio.Event()
        self.stepped = asyncio.Event()
        """Set each time an episode leaves a boundary."""
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self, episode_id: str, entered: asyncio.Event) -> None:
        async with self.participant.episode(episode_id, 1) as episode:
            entered.set()
            while True:
                await self.go.wait()
                await episode.boundary({"episode": episode_id})
                self.stepped.set()
                await asyncio.sleep(0)

    async def start(self, count: int) -> None:
        for number in range(count):
            entered = asyncio.Event()
            self.tasks.append(asyncio.create_task(self.run(f"e{number:03d}", entered)))
            await entered.wait()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def stepper() -> AsyncIterator[Stepper]:
    participant = Participant(state_version="readiness/1")
    stepper = Stepper(participant)
    yield stepper
    participant.open_admission()
    await stepper.stop()


async def parked(participant: Participant, count: int) -> None:
    """Wait until `count` episodes are parked (each park notifies a change)."""
    changed = asyncio.Event()
    participant.on_change(changed.set)
    async with asyncio.timeout(5):
        while sum(e.parked for e in participant.episodes.values()) < count:
            await changed.wait()
            changed.clear()


async def test_stepping_episodes_are_counted_all_and_listed_up_to_the_limit(
    stepper: Stepper,
) -> None:
    participant = stepper.participant
    await stepper.start(LISTED_BLOCKERS + 50)
    participant.close_admission()
    report = participant.blockers()
    assert report.total == LISTED_BLOCKERS + 50
    assert len(report.listed) == LISTED_BLOCKERS
    assert {b["kind"] for b in report.listed} == {"episode_running"}

    stepper.go.set()  # each reaches its next boundary and parks there
    await parked(participant, LISTED_BLOCKERS + 50)
    assert participant.blockers() == ([], 0)


async def test_an_episode_that_steps_again_after_resume_blocks_the_next_prepare(
    stepper: Stepper,
) -> None:
    participant = stepper.participant
    await stepper.start(1)
    stepper.go.set()
    participant.close_admission()
    await parked(participant, 1)
    assert participant.blockers().total == 0

    stepper.go.clear()  # it leaves its boundary and holds before the next one
    stepper.stepped.clear()
    participant.open_admission()
    await asyncio.wait_for(stepper.stepped.wait(), 5)
    participant.close_admission()
    assert [b["id"] for b in participant.blockers().listed] == ["e000"]


async def test_the_apps_busy_flags_are_read_fresh_once_nothing_else_blocks(
    stepper: Stepper,
) -> None:
    participant = stepper.participant
    flags = Flags(["s1", "s2"])
    flags.busy_ids.add("s1")
    participant.register_sessions(flags)
    await stepper.start(1)
    participant.close_admission()
    before = participant.blockers()
    assert (before.total, sorted(b["kind"] for b in before.listed)) == (
        2,
        ["episode_running", "session_busy"],
    )

    flags.busy_ids.clear()  # silently, while the episode still blocks
    stepper.go.set()
    await parked(participant, 1)
    assert participant.blockers() == ([], 0)


async def test_while_episodes_block_the_app_is_not_polled_at_every_report(
    stepper: Stepper,
) -> None:
    participant = stepper.participant
    flags = Flags(f"s{number}" for number in range(100))
    participant.register_sessions(flags)
    await stepper.start(1)
    participant.close_admission()
    reports = 200
    for _ in range(reports):
        assert participant.blockers().total == 1
    # One poll of every session per report would be 20,000; the reports take far less
    # than the 50 ms a poll stays fresh, so a loaded machine still polls only a few times.
    assert flags.polls <= 10 * len(flags.states)
