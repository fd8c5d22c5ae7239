"""Readiness reports (SPEC 5.2): while admission is closed, a worker tells the coordinator
its blockers whenever they change, each report numbered, so the coordinator keeps the
newest and never polls the channel.

The worker re-checks itself on a short poll as well, because some readiness changes
without a notification (an app's `busy` flag clearing); only a changed result crosses the
channel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from tether.checkpoint.participant import Blockers, Participant

POLL_S = 0.05

Report = dict[str, Any]
"""`{"seq": int, "listed": [...], "total": int}`, as it crosses the channel."""


class ReadinessReporter:
    """One worker's reports: `report()` makes one now; `start()` pushes each change
    through `send` until `stop()`."""

    def __init__(
        self,
        participant: Participant,
        send: Callable[[Report], Awaitable[None]],
        poll_s: float = POLL_S,
    ) -> None:
        self._participant = participant
        self._send = send
        self._poll_s = poll_s
        self._seq = 0
        self._last: Blockers | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        participant.on_change(self._wake.set)

    def report(self, blockers: Blockers | None = None) -> Report:
        """This worker's readiness now, numbered after every report before it."""
        if blockers is None:
            blockers = self._participant.blockers()
        self._seq += 1
        self._last = blockers
        return {"seq": self._seq, "listed": blockers.listed, "total": blockers.total}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tether-readiness")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await self._wake.wait()
            self._wake.clear()
            blockers = self._participant.blockers()
            if blockers != self._last:
                try:
                    await self._send(self.report(blockers))
                except Exception:  # the channel is gone: this worker is stopping
                    return
