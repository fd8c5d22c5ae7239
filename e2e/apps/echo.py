"""An app that tells what its request looked like, for the uvicorn-flag tests.

A session is seeded on one worker (`POST /seed_session`); `GET /echo` with its cookie is
then served by that worker wherever it lands, and answers the worker, the scope's scheme,
root path, path and client, a `url_for`, and `$ECHO_FROM_ENV_FILE`. `GET /slow?s=N`
sleeps N seconds after dropping a marker file into `$TETHER_E2E_MARKERS`; `GET /boom`
raises; `GET /health` answers 200 (what a cluster's tests ask every worker).
`create_app` is the same app as a factory.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether import cookie_kind, declare, worker_of

SECRET = "echo-secret"
MARKERS_ENV = "TETHER_E2E_MARKERS"


def _seen(request: Request) -> dict[str, Any]:
    client = request.scope.get("client")
    return {
        "worker": worker_of(request.scope) or f"pid-{os.getpid()}",
        "session_id": request.session.get("session_id"),
        "scheme": request.scope["scheme"],
        "root_path": request.scope.get("root_path", ""),
        "path": request.scope["path"],
        "client": list(client) if client else None,
        "url_for": str(request.url_for("echo")),
        "env": os.environ.get("ECHO_FROM_ENV_FILE"),
    }


async def seed(request: Request) -> JSONResponse:
    body = await request.json()
    request.session["session_id"] = body["session_id"]
    return JSONResponse(_seen(request))


async def echo(request: Request) -> JSONResponse:
    return JSONResponse(_seen(request))


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def boom(request: Request) -> JSONResponse:
    raise RuntimeError("the route failed on purpose")


async def slow(request: Request) -> JSONResponse:
    markers = os.environ.get(MARKERS_ENV)
    if markers:
        marker = Path(markers, f"{os.getpid()}-{secrets.token_hex(8)}")
        await asyncio.to_thread(marker.touch)
    seconds = float(request.query_params.get("s", "1"))
    await asyncio.sleep(seconds)
    return JSONResponse({"slept": seconds, **_seen(request)})


def create_app() -> Starlette:
    """A fresh echo app (the factory `tether serve --factory e2e.apps.echo:create_app` calls)."""
    app = Starlette(
        routes=[
            Route("/seed_session", seed, methods=["POST"]),
            Route("/echo", echo, name="echo"),
            Route("/slow", slow),
            Route("/boom", boom),
            Route("/health", health),
        ],
        middleware=[Middleware(SessionMiddleware, secret_key=SECRET)],
    )
    declare(app, cookie_kind(app))
    return app


app = create_app()
