"""The counter app and long episodes in one participant, with gates the fault-injection
tests hold a checkpoint at (e2e/test_faults_e2e.py, e2e/test_unhappy_paths_e2e.py).

Files in the directory named by `$TETHER_E2E_GATES`, besides `e2e/apps/gated.py`'s
(`slow-export` / `exporting` / `export-open`, `busy-<session>`):

- while `slow-install` exists, installing a session on a worker it names (one worker ID
  a line; every worker if it names none) creates `installing-<worker>` and waits, on the
  event loop (the worker goes on answering), until `install-open` exists;
- `POST /seed_session {"session_id", "build": true}` is a seed that builds its state
  slowly: the session is held at once, half built (count -1), and the seed creates
  `seeding-<session>` and only completes it (count 0) once `seeded-<session>` exists;
- `POST /run {"episode_id", "attempt", "steps", "step_ms", "gate"?}` runs an episode with
  a boundary after each step, as `tether.examples.episodes` does; with `gate`, every step
  waits until the file `gate` exists and ignores cancellation meanwhile (an app's step
  that cannot be interrupted), so a retire cannot stop it before the gate opens.

Nothing waits on a gate longer than `GATE_LIMIT_S`, so a failing test cannot hang a worker.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from e2e.apps.gated import GATE_LIMIT_S, GatedCounters, create_gated_app
from tether.checkpoint.participant import Participant, declared_participant
from tether.examples.counter import Counters
from tether.routing.errors import TetherError
from tether.routing.fence import seed_rejected
from tether.routing.router import worker_of
from tether.routing.types import session_id_or_none


def _gates() -> Path:
    return Path(os.environ["TETHER_E2E_GATES"])


def _names(gate: Path, worker: str | None) -> bool:
    """Whether `gate` exists and names `worker` (or names nobody: every worker)."""
    try:
        named = gate.read_text().split()
    except FileNotFoundError:
        return False
    return not named or worker in named


async def _until_exists(path: Path, stubborn: bool = False) -> None:
    """Wait until `path` exists (at most GATE_LIMIT_S); `stubborn` ignores cancellation
    meanwhile, as a step in C code or a thread would."""
    deadline = time.monotonic() + GATE_LIMIT_S
    task = asyncio.current_task()
    while time.monotonic() < deadline:
        try:
            if await asyncio.to_thread(path.exists):
                return
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if not stubborn or task is None:
                raise
            task.uncancel()


class FaultCounters(GatedCounters):
    """`GatedCounters` whose install can be held on chosen workers."""

    async def install(self, session_id: str, state: Any) -> None:
        gates = _gates()
        if _names(gates / "slow-install", self.participant.worker):
            await asyncio.to_thread((gates / f"installing-{self.participant.worker}").touch)
            await _until_exists(gates / "install-open")
        await self.inner.install(session_id, state)


class Run(BaseModel):
    model_config = ConfigDict(extra="forbid")
    episode_id: str = Field(min_length=1, max_length=256)
    attempt: int = Field(ge=1)
    steps: int = Field(ge=0, le=100_000)
    step_ms: float = Field(ge=0, le=60_000)
    gate: str | None = None


def create_faults_app() -> Starlette:
    """The gated counter with `FaultCounters`, a slowly built seed and `/run`."""
    app = create_gated_app()
    counters: Counters = app.state.counters
    participant = declared_participant(app)
    assert participant is not None
    participant.register_sessions(FaultCounters(counters, participant))

    async def seed_session(request: Request) -> JSONResponse:
        body: Any = await request.json()
        session_id = session_id_or_none(body.get("session_id") if isinstance(body, dict) else None)
        if session_id is None:
            raise seed_rejected("session_id must be 1 to 256 printable ASCII characters")
        async with counters.fence.locked(session_id):
            counters.fence.raise_if_closed(session_id)
            if body.get("build") and session_id not in counters.counts:
                counters.counts[session_id] = -1  # held, half built
                gates = _gates()
                await asyncio.to_thread((gates / f"seeding-{session_id}").touch)
                await _until_exists(gates / f"seeded-{session_id}")
                counters.counts[session_id] = 0
            counters.counts.setdefault(session_id, 0)
        request.session["session_id"] = session_id
        return JSONResponse({"session_id": session_id, "worker": worker_of(request.scope)})

    async def run(request: Request) -> JSONResponse:
        return await _run(request, participant)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "worker": worker_of(request.scope)})

    # Ahead of the counter's own seed and health routes.
    app.router.routes[:0] = [
        Route("/seed_session", seed_session, methods=["POST"]),
        Route("/run", run, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    return app


async def _run(request: Request, participant: Participant) -> JSONResponse:
    try:
        body = Run.model_validate(await request.json())
    except (ValueError, ValidationError) as error:
        raise TetherError("invalid_request", str(error)) from None
    worker = worker_of(request.scope) or f"pid-{os.getpid()}"
    gate = None if body.gate is None else _gates() / body.gate
    async with participant.episode(
        body.episode_id, body.attempt, request.is_disconnected
    ) as episode:
        state: dict[str, Any] = dict(episode.resumed or {"step": 0, "workers": []})
        resumed_from = int(state["step"])
        for _ in range(resumed_from, body.steps):
            if gate is not None:
                await _until_exists(gate, stubborn=True)
            await asyncio.sleep(body.step_ms / 1000)
            state = {"step": state["step"] + 1, "workers": [*state["workers"], worker]}
            await episode.boundary(state)
    return JSONResponse({
        "episode_id": body.episode_id,
        "attempt": body.attempt,
        "steps_done": state["step"],
        "resumed_from": resumed_from,
        "workers": state["workers"],
    })


app = create_faults_app()
