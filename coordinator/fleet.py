"""N workers behind the checkpointer's `Fleet` interface, over the coordinator channel.

Records never travel through here: workers write their own segments and read their
own placed records; this process reads only segment indexes (placement, duplicates)
and keeps held episode records by location (SPEC 5.7, 5.8, 5.11).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import structlog

from tether.checkpoint.held import Held, HeldRecords, least_loaded
from tether.checkpoint.participant import Blockers
from tether.checkpoint.segments import IndexEntry, read_index
from tether.checkpoint.store import Checkpoint, ManifestSegment, PendingCommit, RecordCounts
from tether.coordinator.channel import ChannelLost
from tether.coordinator.placement import place
from tether.routing.errors import TetherError
from tether.routing.types import SessionId, WorkerId

if TYPE_CHECKING:
    from tether.coordinator.coordinator import Coordinator

log = structlog.get_logger("tether.fleet")

CALL_TIMEOUT_S = 5.0
WORK_TIMEOUT_S = 3600.0
WORKERS_MARGIN_S = 0.05
"""Left of a restore's deadline after waiting for workers, to answer workers_missing."""


class ChannelFleet:
    """The workers of one `tether serve`, as the checkpointer sees them."""

    def __init__(self, coordinator: Coordinator, runtime_dir: str) -> None:
        self.coordinator = coordinator
        self.runtime_dir = runtime_dir
        self.expected_workers = coordinator.expected_workers
        self.state_version: str | None = None
        self.closed = False
        self.lost: set[WorkerId] = set()
        self.records = HeldRecords()
        """The held episode records, by location, and the retire marks (SPEC 5.8, 5.9)."""
        self.aliases: dict[WorkerId, WorkerId] = {}
        self.placed_count = 0
        self.tables_file: dict[str, str] | None = None
        self.restored = False
        self.reports: dict[WorkerId, tuple[int, Blockers]] = {}
        """Each worker's newest readiness report (its number, its blockers), while
        admission is closed."""
        self._callbacks: list[Callable[[], None]] = []
        self.claim_results: Counter[str] = Counter()
        """Workers' claims of held records by result (`tether_episode_claims_total`)."""

    @property
    def held(self) -> Mapping[str, Held]:
        """The held records by episode ID (read only; changed through `records`)."""
        return self.records.records

    @property
    def retired(self) -> Mapping[str, int]:
        return self.records.retired

    # Events from the coordinator ----------------------------------------------------

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def changed(self) -> None:
        for callback in self._callbacks:
            callback()

    def worker_left(self, worker: WorkerId) -> None:
        """A worker exited: it blocks an open checkpoint; its claimed records are lost."""
        if self.closed:
            self.lost.add(worker)
        self.reports.pop(worker, None)
        self.records.worker_left(worker)
        self.changed()

    def welcome(self) -> dict[str, Any]:
        """What a registering worker must apply before it serves."""
        return {
            "admission_closed": self.closed,
            "tables": self.tables_file,
            "retired": dict(self.records.retired),
        }

    # Fleet interface --------------------------------------------------------------

    async def close_admission(self) -> None:
        self.closed = True
        for worker, answer in await self._gather("close_admission"):
            if isinstance(answer, dict):
                self.report(worker, answer)  # each worker's first report comes back
            elif not isinstance(answer, ChannelLost):
                log.warning("worker_call_failed", call="close_admission", worker_id=worker,
                            error=repr(answer))

    async def open_admission(self) -> None:
        self.closed = False
        self.lost.clear()
        self.reports.clear()
        await self._all("open_admission")

    def report(self, worker: WorkerId, body: dict[str, Any]) -> None:
        """A worker's readiness report: kept if newer than the one held."""
        seq = body.get("seq")
        if not isinstance(seq, int) or seq <= self.reports.get(worker, (0, None))[0]:
            return
        self.reports[worker] = (seq, Blockers(body["listed"], body["total"]))
        self.changed()

    async def blockers(self, fresh: bool = False) -> Blockers:
        """From each worker's newest report, or, `fresh` (a commit's re-check), asked of
        every worker now; a worker with no report is asked too."""
        found: list[dict[str, Any]] = []
        missing = self.expected_workers - len(self.coordinator.links)
        for _ in range(max(missing, 0)):
            found.append(_blocker("worker_missing", None, None, "fewer workers than configured"))
        for worker in sorted(self.lost):
            found.append(_blocker("worker_lost", worker, None, "exited during the checkpoint"))
        parts = [Blockers(found, len(found))]
        reported = {} if fresh else {w: r for w, (_, r) in self.reports.items()
                                     if w in self.coordinator.links}
        asking = [w for w in self.coordinator.links if w not in reported]
        asked = await self._gather_each("blockers", dict.fromkeys(asking)) if asking else []
        for worker, answer in sorted([*reported.items(), *asked]):
            if isinstance(answer, Blockers):
                parts.append(answer)
            elif isinstance(answer, dict):
                parts.append(Blockers(answer["listed"], answer["total"]))
            else:
                failed = _blocker("worker_unreported", worker, None, repr(answer))
                parts.append(Blockers([failed], 1))
        return Blockers.merge(parts)

    async def fresh(self) -> bool:
        if self.restored or self.records:
            return False
        if any(os.scandir(Path(self.runtime_dir) / "claims")):
            return False
        answers = await self._gather("fresh")
        return all(answer is True for _, answer in answers)

    async def export(
        self, pending: PendingCommit, scope: frozenset[str] | None
    ) -> tuple[list[str], list[ManifestSegment], RecordCounts]:
        links = sorted(self.coordinator.links)
        if not links:
            raise TetherError("commit_failed", "no worker is registered")
        carried = [h.body() for h in self.records.carry(scope)]
        carrier = await self._least_loaded(links) if carried else None
        calls = []
        for worker in links:
            body = {
                "path": str(pending.segment_path(worker)),
                "scope": None if scope is None else sorted(scope),
                "carried": carried if worker == carrier else [],
            }
            calls.append(self._call(worker, "export", body, WORK_TIMEOUT_S))
        try:
            answers = await asyncio.gather(*calls, return_exceptions=True)
        except asyncio.CancelledError:  # the commit's deadline
            await self._abort_exports()
            raise
        segments: list[ManifestSegment] = []
        for worker, answer in zip(links, answers, strict=True):
            if isinstance(answer, BaseException):
                await self._abort_exports()  # a worker that timed out may still write
                raise TetherError("commit_failed", f"worker {worker}: {answer!r}")
            segments.append({"file": answer["file"], "bytes": answer["bytes"],
                             "records": answer["records"], "digest": answer["digest"],
                             "worker": worker})
        counts, duplicates = await asyncio.to_thread(_tally, Path(pending.temp_dir), segments)
        if duplicates:
            raise TetherError("not_ready", {
                "blockers": [_blocker("session_duplicate", None, sid, "exported twice")
                             for sid in duplicates[:100]],
                "blockers_total": len(duplicates),
            })
        return list(links), segments, counts

    async def _least_loaded(self, links: list[WorkerId]) -> WorkerId:
        """The worker holding the fewest sessions and episodes (ties: lowest ID), which
        writes the held records no request continued (SPEC 5.8)."""
        loads = {worker: float("inf") for worker in links}
        for worker, answer in await self._gather("stats"):
            if isinstance(answer, dict) and worker in loads:
                loads[worker] = answer.get("sessions", 0) + answer.get("episodes", 0)
        return least_loaded(loads)

    def drop_held_outside(self, scope: frozenset[str]) -> None:
        self.records.drop_outside(scope)

    async def _abort_exports(self) -> None:
        """Stop every worker's export of an abandoned commit, and wait until each has
        stopped: the commit's temp dir goes next, and a lease may fire after it."""
        for worker, answer in await self._gather("abort_export"):
            if isinstance(answer, BaseException) and not isinstance(answer, ChannelLost):
                log.warning("export_abort_failed", worker_id=worker, error=repr(answer))

    def owner_aliases(self) -> dict[str, str]:
        return {str(old): str(new) for old, new in self.aliases.items()}

    async def restore(
        self, checkpoint: Checkpoint, scope: frozenset[str] | None, dry_run: bool, within_s: float
    ) -> dict[str, Any]:
        wait = max(within_s - WORKERS_MARGIN_S, 0.0)
        if not await self.coordinator.wait_for_workers(self.expected_workers, wait):
            raise TetherError("workers_missing", f"{len(self.coordinator.links)} of "
                              f"{self.expected_workers} workers registered")
        version = checkpoint.manifest.get("state_version")
        if version != self.state_version:
            raise TetherError("incompatible_state",
                              f"checkpoint {version!r}, app {self.state_version!r}")
        sessions = [(SessionId(e.id), _owner(e.owner), e.offset) for s in checkpoint.segments
                    for e in s.entries if e.kind == "session"]
        episodes = [(s.path, e) for s in checkpoint.segments for e in s.entries
                    if e.kind == "episode" and (scope is None or e.id in scope)]
        known = [WorkerId(w) for w in checkpoint.manifest.get("workers", [])]
        inherited = {WorkerId(k): WorkerId(v)
                     for k, v in checkpoint.manifest.get("owner_aliases", {}).items()}
        placement = await asyncio.to_thread(  # ~50 ms per 100,000 sessions
            place, sessions, sorted(self.coordinator.links), known, inherited
        )
        answer = {
            "installed_sessions": len(sessions),
            "held_episodes": [{"episode_id": e.id, "attempt_to_send": (e.attempt or 0) + 1}
                              for _, e in episodes],
            "placed_sessions": len(placement.sessions),
            "owner_aliases": len(placement.aliases),
        }
        if dry_run:
            return answer
        tables = await asyncio.to_thread(self._write_tables, placement.sessions, placement.aliases)
        reads = await asyncio.to_thread(_reads, checkpoint, placement.sessions)
        # From here a worker that registers is welcomed with these tables (SPEC 5.7): it
        # routes old cookies from its first request even while the others install. (Set
        # only where the `try` below takes them back if the restore fails.)
        self.tables_file, self.aliases = tables, dict(placement.aliases)
        # Every placed worker is called, registered or not: one that left since the
        # placement fails the call (ChannelLost) and the restore with it, all or nothing.
        bodies = {w: {"tables": tables, "segments": reads.get(w, [])}
                  for w in {*self.coordinator.links, *reads}}
        try:
            results = await self._gather_each("install", bodies, WORK_TIMEOUT_S)
        except BaseException:  # the restore's deadline: nothing may stay half installed
            self.tables_file, self.aliases = None, {}
            await self._gather("release_installed")
            raise
        failed = [(w, a) for w, a in results if isinstance(a, BaseException)]
        if failed:
            self.tables_file, self.aliases = None, {}
            await self._gather("release_installed")
            worker, error = failed[0]
            if isinstance(error, TetherError):
                raise error
            if isinstance(error, ChannelLost | TimeoutError):
                # The checkpoint is intact; the server is fresh again: retry the restore.
                raise TetherError("worker_lost", f"worker {worker} was lost while installing")
            raise TetherError("corrupt_checkpoint", f"worker {worker} failed to install: {error!r}")
        cluster = self.coordinator.cluster
        if cluster is not None:
            # The checkpointed workers are gone: dead, their leftover claims swept.
            cluster.workers_gone(placement.aliases)
            await self.coordinator.broadcast_live()
        for path, entry in episodes:
            self.records.hold(Held(entry.id, entry.attempt or 0, path, entry))
        self.placed_count = len(placement.sessions)
        self.restored = True
        return answer

    async def release_installed(self) -> None:
        await self._gather("release_installed")
        self.records.clear()
        self.tables_file, self.aliases, self.placed_count = None, {}, 0
        self.restored = False

    async def retire(
        self, episode_id: str, attempt: int, within_s: float
    ) -> list[dict[str, Any]]:
        dropped = self.records.retire(episode_id, attempt)
        # Each worker stops the attempt's work within the deadline and answers at it; the
        # margin is for that answer to arrive.
        body = {"episode_id": episode_id, "attempt": attempt, "within_s": within_s}
        answers = await self._gather("retire", body, within_s + CALL_TIMEOUT_S)
        unreported = [w for w, a in answers if not isinstance(a, dict)]
        if unreported:
            raise TetherError("worker_unreported", {"workers": unreported, "marks": "kept"})
        stopped = sum(a["stopped"] for _, a in answers)
        return [{"episode_id": episode_id, "attempt": attempt, "stopped": stopped,
                 "dropped_held": dropped + sum(a["dropped_held"] for _, a in answers)}]

    async def forget(self, episode_ids: list[str]) -> list[str]:
        forgotten = self.records.forget(episode_ids)
        await self._gather("forget", {"episode_ids": episode_ids})
        return forgotten

    async def workers(self) -> list[dict[str, Any]]:
        rows = []
        for worker, answer in await self._gather("stats"):
            link = self.coordinator.links.get(worker)
            rows.append(answer if isinstance(answer, dict) else
                        {"id": worker, "pid": link.pid if link else None})
        return sorted(rows, key=lambda row: str(row["id"]))

    def held_episodes(self) -> list[dict[str, Any]]:
        return self.records.held_episodes()

    def lost_episodes(self) -> list[dict[str, Any]]:
        return self.records.lost_episodes()

    def tables(self) -> dict[str, int]:
        return {"placed_sessions": self.placed_count, "owner_aliases": len(self.aliases)}

    # Episode records for workers (SPEC 5.8) -------------------------------------------

    def claim(self, worker: WorkerId, episode_id: str, attempt: int) -> dict[str, Any] | None:
        """A worker's request claims the record attempt-1 left; the answer reaches it
        before any later message to it (one ordered channel)."""
        if self.closed:
            self.claim_results["parked"] += 1
            raise TetherError("checkpoint_parked", "a checkpoint is open; retry shortly")
        try:
            held = self.records.claim(episode_id, attempt, worker)
        except TetherError as error:
            self.claim_results[error.code] += 1
            raise
        self.claim_results["none_held" if held is None else "claimed"] += 1
        return None if held is None else held.body()

    def done(self, episode_id: str, worker: WorkerId | None = None) -> None:
        """Kept claimed: an older or repeated attempt is refused."""
        self.records.done(episode_id, worker)

    def hand_back(self, body: dict[str, Any], worker: WorkerId | None = None) -> None:
        """Held again for the same attempt, by location; dropped if its claiming attempt
        was retired meanwhile (5.9). From `worker`, it must be that worker's claim."""
        path, entry = Path(body["path"]), IndexEntry(*body["entry"])
        self.records.hand_back(Held(body["episode_id"], body["attempt"], path, entry), worker)

    # Plumbing ---------------------------------------------------------------------

    def _write_tables(
        self, placed: dict[SessionId, WorkerId], aliases: dict[WorkerId, WorkerId]
    ) -> dict[str, str]:
        data = msgpack.packb({"placed": placed, "aliases": aliases}, use_bin_type=True)
        path = Path(self.runtime_dir) / f"tables-{secrets.token_hex(4)}.msgpack"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        return {"path": str(path), "digest": hashlib.sha256(data).hexdigest()}

    async def _call(self, worker: WorkerId, kind: str, body: Any, within_s: float) -> Any:
        link = self.coordinator.links.get(worker)
        if link is None:
            raise ChannelLost(f"worker {worker} is gone")
        return await link.channel.request(kind, body, timeout=within_s)

    async def _gather(
        self, kind: str, body: Any = None, within_s: float = CALL_TIMEOUT_S
    ) -> list[tuple[WorkerId, Any]]:
        """Call every registered worker with the same body; (worker, answer or error)."""
        return await self._gather_each(kind, dict.fromkeys(self.coordinator.links, body),
                                       within_s)

    async def _gather_each(
        self, kind: str, bodies: dict[WorkerId, Any], within_s: float = CALL_TIMEOUT_S
    ) -> list[tuple[WorkerId, Any]]:
        """Call each worker in `bodies` with its own body; (worker, answer or error)."""
        workers = sorted(bodies)
        answers = await asyncio.gather(
            *(self._call(w, kind, bodies[w], within_s) for w in workers), return_exceptions=True
        )
        return list(zip(workers, answers, strict=True))

    async def _all(self, kind: str) -> None:
        for worker, answer in await self._gather(kind):
            if isinstance(answer, BaseException) and not isinstance(answer, ChannelLost):
                log.warning("worker_call_failed", call=kind, worker_id=worker, error=repr(answer))


