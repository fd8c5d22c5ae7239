"""The checkpoint phase machine (SPEC 5.2-5.6, 5.9): calls and events in, actions out.

Nothing here does I/O or reads a clock. Every call and event takes `now` (unix seconds)
and returns a `Step`: the actions the I/O layer carries out, in order, and the answer::

    step = machine.prepare("c1", now)          # a control call, or
    step = machine.handle(Ready("c1"), now)    # the event that ends an action's work
    for action in step.actions: ...            # execute in order
    step.answer  # an Answer to send, a TetherError to send as an error, or None:
                 # the answer comes from the event that ends the work just started

A refused call changes nothing (a due lease expiry aside) and answers a `TetherError`;
refusals follow SPEC's precedence `stale_checkpoint` → `checkpoint_conflict` →
`invalid_phase` (401 and 422 are checked before the machine is called). Every call and
event first applies a lease expiry that is due, so `tick` only needs to run at
`next_deadline()`.

Actions and how their work ends:

    CloseAdmission / OpenAdmission   close or reopen admission on every worker (5.3)
    WaitReady(deadline)              → Ready, or ReadinessTimeout at the deadline
    RecheckReadiness, WriteCheckpoint→ CommitDone, or CommitFailed (not_ready if the
                                       re-check fails: WriteCheckpoint is then skipped)
    StartRestore(deadline)           → RestoreDone or RestoreFailed
    ReleaseInstalled                 → AbortDone (release is best effort)
    Retire                           answered by the I/O layer; no event
    LogExpired                       log the lease expiry
    Join(key)                        the same call runs: answer with its answer
    RetryAfter(key)                  wait until that work ends, then make the call again

Where SPEC is silent: a prepare in `prepared` waits for readiness again and answers
`blocked` if it slipped, staying `prepared` (commit re-checks anyway); leases only grow;
commit and restore extend by the last `lease_s` a prepare or renew gave; a resume while
a commit, restore or abort runs waits for it (`RetryAfter`); a readiness result for a
prepare overtaken by resume or expiry answers what that prepare would get now; a
restore's identity includes `dry_run`; an expired `restored` lease returns to `open`
keeping what was installed; a completion that matches no running work is `internal_error`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeAlias

from tether.routing.errors import ErrorCode, TetherError

Phase = Literal["open", "preparing", "prepared", "committed", "restored"]
Route = Literal["prepare", "commit", "resume", "renew", "restore", "abort_restore", "retire"]
Reason = Literal["resumed", "expired"]
CommitFailure = Literal["commit_failed", "deadline_exceeded", "not_ready", "stale_checkpoint"]
Scope: TypeAlias = frozenset[str] | None
"""Episode IDs a commit or restore keeps; None keeps all."""
Blocker: TypeAlias = Mapping[str, Any]
"""`{kind, worker, id, detail}` as SPEC 5.2 lists them; passed through unread."""

DEFAULT_DEADLINE_S = 60.0
DEFAULT_LEASE_S = 300.0
REMEMBERED_IDS = 1024
MAX_BLOCKERS = 100
CLOSED: frozenset[Phase] = frozenset({"preparing", "prepared", "committed", "restored"})
"""Phases with admission closed: restored sessions wait for the resume too (SPEC 5.3)."""
"""Phases with admission closed."""


@dataclass(frozen=True)
class CallKey:
    """A call's identity (route, checkpoint ID, scope; a restore's dry_run too)."""

    route: Route
    checkpoint_id: str
    scope: Scope = None
    dry_run: bool = False


# Actions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CloseAdmission:
    checkpoint_id: str


@dataclass(frozen=True)
class OpenAdmission:
    checkpoint_id: str


@dataclass(frozen=True)
class WaitReady:
    """Wait until every worker is ready, or the deadline; then feed the event."""

    checkpoint_id: str
    deadline: float


@dataclass(frozen=True)
class RecheckReadiness:
    checkpoint_id: str


@dataclass(frozen=True)
class WriteCheckpoint:
    key: CallKey
    deadline: float


@dataclass(frozen=True)
class StartRestore:
    key: CallKey
    deadline: float


@dataclass(frozen=True)
class ReleaseInstalled:
    key: CallKey


@dataclass(frozen=True)
class Retire:
    episode_id: str
    attempt: int
    deadline: float


@dataclass(frozen=True)
class LogExpired:
    checkpoint_id: str
    phase: Phase
    lease_expires_at: float


@dataclass(frozen=True)
class Join:
    key: CallKey


@dataclass(frozen=True)
class RetryAfter:
    key: CallKey


Action: TypeAlias = (
    CloseAdmission
    | OpenAdmission
    | WaitReady
    | RecheckReadiness
    | WriteCheckpoint
    | StartRestore
    | ReleaseInstalled
    | Retire
    | LogExpired
    | Join
    | RetryAfter
)

# Events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    checkpoint_id: str


@dataclass(frozen=True)
class ReadinessTimeout:
    checkpoint_id: str
    blockers: Sequence[Blocker]
    blockers_total: int


@dataclass(frozen=True)
class CommitDone:
    checkpoint_id: str
    manifest: Mapping[str, Any]


@dataclass(frozen=True)
class CommitFailed:
    checkpoint_id: str
    code: CommitFailure
    detail: Any = None


@dataclass(frozen=True)
class RestoreDone:
    checkpoint_id: str
    answer: Mapping[str, Any]


@dataclass(frozen=True)
class RestoreFailed:
    checkpoint_id: str
    code: ErrorCode
    detail: Any = None


@dataclass(frozen=True)
class AbortDone:
    checkpoint_id: str


Event: TypeAlias = (
    Ready | ReadinessTimeout | CommitDone | CommitFailed | RestoreDone | RestoreFailed | AbortDone
)

# Answers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareAnswer:
    state: Literal["prepared", "blocked"]
    blockers: tuple[Blocker, ...]
    blockers_total: int
    lease_expires_at: float


@dataclass(frozen=True)
class CommitAnswer:
    manifest: Mapping[str, Any]


@dataclass(frozen=True)
class ResumeAnswer:
    phase: Literal["open"] = "open"


@dataclass(frozen=True)
class RenewAnswer:
    lease_expires_at: float


@dataclass(frozen=True)
class RestoreAnswer:
    answer: Mapping[str, Any]


@dataclass(frozen=True)
class AbortAnswer:
    phase: Literal["open"] = "open"
    fresh: bool = True


@dataclass(frozen=True)
class Status:
    phase: Phase
    checkpoint_id: str | None
    lease_expires_at: float | None
    scope: list[str] | None
    busy: Route | None
    """The running commit, restore or abort_restore, if any."""


Answer: TypeAlias = (
    PrepareAnswer | CommitAnswer | ResumeAnswer | RenewAnswer | RestoreAnswer | AbortAnswer | Status
)


@dataclass(frozen=True)
class Step:
    """What one call or event asks of the I/O layer, and its answer if it has one."""

    actions: tuple[Action, ...] = ()
    answer: Answer | TetherError | None = None

    def result(self) -> Answer | None:
        """The answer, raising it if it is an error."""
        if isinstance(self.answer, TetherError):
            raise self.answer
        return self.answer


def _scope(scope: Iterable[str] | None) -> Scope:
    return None if scope is None else frozenset(scope)


class PhaseMachine:
    """One server's checkpoint phase, lease and remembered IDs (SPEC 5.2-5.6).

    `lease_s` is the lease length commit and restore use until a prepare or renew names
    another; `remember` bounds the remembered resumed or expired IDs (oldest dropped).
    """

    def __init__(self, *, lease_s: float = DEFAULT_LEASE_S, remember: int = REMEMBERED_IDS) -> None:
        self._phase: Phase = "open"
        self._active: str | None = None
        self._scope: Scope = None
        self._lease_at: float | None = None
        self._lease_s = lease_s
        self._work: CallKey | None = None
        self._manifest: Mapping[str, Any] = {}
        self._was_restored = False
        self._last_aborted: str | None = None
        self._remembered: OrderedDict[str, Reason] = OrderedDict()
        self._remember_max = remember

    # Reads ---------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def checkpoint_id(self) -> str | None:
        """The active ID: set in every phase but open, and in open while a restore runs."""
        return self._active

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease_at

    @property
    def busy(self) -> Route | None:
        return None if self._work is None else self._work.route

    @property
    def admission_closed(self) -> bool:
        """Whether admission is closed now: in a closed phase, or while records install."""
        work = self._work
        installing = work is not None and work.route == "restore" and not work.dry_run
        return self._phase in CLOSED or installing

    @property
    def was_restored(self) -> bool:
        return self._was_restored

    def remembered(self, checkpoint_id: str) -> Reason | None:
        """Why the ID is stale here, if it is remembered."""
        return self._remembered.get(checkpoint_id)

    def remembered_count(self) -> int:
        return len(self._remembered)

    def next_deadline(self) -> float | None:
        """When `tick` must next run: the lease's end, unless nothing can expire now."""
        return self._lease_at if self._active is not None and self._work is None else None

    # Calls ---------------------------------------------------------------------

    def status(self, now: float) -> Step:
        """Answers a `Status` (after a due expiry)."""
        return self._run(now, self._status)

    def tick(self, now: float) -> Step:
        """Expire the lease if it is due and nothing runs."""
        return self._run(now, Step)

    def prepare(
        self,
        checkpoint_id: str,
        now: float,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        lease_s: float = DEFAULT_LEASE_S,
        published: bool = False,
    ) -> Step:
        """Close admission and wait for readiness. `published`: this participant's
        directory for the ID exists on disk, so the ID is stale unless it is the active one."""
        return self._run(
            now, partial(self._prepare, checkpoint_id, now, deadline_s, lease_s, published)
        )

    def commit(
        self,
        checkpoint_id: str,
        now: float,
        *,
        scope: Iterable[str] | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        published: bool = False,
    ) -> Step:
        """Re-check readiness and write; the same call again joins or answers the manifest."""
        body = partial(self._commit, checkpoint_id, now, _scope(scope), deadline_s, published)
        return self._run(now, body)

    def resume(self, checkpoint_id: str, now: float) -> Step:
        """Reopen admission and remember the ID; idempotent in open."""
        return self._run(now, partial(self._resume, checkpoint_id))

    def renew(
        self,
        checkpoint_id: str,
        now: float,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        published: bool = False,
    ) -> Step:
        """Extend the active ID's lease to at least `now + lease_s`."""
        return self._run(now, partial(self._renew, checkpoint_id, now, lease_s, published))

    def restore(
        self,
        checkpoint_id: str,
        now: float,
        *,
        fresh: bool,
        scope: Iterable[str] | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        dry_run: bool = False,
    ) -> Step:
        """Start a restore; `fresh`: the app holds nothing and the claim store is empty."""
        body = partial(self._restore, checkpoint_id, now, _scope(scope), deadline_s, dry_run, fresh)
        return self._run(now, body)

    def abort_restore(self, checkpoint_id: str, now: float) -> Step:
        """Release what the restore installed and become fresh again."""
        return self._run(now, partial(self._abort, checkpoint_id))

    def retire(
        self, episode_id: str, attempt: int, now: float, *, deadline_s: float = DEFAULT_DEADLINE_S
    ) -> Step:
        """Gate a retire: only in open with nothing running (5.9)."""
        return self._run(now, partial(self._retire, episode_id, attempt, now + deadline_s))

    def handle(self, event: Event, now: float) -> Step:
        """Feed the end of an action's work; a lease that fell due during it expires now."""
        return self._run(now, partial(self._on, event))

    # Internals -----------------------------------------------------------------

    def _run(self, now: float, body: Callable[[], Step]) -> Step:
        before = self._expire_if_due(now)
        try:
            step = body()
        except TetherError as refusal:
            return Step(before, refusal)
        return Step(before + step.actions + self._expire_if_due(now), step.answer)

    def _expire_if_due(self, now: float) -> tuple[Action, ...]:
        cid, at = self._active, self._lease_at
        if cid is None or at is None or self._work is not None or now < at:
            return ()
        actions: tuple[Action, ...] = (LogExpired(cid, self._phase, at),)
        if self._phase in CLOSED:
            actions = (OpenAdmission(cid), *actions)
        self._clear()
        self._remember(cid, "expired")
        return actions

    def _clear(self) -> None:
        self._phase, self._active, self._scope, self._lease_at = "open", None, None, None
        self._manifest = {}

    def _remember(self, checkpoint_id: str, reason: Reason) -> None:
        self._remembered.setdefault(checkpoint_id, reason)
        self._remembered.move_to_end(checkpoint_id)
        while len(self._remembered) > self._remember_max:
            self._remembered.popitem(last=False)

    def _extend(self, until: float) -> None:
        self._lease_at = until if self._lease_at is None else max(self._lease_at, until)

    def _gate(self, route: Route, checkpoint_id: str, published: bool = False) -> None:
        """Raise `stale_checkpoint` or `checkpoint_conflict`, in that order, if either applies."""
        active = self._active
        if checkpoint_id != active and route in ("prepare", "commit", "renew"):
            reason = self._remembered.get(checkpoint_id)
            if reason is not None:
                raise TetherError("stale_checkpoint", f"checkpoint {checkpoint_id} was {reason}")
            if published:
                raise TetherError("stale_checkpoint", f"checkpoint {checkpoint_id} is published")
        if active is not None and checkpoint_id != active:
            raise TetherError("checkpoint_conflict", f"checkpoint {active} is active")

    def _invalid(self, route: Route) -> TetherError:
        running = f" while {self._work.route} runs" if self._work else ""
        return TetherError("invalid_phase", f"{route} is not allowed in {self._phase}{running}")

    def _same_scope(self, scope: Scope) -> None:
        if scope != self._scope:
            raise TetherError("checkpoint_conflict", f"{self._active} has another scope")

    def _status(self) -> Step:
        scope = None if self._scope is None else sorted(self._scope)
        return Step((), Status(self._phase, self._active, self._lease_at, scope, self.busy))

    def _prepare(
        self, cid: str, now: float, deadline_s: float, lease_s: float, published: bool
    ) -> Step:
        self._gate("prepare", cid, published)
        if not (self._phase in ("preparing", "prepared") or self._active is None):
            raise self._invalid("prepare")
        self._lease_s = lease_s
        wait = WaitReady(cid, now + deadline_s)
        if self._active is not None:  # the active ID: re-evaluate readiness
            self._extend(wait.deadline + lease_s)
            return Step((wait,))
        self._phase, self._active, self._lease_at = "preparing", cid, wait.deadline + lease_s
        self._last_aborted = None
        return Step((CloseAdmission(cid), wait))

    def _commit(
        self, cid: str, now: float, scope: Scope, deadline_s: float, published: bool
    ) -> Step:
        self._gate("commit", cid, published)
        if self._phase not in ("prepared", "committed"):
            raise self._invalid("commit")
        if self._phase == "committed" or self._work is not None:
            self._same_scope(scope)
        self._extend(now + deadline_s + self._lease_s)
        if self._phase == "committed":
            return Step((), CommitAnswer(self._manifest))
        if self._work is not None:
            return Step((Join(self._work),))
        self._work, self._scope = CallKey("commit", cid, scope), scope
        return Step((RecheckReadiness(cid), WriteCheckpoint(self._work, now + deadline_s)))

    def _resume(self, cid: str) -> Step:
        self._gate("resume", cid)
        if self._work is not None:
            return Step((RetryAfter(self._work),))
        actions: tuple[Action, ...] = (OpenAdmission(cid),) if self._phase in CLOSED else ()
        self._clear()
        self._remember(cid, "resumed")
        return Step(actions, ResumeAnswer())

    def _renew(self, cid: str, now: float, lease_s: float, published: bool) -> Step:
        self._gate("renew", cid, published)
        if self._active is None:
            raise self._invalid("renew")
        self._lease_s = lease_s
        self._extend(now + lease_s)
        assert self._lease_at is not None
        return Step((), RenewAnswer(self._lease_at))

    def _restore(
        self, cid: str, now: float, scope: Scope, deadline_s: float, dry_run: bool, fresh: bool
    ) -> Step:
        self._gate("restore", cid)
        key = CallKey("restore", cid, scope, dry_run)
        if self._work is not None and self._work.route == "restore":
            if self._work != key:
                raise TetherError("checkpoint_conflict", f"{cid} restores with other options")
            return Step((Join(key),))
        if self._phase not in ("open", "restored"):
            raise self._invalid("restore")
        if self._phase == "restored" or self._was_restored:
            raise TetherError("not_fresh", "this server was restored")
        if not fresh:
            raise TetherError("not_fresh", "this server holds state")
        self._work, self._active, self._scope = key, cid, scope
        self._lease_at, self._last_aborted = now + deadline_s + self._lease_s, None
        start = StartRestore(key, now + deadline_s)
        # No request may claim or build state while records are installed, and none
        # until the controller resumes: a restore closes admission (a dry run installs
        # nothing, so it leaves admission alone).
        return Step((start,) if dry_run else (CloseAdmission(cid), start))

    def _abort(self, cid: str) -> Step:
        self._gate("abort_restore", cid)
        key = CallKey("abort_restore", cid)
        if self._work == key:
            return Step((Join(key),))
        if self._phase == "restored" and self._work is None:
            self._work = key
            return Step((ReleaseInstalled(key),))
        if self._active is None and cid == self._last_aborted and not self._was_restored:
            return Step((), AbortAnswer())  # a retry of a finished abort
        raise self._invalid("abort_restore")

    def _retire(self, episode_id: str, attempt: int, deadline: float) -> Step:
        if self._phase != "open" or self._active is not None:
            raise self._invalid("retire")
        return Step((Retire(episode_id, attempt, deadline),))

    def _on(self, event: Event) -> Step:
        if isinstance(event, Ready | ReadinessTimeout):
            return self._readiness(event)
        if isinstance(event, CommitDone | CommitFailed):
            self._end("commit", event.checkpoint_id)
            if isinstance(event, CommitFailed):
                self._scope = None
                return Step((), TetherError(event.code, event.detail))
            self._phase, self._manifest = "committed", event.manifest
            return Step((), CommitAnswer(event.manifest))
        if isinstance(event, RestoreDone | RestoreFailed):
            key = self._end("restore", event.checkpoint_id)
            if isinstance(event, RestoreFailed):
                self._clear()
                reopen = () if key.dry_run else (OpenAdmission(event.checkpoint_id),)
                return Step(reopen, TetherError(event.code, event.detail))
            if key.dry_run:
                self._clear()
            else:
                self._phase, self._was_restored = "restored", True
                self._remembered.pop(key.checkpoint_id, None)
            return Step((), RestoreAnswer(event.answer))
        self._end("abort_restore", event.checkpoint_id)
        self._clear()
        self._was_restored, self._last_aborted = False, event.checkpoint_id
        return Step((OpenAdmission(event.checkpoint_id),), AbortAnswer())

    def _readiness(self, event: Ready | ReadinessTimeout) -> Step:
        """Answer the prepare that waited; one overtaken since gets the error it would now."""
        self._gate("prepare", event.checkpoint_id)
        if self._phase not in ("preparing", "prepared"):
            raise self._invalid("prepare")
        assert self._lease_at is not None
        if isinstance(event, Ready):
            self._phase = "prepared"
            return Step((), PrepareAnswer("prepared", (), 0, self._lease_at))
        blockers = tuple(event.blockers[:MAX_BLOCKERS])
        total = max(event.blockers_total, len(event.blockers))
        return Step((), PrepareAnswer("blocked", blockers, total, self._lease_at))

    def _end(self, route: Route, cid: str) -> CallKey:
        work = self._work
        if work is None or work.route != route or work.checkpoint_id != cid:
            raise TetherError("internal_error", f"no {route} of {cid} is running")
        self._work = None
        return work
