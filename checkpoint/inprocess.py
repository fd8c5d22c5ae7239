"""Plain `uvicorn app:app`: the participant serves the control API in-process (SPEC 3).

`in_process(app)` wraps an app that declares its kind and participant. Under plain
uvicorn with one worker the wrapper is the whole server: control routes, admission and
the session checks a one-worker tether server makes. `tether serve` unwraps it and
serves the inner app itself. Under `uvicorn --workers N>1` each worker would hold only
its own share of the state, so control calls answer 409 `unsupported_topology`.

Settings come from the environment: `TETHER_CONTROL_TOKEN` (without it every control
call is 401), `TETHER_CHECKPOINT_ROOT` and `TETHER_NAME`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.control import ControlApp
from tether.checkpoint.fleet import LocalFleet
from tether.checkpoint.participant import Participant, declared_participant
from tether.routing import tracing
from tether.routing.errors import TetherError, send_error
from tether.routing.kinds import declared_kind
from tether.routing.router import Router
from tether.routing.types import new_worker_id

TOKEN_ENV = "TETHER_CONTROL_TOKEN"
ROOT_ENV = "TETHER_CHECKPOINT_ROOT"
NAME_ENV = "TETHER_NAME"


def uvicorn_worker_count(argv: list[str] | None = None) -> int:
    """How many workers the plain uvicorn that started this process runs.

    Spawned uvicorn workers inherit the parent's argv; `WEB_CONCURRENCY` is uvicorn's
    environment default for `--workers`.
    """
    if multiprocessing.parent_process() is None:
        return 1
    args = sys.argv if argv is None else argv
    count = os.environ.get("WEB_CONCURRENCY", "1")
    for index, arg in enumerate(args):
        if arg == "--workers" and index + 1 < len(args):
            count = args[index + 1]
        elif arg.startswith("--workers="):
            count = arg.split("=", 1)[1]
    return int(count) if count.isdigit() else 1


class InProcess:
    """An app served in-process with tether's control API (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.participant = declared_participant(app) or Participant()
        worker = new_worker_id()
        self.participant.worker = worker
        self.checkpointer = Checkpointer(
            LocalFleet(self.participant),
            name=os.environ.get(NAME_ENV),
            root=os.environ.get(ROOT_ENV),
        )
        self._started = False
        token = os.environ.get(TOKEN_ENV)
        self.router = Router(
            app,
            worker=worker,
            kind=declared_kind(app),
            control=ControlApp(token, self._control) if token else _NoToken(),
            admission=self.participant,
            access_log=False,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.router(scope, receive, send)
            return

        async def tracked() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._start()
            elif message["type"] == "lifespan.shutdown" and self._started:
                await self.checkpointer.stop()
                self._started = False
            return message

        await self.app(scope, tracked, send)

    def _start(self) -> None:
        if not self._started:
            tracing.start()  # this process's start, as far as tether can tell
            self.checkpointer.start()
            self._started = True

    async def _control(self, call: str, body: dict[str, Any]) -> Any:
        workers = uvicorn_worker_count()
        if workers > 1:
            raise TetherError(
                "unsupported_topology",
                f"plain uvicorn with {workers} workers gives each worker only its own "
                "share of the state; serve the app with `tether serve --workers N`",
            )
        if call == "metrics":
            raise TetherError(
                "unsupported_topology",
                "tether's metrics are rendered by the main process of `tether serve` "
                "(docs/observability.md); serve the app with `tether serve`",
            )
        self._start()  # lifespan may be off
        return await self.checkpointer.call(call, body)


class _NoToken:
    """Control routes when no token is configured: every call is 401."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_error(
            send, TetherError("unauthorized", f"no control token: set {TOKEN_ENV}")
        )


def in_process(app: ASGIApp) -> InProcess:
    """Wrap an app for plain uvicorn; `tether serve` unwraps it."""
    return InProcess(app)
