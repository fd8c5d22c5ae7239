"""The coordinator: the main process's view of its workers (SPEC 3, 5.11).

It registers workers, keeps the live set and broadcasts it, and answers control calls
that a worker relays. Records never pass through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from tether.checkpoint.checkpointer import Checkpointer
from tether.coordinator.channel import Channel, ChannelLost, Handler
from tether.coordinator.fleet import ChannelFleet
from tether.routing.errors import TetherError
from tether.routing.types import WorkerId, worker_id_or_none

if TYPE_CHECKING:
    from tether.coordinator.cluster import ClusterMember
    from tether.coordinator.metrics import Metrics

log = structlog.get_logger("tether.coordinator")

BROADCAST_TIMEOUT_S = 2.0
RESTART_TIMEOUT_S = 10.0
"""How long a fenced host waits for its killed workers' channels to close."""
CONTROL_CALLS = frozenset(
    {"prepare", "commit", "resume", "renew", "restore", "abort_restore", "retire", "forget"}
)
WORKER_CALLS = frozenset({"claim_episode", "episode_done", "hand_back", "readiness"})
"""What a worker tells or asks of the fleet: held episode records, readiness reports."""


@dataclass
class Link:
    """A registered worker."""

    worker: WorkerId
    pid: int
    channel: Channel
    hop: str | None = None
    """On a cluster, the `tcp://HOST:PORT` other hosts forward this worker's requests to."""


