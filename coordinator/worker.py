"""A worker process of `tether serve`: the user's app behind the router, registered with
the coordinator before it accepts a connection (SPEC 3).

The supervisor starts it with `python -c "from tether.coordinator.worker import main; main()"`
(not `-m`, which would import this module twice); the launcher passes the listening
socket as an inherited file descriptor and the settings as JSON in `TETHER_WORKER`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from tether.checkpoint.control import ControlApp
from tether.checkpoint.participant import Held, Participant, declared_participant
from tether.checkpoint.segments import read_index
from tether.checkpoint.tracing import worker_call
from tether.coordinator.apps import AppError, Preset, import_app, resolve_kind
from tether.coordinator.channel import Channel, ChannelLost, connect
from tether.coordinator.lifespan import AppLifespan
from tether.coordinator.reports import ReadinessReporter, Report
from tether.coordinator.runtime import COORDINATOR_SOCKET
from tether.routing import tracing
from tether.routing.errors import TetherError
from tether.routing.fence import set_close_window
from tether.routing.front import fits, front_protocol
from tether.routing.kinds import SessionKind
from tether.routing.logs import LogFormat, configure_logging, say
from tether.routing.mcp import share_request_state_key
from tether.routing.relay import PING_INTERVAL_S, PING_TIMEOUT_S
from tether.routing.types import SessionId, WorkerId, worker_id_or_none
from tether.routing.worker import HopListener, RoutingWorker

log = structlog.get_logger("tether.worker")

CONFIG_ENV = "TETHER_WORKER"
REGISTER_TIMEOUT_S = 30.0
DEFAULT_CALL_DEADLINE_S = 60.0
"""SPEC 5.4's default `deadline_s`."""
RELAY_MARGIN_S = 30.0
"""How much longer than its deadline a relayed call is waited for: its answer may follow
the deadline (a blocked prepare answers at it, a commit cleans up after it)."""
FORCE_EXIT_AFTER_S = 3.0
RESTORE_DEADLINE_S = 600.0
REPORT_TIMEOUT_S = 5.0
STARTUP_FAILED_EXIT = 3
"""uvicorn's own exit code for a failed start-up."""


