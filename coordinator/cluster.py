"""This host's membership in a service of several hosts (SPEC 12).

The coordinator's side of the cluster: this host's record in the live set (kept by a
`Refresher`), the other hosts' workers pushed to this host's workers whenever they
change, the workers known dead, and their claims swept once the close window has passed.
Only `tether serve --cluster` imports it (it needs `redis`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog

from tether.cluster.claims import RedisClaimStore
from tether.cluster.client import redis_client
from tether.cluster.liveset import LiveSet, LiveView, Refresher
from tether.routing.errors import TetherError
from tether.routing.types import WorkerId

log = structlog.get_logger("tether.cluster")


@dataclass(frozen=True)
class ClusterSettings:
    """What `--cluster` and its companions say (checked by `ServeOptions.problem`)."""

    url: str
    service: str
    host_id: str
    advertise: str
    ttl_s: float = 10.0


class ClusterMember:
    """Keeps this host in the live set, tells the coordinator when the service-wide live
    set changed, and sweeps dead workers' claims after the close window."""

    def __init__(
        self,
        settings: ClusterSettings,
        local: Callable[[], Mapping[WorkerId, str]],
        changed: Callable[[], Awaitable[None]],
        close_window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`local`: this host's live workers and their hop addresses; `changed`: awaited
        when `remote` or `dead` changed."""
        self.settings = settings
        self.local = local
        self.changed = changed
        self.close_window_s = close_window_s
        self.clock = clock
        self.client = redis_client(settings.url)
        self.live = LiveSet(self.client, settings.service, settings.host_id,
                            ttl_s=settings.ttl_s, clock=clock)
        self.claims = RedisClaimStore(self.client, settings.service)
        self.refresher = Refresher(self.live, self.local, self._seen, after_round=self._sweep)
        self.remote: dict[WorkerId, str] = {}
        """Every other host's live workers, and where each takes forwarded requests."""
        self.dead: list[WorkerId] = []
        """Workers once live, now in no host's record: their sessions answer 410."""
        self._died_at: dict[WorkerId, float] = {}
        self._known: set[WorkerId] = set()
        self._swept: set[WorkerId] = set()

    async def join(self) -> int:
        """Join the service under a new epoch and start refreshing; a second live host
        with this ID is refused (`ClusterError`, one line)."""
        epoch = await self.live.join()
        self.refresher.start()
        return epoch

    async def stop(self) -> None:
        """Stop refreshing, leave the live set (other hosts see this host's workers dead
        at once, not a TTL later) and close the client."""
        await self.refresher.stop()
        try:
            await self.live.leave()
        except TetherError as error:
            log.warning("cluster_leave_failed", detail=error.detail)
        await self.client.aclose()

    def worker_left(self, worker: WorkerId) -> None:
        """A worker of this host exited: dead from now, for this host's workers too."""
        self._died_at.setdefault(worker, self.clock())
        self.dead = sorted(self._died_at)

    async def publish(self) -> None:
        """Write this host's record now (a worker registered or left), so other hosts find
        a newcomer before it claims anything; a failure is logged and the refresher's
        next round writes it again."""
        try:
            taken = await self.live.publish(self.local())
        except TetherError as error:
            log.warning("cluster_publish_failed", detail=error.detail)
            return
        if not taken:
            log.error("cluster_fenced", host_id=self.settings.host_id, epoch=self.live.epoch)
        self.refresher.refresh_soon()

    async def _seen(self, view: LiveView) -> None:
        """A refresh saw a new view: take it, sweep what is due, tell the workers."""
        if view.fenced:
            log.error("cluster_fenced", host_id=self.settings.host_id, epoch=self.live.epoch)
        local = self.local()
        remote = {
            worker: f"tcp://{live.address}"
            for worker, live in view.workers.items()
            if live.host_id != self.settings.host_id and worker not in local
        }
        now = self.clock()
        for worker in self._known - remote.keys() - local.keys():
            self._died_at.setdefault(worker, now)
        for worker in remote:
            self._died_at.pop(worker, None)  # listed again (a record read late)
        self._known = set(remote) | set(local)
        dead = sorted(self._died_at)
        if (remote, dead) != (self.remote, self.dead):
            self.remote, self.dead = remote, dead
            await self.changed()

    async def _sweep(self) -> None:
        """Release the claims of workers dead for longer than the close window (any host
        may: the release is owner-checked, so two hosts sweeping is harmless). Swept
        workers stay in `dead`: nothing claims for them again."""
        now = self.clock()
        for worker, died in list(self._died_at.items()):
            if worker in self._swept or now - died < self.close_window_s:
                continue
            released = await self.claims.sweep_worker(worker)
            self._swept.add(worker)
            log.info("dead_worker_swept", worker_id=worker, claims=released)