class Coordinator:
    """Registrations, the live set and control relays for one server."""

    def __init__(
        self, expected_workers: int, name: str | None = None, checkpoint_root: str | None = None
    ) -> None:
        self.expected_workers = expected_workers
        self.name = name
        self.checkpoint_root = checkpoint_root
        self.links: dict[WorkerId, Link] = {}
        self.ever_registered = False
        """Once any worker registered, the app can start: a worker that dies is replaced."""
        self.stopping = False
        self.fleet: ChannelFleet | None = None
        self.checkpointer: Checkpointer | None = None
        self.metrics: Metrics | None = None
        """What `GET /_tether/metrics` renders (SPEC 9)."""
        self.cluster: ClusterMember | None = None
        """This host's membership in a service of several hosts (SPEC 12), or None."""
        self.on_startup_failed: Callable[[str], None] = lambda problem: None
        """Called with the one line a worker that cannot start reports."""
        self.kill_workers: Callable[[], Awaitable[None]] | None = None
        """Kills every worker process and waits for them to exit (they are replaced)."""
        self._changed = asyncio.Condition()

    @property
    def live(self) -> list[WorkerId]:
        return sorted(self.links)

    def handler_for(self, channel: Channel) -> Handler:
        """The handler of one worker's channel."""

        async def handle(kind: str, body: Any) -> Any:
            if kind == "register":
                return await self._register(channel, body)
            if kind == "startup_failed":
                problem = body.get("problem") if isinstance(body, dict) else None
                self.on_startup_failed(str(problem))
                return None
            if kind == "metrics":
                if self.metrics is None:
                    raise TetherError("invalid_request", "this server renders no metrics")
                return await self.metrics.render()
            if kind == "status" or kind in CONTROL_CALLS:
                if self.checkpointer is None:
                    raise TetherError("unsupported_topology", "this server has no checkpointer")
                answer = await self.checkpointer.call(kind, body or {})
                if kind == "status":
                    answer["channel_bytes"] = self.channel_bytes()
                return answer
            if self.fleet is not None and kind in WORKER_CALLS:
                return self._worker_call(channel, kind, body)
            raise TetherError("invalid_request", f"unknown call {kind!r}")

        return handle

    def channel_bytes(self) -> int:
        """Bytes the live workers' channels carried both ways: records never do."""
        channels = [link.channel for link in self.links.values()]
        return sum(c.bytes_sent + c.bytes_received for c in channels)

    async def on_channel(self, channel: Channel) -> None:
        """Wait for a worker's channel to close, then drop the worker from the live set."""
        await channel.wait_closed()
        for worker, link in list(self.links.items()):
            if link.channel is channel:
                del self.links[worker]
                if self.stopping:
                    log.info("worker_stopped", worker_id=worker, pid=link.pid)
                else:
                    log.warning("worker_left", worker_id=worker, pid=link.pid)
                if self.fleet is not None:
                    self.fleet.worker_left(worker)
                if self.metrics is not None:
                    self.metrics.worker_left(worker)  # its last counts stay in the totals
                if self.cluster is not None:
                    self.cluster.worker_left(worker)
                    await self.cluster.publish()
                await self._broadcast_live()
                async with self._changed:
                    self._changed.notify_all()

    async def wait_for_workers(self, count: int, within_s: float) -> bool:
        """Whether `count` workers registered within `within_s` seconds."""
        try:
            async with asyncio.timeout(within_s), self._changed:
                await self._changed.wait_for(lambda: len(self.links) >= count)
        except TimeoutError:
            return False
        return True

    async def _register(self, channel: Channel, body: Any) -> dict[str, Any]:
        worker = worker_id_or_none(body.get("worker") if isinstance(body, dict) else None)
        pid = body.get("pid") if isinstance(body, dict) else None
        if worker is None or not isinstance(pid, int):
            raise TetherError("invalid_request", "register needs a worker ID and a pid")
        if worker in self.links:
            raise TetherError("invalid_request", f"worker {worker} is already registered")
        hop = body.get("hop")
        if self.cluster is not None and not isinstance(hop, str):
            raise TetherError("invalid_request", "a worker of a cluster registers its hop address")
        self.links[worker] = Link(worker, pid, channel, hop if isinstance(hop, str) else None)
        self.ever_registered = True
        started = time.perf_counter()
        if self.cluster is not None:
            # Other hosts find the newcomer in the live set before it claims anything.
            await self.cluster.publish()
        # Every other worker learns the newcomer is live before the newcomer serves, so a
        # claim it makes is never mistaken for a dead worker's.
        await self._broadcast_live(skip=worker)
        log.info(
            "worker_registered",
            worker_id=worker,
            pid=pid,
            live=len(self.links),
            broadcast_ms=round((time.perf_counter() - started) * 1000, 3),
        )
        async with self._changed:
            self._changed.notify_all()
        welcome: dict[str, Any] = {**self.live_message(), "phase": "open"}
        if self.fleet is not None:
            self.fleet.state_version = body.get("state_version")
            welcome.update(self.fleet.welcome())
            self.fleet.changed()
        return welcome

    def _worker_call(self, channel: Channel, kind: str, body: Any) -> Any:
        assert self.fleet is not None
        worker = next((w for w, link in self.links.items() if link.channel is channel), None)
        if worker is None:
            raise TetherError("invalid_request", "register first")
        if kind == "claim_episode":
            return self.fleet.claim(worker, body["episode_id"], body["attempt"])
        if kind == "readiness":
            self.fleet.report(worker, body)
        elif kind == "episode_done":
            self.fleet.done(body["episode_id"], worker)
        else:
            self.fleet.hand_back(body, worker)
        return None

    def hop_addresses(self) -> dict[WorkerId, str]:
        """This host's live workers and where other hosts reach each (a cluster's record)."""
        return {w: link.hop for w, link in self.links.items() if link.hop is not None}

    def live_message(self) -> dict[str, Any]:
        """What every worker is told of the live set: this host's workers and, on a
        cluster, every other host's with where to reach them and who is known dead."""
        if self.cluster is None:
            return {"live": self.live}
        remote = self.cluster.remote
        return {
            "live": [*self.live, *remote],
            "addresses": remote,
            "dead": self.cluster.dead,
            "lease_until": self.cluster.lease_until(),
        }

    async def restart_workers(self) -> None:
        """Replace every worker by a new, empty one (a fenced host: its workers' claims
        are void) and wait until the old ones left the live set."""
        old = set(self.links)
        if self.kill_workers is not None:
            await self.kill_workers()
        try:
            async with asyncio.timeout(RESTART_TIMEOUT_S), self._changed:
                await self._changed.wait_for(lambda: not old & set(self.links))
        except TimeoutError:
            log.error("workers_not_restarted", left=sorted(old & set(self.links)))

    async def reassert_claims(self, within_s: float) -> None:
        """Have every worker write its claims into the cluster's Redis again (a pipeline of
        one script per 500 claims) within `within_s`; raises `TetherError` if one could
        not (the next round asks again)."""
        links = list(self.links.values())
        calls = [link.channel.request("reassert", {}, timeout=within_s) for link in links]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [link.worker for link, result in zip(links, results, strict=True)
                  if isinstance(result, Exception) and not isinstance(result, ChannelLost)]
        for link, result in zip(links, results, strict=True):
            if isinstance(result, dict) and result.get("taken"):
                log.error("claims_taken_meanwhile", worker_id=link.worker, taken=result["taken"])
        if failed:
            raise TetherError("cluster_unavailable", f"workers {failed} did not re-assert")

    async def broadcast_live(self) -> None:
        """Tell every worker the live set (the cluster's view changed)."""
        await self._broadcast_live()

    async def _broadcast_live(self, skip: WorkerId | None = None) -> None:
        message = self.live_message()
        calls = [
            link.channel.request("live", message, timeout=BROADCAST_TIMEOUT_S)
            for worker, link in self.links.items()
            if worker != skip
        ]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, ChannelLost):
                log.warning("live_broadcast_failed", error=repr(result))
