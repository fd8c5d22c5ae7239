"""Placement of restored sessions onto live workers (SPEC 5.7): one pure function.

The input is the session index: each session's ID, old owner (None for a checkpoint of a
server without routing) and offset in its segment. The rule:

1. Order the sessions by old owner (ownerless first), then by stretch: the 1 MiB
   (`STRETCH_BYTES`) piece of its segment the record starts in, the stretches in the
   order of a fixed hash of (owner, stretch number) (`stretch_rank`), then by offset,
   then by ID.
2. Cut that sequence into as many contiguous runs as there are live workers, of
   near-equal size (the first ``len % M`` runs one longer); run *i* goes to the *i*-th
   live worker by ID.

So every session is placed exactly once, the counts per worker differ by at most one
whatever the old and new worker counts and whatever mix of owned and ownerless
sessions, and the result depends only on the sets given, never on their order. An old
owner's sessions (one segment) are one contiguous stretch of the sequence, so a new
worker takes whole old owners plus at most two partial ones at the ends of its run, and
reads that few segments; within a segment its share is whole 1 MiB stretches plus at
most two partial ones, each one contiguous read, as `read_records` reads anyway. The
hash deals a split owner's stretches out in no particular order, so no worker gets only
an owner's oldest or newest sessions. `docs/rescale.md` says why this rule and what it
costs.

Each old owner is aliased to the new worker holding most of its sessions (ties: the
lower worker ID); known old worker IDs without sessions go round-robin over the live
workers by ID; inherited aliases (from earlier restores) chain through the alias of the
worker they pointed at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from tether.routing.types import SessionId, WorkerId

STRETCH_BYTES = 1 << 20
"""The pieces of a segment dealt out whole: `read_records`' own read size."""


@dataclass(frozen=True)
class Placement:
    """Where each restored session goes, and where each old worker ID now points."""

    sessions: dict[SessionId, WorkerId]
    aliases: dict[WorkerId, WorkerId]


def stretch_rank(owner: WorkerId | None, stretch: int) -> int:
    """Where a stretch of an owner's segment comes in placement's order: xxh3_64 of
    ``"<owner>:<stretch>"`` (``-`` for no owner). Fixed across processes and runs (never
    Python's salted `hash`), so every placement of one index is the same."""
    return xxhash.xxh3_64_intdigest(f"{owner or '-'}:{stretch}".encode())


def place(
    sessions: Iterable[tuple[SessionId, WorkerId | None, int]],
    workers: Sequence[WorkerId],
    known: Iterable[WorkerId] = (),
    inherited: Mapping[WorkerId, WorkerId] | None = None,
) -> Placement:
    """Place `sessions` (ID, old owner or None, offset in its segment) onto `workers`.

    `known` are every old worker ID the checkpoint names (owners without sessions
    included); `inherited` the aliases an earlier restore left (older ID → old ID). Each
    is aliased to a live worker, so `x-tether-worker` with any of them still resolves.
    A session ID given twice is a `ValueError` (a checkpoint holding one twice is
    refused as corrupt before placement).
    """
    live = sorted(set(workers))
    if not live:
        raise ValueError("placement needs at least one live worker")
    groups: dict[WorkerId | None, list[tuple[int, SessionId]]] = {}
    for session_id, owner, offset in sessions:
        groups.setdefault(owner, []).append((offset, session_id))
    ordered: list[SessionId] = []
    spans: list[tuple[WorkerId, int, int]] = []  # each old owner's stretch of `ordered`
    for owner in sorted(groups, key=lambda o: (o is not None, o or "")):
        ranks: dict[int, int] = {}
        keyed = []
        for offset, session_id in groups[owner]:
            stretch = offset // STRETCH_BYTES
            rank = ranks.get(stretch)
            if rank is None:
                rank = ranks[stretch] = stretch_rank(owner, stretch)
            keyed.append((rank, offset, session_id))
        keyed.sort()
        first = len(ordered)
        ordered += [session_id for _, _, session_id in keyed]
        if owner is not None:
            spans.append((owner, first, len(ordered)))

    placed: dict[SessionId, WorkerId] = {}
    runs: list[tuple[WorkerId, int, int]] = []  # each live worker's run of `ordered`
    quotient, remainder = divmod(len(ordered), len(live))
    end = 0
    for index, worker in enumerate(live):
        start, end = end, end + quotient + (1 if index < remainder else 0)
        placed.update(dict.fromkeys(ordered[start:end], worker))
        runs.append((worker, start, end))
    if len(placed) != len(ordered):
        raise ValueError("a session ID is given twice")

    aliases: dict[WorkerId, WorkerId] = {}
    for owner, first, last in spans:
        # How many of the owner's sessions each run holds: the overlap of two stretches.
        held = [(min(last, stop) - max(first, begin), worker) for worker, begin, stop in runs]
        aliases[owner] = min(held, key=lambda pair: (-pair[0], pair[1]))[1]
    chained = dict(inherited or {})
    idle = (set(known) | set(chained.values())) - set(aliases)
    for index, old in enumerate(sorted(idle)):
        aliases[old] = live[index % len(live)]
    for older, old in sorted(chained.items()):
        aliases.setdefault(older, aliases[old])
    return Placement(placed, aliases)
