"""Placement of restored sessions onto live workers (SPEC 5.7): one pure function.

Deterministic and independent of input order, ties broken by worker ID: every session is
placed exactly once; all sessions of one old owner land on the same worker; owner
groups are spread largest first onto the least loaded worker; sessions with no owner
(a one-worker checkpoint) are placed one by one onto the least loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tether.routing.types import SessionId, WorkerId


@dataclass(frozen=True)
class Placement:
    """Where each restored session goes, and where each old worker ID now points."""

    sessions: dict[SessionId, WorkerId]
    aliases: dict[WorkerId, WorkerId]


def place(
    sessions: Iterable[tuple[SessionId, WorkerId | None]],
    workers: Sequence[WorkerId],
    known: Iterable[WorkerId] = (),
    inherited: Mapping[WorkerId, WorkerId] | None = None,
) -> Placement:
    """Place `sessions` (ID, old owner or None) onto `workers`.

    `known` are every old worker ID the checkpoint names (owners without sessions
    included); `inherited` the aliases an earlier restore left (older ID → old ID). Each
    is aliased to a live worker, so `x-tether-worker` with any of them still resolves.
    """
    live = sorted(set(workers))
    if not live:
        raise ValueError("placement needs at least one live worker")
    load = dict.fromkeys(live, 0)
    groups: dict[WorkerId, list[SessionId]] = {}
    ownerless: list[SessionId] = []
    for session_id, owner in sessions:
        if owner is None:
            ownerless.append(session_id)
        else:
            groups.setdefault(owner, []).append(session_id)

    def least_loaded() -> WorkerId:
        return min(live, key=lambda worker: (load[worker], worker))

    placed: dict[SessionId, WorkerId] = {}
    aliases: dict[WorkerId, WorkerId] = {}
    for owner, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        target = least_loaded()
        aliases[owner] = target
        load[target] += len(members)
        for session_id in members:
            placed[session_id] = target
    for session_id in sorted(ownerless):
        target = least_loaded()
        load[target] += 1
        placed[session_id] = target
    for index, owner in enumerate(sorted(set(known) - set(aliases))):
        aliases[owner] = live[index % len(live)]
    for older, old in sorted((inherited or {}).items()):
        aliases.setdefault(older, aliases.get(old, live[0]))
    return Placement(placed, aliases)
