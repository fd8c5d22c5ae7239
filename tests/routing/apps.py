"""Small apps the routing tests serve, each instance with its own memory."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether.routing.kinds import SessionKind, cookie_kind, declare
from tether.routing.router import worker_of

SECRET = "test-secret"


def session_app(**kind_options: Any) -> Starlette:
    """An app whose handlers create session state implicitly, plus probes for the tests."""
    state: dict[str, int] = {}
    gates: dict[str, asyncio.Event] = {}
    entered: dict[str, asyncio.Event] = {}

    async def release(session_id: str) -> None:
        state.pop(session_id, None)

    async def seed_session(request: Request) -> JSONResponse:
        # Never reads the session: the start route must claim it anyway.
        body = await request.body()
        return JSONResponse(
            {"worker": worker_of(request.scope), "sha256": hashlib.sha256(body).hexdigest()}
        )

    async def touch(request: Request) -> JSONResponse:
        session_id = request.session["session_id"]
        state[session_id] = state.get(session_id, 0) + 1
        gate = request.query_params.get("gate")
        if gate:
            entered.setdefault(gate, asyncio.Event()).set()
            await gates.setdefault(gate, asyncio.Event()).wait()
        return JSONResponse(
            {"session_id": session_id, "n": state[session_id], "worker": worker_of(request.scope)}
        )

    async def write(request: Request) -> JSONResponse:
        request.session["note"] = "written"
        return JSONResponse({"session_id": request.session["session_id"]})

    async def plain(request: Request) -> JSONResponse:
        return JSONResponse({"worker": worker_of(request.scope)})

    async def whoami(request: Request) -> JSONResponse:
        # What a handler learns of its caller; never touches the session.
        scope = request.scope
        return JSONResponse(
            {
                "worker": worker_of(scope),
                "client": scope["client"],
                "server": scope["server"],
                "scheme": scope["scheme"],
                "root_path": scope["root_path"],
                "path": scope["path"],
                "raw_path": scope["raw_path"].decode("latin-1"),
                "url_for": str(request.url_for("whoami")),
                "headers": [name.decode("latin-1") for name, _ in scope["headers"]],
            }
        )

    async def login(request: Request) -> JSONResponse:
        # Rotates the session ID, as a login should, and moves the state to the new ID.
        old = request.session["session_id"]
        new = request.query_params.get("to") or secrets.token_hex(16)
        if old in state:
            state[new] = state.pop(old)
        request.session["session_id"] = new
        return JSONResponse({"old": old, "new": new, "worker": worker_of(request.scope)})

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "worker": worker_of(request.scope),
                "path": request.url.path,
                "query": request.url.query,
            }
        )

    app = Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/close_session", plain, methods=["POST"]),
            Route("/touch", touch, methods=["GET", "POST"]),
            Route("/write", write, methods=["POST"]),
            Route("/health", plain),
            Route("/echo", echo, methods=["GET", "POST"]),
            Route("/whoami", whoami, name="whoami"),
            Route("/login", login, methods=["POST"]),
        ],
        middleware=[Middleware(SessionMiddleware, secret_key=SECRET, max_age=3600)],
    )
    app.state.values = state
    app.state.gates = gates
    app.state.entered = entered
    declare(app, cookie_kind(app, release=release, **kind_options))
    return app


def header_app(kind: SessionKind) -> Starlette:
    """An app with no cookies whose sessions are named by a header or query parameter."""
    seen: list[str] = []

    async def where(request: Request) -> JSONResponse:
        seen.append(request.url.path)
        return JSONResponse({"worker": worker_of(request.scope)})

    app = Starlette(routes=[Route("/where", where), Route("/start", where, methods=["POST"])])
    declare(app, kind)
    return app
