"""Held episode records (SPEC 5.8, 5.9): the whole life of each one, as one pure object.

A record parked under attempt *a* is held until attempt *a+1* claims it. One
`HeldRecords` keeps a server's records and its retire marks: the participant's when the
server is one process, the coordinator's fleet's when it has several workers. Each
record moves only through these calls::

    hold ─▶ held ─claim(a+1)─▶ claimed ─done─▶ done (still claimed: a repeat is refused)
             ▲                    │
             └─────hand_back──────┤  (dropped instead if a retire covers a+1)
                                  └─worker_left─▶ lost (listed in `lost_episodes`
                                                   until a retire covers its attempt)

    held ─carry(scope)─▶ written as a+1 by one live worker at a commit; still held
    held, done ─retire(a+1 or later)─▶ forgotten (a claimed one when it is handed back)
    held ─drop_outside(scope)─▶ forgotten; every record ─clear─▶ forgotten

Refusals are `TetherError`s with SPEC's codes: a retired attempt or one ≤ *a* is
`stale_attempt`, one > *a+1* is `attempt_mismatch` (`detail.expected`), and a record
someone claimed already is `episode_claimed` (`detail.worker`). A refused call changes
nothing.

Nothing here does I/O or awaits. A record is known by where it lies (segment path and
index entry) or, handed back in one process, by its state in memory; `Held.load` reads
it with the reader it is given, on whatever thread the caller chooses. Which records a
worker exports itself (its parked episodes, its claimed records whose requests ended
while admission was closed) is the participant's business: this object answers which
unclaimed ones someone must *carry*, and `least_loaded` says who.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from tether.routing.errors import TetherError

if TYPE_CHECKING:
    from tether.checkpoint.segments import IndexEntry

RecordReader: TypeAlias = Callable[[Path, list["IndexEntry"]], Iterable[Mapping[str, Any]]]
"""Reads the records at some index entries of a segment (`segments.read_records`)."""

W = TypeVar("W", bound=str)


@dataclass(frozen=True)
class Held:
    """One held episode record: parked under `attempt`, claimable by `attempt + 1`.

    Frozen: only `HeldRecords` changes what a server holds, by storing a new value."""

    episode_id: str
    attempt: int
    path: Path | None = None
    entry: IndexEntry | None = None
    state: Any = None
    """The state, when it is in memory (handed back in one process) rather than on disk."""
    claimed_by: str | None = None
    done: bool = False
    """Continued to the end: kept claimed so an older or repeated attempt is refused."""

    def load(self, read: RecordReader) -> Any:
        """The record's state: read with `read` from its segment, unless in memory."""
        if self.path is None or self.entry is None:
            return self.state
        [record] = list(read(self.path, [self.entry]))
        return record["state"]

    def body(self) -> dict[str, Any]:
        """The record as it crosses the channel: by location, never its state."""
        assert self.path is not None, "held in memory"
        assert self.entry is not None, "held in memory"
        return {"episode_id": self.episode_id, "attempt": self.attempt,
                "path": str(self.path), "entry": list(self.entry)}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Held:
        """The record `body()` sent."""
        from tether.checkpoint.segments import IndexEntry

        return cls(body["episode_id"], body["attempt"], Path(body["path"]),
                   IndexEntry(*body["entry"]))


def check_claim(held: Held, episode_id: str, attempt: int) -> None:
    """The attempt rules of SPEC 5.8 for claiming a held record (raises if refused)."""
    if attempt <= held.attempt:
        raise TetherError(
            "stale_attempt", f"the held record of {episode_id!r} is attempt {held.attempt}"
        )
    if attempt > held.attempt + 1:
        raise TetherError(
            "attempt_mismatch",
            {"expected": held.attempt + 1, "message": f"{episode_id!r} continues once"},
        )
    if held.claimed_by is not None:
        raise TetherError("episode_claimed", {"worker": held.claimed_by})


def least_loaded(loads: Mapping[W, float]) -> W:
    """The worker that carries a commit's unclaimed records: the one holding the fewest
    sessions and episodes, ties to the lowest ID (SPEC 5.8)."""
    return min(loads, key=lambda worker: (loads[worker], worker))


