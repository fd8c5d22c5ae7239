"""What the checkpointer tells its observers (logs, metrics): each phase change, with how
long it took and what it moved (SPEC 9)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import structlog

Change = Literal[
    "prepared", "blocked", "committed", "commit_failed", "resumed", "restored",
    "restore_failed", "expired", "aborted",
]

log = structlog.get_logger("tether.checkpoint")


@dataclass(frozen=True)
class PhaseChange:
    """One phase change of one checkpoint ID.

    `seconds` is how long the step took: a prepare's wait, a commit's write, a restore's
    install, or, on the changes that reopen admission (resumed, expired, aborted), the
    reopening itself; on those, `paused_s` is how long admission stayed closed."""

    change: Change
    checkpoint_id: str
    seconds: float
    records: Mapping[str, int] | None = None
    bytes: int | None = None
    workers: int | None = None
    paused_s: float | None = None
    code: str | None = None
    """Why it failed or blocked: the error code, or the number of blockers."""


Observer = Callable[[PhaseChange], None]


def log_phase_change(event: PhaseChange) -> None:
    """The coordinator's log line for every phase change."""
    fields = {k: v for k, v in (
        ("records", dict(event.records) if event.records is not None else None),
        ("bytes", event.bytes), ("workers", event.workers), ("paused_s", event.paused_s),
        ("code", event.code),
    ) if v is not None}
    failed = event.change in ("commit_failed", "restore_failed", "blocked", "expired")
    (log.warning if failed else log.info)(
        f"checkpoint_{event.change}", checkpoint_id=event.checkpoint_id,
        seconds=round(event.seconds, 3), **fields,
    )
