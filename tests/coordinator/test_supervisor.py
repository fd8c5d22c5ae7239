"""The supervisor with real processes: a worker that keeps failing to start is replaced
ever more slowly, and a replacement that never registers is killed and replaced."""

from __future__ import annotations

import asyncio
import os

from e2e.harness import eventually
from tether.coordinator.supervisor import Supervisor

FAILS = ("-c", "raise SystemExit(3)")
HANGS = ("-c", "import time; time.sleep(600)")


def supervisor(command: tuple[str, ...], **options: object) -> Supervisor:
    return Supervisor(
        1, dict(os.environ), (), started=lambda: True, on_failure=lambda code: None,
        stop_timeout_s=5, command=command, **options,  # type: ignore[arg-type]
    )


async def test_a_worker_that_keeps_failing_to_start_is_replaced_ever_more_slowly() -> None:
    """Each replacement that exits at once waits twice as long as the one before, up to
    the cap, rather than respawning in a tight loop (an app that cannot start now)."""
    watched = supervisor(FAILS, respawn_delays_s=(0.05, 0.2))
    await watched.start()
    try:
        await eventually(lambda: len(watched.delays) >= 4, 30, "four replacements")
    finally:
        await watched.stop()
    assert list(watched.delays)[:4] == [0.05, 0.1, 0.2, 0.2]


async def test_a_replacement_that_never_registers_is_killed_and_replaced() -> None:
    """A replacement hung at start-up (its lifespan never ends) would leave the server
    a worker short for good: past the start timeout it is killed, and replaced."""
    watched = supervisor(HANGS, registered=lambda pid: False, start_timeout_s=0.3,
                         respawn_delays_s=(0.05, 0.1))
    await watched.start()
    try:
        first = watched.pids
        for proc in list(watched._procs.values()):
            proc.kill()  # the first worker dies: its replacement is timed
        await eventually(lambda: watched.restarts >= 2 and bool(watched.pids), 30,
                         "the hung replacement replaced")
        assert watched.pids != first
    finally:
        await watched.stop()
    await asyncio.sleep(0)
    assert watched.pids == []