def _reads(
    checkpoint: Checkpoint, placed: Mapping[SessionId, WorkerId]
) -> dict[WorkerId, list[str]]:
    """The segments each worker must read to install what it was placed: those holding
    some of its sessions (placement keeps them few), none for a worker placed nothing."""
    reads: dict[WorkerId, list[str]] = {}
    for segment in checkpoint.segments:
        workers = {placed[SessionId(e.id)] for e in segment.entries if e.kind == "session"}
        for worker in sorted(workers):
            reads.setdefault(worker, []).append(str(segment.path))
    return reads


def _owner(owner: str | None) -> WorkerId | None:
    return WorkerId(owner) if owner is not None else None


def _tally(directory: Path, segments: list[ManifestSegment]) -> tuple[RecordCounts, list[str]]:
    """The records the workers' segments hold by kind, read from their indexes (so the
    manifest's counts are the coordinator's own), and every session ID held twice; an
    episode exported twice is `commit_failed`."""
    counts: RecordCounts = {"sessions": 0, "episodes": 0}
    seen: set[str] = set()
    twice: list[str] = []
    episodes: dict[str, str] = {}
    for segment in segments:
        entries = read_index(directory / segment["file"])
        if len(entries) != segment["records"]:
            raise TetherError("commit_failed", f"worker {segment['worker']} reported "
                              f"{segment['records']} records, its segment holds {len(entries)}")
        for entry in entries:
            if entry.kind == "session":
                counts["sessions"] += 1
                if entry.id in seen:
                    twice.append(entry.id)
                seen.add(entry.id)
            else:
                counts["episodes"] += 1
                if entry.id in episodes:  # tether's own bug, not the app's: fail the commit
                    raise TetherError("commit_failed", f"episode {entry.id!r} was exported "
                                      f"twice, by {episodes[entry.id]} and {segment['worker']}")
                episodes[entry.id] = segment["worker"]
    return counts, twice


def _blocker(kind: str, worker: str | None, ident: str | None, detail: str) -> dict[str, Any]:
    return {"kind": kind, "worker": worker, "id": ident, "detail": detail}
