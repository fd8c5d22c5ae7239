"""A per-session counter kept in worker memory: the reference app of SPEC section 10.

Run it on four workers with `tether serve tether.examples.counter:app --workers 4`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether import (
    CLOSE_FOLLOWS_HEADER,
    SessionFence,
    TetherError,
    checkpointable,
    cookie_kind,
    in_process,
    lost_verification,
    seed_rejected,
    session_id_or_none,
    session_lost,
    tether_error_response,
    worker_of,
)

SECRET = os.environ.get("COUNTER_SECRET", "counter-example-secret")


class Counters:
    """The counters this worker holds, by session ID; checkpointed as plain ints."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.fence = SessionFence()

    def sessions(self) -> Iterable[str]:
        return self.counts.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.counts

    def export(self, session_id: str) -> int:
        return self.counts[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        self.counts[session_id] = int(state)

    async def release(self, session_id: str) -> None:
        self.counts.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False


def _worker(request: Request) -> str:
    return worker_of(request.scope) or f"pid-{os.getpid()}"


async def _body_session_id(request: Request) -> str:
    try:
        body: Any = await request.json()
    except (ValueError, RecursionError) as error:  # (nested past the stack: not JSON here)
        raise seed_rejected("the body is not JSON") from error
    session_id = session_id_or_none(body.get("session_id") if isinstance(body, dict) else None)
    if session_id is None:
        raise seed_rejected("session_id must be 1 to 256 printable ASCII characters")
    return session_id


def create_app(secret: str = SECRET) -> Starlette:
    """A fresh counter app with its own counters (one per worker process)."""
    counters = Counters()

    def held(request: Request) -> str:
        session_id: str = request.session.get("session_id", "")
        if not counters.holds(session_id):
            raise session_lost(session_id)
        return session_id

    def reply(request: Request, session_id: str) -> JSONResponse:
        return JSONResponse(
            {"session_id": session_id, "count": counters.counts[session_id],
             "worker": _worker(request)}
        )

    async def seed_session(request: Request) -> JSONResponse:
        session_id = await _body_session_id(request)
        async with counters.fence.locked(session_id):
            counters.fence.raise_if_closed(session_id)
            counters.counts.setdefault(session_id, 0)
        request.session["session_id"] = session_id  # so it also works without tether
        return JSONResponse({"session_id": session_id, "worker": _worker(request)})

    async def increment(request: Request) -> JSONResponse:
        session_id = held(request)
        counters.counts[session_id] += 1
        return reply(request, session_id)

    async def count(request: Request) -> JSONResponse:
        return reply(request, held(request))

    async def verify(request: Request) -> JSONResponse:
        session_id: str = request.session.get("session_id", "")
        if not counters.holds(session_id):
            return JSONResponse(lost_verification(session_id))
        result = {"session_id": session_id, "count": counters.counts[session_id]}
        if request.headers.get(CLOSE_FOLLOWS_HEADER) != "1":
            async with counters.fence.locked(session_id):
                await counters.release(session_id)
                counters.fence.close(session_id)
        return JSONResponse(result)

    async def close_session(request: Request) -> JSONResponse:
        session_id = await _body_session_id(request)
        async with counters.fence.locked(session_id):
            await counters.release(session_id)
            counters.fence.close(session_id)
        return JSONResponse({"session_id": session_id, "closed": True})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/increment", increment, methods=["POST"]),
            Route("/count", count, methods=["GET"]),
            Route("/verify", verify, methods=["POST"]),
            Route("/close_session", close_session, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[Middleware(SessionMiddleware, secret_key=secret)],
        exception_handlers={TetherError: tether_error_response},
    )
    app.state.counters = counters
    checkpointable(
        app,
        sessions=cookie_kind(app, release=counters.release),
        state=counters,
        state_version="counter/1",
    )
    return app


# Plain `uvicorn tether.examples.counter:app` serves the control API in-process;
# tether serve unwraps it.
app = in_process(create_app())
