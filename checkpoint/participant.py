"""The worker side of a checkpoint (SPEC 5.1, 5.3, 5.8, 5.9): what the app registers,
admission while a checkpoint is open, readiness, episodes and their boundaries, and the
export and install of this worker's records.

One `Participant` lives in each worker. It never decides a phase: whoever runs the phase
machine (in-process, or the coordinator over the channel) tells it to close or open
admission, asks for readiness, and asks it to export or install.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import structlog

from tether.checkpoint import gcpause
from tether.checkpoint.held import Held as Held  # re-exported: workers build them
from tether.checkpoint.held import HeldRecords
from tether.checkpoint.phases import MAX_BLOCKERS
from tether.checkpoint.segments import (
    IndexEntry,
    SegmentInfo,
    SegmentWriter,
    read_index,
    read_records,
)
from tether.routing.errors import TetherError
from tether.routing.types import LATER, Later, SessionId

log = structlog.get_logger("tether.participant")

EXPORT_BATCH = 512
"""Records an export packs on the event loop before it gives other tasks a turn."""
WRITE_AHEAD = 4 * 1024 * 1024
"""Packed bytes an export hands to its writer thread at a time (it packs on meanwhile)."""
HELD_BATCH = 64
"""Held records whose states an export reads from disk at a time."""
LISTED_BLOCKERS = MAX_BLOCKERS
"""Blockers listed at most (SPEC 5.2); the rest are only counted."""
APP_SCAN_S = 0.05
"""How stale the app's busy flags may be in a report while other blockers remain."""


class SessionState(Protocol):
    """Session state the app keeps on this worker, as a checkpoint sees it."""

    def sessions(self) -> Iterable[str]:
        """The IDs of the sessions this worker holds."""
        ...

    def holds(self, session_id: str) -> bool: ...

    def export(self, session_id: str) -> Any:
        """The session's state as a plain msgpack value."""
        ...

    async def install(self, session_id: str, state: Any) -> None: ...

    async def release(self, session_id: str) -> None: ...

    def busy(self, session_id: str) -> bool:
        """Whether the session is in the middle of work a checkpoint must wait for."""
        ...


@dataclass
class Episode:
    """One running episode: `await boundary(state)` between steps."""

    participant: Participant
    episode_id: str
    attempt: int
    resumed: Any = None
    """The state it continues from, for a restored record; None when new."""
    state: Any = None
    boundaries: int = 0
    parked: bool = False
    retired: bool = False
    disconnected: Callable[[], Awaitable[bool]] | None = field(default=None, repr=False)
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    finished: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def boundary(self, state: Any) -> None:
        """Record a safe point; park here while a checkpoint is open."""
        self.participant.check_attempt(self.episode_id, self.attempt)
        if self.disconnected is not None and await self.disconnected():
            raise ClientGone(f"the client of {self.episode_id!r} left")
        self.state = state
        self.boundaries += 1
        if self.participant.admission_closed:
            self.participant.park(self, True)
            try:
                await self.participant.wait_open()
            finally:
                self.participant.park(self, False)
            self.participant.check_attempt(self.episode_id, self.attempt)


class RemoteRecords(Protocol):
    """Held records kept elsewhere (by the coordinator, for a server of N workers)."""

    async def claim(self, episode_id: str, attempt: int) -> Held | None:
        """Claim the record attempt-1 left, if one is held; raises the attempt errors."""
        ...

    async def done(self, episode_id: str) -> None:
        """The claimed record was continued to the end: drop it."""
        ...

    async def hand_back(self, held: Held) -> None:
        """The claiming request ended early: hold the record again (by location)."""
        ...


class Blockers(NamedTuple):
    """Why a worker (or a server) is not ready: the first few, and how many in all."""

    listed: list[dict[str, Any]]
    total: int

    @classmethod
    def merge(cls, parts: Iterable[Blockers], limit: int = LISTED_BLOCKERS) -> Blockers:
        listed: list[dict[str, Any]] = []
        total = 0
        for part in parts:
            listed.extend(part.listed[: limit - len(listed)])
            total += part.total
        return cls(listed, total)


class Exported(SegmentInfo):
    """A segment this worker wrote, with its records counted by kind."""

    sessions: int
    episodes: int


class ClientGone(Exception):
    """The request's client disconnected; its claimed record is handed back."""


