"""The counter app, with readiness and export that a test drives through files.

Files in the directory named by `$TETHER_E2E_GATES` (no HTTP: while a checkpoint is open
a request of a held session waits at admission, so the app's own routes cannot reach it):

- `POST /hold` is a request of the cookie's session that stays in progress: it creates
  `holding-<session>`, then returns (counting one) once `release-<session>` exists;
- while `busy-<session>` exists the app reports the session busy, telling tether nothing
  (`busy()` changes silently, as an app's own background work would);
- while `slow-export` exists, exporting a session on a worker it names (one worker ID a
  line; every worker if it names none) creates `exporting` and blocks (a synchronous
  export, as the app's own code would be) until `export-open` exists.

`GET /whoami` answers the ID of the worker that accepted the connection (it names no
session), so a test can learn where a kept-alive connection lands.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether.checkpoint.participant import Participant, declared_participant
from tether.examples.counter import Counters, create_app
from tether.routing.fence import session_lost
from tether.routing.router import worker_of

GATES_ENV = "TETHER_E2E_GATES"
GATE_LIMIT_S = 60.0
"""Nothing waits on a gate longer than this, so a test that fails cannot hang a worker."""


def _gates() -> Path:
    return Path(os.environ[GATES_ENV])


class GatedCounters:
    """The counter's state, with `busy` and `export` driven by the gate files."""

    def __init__(self, inner: Counters, participant: Participant) -> None:
        self.inner = inner
        self.participant = participant

    def sessions(self) -> Any:
        return self.inner.sessions()

    def holds(self, session_id: str) -> bool:
        return self.inner.holds(session_id)

    def export(self, session_id: str) -> int:
        gates = _gates()
        if self._slow(gates / "slow-export"):
            (gates / "exporting").touch()
            deadline = time.monotonic() + GATE_LIMIT_S
            while not (gates / "export-open").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.inner.export(session_id)

    def _slow(self, gate: Path) -> bool:
        try:
            named = gate.read_text().split()
        except FileNotFoundError:
            return False
        return not named or self.participant.worker in named

    async def install(self, session_id: str, state: Any) -> None:
        await self.inner.install(session_id, state)

    async def release(self, session_id: str) -> None:
        await self.inner.release(session_id)

    def busy(self, session_id: str) -> bool:
        return (_gates() / f"busy-{session_id}").exists()


async def _until_exists(path: Path) -> None:
    deadline = time.monotonic() + GATE_LIMIT_S
    while time.monotonic() < deadline:
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.01)


def create_gated_app() -> Starlette:
    """The counter app with `GatedCounters` registered and `POST /hold`."""
    app = create_app()
    counters: Counters = app.state.counters
    participant = declared_participant(app)
    assert participant is not None
    participant.register_sessions(GatedCounters(counters, participant))

    async def hold(request: Request) -> JSONResponse:
        session_id: str = request.session.get("session_id", "")
        if not counters.holds(session_id):
            raise session_lost(session_id)
        gates = _gates()
        await asyncio.to_thread((gates / f"holding-{session_id}").touch)
        await _until_exists(gates / f"release-{session_id}")
        counters.counts[session_id] += 1
        return JSONResponse({"session_id": session_id, "count": counters.counts[session_id],
                             "worker": worker_of(request.scope)})

    async def whoami(request: Request) -> JSONResponse:
        return JSONResponse({"worker": worker_of(request.scope)})

    app.router.routes.append(Route("/hold", hold, methods=["POST"]))
    app.router.routes.append(Route("/whoami", whoami))
    return app


app = create_gated_app()
