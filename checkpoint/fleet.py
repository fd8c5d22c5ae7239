"""The workers a checkpointer drives, behind one interface.

`LocalFleet` is one in-process participant (plain uvicorn, or a server with one worker);
the coordinator supplies a fleet of N workers over its channel with the same interface,
so the checkpointer itself never changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from tether.checkpoint.participant import Blockers, Participant
from tether.checkpoint.store import Checkpoint, ManifestSegment, PendingCommit, RecordCounts
from tether.checkpoint.tracing import worker_call
from tether.routing.errors import TetherError


class Fleet(Protocol):
    """The worker side of one server, as the checkpointer needs it."""

    expected_workers: int
    state_version: str | None

    def on_change(self, callback: Callable[[], None]) -> None: ...

    async def close_admission(self) -> None: ...

    async def open_admission(self) -> None: ...

    async def blockers(self, fresh: bool = False) -> Blockers:
        """Every worker's blockers, merged (the first few listed); a total of 0 when the
        server is ready. `fresh`: asked now, not from the newest reports."""
        ...

    async def fresh(self) -> bool: ...

    async def export(
        self, pending: PendingCommit, scope: frozenset[str] | None
    ) -> tuple[list[str], list[ManifestSegment], RecordCounts]:
        """Every worker writes its own segment; returns the worker IDs, the segments and
        the records counted by kind."""
        ...

    async def restore(
        self, checkpoint: Checkpoint, scope: frozenset[str] | None, dry_run: bool, within_s: float
    ) -> dict[str, Any]:
        """Install every worker's records, all or nothing, within `within_s` seconds
        (`workers_missing` if the configured workers did not register by then)."""
        ...

    async def release_installed(self) -> None: ...

    async def retire(
        self, episode_id: str, attempt: int, within_s: float
    ) -> list[dict[str, Any]]:
        """Retire the attempt everywhere within `within_s` seconds (`worker_unreported`
        for a worker that does not confirm in time, marks kept)."""
        ...

    def drop_held_outside(self, scope: frozenset[str]) -> None:
        """A commit with this scope was published: held records it left out are forgotten
        (SPEC 5.8)."""
        ...

    async def forget(self, episode_ids: list[str]) -> list[str]: ...

    async def workers(self) -> list[dict[str, Any]]:
        """Each worker's line in status."""
        ...

    def held_episodes(self) -> list[dict[str, Any]]: ...

    def lost_episodes(self) -> list[dict[str, Any]]: ...

    def tables(self) -> dict[str, int]:
        """Sizes of the placed-session and owner-alias tables."""
        ...

    def owner_aliases(self) -> dict[str, str]:
        """Every old worker ID this server answers for (written into the manifest)."""
        ...


class LocalFleet:
    """One participant in this process. `worker` is the record owner (None without
    routing); `is_open` says whether the router counts a session as open."""

    expected_workers = 1

    def __init__(
        self,
        participant: Participant,
        worker: str | None = None,
        is_open: Callable[[str], bool] = lambda session_id: True,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.participant = participant
        self.state_version = participant.state_version
        self.worker = worker
        self.is_open = is_open
        self._stats = stats

    def on_change(self, callback: Callable[[], None]) -> None:
        self.participant.on_change(callback)

    async def close_admission(self) -> None:
        self.participant.close_admission()

    async def open_admission(self) -> None:
        self.participant.open_admission()

    async def blockers(self, fresh: bool = False) -> Blockers:
        return self.participant.blockers()

    async def fresh(self) -> bool:
        return self.participant.is_fresh()

    async def export(
        self, pending: PendingCommit, scope: frozenset[str] | None
    ) -> tuple[list[str], list[ManifestSegment], RecordCounts]:
        name = self.participant.worker or _local_worker_name()
        info = await worker_call("export", name, self.participant.export(
            pending.segment_path(name), scope, self.worker, self.is_open
        ))
        segment: ManifestSegment = {"file": info["file"], "bytes": info["bytes"],
                                    "records": info["records"], "digest": info["digest"],
                                    "worker": name}
        return [name], [segment], {"sessions": info["sessions"], "episodes": info["episodes"]}

    async def restore(
        self, checkpoint: Checkpoint, scope: frozenset[str] | None, dry_run: bool, within_s: float
    ) -> dict[str, Any]:
        version = checkpoint.manifest.get("state_version")
        if version != self.participant.state_version:
            raise TetherError(
                "incompatible_state",
                f"the checkpoint holds state version {version!r}, "
                f"this app {self.participant.state_version!r}",
            )
        sessions = [e for s in checkpoint.segments for e in s.entries if e.kind == "session"]
        if sessions and self.participant.provider is None:
            raise TetherError("incompatible_state", "the app registers no session state")
        episodes = [
            (segment, entry)
            for segment in checkpoint.segments
            for entry in segment.entries
            if entry.kind == "episode" and (scope is None or entry.id in scope)
        ]
        answer = {
            "installed_sessions": len(sessions),
            "held_episodes": [
                {"episode_id": e.id, "attempt_to_send": (e.attempt or 0) + 1}
                for _, e in episodes
            ],
            "placed_sessions": 0,
            "owner_aliases": 0,
        }
        if dry_run:
            return answer

        async def install() -> int:
            installed = 0
            for segment in checkpoint.segments:
                mine = [e for e in segment.entries if e.kind == "session"]
                if mine:
                    installed += len(await self.participant.install(segment.path, mine))
            return installed

        try:
            await worker_call("install", self.participant.worker or _local_worker_name(),
                              install())
            for segment, entry in episodes:
                self.participant.hold(entry.id, entry.attempt or 0, segment.path, entry)
        except BaseException:
            await self.participant.release_all()
            raise
        self.participant.restored = True
        return answer

    async def release_installed(self) -> None:
        await self.participant.release_all()

    async def retire(
        self, episode_id: str, attempt: int, within_s: float
    ) -> list[dict[str, Any]]:
        return [await self.participant.retire(episode_id, attempt, within_s)]

    def drop_held_outside(self, scope: frozenset[str]) -> None:
        self.participant.drop_held_outside(scope)

    async def forget(self, episode_ids: list[str]) -> list[str]:
        return self.participant.forget(episode_ids)

    async def workers(self) -> list[dict[str, Any]]:
        base = self._stats() if self._stats is not None else {
            "id": self.participant.worker, "pid": os.getpid(), "claims": 0, "forwarded": 0,
            "served_forwarded": 0,
        }
        provider = self.participant.provider
        return [{
            **base,
            "sessions": sum(1 for _ in provider.sessions()) if provider else 0,
            "episodes": len(self.participant.episodes),
        }]

    def held_episodes(self) -> list[dict[str, Any]]:
        return self.participant.records.held_episodes()

    def lost_episodes(self) -> list[dict[str, Any]]:
        return []

    def tables(self) -> dict[str, int]:
        return {"placed_sessions": 0, "owner_aliases": 0}

    def owner_aliases(self) -> dict[str, str]:
        return {}


def _local_worker_name() -> str:
    return "0" * 32
