"""What a router knows about other workers: the live set, owner aliases, placed sessions.

The coordinator keeps these current (its broadcasts replace them whole); the router
only reads them, in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tether.routing.types import SessionId, WorkerId


class Tables:
    """The live workers, the owner-alias table and the placed-session table."""

    def __init__(self, live: Iterable[WorkerId] = ()) -> None:
        self.live: frozenset[WorkerId] = frozenset(live)
        self.aliases: Mapping[WorkerId, WorkerId] = {}
        self.placed: Mapping[SessionId, WorkerId] = {}

    def set_live(self, live: Iterable[WorkerId]) -> None:
        self.live = frozenset(live)

    def is_live(self, worker: WorkerId) -> bool:
        return worker in self.live

    def resolve(self, worker: WorkerId) -> WorkerId | None:
        """The live worker that answers for `worker`: itself, its alias, or None."""
        if worker in self.live:
            return worker
        alias = self.aliases.get(worker)
        return alias if alias is not None and alias in self.live else None
