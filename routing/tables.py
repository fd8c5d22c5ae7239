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
        self.addresses: Mapping[WorkerId, str] = {}
        """Where each live worker of another host takes forwarded requests (tcp://H:P)."""
        self.dead: frozenset[WorkerId] | None = None
        """On a cluster, the workers known dead; None on one host, where a worker that is
        not live is dead (every worker learns a newcomer is live before it serves)."""

    def set_live(
        self,
        live: Iterable[WorkerId],
        addresses: Mapping[WorkerId, str] | None = None,
        dead: Iterable[WorkerId] | None = None,
    ) -> None:
        self.live = frozenset(live)
        self.addresses = addresses or {}
        self.dead = None if dead is None else frozenset(dead)

    def is_live(self, worker: WorkerId) -> bool:
        return worker in self.live

    def is_gone(self, worker: WorkerId) -> bool:
        """Whether a worker that is not live is known dead (410), rather than not yet
        known (a worker of another host whose record this host has not read: 503)."""
        return self.dead is None or worker in self.dead

    def resolve(self, worker: WorkerId) -> WorkerId | None:
        """The live worker that answers for `worker`: itself, its alias, or None."""
        if worker in self.live:
            return worker
        alias = self.aliases.get(worker)
        return alias if alias is not None and alias in self.live else None
