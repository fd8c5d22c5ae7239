"""One worker's routing, composed: claims, lifetimes, the router, forwarding, the private
socket server and the background sweep of expired claims."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.types import ASGIApp

from tether.routing.claims import ClaimStore, FileClaimStore, WorkerClaims
from tether.routing.errors import TetherError
from tether.routing.forward import Forwarder
from tether.routing.front import Passthrough
from tether.routing.handoff import HandoffReceiver
from tether.routing.hopsign import HopSigner, HopVerifier
from tether.routing.kinds import SessionKind
from tether.routing.lifetimes import Lifetimes
from tether.routing.private import PrivateServer
from tether.routing.relay import PING_INTERVAL_S, PING_TIMEOUT_S, Relays
from tether.routing.router import Admission, Router
from tether.routing.tables import Tables
from tether.routing.tracing import hop_traces
from tether.routing.types import SessionId, WorkerId, new_worker_id

log = structlog.get_logger("tether.worker")

MIN_SWEEP_S = 0.05
MAX_SWEEP_S = 5.0
PRIVATE_DRAIN_S = 10
"""How long a stopping worker lets forwarded requests (streams included) finish."""


@dataclass(frozen=True)
class HopListener:
    """Where a worker of a cluster listens for hops from other hosts (the advertised
    address, any free port) and the secret they are signed with."""

    host: str
    secret: bytes = field(repr=False)


def socket_path(runtime_dir: str, worker: WorkerId) -> str:
    """The private socket of `worker` in a server's runtime directory."""
    return os.path.join(runtime_dir, "w", f"{worker}.sock")


def handoff_path(runtime_dir: str, worker: str) -> str:
    """Where `worker` takes connections other workers hand it (routing/handoff.py)."""
    return os.path.join(runtime_dir, "w", f"{worker}.handoff")


def claims_dir(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, "claims")


