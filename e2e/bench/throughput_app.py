"""The throughput benchmark's app: one route that counts requests per session, served the
same under `tether serve` (each session on one worker) and under plain `uvicorn
--workers N` (each worker counts whatever reaches it: the same handler, no sessions).

    GET /count     with a `session` cookie naming `session_id`: {"count", "worker"}
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether import cookie_kind, declare, worker_of

SECRET = "throughput-bench-secret"


def create_app() -> Starlette:
    counts: dict[str, int] = {}

    async def count(request: Request) -> JSONResponse:
        session_id: str = request.session.get("session_id", "")
        counts[session_id] = counts.get(session_id, 0) + 1
        worker = worker_of(request.scope) or f"pid-{os.getpid()}"
        return JSONResponse({"count": counts[session_id], "worker": worker})

    app = Starlette(
        routes=[Route("/count", count, methods=["GET"])],
        middleware=[Middleware(SessionMiddleware, secret_key=SECRET)],
    )
    declare(app, cookie_kind(app))
    return app


app = create_app()
