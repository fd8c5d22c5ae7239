"""The checkpointer tells its observers every phase change, with its duration and what it
moved (SPEC 9): the coordinator's log lines and the metrics are built on these."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.events import PhaseChange
from tether.checkpoint.fleet import LocalFleet
from tether.checkpoint.participant import Participant


class States:
    """Three sessions of small state, as an app would register them."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {f"s{i}": {"n": i} for i in range(3)}

    def sessions(self) -> Iterable[str]:
        return list(self.states)

    def holds(self, session_id: str) -> bool:
        return session_id in self.states

    def export(self, session_id: str) -> Any:
        return self.states[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        self.states[session_id] = state

    async def release(self, session_id: str) -> None:
        self.states.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False


async def run_checkpoint(tmp_path: Path) -> list[PhaseChange]:
    participant = Participant()
    participant.register_sessions(States())
    checkpointer = Checkpointer(LocalFleet(participant), name="ev", root=str(tmp_path))
    seen: list[PhaseChange] = []
    checkpointer.observers.append(seen.append)
    checkpointer.start()
    try:
        await checkpointer.call("prepare", {"checkpoint_id": "c1"})
        await checkpointer.call("commit", {"checkpoint_id": "c1"})
        await checkpointer.call("resume", {"checkpoint_id": "c1"})
        await checkpointer.call("resume", {"checkpoint_id": "c1"})  # a retry: no change
    finally:
        await checkpointer.stop()
    return seen


async def test_a_checkpoint_is_prepared_committed_and_resumed_with_what_it_moved(
    tmp_path: Path,
) -> None:
    seen = await run_checkpoint(tmp_path)
    assert [event.change for event in seen] == ["prepared", "committed", "resumed"]
    committed = seen[1]
    assert committed.records == {"sessions": 3, "episodes": 0}
    assert committed.bytes is not None and committed.bytes > 0
    assert committed.workers == 1
    resumed = seen[2]
    assert resumed.paused_s is not None and resumed.paused_s >= committed.seconds


async def test_every_phase_change_is_logged_with_its_duration_and_counts(
    tmp_path: Path,
) -> None:
    with structlog.testing.capture_logs() as logs:
        await run_checkpoint(tmp_path)
    events = {line["event"]: line for line in logs}
    for change in ("checkpoint_prepared", "checkpoint_committed", "checkpoint_resumed"):
        assert isinstance(events[change]["seconds"], float)
    committed = events["checkpoint_committed"]
    assert committed["records"] == {"sessions": 3, "episodes": 0}
    assert committed["bytes"] > 0
    assert events["checkpoint_resumed"]["paused_s"] >= 0
