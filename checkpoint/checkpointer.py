"""The checkpointer: runs the phase machine and carries out its actions on a fleet.

The same object serves the control API in-process (plain uvicorn, one worker) and, in
the coordinator, across N workers; only the `Fleet` differs. It owns one background
task, the lease timer, which `start`/`stop` manage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from tether.checkpoint import phases as ph
from tether.checkpoint.events import Change, Observer, PhaseChange, log_phase_change
from tether.checkpoint.fleet import Fleet
from tether.checkpoint.participant import Blockers
from tether.checkpoint.store import begin_commit, load_checkpoint, sweep_temp
from tether.checkpoint.tracing import CheckpointSpans
from tether.routing.errors import TetherError

log = structlog.get_logger("tether.checkpoint")

READINESS_POLL_S = 0.05


class Checkpointer:
    """One participant's checkpoint protocol (SPEC 5.2-5.9) over a fleet of workers."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        name: str | None,
        root: str | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self.name = name
        self.root = root
        self.clock = clock
        self.machine = ph.PhaseMachine()
        self._running: dict[ph.CallKey, asyncio.Future[Any]] = {}
        self._changed = asyncio.Event()
        self._rearm = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[int] | None = None
        self._blockers = Blockers([], 0)
        self._calls: set[asyncio.Task[Any]] = set()
        """Calls being answered: each runs in a task of its own, owned here."""
        self.observers: list[Observer] = [log_phase_change]
        """Told of every phase change (logs; metrics add themselves)."""
        self.spans = CheckpointSpans()
        """The protocol's spans (checkpoint/tracing.py); nothing unless this process traces."""
        self.observers.append(self.spans.observe)
        self._closed_at: float | None = None
        """When admission closed, on the monotonic clock (for the pause's length)."""
        self.holding: str | None = None
        """Why control calls are refused for now (a restore at start-up), or None."""
        fleet.on_change(self._changed.set)

    # Lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._timer = asyncio.create_task(self._lease_timer(), name="tether-lease")
        if self.root is not None and self.name is not None:
            # What commits that crashed left: before this server's first commit begins,
            # outside any commit's deadline (a sweep in a thread cannot be called back).
            self._sweep = asyncio.create_task(
                asyncio.to_thread(sweep_temp, self.root, None, self.name), name="tether-sweep"
            )

    async def stop(self) -> None:
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        if self._sweep is not None:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await self._sweep
            self._sweep = None
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        self.spans.end()

    # Control calls (bodies already validated) -------------------------------------

    async def call(self, route: str, body: dict[str, Any]) -> Any:
        """Answer one control call; raises `TetherError` with the contract's code.

        The call runs in a task the checkpointer owns, so its caller may go away (the
        worker that relayed it died, its client left) and the work still ends, and the
        phase machine learns how; a retry of the same call joins it or reads its result."""
        if self.holding is not None:
            raise TetherError("checkpoint_parked", self.holding)
        return await self.run(route, body)

    async def run(self, route: str, body: dict[str, Any]) -> Any:
        """`call` without the start-up hold: for the launcher's own restore at start."""
        task = asyncio.create_task(self._call(route, body), name=f"tether-call-{route}")
        self._calls.add(task)
        task.add_done_callback(_finished_call(self._calls))
        return await asyncio.shield(task)

    async def _call(self, route: str, body: dict[str, Any]) -> Any:
        if route == "status":
            return await self.status()
        if route == "forget":
            return {"forgotten": await self.fleet.forget(body["episode_ids"])}
        if route in ("prepare", "commit", "restore"):
            self._where()
        now = self.clock()
        cid = body.get("checkpoint_id", "")
        deadline = body.get("deadline_s") or ph.DEFAULT_DEADLINE_S
        if route == "prepare":
            step = self.machine.prepare(
                cid, now, deadline_s=deadline, lease_s=body.get("lease_s") or ph.DEFAULT_LEASE_S,
                published=self._published(cid),
            )
        elif route == "commit":
            step = self.machine.commit(
                cid, now, scope=body.get("scope"), deadline_s=deadline,
                published=self._published(cid),
            )
        elif route == "resume":
            step = self.machine.resume(cid, now)
        elif route == "renew":
            step = self.machine.renew(cid, now, lease_s=body.get("lease_s") or ph.DEFAULT_LEASE_S,
                                      published=self._published(cid))
        elif route == "restore":
            step = self.machine.restore(
                cid, now, fresh=await self.fleet.fresh(), scope=body.get("scope"),
                deadline_s=deadline, dry_run=bool(body.get("dry_run")),
            )
        elif route == "abort_restore":
            step = self.machine.abort_restore(cid, now)
        elif route == "retire":
            step = self.machine.retire(
                body["episode_id"], body["attempt"], now, deadline_s=deadline
            )
        else:
            raise TetherError("invalid_request", f"unknown control call {route!r}")
        answer = await self._carry_out(step, route, body)
        return _render(answer)

    async def status(self) -> dict[str, Any]:
        status = self.machine.status(self.clock()).result()
        assert isinstance(status, ph.Status)
        if status.phase == "prepared" and status.busy is None:
            # What a commit would find now (a worker lost since the prepare answered).
            self._blockers = await self.fleet.blockers()
        return {
            "name": self.name,
            "phase": status.phase,
            "checkpoint_id": status.checkpoint_id,
            "lease_expires_at": status.lease_expires_at,
            "expected_workers": self.fleet.expected_workers,
            "workers": await self.fleet.workers(),
            "held_episodes": self.fleet.held_episodes(),
            "lost_episodes": self.fleet.lost_episodes(),
            "tables": self.fleet.tables(),
            "blockers": self._blockers.listed,
            "blockers_total": self._blockers.total,
            "checkpoint_root": self.root,
        }

    # Carrying out a step -----------------------------------------------------------

    async def _carry_out(self, step: ph.Step, route: str, body: dict[str, Any]) -> Any:
        self._rearm.set()
        answer: Any = step.answer
        for action in step.actions:
            result = await self._act(action, route, body)
            if result is not None:
                answer = result
        if isinstance(answer, TetherError):
            raise answer
        return answer

    async def _act(self, action: ph.Action, route: str, body: dict[str, Any]) -> Any:
        """Carry out one action; return the call's answer if the action produced it."""
        if isinstance(action, ph.CloseAdmission):
            self.spans.closing(route, action.checkpoint_id)
            self._closed_at = time.monotonic()
            await self.fleet.close_admission()
            log.info("admission_closed", checkpoint_id=action.checkpoint_id)
        elif isinstance(action, ph.OpenAdmission):
            reopening = time.perf_counter()
            with self.spans.reopening(action.checkpoint_id, route):
                await self.fleet.open_admission()
            reopened_s = time.perf_counter() - reopening
            self._blockers = Blockers([], 0)
            paused = None if self._closed_at is None else time.monotonic() - self._closed_at
            self._closed_at = None
            reopened: dict[str, Change] = {"resume": "resumed", "tick": "expired",
                                           "abort_restore": "aborted"}
            change = reopened.get(route)
            if change is None and route != "restore":  # a call found the lease run out
                change = "expired"
            if change is not None:
                # `seconds`: the reopening itself (a resume's phase); `paused_s`: the pause.
                self._emit(PhaseChange(change, action.checkpoint_id, reopened_s,
                                       paused_s=paused))
        elif isinstance(action, ph.LogExpired):
            log.warning("lease_expired", checkpoint_id=action.checkpoint_id, phase=action.phase)
        elif isinstance(action, ph.WaitReady):
            with self.spans.phase("prepare", action.checkpoint_id):
                return await self._wait_ready(action)
        elif isinstance(action, ph.RecheckReadiness):
            return None  # WriteCheckpoint re-checks right before it writes
        elif isinstance(action, ph.WriteCheckpoint):
            with self.spans.phase("commit", action.key.checkpoint_id):
                return await self._shared(action.key, self._commit(action))
        elif isinstance(action, ph.StartRestore):
            with self.spans.within(action.key.checkpoint_id):
                return await self._shared(action.key, self._restore(action))
        elif isinstance(action, ph.ReleaseInstalled):
            return await self._shared(action.key, self._abort(action))
        elif isinstance(action, ph.Retire):
            within_s = max(action.deadline - self.clock(), 0.0)
            retired = await self.fleet.retire(action.episode_id, action.attempt, within_s)
            return {"retired": retired}
        elif isinstance(action, ph.Join):
            future = self._running.get(action.key)
            if future is None:
                log.error("running_work_missing", call=action.key.route)
                raise TetherError("internal_error", f"{action.key.route} is marked running")
            return await asyncio.shield(future)
        elif isinstance(action, ph.RetryAfter):
            future = self._running.get(action.key)
            if future is None:  # the machine marks work running only while it runs
                log.error("running_work_missing", call=action.key.route)
                raise TetherError("internal_error", f"{action.key.route} is marked running")
            with contextlib.suppress(Exception):
                await asyncio.shield(future)
            return await self._call(route, body)
        return None

    async def _shared(self, key: ph.CallKey, work: Any) -> Any:
        """Run one commit, restore or abort; a retry of the same call joins it."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            answer = await work
            future.set_result(answer)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved here; joiners re-raise it
            raise
        finally:
            del self._running[key]
        return answer

    async def _wait_ready(self, action: ph.WaitReady) -> Any:
        started = time.perf_counter()
        while True:
            self._changed.clear()
            blockers = await self.fleet.blockers()
            self._blockers = blockers
            now = self.clock()
            if not blockers.total:
                step = self.machine.handle(ph.Ready(action.checkpoint_id), now)
                break
            if now >= action.deadline:
                step = self.machine.handle(
                    ph.ReadinessTimeout(action.checkpoint_id, blockers.listed, blockers.total),
                    now,
                )
                break
            await _wait(self._changed, min(READINESS_POLL_S, action.deadline - now))
        answer = step.answer
        if isinstance(answer, ph.PrepareAnswer):
            self._emit(PhaseChange(
                answer.state, action.checkpoint_id, time.perf_counter() - started,
                code=None if answer.state == "prepared" else f"{answer.blockers_total} blockers",
            ))
        return await self._carry_out(step, "prepare", {})

    async def _commit(self, action: ph.WriteCheckpoint) -> Any:
        cid = action.key.checkpoint_id
        started = time.perf_counter()
        event: ph.Event
        unready = False  # the fresh check found blockers: a commit refused, not failed
        try:  # (the check runs the app's `busy` and `sessions`, which may raise too)
            blockers = await self.fleet.blockers(fresh=True)
            if blockers.total:
                unready = True
                event = ph.CommitFailed(cid, "not_ready", {"blockers": blockers.listed,
                                                           "blockers_total": blockers.total})
            else:
                event = ph.CommitDone(cid, await self._write(cid, action))
        except TimeoutError:
            event = ph.CommitFailed(cid, "deadline_exceeded", "the commit missed its deadline")
        except TetherError as error:
            code: ph.CommitFailure = "commit_failed"
            if error.code == "stale_checkpoint":
                code = "stale_checkpoint"
            elif error.code == "not_ready":
                code = "not_ready"
            event = ph.CommitFailed(cid, code, error.detail)
        except Exception as error:  # the app's export or the disk: the commit fails, cleanly
            log.exception("commit_error", checkpoint_id=cid)
            event = ph.CommitFailed(cid, "commit_failed", f"{type(error).__name__}: {error}")
        if unready:
            return await self._carry_out(self.machine.handle(event, self.clock()), "commit", {})
        seconds = time.perf_counter() - started
        if isinstance(event, ph.CommitDone):
            segments = event.manifest.get("segments", [])
            self._emit(PhaseChange(
                "committed", cid, seconds, records=event.manifest.get("records"),
                bytes=sum(int(segment.get("bytes", 0)) for segment in segments),
                workers=len(event.manifest.get("workers", [])),
            ))
        else:
            self._emit(PhaseChange("commit_failed", cid, seconds, code=event.code))
        return await self._carry_out(self.machine.handle(event, self.clock()), "commit", {})

    async def _write(self, cid: str, action: ph.WriteCheckpoint) -> dict[str, Any]:
        """Export and publish; the deadline bounds the export only (`TimeoutError`). The
        temp dir is made and the manifest published each to its end, even if the task is
        cancelled meanwhile: a publish cut short by a deadline would go on in its thread
        after the commit answered that it failed, and beside the temp dir's removal."""
        scope = action.key.scope
        root, name = self._where()
        if self._sweep is not None:
            try:
                swept = await asyncio.shield(self._sweep)
            except OSError as error:  # leftovers stay; they never block a commit
                log.warning("crashed_commits_not_swept", error=str(error))
            else:
                if swept:
                    log.info("crashed_commits_swept", temp_dirs=swept)
            self._sweep = None
        pending = await _to_the_end(begin_commit, root, cid, name)
        try:
            async with asyncio.timeout(max(action.deadline - self.clock(), 0.001)):
                workers, segments, counts = await self.fleet.export(pending, scope)
            fields: Any = {
                "workers": workers,
                "owner_aliases": self.fleet.owner_aliases(),
                "state_version": self.fleet.state_version,
                "records": counts,
                "segments": segments,
            }
            # The fleet vouches for the counts: its writer counted them in this process,
            # or it read every worker's index. Reading them again would double the cost.
            manifest = await _to_the_end(
                functools.partial(pending.publish, fields, check_indexes=False)
            )
        except BaseException:
            await asyncio.to_thread(pending.abort)
            raise
        if scope is not None:
            self.fleet.drop_held_outside(scope)  # SPEC 5.8: the scope forgets the rest
        return manifest

    async def _restore(self, action: ph.StartRestore) -> Any:
        key = action.key
        started = time.perf_counter()
        event: ph.Event
        root, name = self._where()
        try:
            async with asyncio.timeout(max(action.deadline - self.clock(), 0.001)):
                checkpoint = await asyncio.to_thread(load_checkpoint, root, key.checkpoint_id, name)
                within_s = action.deadline - self.clock()
                answer = await self.fleet.restore(checkpoint, key.scope, key.dry_run, within_s)
            event = ph.RestoreDone(key.checkpoint_id, answer)
        except TimeoutError:
            event = ph.RestoreFailed(key.checkpoint_id, "deadline_exceeded", "restore timed out")
        except TetherError as error:
            event = ph.RestoreFailed(key.checkpoint_id, error.code, error.detail)
        except Exception as error:  # the app's install failed; the fleet released it all
            log.exception("restore_error", checkpoint_id=key.checkpoint_id)
            event = ph.RestoreFailed(
                key.checkpoint_id, "incompatible_state", f"{type(error).__name__}: {error}"
            )
        seconds = time.perf_counter() - started
        if key.dry_run:
            log.info("restore_dry_run", checkpoint_id=key.checkpoint_id,
                     ok=isinstance(event, ph.RestoreDone), seconds=round(seconds, 3))
        elif isinstance(event, ph.RestoreDone):
            records = {"sessions": int(event.answer.get("installed_sessions", 0)),
                       "episodes": len(event.answer.get("held_episodes", []))}
            self._emit(PhaseChange("restored", key.checkpoint_id, seconds, records=records,
                                   workers=self.fleet.expected_workers))
        else:
            self._emit(PhaseChange("restore_failed", key.checkpoint_id, seconds,
                                   code=event.code))
        return await self._carry_out(self.machine.handle(event, self.clock()), "restore", {})

    async def _abort(self, action: ph.ReleaseInstalled) -> Any:
        """Release what the restore installed, then reopen admission as the machine says,
        even if the app's release failed (its error is then the answer: 500)."""
        failure: Exception | None = None
        try:
            await self.fleet.release_installed()
        except Exception as error:
            log.exception("abort_release_failed", checkpoint_id=action.key.checkpoint_id)
            failure = error
        finally:
            step = self.machine.handle(ph.AbortDone(action.key.checkpoint_id), self.clock())
        answer = await self._carry_out(step, "abort_restore", {})
        if failure is not None:
            raise TetherError(
                "internal_error",
                f"the restore was aborted, but releasing it failed: "
                f"{type(failure).__name__}: {failure}",
            )
        return answer

    def _emit(self, event: PhaseChange) -> None:
        for observer in self.observers:
            try:
                observer(event)
            except Exception:  # an observer's bug must not fail the checkpoint
                log.exception("phase_observer_failed", change=event.change)

    def _where(self) -> tuple[str, str]:
        if self.root is None or self.name is None:
            raise TetherError("invalid_request", "this server has no checkpoint root or name")
        return self.root, self.name

    def _published(self, checkpoint_id: str) -> bool:
        if self.root is None or self.name is None:
            return False
        return (Path(self.root) / checkpoint_id / self.name).is_dir()

    async def _lease_timer(self) -> None:
        while True:
            self._rearm.clear()
            deadline = self.machine.next_deadline()
            wait = 3600.0 if deadline is None else max(deadline - self.clock(), 0.0)
            await _wait(self._rearm, wait)
            if self._rearm.is_set():
                continue
            try:
                await self._carry_out(self.machine.tick(self.clock()), "tick", {})
            except TetherError:
                log.exception("lease_tick_failed")


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait for `event` at most `seconds`. Not `wait_for`: on 3.11 it can swallow a
    cancellation that arrives as the event is set, and `stop()` would then hang."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


