"""This host's membership in a service of several hosts (SPEC 12).

The coordinator's side of the cluster: this host's record in the live set (kept by a
`Refresher`), the other hosts' workers pushed to this host's workers whenever they
change, the workers known dead, and their claims swept once the close window has passed.
Only `tether serve --cluster` imports it (it needs `redis`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from tether.cluster.claims import RedisClaimStore
from tether.cluster.client import redis_client
from tether.cluster.liveset import ClusterError, LiveSet, LiveView, Refresher
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
    set or this host's lease changed, sweeps dead workers' claims after the close window,
    has the workers re-assert their claims when Redis lost them, and restarts the
    workers under a new epoch once this host was fenced out (SPEC 12)."""

    def __init__(
        self,
        settings: ClusterSettings,
        local: Callable[[], Mapping[WorkerId, str]],
        changed: Callable[[], Awaitable[None]],
        close_window_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        restart_workers: Callable[[], Awaitable[None]] | None = None,
        reassert_claims: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """`local`: this host's live workers and their hop addresses; `changed`: awaited
        when `remote`, `dead` or `lease_until` changed; `restart_workers`: replaces every
        worker by a new one (their claims are void); `reassert_claims`: has every worker
        write its claims into Redis again within the seconds given (raises if one could
        not)."""
        self.settings = settings
        self.local = local
        self.changed = changed
        self.close_window_s = close_window_s
        self.clock = clock
        self.restart_workers = restart_workers
        self.reassert_claims = reassert_claims
        self.client = redis_client(settings.url)
        self.live = LiveSet(self.client, settings.service, settings.host_id,
                            ttl_s=settings.ttl_s, clock=clock)
        self.claims = RedisClaimStore(self.client, settings.service)
        self.refresher = Refresher(self.live, self.local, self._seen,
                                   after_round=self._after_round, asserted=lambda: self.asserted,
                                   claimants=self.claims.claimants)
        self.remote: dict[WorkerId, str] = {}
        """Every other host's live workers, and where each takes forwarded requests."""
        self.dead: list[WorkerId] = []
        """Workers once live, now in no host's record: their sessions answer 410."""
        self.asserted = ""
        """The re-assertion round (`RedisClaimStore.trust`) this host's workers last
        wrote their claims in."""
        self.fenced = False
        """This incarnation is over: its workers are being replaced and it joins again."""
        self._restart: asyncio.Task[None] | None = None
        """Replaces the workers of a fenced incarnation; it joins again once that ended."""
        self._pushed_lease = 0.0
        self._trusted_run: str | None = None
        """The Redis run ID under which the claims (and so the records) were last seen
        trusted."""
        self._died_at: dict[WorkerId, float] = {}
        self._known: set[WorkerId] = set()
        self._swept: set[WorkerId] = set()

    def lease_until(self) -> float:
        """Until when this host's workers may serve sessions (monotonic clock)."""
        return 0.0 if self.fenced else self.live.lease_until()

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
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        try:
            await self.live.leave()
        except TetherError as error:
            log.warning("cluster_leave_failed", detail=error.detail)
        await self.client.aclose()

    def worker_left(self, worker: WorkerId) -> None:
        """A worker of this host exited: dead from now, for this host's workers too."""
        self._died_at.setdefault(worker, self.clock())
        self.dead = sorted(self._died_at)

    def workers_gone(self, workers: Iterable[WorkerId]) -> None:
        """Workers of this host's previous incarnation (a restore's): dead, so their
        sessions answer 410 here and the claims they left are swept a window later."""
        for worker in workers:
            if worker not in self.local():
                self.worker_left(worker)

    async def publish(self) -> None:
        """Write this host's record now (a worker registered or left), so other hosts find
        a newcomer before it claims anything; a failure is logged and the refresher's
        next round writes it again."""
        if self.fenced:
            return  # the next round joins again, then writes the record
        try:
            taken = await self.live.publish(self.local(), self.asserted)
        except TetherError as error:
            log.warning("cluster_publish_failed", detail=error.detail)
            return
        if not taken:
            log.warning("cluster_publish_refused", host_id=self.settings.host_id,
                        epoch=self.live.epoch)
        self.refresher.refresh_soon()

    async def _seen(self, view: LiveView) -> None:
        """A refresh saw a new view: take it and tell the workers."""
        if view.fenced and not self.fenced:
            await self._fence()
        await self._take(view)

    async def _take(self, view: LiveView) -> None:
        """Take the other hosts' workers from `view`. A worker that vanished from it is
        dead only if the claims are trusted under the view's Redis run: a Redis that
        came back empty lost every record too, and until the hosts have written theirs
        again their workers are not known to be live (503), not dead (410)."""
        local = self.local()
        remote = {
            worker: f"tcp://{live.address}"
            for worker, live in view.workers.items()
            if live.host_id != self.settings.host_id and worker not in local
        }
        if self._trusted_run == view.run_id:
            now = self.clock()
            for worker in (self._known | view.claimants) - remote.keys() - local.keys():
                self._died_at.setdefault(worker, now)
            self._known = set(remote) | set(local)
        else:
            self._known |= set(remote) | set(local)
        for worker in remote:
            self._died_at.pop(worker, None)  # listed again (a record read late)
        dead = sorted(self._died_at)
        if (remote, dead) != (self.remote, self.dead):
            self.remote, self.dead = remote, dead
            await self.changed()

    async def _fence(self) -> None:
        """This incarnation is over (its record expired or a newer one started): other
        hosts may have seen its workers dead and swept their claims, so every worker is
        replaced, with nothing, before this host joins again. The replacement runs in a
        task of its own, so a round's time bound never cuts it short."""
        self.fenced = True
        log.error("cluster_fenced", host_id=self.settings.host_id, epoch=self.live.epoch)
        self._restart = asyncio.create_task(self._replace_workers(), name="tether-fenced")

    async def _replace_workers(self) -> None:
        if self.restart_workers is not None:
            await self.restart_workers()

    async def _after_round(self, view: LiveView) -> None:
        """What a round that reached Redis is followed by: the lease pushed to the
        workers (first: nothing after it may hold it up), joining again once fenced, the
        sweep of dead workers' claims, the claims' trust."""
        lease = self.lease_until()
        if lease != self._pushed_lease:
            self._pushed_lease = lease
            await self.changed()
        if self.fenced:
            await self._join_again()
            return
        await self._sweep()
        await self._keep_claims_trusted(view)

    async def _join_again(self) -> None:
        """Start a new incarnation once the fenced one's workers are gone; tried every
        round until it succeeds (a host of this ID that is live meanwhile is logged, not
        fought)."""
        restart = self._restart
        if restart is None or not restart.done():
            return
        if not restart.cancelled() and restart.exception() is not None:
            log.error("workers_not_replaced", error=repr(restart.exception()))
            self._restart = asyncio.create_task(self._replace_workers(), name="tether-fenced")
            return
        try:
            epoch = await self.live.join()
        except ClusterError as error:
            log.error("cluster_join_refused", detail=str(error))
            return
        self.fenced, self._restart = False, None
        log.info("cluster_joined", service=self.settings.service,
                 host_id=self.settings.host_id, epoch=epoch, restarted=True)
        self.refresher.refresh_soon()

    async def _keep_claims_trusted(self, view: LiveView) -> None:
        """While Redis lost its claims (it came back empty, or failed over), a lookup that
        finds none is refused; this host's workers write theirs again, once per
        re-assertion round, and the claims are trusted again once every live host has."""
        trusted, round_ = await self.claims.trust(view.run_id, self.live.ttl_ms)
        if trusted:
            if self._trusted_run != view.run_id:
                self._trusted_run = view.run_id
                await self._take(view)  # whoever is still missing is dead now
            return
        self._trusted_run = None
        if round_ == self.asserted:
            return
        log.warning("claims_untrusted", round=round_)
        if self.reassert_claims is not None:
            await self.reassert_claims(self.live.ttl_s / 4)  # within the round's bound
        self.asserted = round_
        log.info("claims_reasserted", round=round_)
        self.refresher.refresh_soon()  # the record says so at once

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
