"""Long episodes with a boundary after each step: the reference app of SPEC section 10.

`POST /run {"episode_id", "attempt", "steps", "step_ms"}` runs the episode; a checkpoint
parks it at its next boundary, and after a restore attempt+1 continues from there.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether import (
    Participant,
    TetherError,
    declare_participant,
    in_process,
    tether_error_response,
    worker_of,
)


class Run(BaseModel):
    model_config = ConfigDict(extra="forbid")
    episode_id: str = Field(min_length=1, max_length=256)
    attempt: int = Field(ge=1)
    steps: int = Field(ge=0, le=100_000)
    step_ms: float = Field(ge=0, le=60_000)


def create_app() -> Starlette:
    """A fresh episodes app with its own participant."""
    participant = Participant(state_version="episodes/1")

    async def run(request: Request) -> JSONResponse:
        try:
            body = Run.model_validate(await request.json())
        except (ValueError, RecursionError, ValidationError) as error:
            raise TetherError("invalid_request", str(error)) from None
        worker = worker_of(request.scope) or f"pid-{os.getpid()}"
        async with participant.episode(
            body.episode_id, body.attempt, request.is_disconnected
        ) as episode:
            state: dict[str, Any] = dict(episode.resumed or {"step": 0, "workers": []})
            resumed_from = int(state["step"])
            for _ in range(resumed_from, body.steps):
                await asyncio.sleep(body.step_ms / 1000)
                state = {"step": state["step"] + 1, "workers": [*state["workers"], worker]}
                await episode.boundary(state)
        return JSONResponse(
            {
                "episode_id": body.episode_id,
                "attempt": body.attempt,
                "steps_done": state["step"],
                "resumed_from": resumed_from,
                "workers": state["workers"],
            }
        )

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[Route("/run", run, methods=["POST"]), Route("/health", health)],
        exception_handlers={TetherError: tether_error_response},
    )
    declare_participant(app, participant)
    return app


# Plain `uvicorn examples.episodes:app` serves the control API in-process; tether serve unwraps it.
app = in_process(create_app())
