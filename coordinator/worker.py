"""A worker process of `tether serve`: the user's app behind the router, registered with
the coordinator before it accepts a connection (SPEC 3).

The supervisor starts it with `python -c "from coordinator.worker import main; main()"`
(not `-m`, which would import this module twice); the launcher passes the listening
socket as an inherited file descriptor and the settings as JSON in `TETHER_WORKER`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from checkpoint.checkpointer import Checkpointer
from checkpoint.control import ControlApp
from checkpoint.fleet import LocalFleet
from checkpoint.participant import Participant, declared_participant
from checkpoint.store import resolve_latest
from coordinator.apps import Preset, import_app, resolve_kind
from coordinator.channel import Channel, connect
from coordinator.lifespan import AppLifespan
from coordinator.runtime import COORDINATOR_SOCKET
from routing.errors import TetherError
from routing.kinds import SessionKind
from routing.logs import LogFormat, configure_logging
from routing.types import WorkerId, worker_id_or_none
from routing.worker import RoutingWorker

log = structlog.get_logger("tether.worker")

CONFIG_ENV = "TETHER_WORKER"
REGISTER_TIMEOUT_S = 30.0
RELAY_TIMEOUT_S = 120.0
FORCE_EXIT_AFTER_S = 3.0
RESTORE_DEADLINE_S = 600.0


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
        self.routing = RoutingWorker(
            app,
            kind=kind,
            runtime_dir=settings.runtime_dir if settings.workers > 1 else None,
            control=ControlApp(settings.token, self._control),
            admission=self.participant,
        )
        self.participant.worker = self.routing.id
        self.checkpointer: Checkpointer | None = None
        if settings.workers == 1:
            fleet = LocalFleet(self.participant, None, self.routing.is_open, self.routing.stats)
            self.checkpointer = Checkpointer(
                fleet, name=settings.name, root=settings.checkpoint_root
            )
        self.server: uvicorn.Server | None = None
        self.channel: Channel | None = None
        self._watch: asyncio.Task[None] | None = None
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
        app_lifespan = AppLifespan(self.app, scope)
        try:
            await app_lifespan.startup()
            await self.routing.start()
            if self.checkpointer is not None:
                self.checkpointer.start()
                await self._restore()
            await self._register()
        except Exception as error:
            log.exception("worker_start_failed")
            await self._stop_routing()
            await send({"type": "lifespan.startup.failed", "message": str(error)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()
        self._stopping = True
        await self._stop_routing()
        try:
            await app_lifespan.shutdown()
        except Exception as error:
            await send({"type": "lifespan.shutdown.failed", "message": str(error)})
            return
        await send({"type": "lifespan.shutdown.complete"})

    async def _register(self) -> None:
        path = os.path.join(self.settings.runtime_dir, COORDINATOR_SOCKET)
        self.channel = await connect(path, self._handle, name=f"worker-{self.id[:8]}")
        welcome = await self.channel.request(
            "register", {"worker": self.id, "pid": os.getpid()}, timeout=REGISTER_TIMEOUT_S
        )
        self._apply_live(welcome["live"])
        self._watch = asyncio.create_task(self._watch_coordinator(), name="tether-coordinator")
        log.info("worker_registered", live=len(welcome["live"]))

    async def _restore(self) -> None:
        """`--restore ID|latest`: restore, then resume, before serving any request."""
        checkpoint_id = self.settings.restore
        if checkpoint_id is None or self.checkpointer is None:
            return
        if checkpoint_id == "latest":
            assert self.settings.checkpoint_root is not None
            checkpoint_id = await asyncio.to_thread(
                resolve_latest, self.settings.checkpoint_root, self.settings.name
            )
            if checkpoint_id is None:
                log.info("no_checkpoint_yet", restore="latest")
                return
        answer = await self.checkpointer.call(
            "restore", {"checkpoint_id": checkpoint_id, "deadline_s": RESTORE_DEADLINE_S}
        )
        await self.checkpointer.call("resume", {"checkpoint_id": checkpoint_id})
        log.info("restored", checkpoint_id=checkpoint_id,
                 sessions=answer["installed_sessions"], episodes=len(answer["held_episodes"]))

    async def _control(self, call: str, body: dict[str, Any]) -> Any:
        if self.checkpointer is not None:
            return await self.checkpointer.call(call, body)
        return await self._relay(call, body)

    async def _stop_routing(self) -> None:
        if self.checkpointer is not None:
            await self.checkpointer.stop()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.routing.stop()
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
            self._apply_live(body["workers"])
            return None
        if kind == "stats":
            provider = self.participant.provider
            return {
                **self.routing.stats(),
                "sessions": sum(1 for _ in provider.sessions()) if provider else 0,
                "episodes": len(self.participant.episodes),
            }
        raise TetherError("invalid_request", f"unknown call {kind!r}")

    def _apply_live(self, workers: list[str]) -> None:
        live = [w for w in (worker_id_or_none(w) for w in workers) if w is not None]
        self.routing.tables.set_live([*live, self.id])

    async def _relay(self, call: str, body: Any) -> Any:
        if self.channel is None:
            raise TetherError("worker_unreported", "this worker is not registered yet")
        return await self.channel.request(call, body, timeout=RELAY_TIMEOUT_S)


def main() -> None:
    settings = WorkerSettings.from_json(os.environ[CONFIG_ENV])
    app = import_app(settings.app)
    kind = resolve_kind(app, settings.sessions, settings.close_window_s)
    worker = TetherWorker(app, kind, settings)
    configure_logging(settings.log_format, worker_id=worker.id)
    listener = socket.socket(fileno=settings.fd)
    config = uvicorn.Config(
        worker,
        lifespan="on",
        access_log=False,
        log_config=None,
        http="httptools",
            interface="asgi3",
        timeout_graceful_shutdown=20,
    )
    worker.server = uvicorn.Server(config)
    worker.server.run(sockets=[listener])


if __name__ == "__main__":
    main()