def _finished_call(calls: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    """What a call's task does when it ends: leave the set; an error nobody awaited any
    more (its caller went away) is retrieved, not reported as lost."""

    def done(task: asyncio.Task[Any]) -> None:
        calls.discard(task)
        if not task.cancelled():
            task.exception()

    return done


def _render(answer: Any) -> Any:
    if isinstance(answer, ph.PrepareAnswer):
        return {"state": answer.state, "blockers": list(answer.blockers),
                "blockers_total": answer.blockers_total,
                "lease_expires_at": answer.lease_expires_at}
    if isinstance(answer, ph.CommitAnswer):
        return dict(answer.manifest)
    if isinstance(answer, ph.ResumeAnswer):
        return {"phase": "open"}
    if isinstance(answer, ph.RenewAnswer):
        return {"lease_expires_at": answer.lease_expires_at}
    if isinstance(answer, ph.RestoreAnswer):
        return dict(answer.answer)
    if isinstance(answer, ph.AbortAnswer):
        return {"phase": "open", "fresh": True}
    return answer


T = TypeVar("T")


async def _to_the_end(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` in a thread, waited for to its end even when this task is cancelled
    meanwhile (the cancellation then goes on once it has): a thread cannot be stopped,
    and what it does to the disk must be over before the caller cleans up after it."""
    running = asyncio.ensure_future(asyncio.to_thread(call, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise
