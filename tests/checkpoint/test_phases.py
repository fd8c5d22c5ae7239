"""The checkpoint phase machine: transitions, refusals and the lease, with an injected
time and no sockets (SPEC 5.2-5.6, 5.9)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.checkpoint.phase_driver import T0, Driver
from tether.checkpoint.phases import (
    AbortAnswer,
    AbortDone,
    CallKey,
    CloseAdmission,
    CommitAnswer,
    CommitDone,
    CommitFailed,
    Event,
    Join,
    LogExpired,
    OpenAdmission,
    PhaseMachine,
    PrepareAnswer,
    ReadinessTimeout,
    Ready,
    RecheckReadiness,
    ReleaseInstalled,
    RenewAnswer,
    RestoreAnswer,
    RestoreDone,
    RestoreFailed,
    ResumeAnswer,
    Retire,
    RetryAfter,
    StartRestore,
    Status,
    Step,
    WaitReady,
    WriteCheckpoint,
)
from tether.routing.errors import TetherError

MANIFEST = {"format": 1, "checkpoint_id": "c1", "records": {"sessions": 2, "episodes": 0}}
RESTORED = {"installed_sessions": 2, "held_episodes": [], "placed_sessions": 2, "owner_aliases": 1}


def refused(step: Step) -> str:
    """The code of the error a step answers with."""
    assert isinstance(step.answer, TetherError), step
    return step.answer.code


def status(m: PhaseMachine, now: float = T0) -> Status:
    answer = m.status(now).answer
    assert isinstance(answer, Status)
    return answer


def preparing(m: PhaseMachine, cid: str = "c1", now: float = T0) -> PhaseMachine:
    m.prepare(cid, now)
    return m


def prepared(m: PhaseMachine, cid: str = "c1", now: float = T0) -> PhaseMachine:
    preparing(m, cid, now)
    m.handle(Ready(cid), now)
    return m


def committing(m: PhaseMachine, cid: str = "c1", now: float = T0) -> PhaseMachine:
    prepared(m, cid, now)
    m.commit(cid, now)
    return m


def committed(m: PhaseMachine, cid: str = "c1", now: float = T0) -> PhaseMachine:
    committing(m, cid, now)
    m.handle(CommitDone(cid, MANIFEST), now)
    return m


def restoring(m: PhaseMachine, cid: str = "c1", now: float = T0) -> PhaseMachine:
    m.restore(cid, now, fresh=True)
    return m


def restored(m: PhaseMachine, cid: str = "c1", now: float = T0) -> PhaseMachine:
    restoring(m, cid, now)
    m.handle(RestoreDone(cid, RESTORED), now)
    return m


SETUPS = {
    "open": lambda m: m,
    "preparing": preparing,
    "prepared": prepared,
    "committing": committing,
    "committed": committed,
    "restoring": restoring,
    "restored": restored,
}


def machine_in(state: str) -> PhaseMachine:
    m = PhaseMachine()
    SETUPS[state](m)
    return m


# Transitions -------------------------------------------------------------------------


def test_prepare_in_open_closes_admission_and_waits_until_its_deadline() -> None:
    m = PhaseMachine()
    step = m.prepare("c1", T0, deadline_s=10, lease_s=20)
    assert step.actions == (CloseAdmission("c1"), WaitReady("c1", T0 + 10))
    assert step.answer is None
    assert (m.phase, m.checkpoint_id, m.lease_expires_at) == ("preparing", "c1", T0 + 30)


def test_ready_answers_prepared_and_moves_to_prepared() -> None:
    m = preparing(PhaseMachine())
    step = m.handle(Ready("c1"), T0 + 1)
    assert step.answer == PrepareAnswer("prepared", (), 0, T0 + 360)
    assert m.phase == "prepared"


def test_readiness_timeout_answers_blocked_and_stays_preparing_with_admission_closed() -> None:
    m = preparing(PhaseMachine())
    blockers = [
        {"kind": "session_busy", "worker": "w", "id": str(i), "detail": None} for i in range(150)
    ]
    step = m.handle(ReadinessTimeout("c1", blockers, 150), T0 + 60)
    assert isinstance(step.answer, PrepareAnswer)
    assert step.answer.state == "blocked"
    assert len(step.answer.blockers) == 100 and step.answer.blockers_total == 150
    assert step.actions == ()
    assert m.phase == "preparing"


def test_commit_rechecks_readiness_then_writes_and_its_end_moves_to_committed() -> None:
    m = prepared(PhaseMachine())
    step = m.commit("c1", T0 + 1, scope=["e2", "e1"], deadline_s=30)
    key = CallKey("commit", "c1", frozenset({"e1", "e2"}))
    assert step.actions == (RecheckReadiness("c1"), WriteCheckpoint(key, T0 + 31))
    assert (m.busy, m.phase) == ("commit", "prepared")
    done = m.handle(CommitDone("c1", MANIFEST), T0 + 2)
    assert done.answer == CommitAnswer(MANIFEST)
    assert m.phase == "committed" and m.busy is None
    assert status(m).scope == ["e1", "e2"]


@pytest.mark.parametrize("code", ["commit_failed", "deadline_exceeded", "not_ready"])
def test_a_failed_commit_answers_its_code_and_stays_prepared(code: Any) -> None:
    m = committing(PhaseMachine())
    step = m.handle(CommitFailed("c1", code, {"blockers": []}), T0 + 1)
    assert refused(step) == code
    assert (m.phase, m.busy) == ("prepared", None)
    assert m.commit("c1", T0 + 2, scope=["other"]).actions[0] == RecheckReadiness("c1")


@pytest.mark.parametrize("state", ["preparing", "prepared", "committed"])
def test_resume_from_a_closed_phase_opens_admission_and_remembers_the_id(state: str) -> None:
    m = machine_in(state)
    step = m.resume("c1", T0 + 1)
    assert step.actions == (OpenAdmission("c1"),)
    assert step.answer == ResumeAnswer()
    assert status(m) == Status("open", None, None, None, None)
    assert m.remembered("c1") == "resumed"


def test_restore_on_a_fresh_server_closes_admission_and_moves_to_restored() -> None:
    m = PhaseMachine()
    step = m.restore("c1", T0, fresh=True, scope=["e1"], deadline_s=5)
    key = CallKey("restore", "c1", frozenset({"e1"}))
    assert step.actions == (CloseAdmission("c1"), StartRestore(key, T0 + 5))
    assert (m.phase, m.busy, m.lease_expires_at) == ("open", "restore", T0 + 305)
    done = m.handle(RestoreDone("c1", RESTORED), T0 + 1)
    assert done.answer == RestoreAnswer(RESTORED) and done.actions == ()
    assert status(m) == Status("restored", "c1", T0 + 305, ["e1"], None)


def test_a_dry_run_restore_leaves_admission_alone() -> None:
    step = PhaseMachine().restore("c1", T0, fresh=True, dry_run=True)
    assert [type(a) for a in step.actions] == [StartRestore]


def test_a_failed_restore_reopens_admission() -> None:
    m = PhaseMachine()
    m.restore("c1", T0, fresh=True)
    step = m.handle(RestoreFailed("c1", "worker_lost"), T0 + 1)
    assert step.actions == (OpenAdmission("c1"),) and refused(step) == "worker_lost"


def test_an_abort_reopens_admission() -> None:
    m = restored(PhaseMachine())
    m.abort_restore("c1", T0 + 1)
    assert m.handle(AbortDone("c1"), T0 + 2).actions == (OpenAdmission("c1"),)


def test_resume_from_restored_opens_admission() -> None:
    m = restored(PhaseMachine())
    step = m.resume("c1", T0 + 1)
    assert step.actions == (OpenAdmission("c1"),) and step.answer == ResumeAnswer()
    assert m.phase == "open" and m.remembered("c1") == "resumed"


def test_retire_in_open_passes_on_with_its_deadline() -> None:
    step = PhaseMachine().retire("ep", 3, T0, deadline_s=7)
    assert step.actions == (Retire("ep", 3, T0 + 7),) and step.answer is None


# Calls in the wrong phase ------------------------------------------------------------

WRONG_PHASE = [
    ("open", "commit"),
    ("preparing", "commit"),
    ("restoring", "commit"),
    ("restored", "commit"),
    ("committed", "prepare"),
    ("restoring", "prepare"),
    ("restored", "prepare"),
    ("open", "renew"),
    ("open", "abort_restore"),
    ("preparing", "abort_restore"),
    ("prepared", "abort_restore"),
    ("committed", "abort_restore"),
    ("restoring", "abort_restore"),
    ("preparing", "retire"),
    ("prepared", "retire"),
    ("committing", "retire"),
    ("committed", "retire"),
    ("restoring", "retire"),
    ("restored", "retire"),
    ("preparing", "restore"),
    ("prepared", "restore"),
    ("committed", "restore"),
]


def call(m: PhaseMachine, route: str, cid: str = "c1", now: float = T0 + 1) -> Step:
    match route:
        case "prepare":
            return m.prepare(cid, now)
        case "commit":
            return m.commit(cid, now)
        case "resume":
            return m.resume(cid, now)
        case "renew":
            return m.renew(cid, now)
        case "restore":
            return m.restore(cid, now, fresh=True)
        case "abort_restore":
            return m.abort_restore(cid, now)
        case "retire":
            return m.retire("ep", 1, now)
    raise AssertionError(route)


@pytest.mark.parametrize(("state", "route"), WRONG_PHASE)
def test_a_call_in_the_wrong_phase_gets_invalid_phase_and_changes_nothing(
    state: str, route: str
) -> None:
    m = machine_in(state)
    before = status(m)
    assert refused(call(m, route)) == "invalid_phase"
    assert status(m) == before


def test_commit_before_prepare_gets_invalid_phase() -> None:
    assert refused(PhaseMachine().commit("c1", T0)) == "invalid_phase"


def test_in_restored_a_second_restore_gets_not_fresh() -> None:
    m = restored(PhaseMachine())
    assert refused(m.restore("c1", T0 + 1, fresh=True)) == "not_fresh"
    m.resume("c1", T0 + 2)
    assert refused(m.restore("c1", T0 + 3, fresh=True)) == "not_fresh"
    assert refused(m.restore("c2", T0 + 3, fresh=True)) == "not_fresh"


# Retries -----------------------------------------------------------------------------


def test_a_second_prepare_of_the_active_id_waits_again_without_closing_twice() -> None:
    m = preparing(PhaseMachine())
    step = m.prepare("c1", T0 + 5, deadline_s=10, lease_s=300)
    assert step.actions == (WaitReady("c1", T0 + 15),)
    assert m.lease_expires_at == T0 + 360  # extended, never shortened
    m.prepare("c1", T0 + 100)
    assert m.lease_expires_at == T0 + 460


def test_a_prepare_in_prepared_re_evaluates_readiness_and_stays_prepared() -> None:
    m = prepared(PhaseMachine())
    assert m.prepare("c1", T0 + 1).actions == (WaitReady("c1", T0 + 61),)
    assert m.handle(Ready("c1"), T0 + 1).answer == PrepareAnswer("prepared", (), 0, T0 + 361)
    blocked = m.handle(ReadinessTimeout("c1", [{"kind": "worker_lost"}], 1), T0 + 61).answer
    assert isinstance(blocked, PrepareAnswer) and blocked.state == "blocked"
    assert m.phase == "prepared"


def test_the_same_commit_while_it_runs_joins_it_and_after_it_gets_the_manifest() -> None:
    m = committing(PhaseMachine())
    assert m.commit("c1", T0 + 1).actions == (Join(CallKey("commit", "c1")),)
    m.handle(CommitDone("c1", MANIFEST), T0 + 2)
    first, again = m.commit("c1", T0 + 3), m.commit("c1", T0 + 4)
    assert first.answer == again.answer == CommitAnswer(MANIFEST)
    assert first.actions == again.actions == ()


def test_a_commit_with_another_scope_gets_checkpoint_conflict() -> None:
    m = committing(PhaseMachine())
    assert refused(m.commit("c1", T0 + 1, scope=["e1"])) == "checkpoint_conflict"
    m.handle(CommitDone("c1", MANIFEST), T0 + 2)
    assert refused(m.commit("c1", T0 + 3, scope=[])) == "checkpoint_conflict"


def test_resume_twice_answers_the_same_and_opens_admission_once() -> None:
    m = prepared(PhaseMachine())
    first, again = m.resume("c1", T0 + 1), m.resume("c1", T0 + 2)
    assert first.answer == again.answer == ResumeAnswer()
    assert first.actions == (OpenAdmission("c1"),) and again.actions == ()


def test_resume_in_open_of_an_unknown_id_answers_and_remembers_it() -> None:
    m = PhaseMachine()
    assert m.resume("never", T0).answer == ResumeAnswer()
    assert refused(m.prepare("never", T0 + 1)) == "stale_checkpoint"


def test_resume_while_a_commit_runs_waits_for_it_then_applies() -> None:
    m = committing(PhaseMachine())
    assert m.resume("c1", T0 + 1).actions == (RetryAfter(CallKey("commit", "c1")),)
    assert m.phase == "prepared"
    m.handle(CommitDone("c1", MANIFEST), T0 + 2)
    assert m.resume("c1", T0 + 2).actions == (OpenAdmission("c1"),)


def test_the_same_restore_while_it_runs_joins_it_and_other_options_conflict() -> None:
    m = restoring(PhaseMachine())
    assert m.restore("c1", T0 + 1, fresh=False).actions == (Join(CallKey("restore", "c1")),)
    assert refused(m.restore("c1", T0 + 1, fresh=True, dry_run=True)) == "checkpoint_conflict"
    assert refused(m.restore("c1", T0 + 1, fresh=True, scope=["e"])) == "checkpoint_conflict"


def test_abort_restore_retried_joins_while_it_runs_and_answers_after() -> None:
    m = restored(PhaseMachine())
    key = CallKey("abort_restore", "c1")
    assert m.abort_restore("c1", T0 + 1).actions == (ReleaseInstalled(key),)
    assert m.abort_restore("c1", T0 + 1).actions == (Join(key),)
    assert m.handle(AbortDone("c1"), T0 + 2).answer == AbortAnswer()
    assert m.abort_restore("c1", T0 + 3).answer == AbortAnswer()


# Conflicts, stale IDs and precedence -------------------------------------------------


@pytest.mark.parametrize(
    "state", ["preparing", "prepared", "committing", "committed", "restoring", "restored"]
)
@pytest.mark.parametrize(
    "route", ["prepare", "commit", "resume", "renew", "restore", "abort_restore"]
)
def test_another_id_while_one_is_active_gets_checkpoint_conflict(state: str, route: str) -> None:
    m = machine_in(state)
    assert refused(call(m, route, "c2")) == "checkpoint_conflict"


def test_a_delayed_prepare_after_resume_gets_stale_checkpoint() -> None:
    m = prepared(PhaseMachine())
    m.resume("c1", T0 + 1)
    assert refused(m.prepare("c1", T0 + 2)) == "stale_checkpoint"
    assert refused(m.commit("c1", T0 + 2)) == "stale_checkpoint"
    assert refused(m.renew("c1", T0 + 2)) == "stale_checkpoint"


def test_a_wait_that_ends_after_resume_answers_stale_checkpoint() -> None:
    m = preparing(PhaseMachine())
    m.resume("c1", T0 + 1)
    assert refused(m.handle(Ready("c1"), T0 + 2)) == "stale_checkpoint"
    assert m.phase == "open"


def test_a_published_id_is_stale_for_prepare_and_commit_but_not_renew() -> None:
    m = PhaseMachine()
    assert refused(m.prepare("old", T0, published=True)) == "stale_checkpoint"
    assert refused(m.commit("old", T0, published=True)) == "stale_checkpoint"
    assert refused(m.renew("old", T0)) == "invalid_phase"


def test_the_committed_ids_own_directory_does_not_make_its_retry_stale() -> None:
    m = committed(PhaseMachine())
    assert m.commit("c1", T0 + 1, published=True).answer == CommitAnswer(MANIFEST)


def test_stale_beats_conflict_and_invalid_phase() -> None:
    m = PhaseMachine()
    m.resume("old", T0)
    committed(m, "c2")  # "old" is also another ID, and prepare is invalid in committed
    assert refused(m.prepare("old", T0 + 1)) == "stale_checkpoint"
    assert refused(m.prepare("pub", T0 + 1, published=True)) == "stale_checkpoint"


def test_stale_beats_invalid_phase_in_open() -> None:
    m = PhaseMachine()
    m.resume("old", T0)
    assert refused(m.commit("old", T0 + 1)) == "stale_checkpoint"
    assert refused(m.renew("old", T0 + 1)) == "stale_checkpoint"


def test_conflict_beats_invalid_phase() -> None:
    m = committed(PhaseMachine())  # prepare is invalid in committed; "c2" is another ID
    assert refused(m.prepare("c2", T0 + 1)) == "checkpoint_conflict"
    m = restored(PhaseMachine())  # commit is invalid in restored
    assert refused(m.commit("c2", T0 + 1)) == "checkpoint_conflict"


def test_remembered_ids_are_bounded_oldest_dropped() -> None:
    m = PhaseMachine(remember=3)
    for cid in ["a", "b", "c", "d"]:
        m.resume(cid, T0)
    assert m.remembered_count() == 3
    assert m.remembered("a") is None
    assert m.prepare("a", T0 + 1).actions[0] == CloseAdmission("a")
    assert refused(m.prepare("d", T0 + 1)) == "stale_checkpoint"
    m.resume("a", T0 + 2)
    assert m.remembered("b") is None
    assert m.prepare("b", T0 + 3).actions[0] == CloseAdmission("b")


def test_a_completion_with_no_running_work_is_an_internal_error_and_changes_nothing() -> None:
    m = prepared(PhaseMachine())
    events: list[Event] = [
        CommitDone("c1", MANIFEST),
        RestoreDone("c1", RESTORED),
        AbortDone("c1"),
        CommitFailed("c2", "commit_failed"),
    ]
    for event in events:
        assert refused(m.handle(event, T0 + 1)) == "internal_error"
    assert (m.phase, m.busy) == ("prepared", None)


# The lease ---------------------------------------------------------------------------


def test_the_lease_defaults_to_call_time_plus_deadline_plus_lease() -> None:
    m = preparing(PhaseMachine())
    assert m.lease_expires_at == T0 + 60 + 300
    assert m.next_deadline() == T0 + 360


def test_an_abandoned_prepare_resumes_by_itself_when_its_lease_runs_out() -> None:
    m = prepared(PhaseMachine())
    assert m.tick(T0 + 359).actions == ()
    step = m.tick(T0 + 360)
    assert step.actions == (OpenAdmission("c1"), LogExpired("c1", "prepared", T0 + 360))
    assert m.phase == "open" and m.remembered("c1") == "expired"
    assert m.next_deadline() is None
    assert refused(m.commit("c1", T0 + 361)) == "stale_checkpoint"
    assert m.resume("c1", T0 + 362).answer == ResumeAnswer()


def test_a_late_call_applies_a_due_expiry_before_it_is_answered() -> None:
    m = prepared(PhaseMachine())
    step = m.commit("c1", T0 + 1_000)
    assert step.actions == (OpenAdmission("c1"), LogExpired("c1", "prepared", T0 + 360))
    assert refused(step) == "stale_checkpoint"


def test_an_expiry_inside_a_slow_commit_fires_only_when_it_ends() -> None:
    m = committing(PhaseMachine(), now=T0)  # lease T0 + 360
    assert m.next_deadline() is None
    assert m.tick(T0 + 10_000).actions == ()
    assert m.renew("c1", T0 + 10_000, lease_s=1).answer == RenewAnswer(T0 + 10_001)
    assert m.phase == "prepared"
    step = m.handle(CommitDone("c1", MANIFEST), T0 + 20_000)
    assert step.answer == CommitAnswer(MANIFEST)
    assert step.actions == (OpenAdmission("c1"), LogExpired("c1", "committed", T0 + 10_001))
    assert m.remembered("c1") == "expired"


def test_an_expiry_inside_a_failed_commit_fires_when_it_fails() -> None:
    m = committing(PhaseMachine())
    step = m.handle(CommitFailed("c1", "deadline_exceeded"), T0 + 500)
    assert refused(step) == "deadline_exceeded"
    assert LogExpired("c1", "prepared", T0 + 360) in step.actions
    assert m.phase == "open"


def test_renew_extends_the_lease_and_never_shortens_it() -> None:
    m = prepared(PhaseMachine())
    assert m.renew("c1", T0 + 300, lease_s=600).answer == RenewAnswer(T0 + 900)
    assert m.tick(T0 + 899).actions == ()
    assert m.renew("c1", T0 + 400, lease_s=10).answer == RenewAnswer(T0 + 900)
    assert m.tick(T0 + 900).actions[0] == OpenAdmission("c1")


def test_commit_extends_the_lease_by_its_deadline_and_the_last_lease_length() -> None:
    m = PhaseMachine()
    m.prepare("c1", T0, lease_s=100)
    m.handle(Ready("c1"), T0)
    m.commit("c1", T0 + 150, deadline_s=30)
    assert m.lease_expires_at == T0 + 280


def test_an_expiry_inside_a_restore_fires_when_it_ends_and_leaves_it_unfresh() -> None:
    m = restoring(PhaseMachine())
    assert m.tick(T0 + 1_000).actions == ()
    step = m.handle(RestoreDone("c1", RESTORED), T0 + 1_000)
    assert step.answer == RestoreAnswer(RESTORED)
    assert step.actions == (OpenAdmission("c1"), LogExpired("c1", "restored", T0 + 360))
    assert m.phase == "open" and m.was_restored
    assert refused(m.restore("c2", T0 + 1_001, fresh=True)) == "not_fresh"


def test_an_expired_restored_lease_leaves_the_server_open() -> None:
    m = restored(PhaseMachine())
    assert m.tick(T0 + 360).actions == (
        OpenAdmission("c1"), LogExpired("c1", "restored", T0 + 360)
    )
    assert m.phase == "open"


# Restore -----------------------------------------------------------------------------


def test_restore_on_a_server_holding_state_gets_not_fresh() -> None:
    m = PhaseMachine()
    assert refused(m.restore("c1", T0, fresh=False)) == "not_fresh"
    assert m.busy is None


def test_a_dry_run_restore_stays_open_and_fresh() -> None:
    m = PhaseMachine()
    m.restore("c1", T0, fresh=True, dry_run=True)
    assert m.handle(RestoreDone("c1", RESTORED), T0 + 1).answer == RestoreAnswer(RESTORED)
    assert status(m) == Status("open", None, None, None, None)
    assert not m.was_restored
    assert m.restore("c1", T0 + 2, fresh=True).actions != ()


def test_a_failed_restore_answers_its_code_and_stays_fresh() -> None:
    m = restoring(PhaseMachine())
    assert refused(m.handle(RestoreFailed("c1", "workers_missing"), T0 + 60)) == "workers_missing"
    assert status(m) == Status("open", None, None, None, None)
    assert isinstance(m.restore("c1", T0 + 61, fresh=True).actions[-1], StartRestore)


def test_abort_restore_releases_what_was_installed_and_returns_to_fresh() -> None:
    m = restored(PhaseMachine())
    m.abort_restore("c1", T0 + 1)
    assert m.phase == "restored" and m.busy == "abort_restore"
    assert m.resume("c1", T0 + 1).actions == (RetryAfter(CallKey("abort_restore", "c1")),)
    assert m.handle(AbortDone("c1"), T0 + 2).answer == AbortAnswer()
    assert status(m) == Status("open", None, None, None, None)
    assert not m.was_restored
    assert isinstance(m.restore("c1", T0 + 3, fresh=True).actions[-1], StartRestore)


def test_in_restored_renew_and_status_are_accepted() -> None:
    m = restored(PhaseMachine())
    assert m.renew("c1", T0 + 100, lease_s=1_000).answer == RenewAnswer(T0 + 1_100)
    assert status(m, T0 + 100).phase == "restored"


def test_a_restored_id_that_was_resumed_before_is_active_again() -> None:
    m = PhaseMachine()
    m.resume("c1", T0)
    restored(m, "c1", T0 + 1)
    assert m.remembered("c1") is None
    assert isinstance(m.renew("c1", T0 + 2).answer, RenewAnswer)


# Property: random calls and events keep the machine consistent ----------------------

# Which ID a call names, resolved as it runs: the active one (a new one if none), a new
# one, the last one named, or the first one named (long dropped from memory, often)
ids = st.sampled_from(["active", "active", "active", "new", "last", "first"])
settle = st.sampled_from([0, 0, 1, 1, 2])  # then: leave the work running, end it well or badly
operations = st.one_of(
    st.tuples(st.just("prepare"), settle, ids, st.sampled_from([False, False, False, True])),
    st.tuples(st.just("commit"), settle, ids, st.sampled_from([None, (), ("e1",)])),
    st.tuples(st.just("restore"), settle, ids, st.booleans(), st.booleans()),
    st.tuples(st.just("abort_restore"), settle, ids),
    st.tuples(st.just("resume"), st.just(0), ids),
    st.tuples(st.just("renew"), st.just(0), ids, st.sampled_from([1.0, 100.0])),
    st.tuples(st.just("retire"), st.just(0)),
    st.tuples(st.just("tick"), st.just(0)),
    st.tuples(st.just("advance"), st.just(0), st.floats(0, 150)),
    st.tuples(st.just("finish"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("stray"), st.just(0), ids, st.integers(0, 6)),
)
def stray_event(cid: str, kind: int) -> Event:
    events: list[Event] = [
        Ready(cid),
        ReadinessTimeout(cid, [], 0),
        CommitDone(cid, {}),
        CommitFailed(cid, "commit_failed"),
        RestoreDone(cid, {}),
        RestoreFailed(cid, "no_checkpoint"),
        AbortDone(cid),
    ]
    return events[kind]


@settings(max_examples=500, deadline=None)
@given(st.lists(operations, min_size=5, max_size=60))
def test_random_calls_and_events_keep_the_machine_consistent(ops: list[tuple[Any, ...]]) -> None:
    d = Driver()
    m = d.m
    for op in ops:
        match op:
            case ("prepare", _, which, published):
                calling = partial(
                    m.prepare, d.resolve(which), deadline_s=30, lease_s=50, published=published
                )
            case ("commit", _, which, scope):
                calling = partial(m.commit, d.resolve(which), scope=scope, deadline_s=30)
            case ("restore", _, which, fresh, dry_run):
                calling = partial(m.restore, d.resolve(which), fresh=fresh, dry_run=dry_run)
            case ("abort_restore", _, which):
                calling = partial(m.abort_restore, d.resolve(which))
            case ("resume", _, which):
                calling = partial(m.resume, d.resolve(which))
            case ("renew", _, which, lease_s):
                calling = partial(m.renew, d.resolve(which), lease_s=lease_s)
            case ("retire", _):
                calling = partial(m.retire, "ep", 1)
            case ("tick", _):
                busy = m.busy
                assert d.step(lambda: m.tick(d.now)).actions == () or busy is None
                continue
            case ("advance", _, dt):
                d.now += dt
                continue
            case ("finish", index, success):
                if d.pending:
                    d.finish(d.pending[index % len(d.pending)], success)
                continue
            case ("stray", _, which, kind):
                d.stray(stray_event(d.resolve(which), kind))
                continue
            case _:
                raise AssertionError(op)
        step = d.step(partial(calling, now=d.now))
        for action in step.actions:
            if op[1] and action in d.pending:  # the I/O layer's work ends right away
                d.finish(action, success=op[1] == 1)


def test_renew_of_a_published_id_this_server_forgot_is_stale() -> None:
    step = PhaseMachine().renew("gone", T0, published=True)
    assert refused(step) == "stale_checkpoint"