class Participant:
    """What one worker's app registers for checkpoints, and its checkpoint-time duties.

    Held episode records are kept in `records` (one worker) or by `remote` (several
    workers); `records` keeps the retire marks either way."""

    def __init__(self, *, state_version: str | None = None) -> None:
        self.state_version = state_version
        self.provider: SessionState | None = None
        self.worker: str | None = None
        self.episodes: dict[tuple[str, int], Episode] = {}
        self._stepping: dict[tuple[str, int], Episode] = {}
        """The episodes not parked at a boundary (each one blocks readiness)."""
        self._settling: dict[asyncio.Future[None], str] = {}
        """Hand-backs in flight, with their episode IDs: kept so they finish, and each
        blocks readiness (until it lands, the record is in no one's export)."""
        self._stopping = False
        """The worker stops: hand-backs go at once, admission or not."""
        self._returning: dict[str, Held] = {}
        """Claimed records whose request ended while admission was closed. They stay
        claimed, and this worker's exports carry them, until admission opens again: a
        hand-back during an open checkpoint could reach the coordinator after it chose
        what to carry itself, and the record would be in no segment."""
        self._app_busy = Blockers([], 0)
        self._app_scanned = -APP_SCAN_S
        self.records = HeldRecords()
        self._in_progress: dict[str, int] = {}
        self._open = asyncio.Event()
        self._open.set()
        self._closed = False
        """Admission is closed: `_open` unset, as a plain attribute (`admit` reads it)."""
        self._changed: list[Callable[[], None]] = []
        self.restored = False
        self.remote: RemoteRecords | None = None
        self.handback_dir: Path | None = None
        """Where a handed-back boundary state is written when records are remote."""

    @property
    def held(self) -> Mapping[str, Held]:
        """The held records by episode ID (read only; changed through `records`)."""
        return self.records.records

    # Registration --------------------------------------------------------------

    def register_sessions(self, provider: SessionState) -> None:
        """Register the app's session state (one provider per participant)."""
        self.provider = provider

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever readiness may have changed."""
        self._changed.append(callback)

    def changed(self) -> None:
        for callback in self._changed:
            callback()

    # Admission (SPEC 5.3) -------------------------------------------------------

    @property
    def admission_closed(self) -> bool:
        return self._closed

    def close_admission(self) -> None:
        self._closed = True
        self._open.clear()

    def open_admission(self) -> None:
        self._closed = False
        self._open.set()
        returning, self._returning = self._returning, {}
        for held in returning.values():
            self._settle(held)

    async def wait_open(self) -> None:
        await self._open.wait()

    def holds(self, session_id: str) -> bool:
        return self.provider is not None and self.provider.holds(session_id)

    def admit(
        self, session_id: SessionId | None, stateless: bool, background: bool
    ) -> Callable[[], None] | Later | None:
        """Admit one request: serve stateless routes, refuse with 503 `checkpoint_parked`
        any other while closed unless it names a session held here, which must wait
        (LATER: `enter` waits).

        Returns the call that ends the request's tracking, or None when it is not tracked
        (background streams, stateless routes, requests that name no session). A request
        of a session not held here yet (a seed still running) is tracked too: it may be
        building the state a checkpoint would write."""
        if background:
            return None
        if self._closed:  # (`admission_closed` without the property's call: every request asks)
            if stateless:
                return None
            if session_id is None or not self.holds(session_id):
                raise TetherError("checkpoint_parked", "a checkpoint is open; retry shortly")
            return LATER
        return None if session_id is None else self._track(session_id)

    async def enter(
        self, session_id: SessionId | None, stateless: bool, background: bool
    ) -> Callable[[], None] | None:
        """`admit`, waiting while closed for a request that names a session held here."""
        admitted = self.admit(session_id, stateless, background)
        if admitted is not LATER:
            return admitted
        await self.wait_open()
        if session_id is None or not self.holds(session_id):  # released: an aborted restore
            raise TetherError("checkpoint_parked", "its session went away while it waited; retry")
        return self._track(session_id)

    def _track(self, session_id: SessionId) -> Callable[[], None]:
        key = str(session_id)
        self._in_progress[key] = self._in_progress.get(key, 0) + 1

        def leave() -> None:
            count = self._in_progress[key] - 1
            if count:
                self._in_progress[key] = count
            else:
                del self._in_progress[key]
                for callback in self._changed:  # (`changed`, inline: most requests end here)
                    callback()

        return leave

    # Readiness (SPEC 5.2) -------------------------------------------------------

    def blockers(self) -> Blockers:
        """Why this worker is not ready (nothing listed and a total of 0 when it is).

        Requests in progress and stepping episodes are known here as they change; the
        app's `busy` flags are polled over every session, so that scan runs only when
        nothing else blocks or the last one is `APP_SCAN_S` old: a prepare that waits
        for 10,000 episodes to park does not scan 100,000 sessions at each park.
        """
        worker = self.worker
        requests = Blockers(
            [_blocker("session_busy", worker, session_id, "a request is in progress")
             for session_id in itertools.islice(self._in_progress, LISTED_BLOCKERS)],
            len(self._in_progress),
        )
        episodes = Blockers(
            [_blocker("episode_running", worker, e.episode_id,
                      f"attempt {e.attempt} has not reached a boundary")
             for e in itertools.islice(self._stepping.values(), LISTED_BLOCKERS)],
            len(self._stepping),
        )
        returning = Blockers(
            [_blocker("episode_running", worker, episode_id, "its record is being handed back")
             for episode_id in itertools.islice(self._settling.values(), LISTED_BLOCKERS)],
            len(self._settling),
        )
        now = time.monotonic()
        waiting = requests.total + episodes.total + returning.total
        if waiting == 0 or now - self._app_scanned >= APP_SCAN_S:
            self._app_busy = self._scan_app()
            self._app_scanned = now
        return Blockers.merge([requests, episodes, returning, self._app_busy])

    def _scan_app(self) -> Blockers:
        if self.provider is None:
            return Blockers([], 0)
        busy = [session_id for session_id in self.provider.sessions()
                if session_id not in self._in_progress and self.provider.busy(session_id)]
        return Blockers(
            [_blocker("session_busy", self.worker, session_id, "the app is busy")
             for session_id in busy[:LISTED_BLOCKERS]],
            len(busy),
        )

    def park(self, episode: Episode, parked: bool) -> None:
        """Mark `episode` parked at a boundary (or stepping again)."""
        episode.parked = parked
        key = (episode.episode_id, episode.attempt)
        if parked:
            if self._stepping.get(key) is episode:
                del self._stepping[key]
            self.changed()
        elif self.episodes.get(key) is episode:
            self._stepping[key] = episode

    # Episodes (SPEC 5.1, 5.8, 5.9) ---------------------------------------------

    def check_attempt(self, episode_id: str, attempt: int) -> None:
        """409 `stale_attempt` for a retired attempt or an older one."""
        self.records.check_attempt(episode_id, attempt)

    @contextlib.asynccontextmanager
    async def episode(
        self,
        episode_id: str,
        attempt: int,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[Episode]:
        """Run one episode attempt; a restored record of attempt-1 is continued once.

        `disconnected` (e.g. Starlette's `request.is_disconnected`) is checked at each
        boundary, so a client that left hands a claimed record back instead of using it.
        """
        if self.admission_closed:
            raise TetherError("checkpoint_parked", "a checkpoint is open; retry shortly")
        self.check_attempt(episode_id, attempt)
        if (episode_id, attempt) in self.episodes:
            raise TetherError("episode_claimed", {"worker": self.worker})
        if self.remote is not None:
            claiming = asyncio.ensure_future(self.remote.claim(episode_id, attempt))
            try:
                held = await asyncio.shield(claiming)
            except asyncio.CancelledError:
                # Cancelled while the answer was on its way: a record granted to this
                # request goes back, or it would stay claimed by a live worker (5.8).
                claiming.add_done_callback(self._give_back)
                raise
        else:
            held = self.records.claim(episode_id, attempt, self._claimant)
        episode = Episode(self, episode_id, attempt, disconnected=disconnected,
                          task=asyncio.current_task())
        # Registered before anything awaits: a close that follows the claim's answer
        # must find it stepping, or the prepare would miss a record nobody else holds.
        self.episodes[(episode_id, attempt)] = episode
        self._stepping[(episode_id, attempt)] = episode
        self.changed()
        finished = False
        try:
            if held is not None:  # a failed read hands the claim back, in `finally`
                episode.resumed = episode.state = await asyncio.to_thread(
                    held.load, read_records
                )
            yield episode
            finished = True
        except asyncio.CancelledError:
            if not episode.retired:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # stopped by retire, not by the server
            raise TetherError(
                "stale_attempt", f"attempt {attempt} of {episode_id!r} was retired"
            ) from None
        finally:
            del self.episodes[(episode_id, attempt)]
            self._stepping.pop((episode_id, attempt), None)
            try:
                # Shielded: a cancel that lands here must not leave the record claimed
                # by a live worker, in nobody's export (SPEC 5.8).
                if held is not None and finished:
                    await asyncio.shield(self._done(episode_id))  # continued exactly once
                elif held is not None:
                    handing_back = self._hand_back(episode, held)
                    if handing_back is not None:
                        await asyncio.shield(handing_back)
            finally:
                episode.finished.set()  # retire answers once the record is settled
                self.changed()

    def _give_back(self, claiming: asyncio.Future[Held | None]) -> None:
        """Hand back a record claimed for a request that was cancelled meanwhile."""
        if claiming.cancelled() or claiming.exception() is not None:
            return
        held = claiming.result()
        if held is not None and self.remote is not None:
            self._release(held)

    async def hand_back_all(self, within_s: float = 10.0) -> None:
        """The worker stops: hand back what waits for admission to open, and what the
        requests it just cancelled hand back, and wait until every hand-back is done
        (within `within_s`). Its checkpoint, if one is open, cannot commit without it."""
        self._stopping = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                for _ in range(3):  # requests cancelled a moment ago unwind (and hand back)
                    await asyncio.sleep(0)
                while self._returning or self._settling:
                    returning, self._returning = self._returning, {}
                    for held in returning.values():
                        self._settle(held)
                    await asyncio.wait(set(self._settling))

    def _release(self, held: Held) -> asyncio.Future[None] | None:
        """Hand `held` back now (the task doing it), or keep it claimed until admission
        opens (None) while a checkpoint is open."""
        if self.admission_closed and not self._stopping:
            self._returning[held.episode_id] = held
            return None
        return self._settle(held)

    def _settle(self, held: Held) -> asyncio.Future[None]:
        """Hand `held` back in a task that runs to its end even if nobody awaits it (a
        failure is logged); readiness waits for it."""
        task = asyncio.ensure_future(self._return(held))
        self._settling[task] = held.episode_id
        task.add_done_callback(_settled)
        task.add_done_callback(self._settled_one)
        self.changed()
        return task

    def _settled_one(self, task: asyncio.Future[None]) -> None:
        del self._settling[task]
        self.changed()

    @property
    def _claimant(self) -> str:
        """Who claims a record this participant holds itself (one worker)."""
        return self.worker or "local"

    async def _done(self, episode_id: str) -> None:
        if self.remote is not None:
            await self.remote.done(episode_id)
        else:
            self.records.done(episode_id, self._claimant)

    def _hand_back(self, episode: Episode, held: Held) -> asyncio.Future[None] | None:
        """A claimed request ended early: hold its latest boundary state again, for the
        same attempt, now or, while admission is closed, once it opens. Decided before
        anything awaits, so an export that starts meanwhile finds the record in
        `_returning` if not among the parked episodes."""
        if episode.boundaries:
            held = replace(held, path=None, entry=None, state=episode.state)
        return self._release(held)

    async def _return(self, held: Held) -> None:
        """Hold `held` again here, or hand it back to the coordinator (its state written
        to a one-record file first if it is in memory, so no state crosses the channel).
        Held again here, a record whose claiming attempt was retired meanwhile is dropped."""
        if self.remote is None:
            self.records.hand_back(held, self._claimant)
            return
        if held.path is None and self.handback_dir is not None:
            name = f"{held.episode_id.encode().hex()[:64]}-{secrets.token_hex(4)}.msgpack"
            path = self.handback_dir / name
            record = {"kind": "episode", "episode_id": held.episode_id,
                      "attempt": held.attempt, "state": held.state}
            where, entry = await asyncio.to_thread(_write_one, path, record)
            held = replace(held, path=where, entry=entry, state=None)
            if self.admission_closed and not self._stopping:
                # A checkpoint opened while the file was written: the coordinator still
                # counts the record as this worker's, so this worker's export carries it.
                self._returning[held.episode_id] = held
                return
        await self.remote.hand_back(held)

    async def retire(self, episode_id: str, attempt: int, within_s: float = 30.0) -> dict[str, Any]:
        """Mark the attempt (and older) retired, stop its running work (its request answers
        409 `stale_attempt`), drop held records it could claim; answers once stopped.
        The marks go first, so no request of the attempt starts or claims meanwhile."""
        dropped = self.records.retire(episode_id, attempt)
        deadline = asyncio.get_running_loop().time() + within_s  # one budget for both waits
        if self._settling:  # hand-backs in flight (say, just after a resume) land first
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.wait(set(self._settling))
        running = [e for (eid, a), e in self.episodes.items() if eid == episode_id and a <= attempt]
        for episode in running:
            episode.retired = True
            if episode.task is not None and episode.task is not asyncio.current_task():
                episode.task.cancel()
        if running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    for episode in running:
                        await episode.finished.wait()
        stopped = sum(1 for e in running if e.finished.is_set())
        if stopped < len(running):
            raise TetherError("worker_unreported", {
                "worker": self.worker, "marks": "kept",
                "detail": f"{len(running) - stopped} of attempt {attempt}'s requests did not "
                          f"stop within {within_s:g} s",
            })
        dropped += self.records.retire(episode_id, attempt)  # landed while it waited
        return {"episode_id": episode_id, "attempt": attempt, "stopped": stopped,
                "dropped_held": dropped}

    def drop_held_outside(self, scope: frozenset[str]) -> None:
        """Forget the unclaimed held records a published commit's scope left out."""
        self.records.drop_outside(scope)

    def forget(self, episode_ids: Iterable[str]) -> list[str]:
        return self.records.forget(episode_ids)

    # Export and install (SPEC 5.1, 5.6, 5.10) ----------------------------------

    def is_fresh(self) -> bool:
        has_sessions = self.provider is not None and any(True for _ in self.provider.sessions())
        return not (has_sessions or self.episodes or self.records or self.restored)

    async def export(
        self,
        path: Path,
        scope: frozenset[str] | None,
        owner: str | None,
        is_open: Callable[[str], bool],
        carried: Iterable[Held] = (),
    ) -> Exported:
        """Write this worker's records to its segment. Each state is packed on the loop
        as the app hands it over (a snapshot no other thread reads while the app runs);
        every `WRITE_AHEAD` bytes packed are hashed and written in a thread while the
        packing goes on (the loop is given a turn every `EXPORT_BATCH` records). Parked
        episodes and unclaimed held records in `scope` go in (held ones relabelled to the
        attempt that would have claimed them).

        The writes go in big pieces, one at a time: the thread waits up to a switch
        interval (5 ms) to win the GIL back from the packing loop after each call, so
        with 1 MiB pieces it fell behind and overlapping measured slower than waiting.

        The packing runs in a task of its own, which a cancelled caller cancels and
        waits for: msgpack's `pack` walks the exception state of every coroutine awaiting
        it, on each call, and under a control request's 15 it took a quarter longer."""
        return await asyncio.create_task(self._export(path, scope, owner, is_open, carried))

    async def _export(
        self,
        path: Path,
        scope: frozenset[str] | None,
        owner: str | None,
        is_open: Callable[[str], bool],
        carried: Iterable[Held],
    ) -> Exported:
        writer = SegmentWriter(path)
        writing: asyncio.Future[None] | None = None

        async def write_full() -> None:
            """Start a write once `WRITE_AHEAD` bytes wait and none runs; wait for the
            running one only when twice that piled up behind it. Called every
            `EXPORT_BATCH` records, and at once when twice `WRITE_AHEAD` wait."""
            nonlocal writing
            if writing is not None and (writing.done() or writer.full_bytes >= 2 * WRITE_AHEAD):
                await writing  # raises what the write raised
                writing = None
            if writing is None and writer.full_bytes >= WRITE_AHEAD:
                writing = asyncio.ensure_future(asyncio.to_thread(writer.write, writer.take()))
            await asyncio.sleep(0)

        try:
            with gcpause.paused():  # admission is closed: no collections over the states
                # What goes in is chosen before anything awaits: an episode that leaves
                # meanwhile is in `parked` or, handed back, in `_returning`, never both.
                provider = self.provider
                sessions = list(provider.sessions()) if provider is not None else []
                parked = self._parked(scope)
                held = self.records.carry(scope)
                held += [h for h in [*self._returning.values(), *carried]
                         if scope is None or h.episode_id in scope]
                done = 0
                while done < len(sessions):
                    assert provider is not None
                    batch = sessions[done : done + EXPORT_BATCH]
                    done += writer.add_sessions(
                        batch, provider.export, is_open, owner, until_full=2 * WRITE_AHEAD
                    )
                    await write_full()
                for count, episode in enumerate(parked, 1):
                    writer.add_episode(episode.episode_id, episode.attempt, episode.state)
                    if count % EXPORT_BATCH == 0 or writer.full_bytes >= 2 * WRITE_AHEAD:
                        await write_full()
                for start in range(0, len(held), HELD_BATCH):  # their states are on disk
                    group = held[start : start + HELD_BATCH]
                    states = await asyncio.to_thread(_load_all, group)
                    for record, state in zip(group, states, strict=True):
                        writer.add_episode(record.episode_id, record.attempt + 1, state)
                    await write_full()
                if writing is not None:
                    await writing
                info = await asyncio.to_thread(writer.close)  # writes what is left
        except BaseException as error:
            failed = None
            if writing is not None:  # its thread would run on if cancelled: let it end
                await asyncio.wait([writing])
                failed = None if writing.cancelled() else writing.exception()
            await asyncio.to_thread(writer.discard)
            if failed is not None and not isinstance(error, asyncio.CancelledError):
                raise failed from None  # the cause: packing then found the file closed
            raise
        written = writer.sessions
        return {**info, "sessions": written, "episodes": info["records"] - written}

    def _parked(self, scope: frozenset[str] | None) -> list[Episode]:
        return [e for e in self.episodes.values()
                if e.parked and (scope is None or e.episode_id in scope)]

    def set_retired(self, marks: dict[str, int]) -> None:
        """Inherit the retire marks of the server (a worker that joins late)."""
        self.records.inherit(marks)

    async def install(self, path: Path, entries: list[IndexEntry]) -> dict[str, bool]:
        """Install this worker's sessions from one segment; returns each one's ID and
        whether the router counted it open when it was checkpointed."""
        assert self.provider is not None, "no session state registered"
        records = await asyncio.to_thread(_read_paused, path, entries)
        for record in records:  # the app's code: collection is not paused around it
            await self.provider.install(record["id"], record["state"])
        self.restored = True
        return {record["id"]: record["open"] for record in records}

    def hold(self, episode_id: str, attempt: int, path: Path, entry: IndexEntry) -> None:
        """Hold a restored episode record by its location until attempt+1 claims it."""
        self.records.hold(Held(episode_id, attempt, path, entry))
        self.restored = True

    async def release_all(self) -> None:
        """Drop every installed session and held record (abort_restore)."""
        if self.provider is not None:
            for session_id in list(self.provider.sessions()):
                await self.provider.release(session_id)
        self.records.clear()
        self.restored = False


def _settled(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("hand_back_failed", error=repr(task.exception()))


def _read_paused(path: Path, entries: list[IndexEntry]) -> list[dict[str, Any]]:
    """The records of `entries`, read with collection paused (a burst of new states)."""
    with gcpause.paused():
        return list(read_records(path, entries))


def _load_all(held: list[Held]) -> list[Any]:
    return [record.load(read_records) for record in held]


def _write_one(path: Path, record: dict[str, Any]) -> tuple[Path, IndexEntry]:
    """Write one record as a segment of its own; return where it is."""
    with SegmentWriter(path) as writer:
        writer.add(record)
        writer.close()
    [entry] = read_index(path)
    return path, entry


def _blocker(kind: str, worker: str | None, ident: str, detail: str) -> dict[str, Any]:
    return {"kind": kind, "worker": worker, "id": ident, "detail": detail}


_DECLARED = "tether_participant"


def declare_participant(app: Any, participant: Participant) -> None:
    """Declare the app's participant in code; `tether serve` and the in-process control
    API then use it."""
    setattr(app.state, _DECLARED, participant)


def declared_participant(app: Any) -> Participant | None:
    state = getattr(app, "state", None)
    participant = getattr(state, _DECLARED, None) if state is not None else None
    return participant if isinstance(participant, Participant) else None
