"""The checkpoint protocol as a whole, with no I/O: the pure phase machine and the pure
held-record core driven together through random control calls, worker losses, timeouts,
claims, hand-backs and episode ends, with the invariants of SPEC 5.2-5.9 checked after
every step.

The model plays everything around the two pure objects the way the checkpointer, the
coordinator's fleet and the participants do: `Driver` (shared with `test_phases.py`)
carries out the machine's actions and feeds back the events that end its work; the rest
of this module plays the workers, their episode requests, the commit's export and the
checkpoint root. A crash starts a new server (new machine, new records, new workers) on
the same root, so records travel through checkpoints and restores and come back to be
claimed again.

After every step:
- at most one request continues each record, and it is the record's claimant; a record
  claimed by a live worker is its request's (running, or ended while admission was closed
  and exported by that worker), never orphaned;
- at a commit, no record is both carried and exported by its worker, and every record
  the scope keeps is written exactly once;
- admission is never closed without a live lease or running work;
- every call is answered with its expected answer type, or a `TetherError` whose code is
  in `ERRORS` and is never `internal_error`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.checkpoint.phase_driver import Driver
from tether.checkpoint.held import Held, HeldRecords, least_loaded
from tether.checkpoint.phases import (
    AbortAnswer,
    AbortDone,
    Action,
    CommitAnswer,
    CommitDone,
    CommitFailed,
    Event,
    OpenAdmission,
    PrepareAnswer,
    ReadinessTimeout,
    Ready,
    ReleaseInstalled,
    RenewAnswer,
    RestoreAnswer,
    RestoreDone,
    RestoreFailed,
    ResumeAnswer,
    Retire,
    StartRestore,
    Status,
    Step,
    WaitReady,
    WriteCheckpoint,
)
from tether.checkpoint.segments import IndexEntry
from tether.routing.errors import ERRORS, TetherError

EXPECTED_WORKERS = 2
EPISODES = ("e0", "e1", "e2")
DEADLINE_S = 30.0
LEASE_S = 50.0
CLAIM_ERRORS = frozenset({"checkpoint_parked", "stale_attempt", "attempt_mismatch",
                          "episode_claimed"})

ids = st.sampled_from(["active", "active", "active", "new", "last", "first"])
scopes = st.sampled_from([None, (), ("e0",), ("e0", "e1")])
episodes = st.sampled_from(EPISODES)
attempts = st.sampled_from(["next", "next", "next", "same", "skip", "old", "first"])
"""Which attempt a request sends, relative to the record held for its episode, if any."""
settle = st.sampled_from([0, 0, 1, 1, 1, 2])
"""Then: leave the work the call started running, end it well, or end it badly."""
picks = st.integers(0, 63)
"""Which worker, request or pending work a rule picks (modulo how many there are)."""


@dataclass
class Request:
    """One `/run` of an episode attempt on a worker."""

    worker: str
    episode_id: str
    attempt: int
    held: Held | None
    """The record it continues (claimed for it), or None for an episode that starts anew."""
    boundaries: int = 0
    parked: bool = False
    state: Any = None


def answered(answer: Any, *expected: type) -> None:
    """An answer of an expected type, or a contract error that is never internal."""
    if isinstance(answer, TetherError):
        assert answer.code in ERRORS, answer
        assert answer.code != "internal_error", answer
        return
    assert isinstance(answer, expected), (answer, expected)


class ProtocolModel(RuleBasedStateMachine):
    """One server and the checkpoint root it writes to."""

    def __init__(self) -> None:
        super().__init__()
        self.disk: dict[str, dict[str, int]] = {}
        """Committed checkpoints: ID → the episode records written, with their attempts."""
        self.serial = 0
        self.last_call: tuple[str, dict[str, Any]] | None = None
        self.last_claim: tuple[str, str, int] | None = None
        self.start_server(Driver())

    def start_server(self, driver: Driver) -> None:
        self.d = driver
        self.records = HeldRecords()
        self.workers: list[str] = []
        self.lost: set[str] = set()
        self.requests: list[Request] = []
        self.returning: dict[str, tuple[str, Held]] = {}
        """Claimed records whose request ended while admission was closed: still claimed,
        exported by that worker, handed back once admission opens."""
        self.restored_from: str | None = None
        self.finished: set[str] = set()
        """Episodes whose restored record a request continued to the end on this server."""
        for _ in range(EXPECTED_WORKERS):
            self.join()

    # The I/O layer -------------------------------------------------------------------

    def run(
        self, make: Callable[[], Step], *expected: type, ends_work: bool = False, settle: int = 0
    ) -> Step:
        """Run a call or event through the driver, check its answer, carry out its effects;
        `settle`: end the work it started at once, well (1) or badly (2)."""
        step = self.d.step(make, ends_work)
        if step.answer is not None:
            answered(step.answer, *expected)
        for action in step.actions:
            self.carry_out(action)
        for action in step.actions:
            if settle and action in self.d.pending:
                self.finish(action, success=settle == 1)
        return step

    def carry_out(self, action: Action) -> None:
        if isinstance(action, OpenAdmission):
            self.lost.clear()
            for request in self.requests:
                request.parked = False
            returning, self.returning = self.returning, {}
            for worker, held in returning.values():
                assert isinstance(self.records.hand_back(held, worker), bool)
        elif isinstance(action, Retire):
            self.retire_everywhere(action.episode_id, action.attempt)

    def retire_everywhere(self, episode_id: str, attempt: int) -> None:
        """The fleet's retire: marks and drops first, then every worker stops the attempt
        (its request hands the record back, which the mark drops)."""
        dropped = self.records.retire(episode_id, attempt)
        event(f"retire dropped {dropped}")
        if self.records.get(episode_id) is None:
            self.finished.discard(episode_id)  # retire frees a finished record too
        stopping = [r for r in self.requests if r.episode_id == episode_id and r.attempt <= attempt]
        for request in stopping:
            self.end(request, finished=False)
        answer = {"retired": [{"episode_id": episode_id, "attempt": attempt,
                               "stopped": len(stopping), "dropped_held": dropped}]}
        assert dropped in (0, 1), answer
        held = self.records.get(episode_id)
        assert held is None or held.attempt + 1 > attempt, "a retired attempt's record is held"

    def ready(self) -> bool:
        return (len(self.workers) >= EXPECTED_WORKERS and not self.lost
                and all(r.parked for r in self.requests))

    def blockers(self) -> list[dict[str, Any]]:
        found = [{"kind": "worker_lost", "worker": w} for w in sorted(self.lost)]
        found += [{"kind": "worker_missing"}] * max(EXPECTED_WORKERS - len(self.workers), 0)
        found += [{"kind": "episode_running", "id": r.episode_id}
                  for r in self.requests if not r.parked]
        return found

    def fresh(self) -> bool:
        return not (self.records or self.requests or self.returning or self.restored_from)

    def ending(self, action: Action, success: bool) -> Event:
        """The event the I/O layer feeds when `action`'s work ends now."""
        d = self.d
        match action:
            case WaitReady(checkpoint_id=cid, deadline=deadline):
                if success and d.closed:  # meanwhile, every running episode steps once more
                    for request in [r for r in self.requests if not r.parked]:
                        self.reach_boundary(request)
                if self.ready() and d.now <= deadline:
                    return Ready(cid)
                d.now = max(d.now, deadline)  # it waited until its deadline
                found = self.blockers()
                return ReadinessTimeout(cid, found, len(found))
            case WriteCheckpoint(key=key, deadline=deadline):
                cid = key.checkpoint_id
                if not self.ready():
                    return CommitFailed(cid, "not_ready", {"blockers": self.blockers()})
                if not success:
                    d.now = max(d.now, deadline)
                    return CommitFailed(cid, "deadline_exceeded")
                if cid in self.disk:
                    return CommitFailed(cid, "stale_checkpoint")
                self.disk[cid] = self.export(key.scope)
                event("a commit is written")
                if key.scope is not None:
                    self.records.drop_outside(key.scope)
                return CommitDone(cid, {"checkpoint_id": cid})
            case StartRestore(key=key, deadline=deadline):
                cid = key.checkpoint_id
                if cid not in self.disk:
                    return RestoreFailed(cid, "no_checkpoint")
                if len(self.workers) < EXPECTED_WORKERS or not success:
                    d.now = max(d.now, deadline)  # it waited for workers until its deadline
                    missing = len(self.workers) < EXPECTED_WORKERS
                    return RestoreFailed(cid, "workers_missing" if missing else "deadline_exceeded")
                kept = {e: a for e, a in self.disk[cid].items()
                        if key.scope is None or e in key.scope}
                if not key.dry_run:
                    for episode_id, attempt in kept.items():
                        entry = IndexEntry("episode", episode_id, None, attempt, 0, 1)
                        self.records.hold(Held(episode_id, attempt, None, entry, state=cid))
                    self.restored_from = cid
                    event(f"restored {len(kept)} episode records")
                held = [{"episode_id": e, "attempt_to_send": a + 1} for e, a in kept.items()]
                return RestoreDone(cid, {"held_episodes": held})
            case ReleaseInstalled(key=key):
                self.records.clear()
                self.restored_from = None
                return AbortDone(key.checkpoint_id)
        raise AssertionError(action)

    def export(self, scope: frozenset[str] | None) -> dict[str, int]:
        """Every worker writes its segment: its parked episodes and the claimed records it
        holds back, and the least loaded worker carries the unclaimed ones (relabelled)."""
        loads = {w: float(sum(r.worker == w for r in self.requests)) for w in self.workers}
        carrier = least_loaded(loads)

        def kept(episode_id: str) -> bool:
            return scope is None or episode_id in scope

        written: dict[str, list[tuple[str, int]]] = {w: [] for w in self.workers}
        for request in self.requests:
            assert request.parked, "a commit runs only when every episode is parked"
            if kept(request.episode_id):
                written[request.worker].append((request.episode_id, request.attempt))
        for episode_id, (worker, held) in self.returning.items():
            if kept(episode_id):
                event("commit writes a record its request ended with")
                written[worker].append((episode_id, held.attempt + 1))
        for held in self.records.carry(scope):
            event("commit carries an unclaimed record")
            written[carrier].append((held.episode_id, held.attempt + 1))
        records = [record for segment in written.values() for record in segment]
        ids = [episode_id for episode_id, _ in records]
        assert len(ids) == len(set(ids)), f"a record written twice: {written}"
        for episode_id, held in self.records.records.items():
            if kept(episode_id) and not held.done:
                assert (episode_id, held.attempt + 1) in records, f"{episode_id} not written"
        return dict(records)

    @initialize(
        held=st.dictionaries(episodes, st.integers(0, 3), min_size=1),
        restore=st.sampled_from([True, True, True, False]),
    )
    def start(self, held: dict[str, int], restore: bool) -> None:
        """The root holds a checkpoint of some episodes already; maybe the first server
        starts with `--restore latest`."""
        self.disk["c-start"] = held
        if restore:
            self.control("restore", 1, checkpoint_id="c-start")
            self.control("resume", checkpoint_id="c-start")

    # Control calls -------------------------------------------------------------------

    def control(self, route: str, settle: int = 0, **options: Any) -> None:
        """One control call, as the checkpointer makes it of the machine."""
        self.last_call = (route, {"settle": settle, **options})
        m, now, published = self.d.m, self.d.now, options.get("checkpoint_id") in self.disk
        cid = options.get("checkpoint_id", "")
        calls: dict[str, tuple[Callable[[], Step], tuple[type, ...]]] = {
            "prepare": (lambda: m.prepare(cid, now, deadline_s=DEADLINE_S, lease_s=LEASE_S,
                                          published=published), (PrepareAnswer,)),
            "commit": (lambda: m.commit(cid, now, scope=options.get("scope"),
                                        deadline_s=DEADLINE_S, published=published),
                       (CommitAnswer,)),
            "resume": (lambda: m.resume(cid, now), (ResumeAnswer,)),
            "renew": (lambda: m.renew(cid, now, lease_s=options.get("lease_s", LEASE_S),
                                      published=published), (RenewAnswer,)),
            "restore": (lambda: m.restore(cid, now, fresh=self.fresh(), scope=options.get("scope"),
                                          deadline_s=DEADLINE_S,
                                          dry_run=options.get("dry_run", False)),
                        (RestoreAnswer,)),
            "abort_restore": (lambda: m.abort_restore(cid, now), (AbortAnswer,)),
            "retire": (lambda: m.retire(options["episode_id"], options["attempt"], now), ()),
        }
        make, expected = calls[route]
        self.run(make, *expected, settle=settle)

    @rule(which=ids, settle=settle)
    def prepare(self, which: str, settle: int) -> None:
        self.control("prepare", settle, checkpoint_id=self.d.resolve(which))

    @rule(which=ids, scope=scopes, settle=settle)
    def commit(self, which: str, scope: tuple[str, ...] | None, settle: int) -> None:
        self.control("commit", settle, checkpoint_id=self.d.resolve(which), scope=scope)

    @rule(scope=scopes, resume=st.sampled_from([True, True, True, False]),
          cancel=st.none() | picks)
    def checkpoint(self, scope: tuple[str, ...] | None, resume: bool, cancel: int | None) -> None:
        """What the controller's `checkpoint` does: prepare a new ID, commit it, resume;
        `cancel`: a request ends between the prepare and the commit."""
        cid = self.d.resolve("new")
        self.control("prepare", 1, checkpoint_id=cid)
        if cancel is not None and self.requests:
            self.request_ends_early(cancel)
        self.control("commit", 1, checkpoint_id=cid, scope=scope)
        if resume:
            self.control("resume", checkpoint_id=cid)

    @rule(which=ids)
    def resume(self, which: str) -> None:
        self.control("resume", checkpoint_id=self.d.resolve(which))

    @rule(which=ids, lease_s=st.sampled_from([1.0, 100.0]))
    def renew(self, which: str, lease_s: float) -> None:
        self.control("renew", checkpoint_id=self.d.resolve(which), lease_s=lease_s)

    @rule(pick=picks, scope=scopes, dry_run=st.booleans(), settle=settle)
    def restore(self, pick: int, scope: tuple[str, ...] | None, dry_run: bool, settle: int) -> None:
        on_disk = sorted(self.disk)
        cid = on_disk[pick % len(on_disk)] if on_disk and pick % 4 else self.d.resolve("new")
        self.control("restore", settle, checkpoint_id=cid, scope=scope, dry_run=dry_run)

    @rule(which=ids, settle=settle)
    def abort_restore(self, which: str, settle: int) -> None:
        self.control("abort_restore", settle, checkpoint_id=self.d.resolve(which))

    @rule(episode_id=episodes, attempt=st.integers(0, 4))
    def retire(self, episode_id: str, attempt: int) -> None:
        self.control("retire", episode_id=episode_id, attempt=attempt)

    @precondition(lambda self: self.last_call is not None)
    @rule()
    def repeat_the_last_call(self) -> None:
        assert self.last_call is not None
        route, options = self.last_call
        self.control(route, **options)

    @rule()
    def status(self) -> None:
        self.run(lambda: self.d.m.status(self.d.now), Status)

    @rule(dt=st.floats(0, 60))
    def time_passes(self, dt: float) -> None:
        """The clock moves on and the lease timer fires if it is due."""
        self.d.now += dt
        self.run(lambda: self.d.m.tick(self.d.now))

    @precondition(lambda self: bool(self.d.pending))
    @rule(pick=picks, success=st.booleans())
    def work_ends(self, pick: int, success: bool) -> None:
        self.finish(self.d.pending[pick % len(self.d.pending)], success)

    def finish(self, action: Action, success: bool) -> None:
        event = self.ending(action, success)
        expected: dict[type, type] = {
            Ready: PrepareAnswer, ReadinessTimeout: PrepareAnswer, CommitDone: CommitAnswer,
            RestoreDone: RestoreAnswer, AbortDone: AbortAnswer,
        }
        answer_type: tuple[type, ...] = (expected[type(event)],) if type(event) in expected else ()
        self.d.pending.remove(action)
        step = self.run(lambda: self.d.m.handle(event, self.d.now), *answer_type,
                        ends_work=not isinstance(action, WaitReady))
        if isinstance(event, RestoreDone) and isinstance(step.answer, RestoreAnswer):
            key = action.key if isinstance(action, StartRestore) else None
            if key is not None and not key.dry_run:
                listed = sorted(e["episode_id"] for e in event.answer["held_episodes"])
                assert sorted(h["episode_id"] for h in self.records.held_episodes()) == listed

    # Workers and their requests ------------------------------------------------------

    def join(self) -> None:
        self.serial += 1
        self.workers.append(f"w{self.serial}")

    @precondition(lambda self: len(self.workers) < EXPECTED_WORKERS + 1)
    @rule()
    def worker_joins(self) -> None:
        self.join()

    @precondition(lambda self: bool(self.workers))
    @rule(pick=picks)
    def worker_dies(self, pick: int) -> None:
        worker = self.workers.pop(pick % len(self.workers))
        claimed = {r.episode_id for r in self.requests if r.worker == worker and r.held}
        claimed |= {e for e, (w, _) in self.returning.items() if w == worker}
        self.requests = [r for r in self.requests if r.worker != worker]
        self.returning = {e: (w, h) for e, (w, h) in self.returning.items() if w != worker}
        lost = self.records.worker_left(worker)
        if lost:
            event("a dead worker's claimed record is lost")
        assert {record["episode_id"] for record in lost} == claimed
        if self.d.closed:
            self.lost.add(worker)

    @precondition(lambda self: bool(self.workers))
    @rule(pick=picks, episode_id=episodes, which=attempts)
    def request(self, pick: int, episode_id: str, which: str) -> None:
        held = self.records.get(episode_id)
        base = 0 if held is None else held.attempt
        offset = {"next": 1, "same": 0, "skip": 2, "old": -1, "first": 1 - base}[which]
        self.claim(self.workers[pick % len(self.workers)], episode_id, base + offset)

    @precondition(lambda self: bool(self.workers and self.records))
    @rule(pick=picks, held=picks)
    def request_of_a_held_record(self, pick: int, held: int) -> None:
        """A request of the attempt a held (or claimed) record expects."""
        record = list(self.records.records.values())[held % len(self.records)]
        self.claim(self.workers[pick % len(self.workers)], record.episode_id, record.attempt + 1)

    @precondition(lambda self: self.last_claim is not None)
    @rule()
    def request_again(self) -> None:
        assert self.last_claim is not None
        worker, episode_id, attempt = self.last_claim
        if worker in self.workers:
            self.claim(worker, episode_id, attempt)

    def claim(self, worker: str, episode_id: str, attempt: int) -> None:
        """A `/run` arrives on `worker`: the participant's checks, then the fleet's claim."""
        self.last_claim = (worker, episode_id, attempt)
        before = self.records.get(episode_id)
        held = self.claim_on(worker, episode_id, attempt)
        if isinstance(held, TetherError):
            answered(held)
            event(f"claim refused: {held.code}")
            assert held.code in CLAIM_ERRORS, held
            assert self.records.get(episode_id) == before, "a refused claim changed nothing"
            if held.code == "attempt_mismatch":
                assert before is not None
                assert held.detail["expected"] == before.attempt + 1
            return
        if held is None:
            assert before is None
            assert episode_id not in self.finished, "a record was continued to the end twice"
            if any(r.episode_id == episode_id for r in self.requests) or (
                episode_id in self.returning
            ):
                return  # the app's own duplicate of an episode nobody holds: not modelled
        else:
            event("claim granted")
            assert before is not None and attempt == before.attempt + 1
            assert held.claimed_by == worker
        self.requests.append(Request(worker, episode_id, attempt, held))

    def claim_on(self, worker: str, episode_id: str, attempt: int) -> Held | TetherError | None:
        """The participant's checks, then the fleet's: the record, None, or the refusal."""
        try:
            if self.d.closed:
                raise TetherError("checkpoint_parked", "a checkpoint is open")
            self.records.check_attempt(episode_id, attempt)
            if any(r.worker == worker and (r.episode_id, r.attempt) == (episode_id, attempt)
                   for r in self.requests):
                raise TetherError("episode_claimed", {"worker": worker})
            return self.records.claim(episode_id, attempt, worker)
        except TetherError as refusal:
            return refusal

    def pick(self, pick: int) -> Request:
        return self.requests[pick % len(self.requests)]

    @precondition(lambda self: bool(self.requests))
    @rule(pick=picks)
    def boundary(self, pick: int) -> None:
        """A request reaches a boundary: parks there while admission is closed."""
        self.reach_boundary(self.pick(pick))

    def reach_boundary(self, request: Request) -> None:
        if request.parked:
            return
        try:
            self.records.check_attempt(request.episode_id, request.attempt)
        except TetherError as refusal:
            answered(refusal)
            self.end(request, finished=False)  # retired meanwhile: 409 stale_attempt
            return
        request.boundaries += 1
        request.state = (request.episode_id, request.attempt, request.boundaries)
        request.parked = self.d.closed

    @precondition(lambda self: bool(self.requests))
    @rule(pick=picks)
    def request_ends_early(self, pick: int) -> None:
        """A disconnect, an error before the first boundary, or the server cancelling it."""
        continuing = [r for r in self.requests if r.held is not None] or self.requests
        self.end(continuing[pick % len(continuing)], finished=False)

    @precondition(lambda self: any(not r.parked for r in self.requests))
    @rule(pick=picks)
    def episode_finishes(self, pick: int) -> None:
        stepping = [r for r in self.requests if not r.parked]
        self.end(stepping[pick % len(stepping)], finished=True)

    def end(self, request: Request, finished: bool) -> None:
        """The request ends: its record is done, or handed back (its latest boundary state),
        at once while admission is open, else once it opens."""
        self.requests.remove(request)
        held = request.held
        if held is None:
            return
        if finished:
            self.records.done(held.episode_id, request.worker)
            self.finished.add(held.episode_id)
            return
        if request.boundaries:
            held = replace(held, path=None, entry=None, state=request.state)
        if self.d.closed:
            event("a request ends while admission is closed")
            self.returning[held.episode_id] = (request.worker, held)
        elif not self.records.hand_back(held, request.worker):
            event("a retired record is dropped as it is handed back")

    @rule(restore_latest=st.booleans(), dies=st.integers(0, 3))
    def crash(self, restore_latest: bool, dies: int) -> None:
        """The server dies (one time in four: it ends everything the run built up); a new
        one starts on the same checkpoint root, and restores the newest checkpoint, then
        resumes, as `tether serve --restore latest` does."""
        if dies:
            return
        driver = Driver()
        driver.named, driver.now = self.d.named, self.d.now
        self.start_server(driver)
        if restore_latest and self.disk:
            latest = list(self.disk)[-1]
            self.control("restore", 1, checkpoint_id=latest)
            self.control("resume", checkpoint_id=latest)

    # Invariants ----------------------------------------------------------------------

    @invariant()
    def machine_is_consistent(self) -> None:
        self.d.check()

    @invariant()
    def each_record_has_at_most_one_claimant_and_it_is_its_request(self) -> None:
        holders: dict[str, list[str]] = {}
        for request in self.requests:
            if request.held is not None:
                holders.setdefault(request.episode_id, []).append(request.worker)
        for episode_id, (worker, _) in self.returning.items():
            holders.setdefault(episode_id, []).append(worker)
        for episode_id, workers in holders.items():
            assert len(workers) == 1, f"{episode_id} continued by {workers}"
            held = self.records.get(episode_id)
            assert held is not None and held.claimed_by == workers[0] and not held.done
        for episode_id, held in self.records.records.items():
            if held.claimed_by is not None and not held.done:
                assert held.claimed_by in self.workers, f"{episode_id}: a dead worker's claim"
                assert episode_id in holders, f"{episode_id} claimed, yet no request has it"

    @invariant()
    def parked_only_while_closed(self) -> None:
        assert self.d.closed or not any(r.parked for r in self.requests)
        assert self.d.closed or not self.returning


ProtocolModel.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None
)
TestProtocolModel = ProtocolModel.TestCase
