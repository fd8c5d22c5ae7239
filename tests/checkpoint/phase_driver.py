"""A stand-in for the checkpointer's I/O layer around a `PhaseMachine`, with a fake clock:
it runs each step's actions in the small (admission, work left unfinished), feeds the
events that end that work, and checks the machine's invariants after every step.

Shared by the phase machine's own property test (`test_phases.py`) and the model of the
whole protocol (`test_protocol_model.py`), which adds workers and held records around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from tether.checkpoint.phases import (
    CLOSED,
    AbortDone,
    Action,
    CloseAdmission,
    CommitDone,
    CommitFailed,
    Event,
    LogExpired,
    OpenAdmission,
    Phase,
    PhaseMachine,
    ReadinessTimeout,
    Ready,
    ReleaseInstalled,
    RestoreDone,
    RestoreFailed,
    StartRestore,
    Step,
    WaitReady,
    WriteCheckpoint,
)
from tether.routing.errors import TetherError

T0 = 1_000.0
STARTS_WORK = (WaitReady, WriteCheckpoint, StartRestore, ReleaseInstalled)
"""Actions whose work ends with an event fed back later."""


def ending(action: Action, success: bool) -> Event:
    """The event that ends the work an action started, well or badly."""
    match action:
        case WaitReady(checkpoint_id=cid):
            return Ready(cid) if success else ReadinessTimeout(cid, [{"kind": "x"}], 1)
        case WriteCheckpoint(key=key):
            if success:
                return CommitDone(key.checkpoint_id, {"id": key.checkpoint_id})
            return CommitFailed(key.checkpoint_id, "not_ready")
        case StartRestore(key=key):
            if success:
                return RestoreDone(key.checkpoint_id, {})
            return RestoreFailed(key.checkpoint_id, "corrupt_checkpoint")
        case ReleaseInstalled(key=key):
            return AbortDone(key.checkpoint_id)
    raise AssertionError(action)


class Driver:
    """Plays the I/O layer: runs steps, tracks admission and unfinished work, and checks
    the machine's invariants after every step."""

    def __init__(self, remember: int = 3) -> None:
        self.m = PhaseMachine(remember=remember)
        self.remember = remember
        self.now = T0
        self.closed = False
        self.pending: list[Action] = []
        self.lease_of: tuple[str | None, float | None] = (None, None)
        self.named: list[str] = []

    def resolve(self, which: str) -> str:
        """The ID a call names: `active` (a new one if none is), `new`, `last` or `first`."""
        active = self.m.checkpoint_id
        if which == "new" or not self.named or (which == "active" and active is None):
            self.named.append(f"c{len(self.named)}")
            return self.named[-1]
        return {"active": active, "last": self.named[-1]}.get(which) or self.named[0]

    def step(self, make: Callable[[], Step], ends_work: bool = False) -> Step:
        """Run one call or event; `ends_work`: it ends work a lease may have waited for."""
        m = self.m
        busy_before, restored_before = m.busy, m.was_restored
        step = make()
        for action in step.actions:
            if isinstance(action, CloseAdmission):
                assert not self.closed
                self.closed = True
            elif isinstance(action, OpenAdmission):
                assert self.closed
                self.closed = False
            elif isinstance(action, STARTS_WORK):
                assert not (isinstance(action, StartRestore) and restored_before)
                self.pending.append(action)
        if any(isinstance(action, LogExpired) for action in step.actions):
            assert busy_before is None or ends_work, "a lease never expires while busy"
        self.check()
        return step

    def finish(self, action: Action, success: bool = True, event: Event | None = None) -> Step:
        """End the work `action` started with `event` (by default `ending(action, success)`)."""
        self.pending.remove(action)
        ended = event if event is not None else ending(action, success)
        step = self.step(lambda: self.m.handle(ended, self.now), not isinstance(action, WaitReady))
        refusal = step.answer if isinstance(step.answer, TetherError) else None
        assert refusal is None or refusal.code != "internal_error", "started work ends cleanly"
        return step

    def stray(self, event: Event) -> None:
        """Feed an event no running work asked for."""
        step = self.step(lambda: self.m.handle(event, self.now), ends_work=True)
        ended = not isinstance(step.answer, TetherError) or step.answer.code != "internal_error"
        if ended and not isinstance(event, Ready | ReadinessTimeout):
            self.pending = [action for action in self.pending if isinstance(action, WaitReady)]

    def check(self) -> None:
        m, phase = self.m, self.m.phase
        assert phase in get_args(Phase)
        assert self.closed == m.admission_closed
        assert m.admission_closed >= (phase in CLOSED)
        assert m.remembered_count() <= self.remember
        if phase != "open":
            assert m.checkpoint_id is not None and m.lease_expires_at is not None
            assert m.remembered(m.checkpoint_id) is None
        if m.checkpoint_id is None:
            assert m.busy is None and m.lease_expires_at is None
        expected = {"commit": "prepared", "restore": "open", "abort_restore": "restored"}
        assert expected.get(m.busy or "", phase) == phase
        lease_at = m.lease_expires_at
        if m.checkpoint_id is not None and m.busy is None:
            assert lease_at is not None and self.now < lease_at, "a due lease has expired"
        if m.admission_closed:  # a dead controller cannot freeze a fleet (SPEC 5.4)
            live = lease_at is not None and self.now < lease_at
            assert live or m.busy is not None, "admission closed with no lease and no work"
        if self.lease_of[0] == m.checkpoint_id and None not in (self.lease_of[1], lease_at):
            assert lease_at >= self.lease_of[1], "the lease only grows"  # type: ignore[operator]
        self.lease_of = (m.checkpoint_id, lease_at)