class RoutingWorker:
    """Everything one worker needs to route: with `runtime_dir` None (one worker) it
    claims and forwards nothing, and opens no private socket."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        kind: SessionKind | None,
        runtime_dir: str | None,
        worker: WorkerId | None = None,
        store: ClaimStore | None = None,
        control: ASGIApp | None = None,
        admission: Admission | None = None,
        access_log: bool = True,
        drain_s: int | None = PRIVATE_DRAIN_S,
        hops: HopListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        ws_ping: tuple[float | None, float | None] = (PING_INTERVAL_S, PING_TIMEOUT_S),
    ) -> None:
        """`drain_s`: how long a stopping worker lets forwarded requests run (None: as
        long as they take), as `--timeout-graceful-shutdown` does for its own. `hops`:
        on a cluster, where this worker takes requests from other hosts, and their secret.
        `ws_ping`: how often a relayed WebSocket's holder is pinged, and how long it may
        take to answer (`--ws-ping-interval`, `--ws-ping-timeout`)."""
        self.id = worker or new_worker_id()
        self.runtime_dir = runtime_dir
        self.tables = Tables([self.id])
        self.claims: WorkerClaims | None = None
        self.forwarder: Forwarder | None = None
        self.relays: Relays | None = None
        self.private: PrivateServer | None = None
        self.hop_server: PrivateServer | None = None
        """On a cluster, the TCP listener for requests other hosts forward here."""
        self.passthrough: Passthrough | None = None
        """Sends requests of sessions another worker of this host holds on as bytes."""
        self.handoffs: HandoffReceiver | None = None
        """Takes connections other workers hand here, once `accept_handoffs` is called."""
        window = kind.close_window_s if kind else 300.0
        self._sweep_every = min(max(window / 20, MIN_SWEEP_S), MAX_SWEEP_S)
        self._sweeper: asyncio.Task[None] | None = None
        if runtime_dir is not None:
            if store is None:
                store = FileClaimStore(claims_dir(runtime_dir))
            holder = kind.holder if kind else None
            self.claims = WorkerClaims(store, self.id, Lifetimes(window, holder), clock)
            signer = None if hops is None else HopSigner(hops.secret)
            self.forwarder = Forwarder(signer=signer)
            self.relays = Relays(
                signer=signer, ping_interval=ws_ping[0], ping_timeout=ws_ping[1]
            )
        self.router = Router(
            app,
            worker=self.id,
            kind=kind,
            claims=self.claims,
            forwarder=self.forwarder,
            socket_path=self.socket_path,
            tables=self.tables,
            control=control,
            admission=admission,
            access_log=access_log,
            tracing=None if self.forwarder is None else hop_traces(self.forwarder, self.id),
            relays=self.relays,
        )
        if runtime_dir is not None:
            self.passthrough = Passthrough(
                self.router, self.socket_path, lambda worker: handoff_path(runtime_dir, worker)
            )
            os.makedirs(os.path.join(runtime_dir, "w"), mode=0o700, exist_ok=True)
            self.private = PrivateServer(
                self.router.serve_forwarded,
                self.socket_path(self.id),
                timeout_graceful_shutdown=drain_s,
            )
        if runtime_dir is not None and hops is not None:
            self.hop_server = PrivateServer.tcp(
                self.router.serve_forwarded, hops.host, 0, HopVerifier(hops.secret), self.id,
                timeout_graceful_shutdown=drain_s, ws_ping=ws_ping,
            )

    def socket_path(self, worker: WorkerId) -> str:
        assert self.runtime_dir is not None
        return socket_path(self.runtime_dir, worker)

    def set_gone(self, addresses: frozenset[str]) -> None:
        """The hop listeners of other hosts' workers now known dead: a request waiting
        on one, copied or passed through, ends (410 before its reply began, a cut reply
        after), and none is sent to one again."""
        if self.forwarder is not None:
            self.forwarder.set_gone(addresses)
        if self.passthrough is not None:
            self.passthrough.links.set_gone(addresses)

    async def listen_for_hops(self) -> str | None:
        """On a cluster, start the hop listener and return its `host:port`, which the
        worker registers. Safe before registering: no other host can name this worker
        before its host's record lists it."""
        if self.hop_server is None:
            return None
        await self.hop_server.start()
        return f"{self.hop_server.host}:{self.hop_server.port}"

    def accept_handoffs(self, serve: Callable[[bytes], asyncio.Protocol]) -> None:
        """From `start` on, take connections other workers hand here, each served by the
        public server's protocol `serve` makes for the request already read from it (a
        `FrontProtocol` after `hand_in`, front.py)."""
        assert self.runtime_dir is not None
        self.handoffs = HandoffReceiver(handoff_path(self.runtime_dir, self.id), serve)

    async def stop_handoffs(self) -> None:
        """Take no more connections from other workers: before the public server closes
        its own, so that those handed here already are among them."""
        if self.handoffs is not None:
            await self.handoffs.stop()

    async def start(self) -> None:
        """Serve forwarded requests and start sweeping expired claims."""
        if self.private is not None:
            await self.private.start()
        if self.handoffs is not None:
            self.handoffs.start()
        if self.claims is not None:
            if isinstance(self.claims.store, FileClaimStore):
                self.claims.store.watch(asyncio.get_running_loop())
            self._sweeper = asyncio.create_task(self._sweep(), name="tether-claim-sweep")

    async def stop(self) -> None:
        """Stop sweeping, close relayed WebSockets, let forwarded requests finish, close
        every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.stop_handoffs()
        if self.relays is not None:
            await self.relays.close()  # the WebSockets this worker relays, both sides
        if self.hop_server is not None:
            await self.hop_server.stop()
        if self.private is not None:
            await self.private.stop()
        if self.forwarder is not None:
            await self.forwarder.close()
        if self.passthrough is not None:
            self.passthrough.close()
        if self.claims is not None and isinstance(self.claims.store, FileClaimStore):
            self.claims.store.close()

    def is_open(self, session_id: str) -> bool:
        """Whether the router counts the session as open (True without routing)."""
        if self.claims is None:
            return True
        return self.claims.lifetimes.is_open(SessionId(session_id))

    def stats(self) -> dict[str, Any]:
        """This worker's line in status."""
        return {
            "id": self.id,
            "pid": os.getpid(),
            "claims": len(self.claims) if self.claims is not None else 0,
            "forwarded": self.router.stats.forwarded,
            "served_forwarded": self.router.stats.served_forwarded,
            "passed_through": self.router.stats.passed_through,
            "handed_off": self.router.stats.handed_off,
        }

    def metrics(self) -> dict[str, Any]:
        """This worker's counters, as the main process's metrics read them: its line in
        status and the router's counts (`RouterStats.report`)."""
        return {**self.stats(), **self.router.stats.report()}

    async def _sweep(self) -> None:
        assert self.claims is not None
        while True:
            await asyncio.sleep(self._sweep_every)
            try:
                released = await self.claims.sweep()
            except OSError:
                log.exception("claim_sweep_failed")
                continue
            except TetherError as error:  # a cluster's Redis out of reach: next round
                log.warning("claim_sweep_failed", code=error.code, detail=error.detail)
                continue
            if released:
                log.debug("claims_released", count=len(released))