@dataclass(frozen=True)
class WorkerSettings:
    """What the launcher tells each worker."""

    app: str
    runtime_dir: str
    workers: int
    fd: int
    token: str
    sessions: Preset | None = None
    close_window_s: float | None = None
    log_format: LogFormat | None = None
    name: str | None = None
    checkpoint_root: str | None = None
    restore: str | None = None
    app_dir: str = "."
    factory: bool = False
    lifespan: str = "auto"
    log_level: str | None = None
    access_log: bool = True
    uvicorn: dict[str, Any] = field(default_factory=dict)
    """The public server's `uvicorn.Config` keyword arguments (`ServeOptions.uvicorn_config`)."""
    server_secret: str = ""
    """Random per server run, the same in every worker: for what must agree across
    workers but is per-process in a library (the MCP SDK's request-state key)."""
    cluster: dict[str, str] | None = None
    """On a cluster (SPEC 12): `url`, `service`, `advertise` and `hop_secret` (hex)."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        return cls(**json.loads(text))


class TetherWorker:
    """The ASGI app one worker process serves: lifespan start-up registers with the
    coordinator; every other request goes through the router."""

    def __init__(self, app: ASGIApp, kind: SessionKind | None, settings: WorkerSettings) -> None:
        self.app = app
        self.settings = settings
        self.participant = declared_participant(app) or Participant()
        cluster = settings.cluster
        self._redis: Any = None
        """On a cluster, this worker's client of the claims' Redis (closed at stop)."""
        store = None
        if cluster is not None:
            from tether.cluster.claims import RedisClaimStore
            from tether.cluster.client import redis_client

            self._redis = redis_client(cluster["url"])
            store = RedisClaimStore(self._redis, cluster["service"])
        self._cluster_store = store
        self._hop_addresses: dict[WorkerId, str] = {}
        """Every other host's worker this one was told of, and where it took hops."""
        self.routing = RoutingWorker(
            app,
            kind=kind,
            # One worker routes nothing, unless other hosts forward to it.
            runtime_dir=settings.runtime_dir if settings.workers > 1 or cluster else None,
            store=store,
            control=ControlApp(settings.token, self._control),
            admission=self.participant,
            access_log=settings.access_log,
            drain_s=settings.uvicorn.get("timeout_graceful_shutdown"),
            ws_ping=(
                settings.uvicorn.get("ws_ping_interval", PING_INTERVAL_S),
                settings.uvicorn.get("ws_ping_timeout", PING_TIMEOUT_S),
            ),
            hops=None if cluster is None else HopListener(
                cluster["advertise"], bytes.fromhex(cluster["hop_secret"])
            ),
        )
        self.participant.worker = self.routing.id
        if cluster is not None and self.routing.claims is not None:
            self.routing.claims.lease_until = 0.0  # nothing is provable before the welcome
        self.reports = ReadinessReporter(self.participant, self._send_report)
        self.server: uvicorn.Server | None = None
        self.channel: Channel | None = None
        self._watch: asyncio.Task[None] | None = None
        self._exports: set[asyncio.Task[Any]] = set()
        """Exports running for the coordinator; `abort_export` cancels them."""
        self._installs: set[asyncio.Future[int]] = set()
        """Installs running for the coordinator; `release_installed` cancels them."""
        self._stopping = False

    @property
    def id(self) -> WorkerId:
        return self.routing.id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.routing.router(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        app_lifespan = AppLifespan(self.app, scope, self.settings.lifespan)
        try:
            await app_lifespan.startup()
            # Registered and welcomed before any socket of this worker accepts (SPEC 3).
            await self._register(await self.routing.listen_for_hops())
            await self.routing.start()
        except Exception as error:
            problem = str(error) if isinstance(error, RuntimeError) else repr(error)
            log.debug("worker_start_failed", exc_info=True)
            await self._stop_routing()
            await report_startup_failure(self.settings, f"a worker could not start: {problem}")
            # The main process prints the one line; uvicorn would add its own.
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
            await send({"type": "lifespan.startup.failed", "message": problem})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()
        self._stopping = True
        await self.participant.hand_back_all()  # while the channel is up
        await self._stop_routing()
        try:
            await app_lifespan.shutdown()
        except Exception as error:
            await send({"type": "lifespan.shutdown.failed", "message": str(error)})
            return
        finally:
            # uvicorn re-raises the SIGTERM it caught once it has shut down, so neither
            # the code after its `run` nor atexit runs: batched spans go out now.
            await asyncio.to_thread(tracing.stop)
        await send({"type": "lifespan.shutdown.complete"})

    async def _register(self, hop: str | None) -> None:
        path = os.path.join(self.settings.runtime_dir, COORDINATOR_SOCKET)
        self.channel = await connect(path, self._handle, name=f"worker-{self.id[:8]}")
        welcome = await self.channel.request(
            "register",
            {"worker": self.id, "pid": os.getpid(),
             "state_version": self.participant.state_version, "hop": hop},
            timeout=REGISTER_TIMEOUT_S,
        )
        self._apply_live(welcome)
        if welcome.get("admission_closed"):
            self.participant.close_admission()
            self.reports.start()  # its first report follows at once
        self.participant.set_retired(welcome.get("retired") or {})
        await self._apply_tables(welcome.get("tables"))
        self.participant.remote = _CoordinatorRecords(self.channel)
        self.participant.handback_dir = Path(self.settings.runtime_dir) / "handback"
        self.participant.handback_dir.mkdir(mode=0o700, exist_ok=True)
        self._watch = asyncio.create_task(self._watch_coordinator(), name="tether-coordinator")
        log.info("worker_registered", live=len(welcome["live"]))

    async def _control(self, call: str, body: dict[str, Any]) -> Any:
        return await self._relay(call, body)

    async def _send_report(self, report: Report) -> None:
        if self.channel is not None:
            await self.channel.notify("readiness", report)

    async def _stop_routing(self) -> None:
        await self.reports.stop()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.routing.stop()
        if self._redis is not None:
            await self._redis.aclose()
        if self.channel is not None:
            await self.channel.close()

    async def _watch_coordinator(self) -> None:
        """A worker whose coordinator is gone stops itself."""
        assert self.channel is not None
        await self.channel.wait_closed()
        if self._stopping or self.server is None:
            return
        log.error("coordinator_lost")
        self.server.should_exit = True
        await asyncio.sleep(FORCE_EXIT_AFTER_S)
        self.server.force_exit = True

    async def _handle(self, kind: str, body: Any) -> Any:
        if kind == "live":
            self._apply_live(body)
            return None
        if kind == "reassert":
            return await self._reassert()
        if kind in _PARTICIPANT_CALLS:
            return await worker_call(kind, self.id, self._participant_call(kind, body))
        if kind == "metrics" and isinstance(body, dict) and body.get("counts_only"):
            return self.routing.metrics()  # the main process's refresh: no session count
        if kind in ("stats", "metrics"):
            provider = self.participant.provider
            # `metrics` adds the router's counts (the main process renders them; SPEC 9).
            line = self.routing.stats() if kind == "stats" else self.routing.metrics()
            return {
                **line,
                "sessions": sum(1 for _ in provider.sessions()) if provider else 0,
                "episodes": len(self.participant.episodes),
            }
        raise TetherError("invalid_request", f"unknown call {kind!r}")

    async def _participant_call(self, kind: str, body: Any) -> Any:
        """What the coordinator asks of this worker's participant (several workers)."""
        participant = self.participant
        if kind == "close_admission":
            participant.close_admission()
            self.reports.start()
            return self.reports.report()  # the first report, with the call's answer
        elif kind == "open_admission":
            participant.open_admission()
            await self.reports.stop()
        elif kind == "blockers":
            return participant.blockers()._asdict()
        elif kind == "fresh":
            return participant.is_fresh()
        elif kind == "export":
            scope = None if body["scope"] is None else frozenset(body["scope"])
            carried = [Held.from_body(record) for record in body["carried"]]
            # One worker routes nothing: its records name no owner (SPEC 5.1).
            owner = self.id if self.settings.workers > 1 else None
            export = asyncio.ensure_future(participant.export(
                Path(body["path"]), scope, owner, self.routing.is_open, carried
            ))
            self._exports.add(export)
            try:
                return dict(await export)
            except BaseException:
                export.cancel()  # this call was cancelled (shutdown): so is its export
                raise
            finally:
                self._exports.discard(export)
        elif kind == "abort_export":
            # The coordinator gave up on this commit: stop writing into its temp dir
            # before it removes it. Answers once every export here is gone.
            running = list(self._exports)
            for export in running:
                export.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return len(running)
        elif kind == "install":
            install = asyncio.ensure_future(self._install(body))
            self._installs.add(install)
            try:
                return await install
            except BaseException:
                install.cancel()
                raise
            finally:
                self._installs.discard(install)
        elif kind == "release_installed":
            installing = list(self._installs)  # a restore given up: stop installing first
            for stopping in installing:
                stopping.cancel()
            await asyncio.gather(*installing, return_exceptions=True)
            await participant.release_all()
            if self.routing.claims is not None:
                await self.routing.claims.release_all()
            self.routing.tables.placed, self.routing.tables.aliases = {}, {}
        elif kind == "retire":
            return await participant.retire(body["episode_id"], body["attempt"], body["within_s"])
        elif kind == "forget":
            return participant.forget(body["episode_ids"])
        return None

    async def _install(self, body: dict[str, Any]) -> int:
        """Load the restore's tables, then install the sessions placed on this worker."""
        await self._apply_tables(body["tables"])
        placed = self.routing.tables.placed
        installed = 0
        restored: list[tuple[SessionId, WorkerId | None, bool]] = []
        for path in body["segments"]:
            entries = await asyncio.to_thread(read_index, path)
            mine = [
                e for e in entries
                if e.kind == "session" and placed.get(SessionId(e.id)) == self.id
            ]
            if mine:
                opened = await self.participant.install(Path(path), mine)
                installed += len(opened)
                restored += [
                    (SessionId(e.id), worker_id_or_none(e.owner), opened[e.id]) for e in mine
                ]
        claims, store = self.routing.claims, self._cluster_store
        if claims is not None and store is not None and restored:
            # Before admission opens: every host must find the restored sessions here.
            taken = await claims.adopt(restored, store.take_over)
            if taken:
                log.error("restored_sessions_held_elsewhere", sessions=len(taken),
                          example=next(iter(taken)))
        return installed

    async def _apply_tables(self, tables: dict[str, str] | None) -> None:
        if tables is None:
            return
        data = await asyncio.to_thread(Path(tables["path"]).read_bytes)
        if hashlib.sha256(data).hexdigest() != tables["digest"]:
            raise TetherError("corrupt_checkpoint", "the restore's tables file changed")
        loaded = msgpack.unpackb(data, raw=False)
        # A handful of worker IDs repeat across every entry: share one string each.
        workers: dict[str, WorkerId] = {}
        self.routing.tables.placed = {
            sid: workers.setdefault(w, WorkerId(w)) for sid, w in loaded["placed"].items()
        }
        self.routing.tables.aliases = loaded["aliases"]

    def _apply_live(self, body: dict[str, Any]) -> None:
        """The live set the coordinator pushed: this host's workers, and on a cluster every
        other host's with its hop address, and the workers known dead."""
        live = [w for w in (worker_id_or_none(w) for w in body["live"]) if w is not None]
        addresses = body.get("addresses")
        dead = body.get("dead")
        tables = self.routing.tables
        tables.set_live(
            [*live, self.id],
            {WorkerId(w): str(a) for w, a in addresses.items()} if addresses else None,
            None if dead is None else [WorkerId(w) for w in dead],
        )
        self._hop_addresses.update(tables.addresses)
        if tables.dead is not None:
            # Another host's worker now dead: what waits on it ends with 410. (A live
            # worker listening where a dead one did, its port taken again, is not.)
            seen, live_at = self._hop_addresses, set(tables.addresses.values())
            self.routing.set_gone(frozenset(
                seen[w] for w in tables.dead if w in seen and seen[w] not in live_at
            ))
        lease = body.get("lease_until")
        if isinstance(lease, int | float) and self.routing.claims is not None:
            self.routing.claims.lease_until = float(lease)

    async def _reassert(self) -> dict[str, Any]:
        """Write this worker's claims into the cluster's Redis again (it lost them)."""
        claims, store = self.routing.claims, self._cluster_store
        if claims is None or store is None:
            raise TetherError("invalid_request", "only a worker of a cluster re-asserts claims")
        taken = await claims.reassert(store.reassert)
        log.info("claims_reasserted", claims=len(claims), taken=len(taken))
        return {"claims": len(claims), "taken": len(taken)}

    async def _relay(self, call: str, body: Any) -> Any:
        """A control call, answered by the coordinator. It waits as long as the call's own
        deadline allows (and a margin for the answer); the work itself goes on in the
        coordinator whatever happens to this worker or its client."""
        if self.channel is None:
            raise TetherError("worker_unreported", "this worker is not registered yet")
        deadline = body.get("deadline_s") if isinstance(body, dict) else None
        timeout = (deadline or DEFAULT_CALL_DEADLINE_S) + RELAY_MARGIN_S
        try:
            return await self.channel.request(call, body, timeout=timeout)
        except TimeoutError:
            raise TetherError(
                "deadline_exceeded", f"{call} did not answer within {timeout:.0f} s"
            ) from None
        except ChannelLost:
            raise TetherError(
                "worker_unreported", "this worker lost its coordinator; retry on another"
            ) from None


_PARTICIPANT_CALLS = frozenset({
    "close_admission", "open_admission", "blockers", "fresh", "export", "abort_export",
    "install",
    "release_installed", "retire", "forget",
})


class _CoordinatorRecords:
    """Held episode records kept by the coordinator, claimed over the channel."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def claim(self, episode_id: str, attempt: int) -> Held | None:
        body = await self.channel.request(
            "claim_episode", {"episode_id": episode_id, "attempt": attempt}
        )
        return None if body is None else Held.from_body(body)

    async def done(self, episode_id: str) -> None:
        await self.channel.request("episode_done", {"episode_id": episode_id})

    async def hand_back(self, held: Held) -> None:
        await self.channel.request("hand_back", held.body())


async def report_startup_failure(settings: WorkerSettings, problem: str) -> None:
    """Tell the main process why this worker cannot start, so it prints one line; if the
    coordinator cannot be reached, print the line here instead."""
    path = os.path.join(settings.runtime_dir, COORDINATOR_SOCKET)
    try:
        channel = await connect(path, _refuse_calls, name="worker-starting")
        try:
            await channel.request("startup_failed", {"problem": problem},
                                  timeout=REPORT_TIMEOUT_S)
        finally:
            await channel.close()
    except (OSError, ChannelLost, TetherError, TimeoutError):
        say(f"tether serve: {problem}", "startup_failed", error=True)


async def _refuse_calls(kind: str, body: Any) -> Any:
    raise TetherError("invalid_request", "this worker is not registered")


def main() -> None:
    settings = WorkerSettings.from_json(os.environ[CONFIG_ENV])
    configure_logging(settings.log_format, settings.log_level)
    if settings.sessions == "mcp":
        # Before the app is imported: the 2.x SDK picks its requestState key when the app
        # builds its MCPServer, at import.
        share_request_state_key(settings.server_secret)
    try:
        app = import_app(settings.app, settings.app_dir, settings.factory)
        kind = resolve_kind(app, settings.sessions, settings.close_window_s)
    except AppError as error:
        asyncio.run(report_startup_failure(settings, str(error)))
        sys.exit(STARTUP_FAILED_EXIT)
    if kind is not None:
        set_close_window(kind.close_window_s)
    tracing.start()  # after the app's import: an SDK it configured there is used
    worker = TetherWorker(app, kind, settings)
    configure_logging(settings.log_format, settings.log_level, worker_id=worker.id)
    listener = socket.socket(fileno=settings.fd)
    config = uvicorn.Config(
        worker,
        **settings.uvicorn,
        lifespan="on",  # tether's own start-up; the app's follows --lifespan (AppLifespan)
        access_log=False,  # the router logs each request once
        log_config=None,
        interface="asgi3",
    )
    routing = worker.routing
    server = worker.server = _PublicServer(config, routing)
    if routing.passthrough is not None and routing.router.tracing is None and fits(config):
        front = config.http = front_protocol(routing.passthrough)

        def handed_in(data: bytes) -> asyncio.Protocol:
            protocol: Any = front(  # (a FrontProtocol)
                config=config, server_state=server.server_state, app_state=server.lifespan.state
            )
            protocol.hand_in(data)
            return protocol  # type: ignore[no-any-return]

        routing.accept_handoffs(handed_in)
    server.run(sockets=[listener])


class _PublicServer(uvicorn.Server):
    """uvicorn's server that stops taking handed-off connections (routing/handoff.py)
    before it closes its own, so those already handed here are closed the same way."""

    def __init__(self, config: uvicorn.Config, routing: RoutingWorker) -> None:
        super().__init__(config)
        self.routing = routing

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.routing.stop_handoffs()
        await super().shutdown(sockets)


if __name__ == "__main__":
    main()