class HeldRecords:
    """A server's held episode records and retire marks (SPEC 5.8, 5.9)."""

    def __init__(self) -> None:
        self._records: dict[str, Held] = {}
        self._retired: dict[str, int] = {}
        self._lost: list[dict[str, Any]] = []

    # Reads ---------------------------------------------------------------------

    @property
    def records(self) -> Mapping[str, Held]:
        """Every record, held, claimed or done, by episode ID (read only)."""
        return MappingProxyType(self._records)

    @property
    def retired(self) -> Mapping[str, int]:
        """The retire marks: episode ID → the newest attempt retired (read only)."""
        return MappingProxyType(self._retired)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, episode_id: str) -> Held | None:
        return self._records.get(episode_id)

    def held_episodes(self) -> list[dict[str, Any]]:
        """Status's `held_episodes`: each unclaimed record and the attempt to send."""
        return [{"episode_id": h.episode_id, "attempt_to_send": h.attempt + 1}
                for h in self._records.values() if h.claimed_by is None]

    def lost_episodes(self) -> list[dict[str, Any]]:
        """Status's `lost_episodes`: records whose claiming worker died."""
        return list(self._lost)

    def carry(self, scope: frozenset[str] | None) -> list[Held]:
        """The unclaimed records a commit with `scope` keeps: one live worker writes them,
        relabelled to the attempt that would have claimed them. A claimed record is its
        worker's to write (parked, or ended while admission was closed), never these."""
        return [h for h in self._records.values()
                if h.claimed_by is None and (scope is None or h.episode_id in scope)]

    # Attempt rules -------------------------------------------------------------

    def check_attempt(self, episode_id: str, attempt: int) -> None:
        """409 `stale_attempt` for a retired attempt or an older one (SPEC 5.9)."""
        retired = self._retired.get(episode_id)
        if retired is not None and attempt <= retired:
            raise TetherError(
                "stale_attempt", f"attempt {attempt} of {episode_id!r} is retired (<= {retired})"
            )

    def _retires(self, held: Held) -> bool:
        """Whether a retire mark covers the attempt that would claim `held`."""
        return self._retired.get(held.episode_id, -1) >= held.attempt + 1

    # Changes -------------------------------------------------------------------

    def hold(self, held: Held) -> None:
        """Hold a restored record (unclaimed) until its attempt+1 claims it."""
        self._records[held.episode_id] = replace(held, claimed_by=None, done=False)

    def claim(self, episode_id: str, attempt: int, worker: str) -> Held | None:
        """`worker`'s request of `attempt` claims the record attempt-1 left: the claimed
        record, None if none is held (the episode starts anew), or the refusal."""
        self.check_attempt(episode_id, attempt)
        held = self._records.get(episode_id)
        if held is None:
            return None
        check_claim(held, episode_id, attempt)
        claimed = self._records[episode_id] = replace(held, claimed_by=worker)
        return claimed

    def done(self, episode_id: str, worker: str | None = None) -> None:
        """The claimed record was continued to the end: kept claimed and marked done, so
        an older or repeated attempt is refused. `worker`, if given, must hold the claim."""
        held = self._records.get(episode_id)
        if held is not None and held.claimed_by is not None and worker in (None, held.claimed_by):
            self._records[episode_id] = replace(held, done=True)

    def hand_back(self, held: Held, worker: str | None = None) -> bool:
        """The claiming request ended early: hold `held` (its latest boundary state, by
        location or in memory) again for the same attempt. False if it was dropped
        instead, because a retire covers the attempt that would claim it. `worker`, if
        given, must be the claimant: a record claimed by another is `episode_claimed`."""
        current = self._records.get(held.episode_id)
        claimant = None if current is None else current.claimed_by
        if worker is not None and claimant not in (None, worker):
            raise TetherError("episode_claimed", {"worker": claimant})
        if self._retires(held):
            self._records.pop(held.episode_id, None)
            return False
        self._records[held.episode_id] = replace(held, claimed_by=None, done=False)
        return True

    def drop_outside(self, scope: frozenset[str]) -> list[str]:
        """A commit with `scope` was published: forget the unclaimed records it left out
        (claimed ones go on with their requests). Returns the IDs forgotten."""
        dropped = [eid for eid, h in self._records.items()
                   if h.claimed_by is None and eid not in scope]
        for episode_id in dropped:
            del self._records[episode_id]
        return dropped

    def retire(self, episode_id: str, attempt: int) -> int:
        """Mark `attempt` (and older) of the episode retired, and drop the record if the
        attempt that would claim it is covered, unless a running request holds it (that
        one is dropped when handed back). Returns how many held (unclaimed) records were
        dropped: 0 or 1. A lost record the retire covers is no longer listed (the
        controller has given that attempt up). Idempotent."""
        self._retired[episode_id] = max(attempt, self._retired.get(episode_id, attempt))
        self._lost = [lost for lost in self._lost
                      if lost["episode_id"] != episode_id or lost["attempt"] > attempt]
        held = self._records.get(episode_id)
        if held is None or not self._retires(held):
            return 0
        if held.claimed_by is not None and not held.done:
            return 0  # its request is being stopped; the hand-back drops it
        del self._records[episode_id]
        return 1 if held.claimed_by is None else 0

    def inherit(self, marks: Mapping[str, int]) -> None:
        """Take on retire marks made elsewhere (a worker that joins late)."""
        for episode_id, attempt in marks.items():
            self._retired[episode_id] = max(attempt, self._retired.get(episode_id, attempt))

    def forget(self, episode_ids: Iterable[str]) -> list[str]:
        """Drop the marks of `episode_ids`; returns those that had one."""
        return [eid for eid in episode_ids if self._retired.pop(eid, None) is not None]

    def worker_left(self, worker: str) -> list[dict[str, Any]]:
        """`worker` died: the records its requests were continuing are lost to this
        server (SPEC 5.8). Returns them as `lost_episodes` lists them."""
        gone = [h for h in self._records.values() if h.claimed_by == worker and not h.done]
        lost = [{"episode_id": h.episode_id, "attempt": h.attempt + 1, "worker": worker}
                for h in gone]
        for held in gone:
            del self._records[held.episode_id]
        self._lost.extend(lost)
        return lost

    def clear(self) -> None:
        """Forget every record (abort_restore); the marks stay."""
        self._records.clear()
