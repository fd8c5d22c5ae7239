"""The counter over a WebSocket: a session is seeded over HTTP, then counted over `/ws`.

`POST /seed_session {"session_id"}` creates the session's counter on the worker that
serves it (the cookie names it). `/ws`, with that cookie, counts: each text message
`inc` adds one and each `get` reads, both answered `{"count", "worker"}`; `close:CODE:
REASON` makes the app close with that code and reason; a WebSocket for a session this
worker does not hold is refused with 404 `session_lost` (what a worker without the
session can do). `GET /last_close` tells how the session's last WebSocket was closed by
its client. `/flood` sends 64 KiB binary messages until its client leaves, and `GET
/flood_sent` tells how many bytes it got to send. The counters are checkpointable state,
so a prepare counts them, and one that is busy reports it (no WebSocket's is).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tether import checkpointable, cookie_kind, in_process, worker_of

SECRET = "wscounter-secret"
FLOOD_MESSAGE = 64 * 1024


class Counters:
    """The counters this worker holds, by session ID, and what its WebSockets saw."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.closes: dict[str, dict[str, Any]] = {}
        self.flooded: dict[str, int] = {}

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


def _worker(connection: HTTPConnection) -> str:
    return worker_of(connection.scope) or f"pid-{os.getpid()}"


def create_app() -> Starlette:
    counters = Counters()

    def session_id(connection: HTTPConnection) -> str:
        value = connection.session.get("session_id")
        return value if isinstance(value, str) else ""

    async def seed_session(request: Request) -> JSONResponse:
        body = await request.json()
        request.session["session_id"] = body["session_id"]
        counters.counts.setdefault(body["session_id"], 0)
        return JSONResponse({"session_id": body["session_id"], "worker": _worker(request)})

    async def last_close(request: Request) -> JSONResponse:
        closed = counters.closes.get(session_id(request))
        return JSONResponse({"close": closed, "worker": _worker(request)})

    async def flood_sent(request: Request) -> JSONResponse:
        return JSONResponse({"sent": counters.flooded.get(session_id(request), 0)})

    async def refuse_lost(socket: WebSocket, sid: str) -> None:
        await socket.send_denial_response(JSONResponse(
            {"code": "session_lost", "detail": f"no session {sid!r} here",
             "worker": _worker(socket)},
            status_code=404,
        ))

    async def count(socket: WebSocket) -> None:
        sid = session_id(socket)
        if sid not in counters.counts:
            await refuse_lost(socket, sid)
            return
        await socket.accept()
        try:
            while True:
                text = await socket.receive_text()
                if text.startswith("close:"):
                    _, code, reason = text.split(":", 2)
                    await socket.close(int(code), reason)
                    return
                if text == "inc":
                    counters.counts[sid] += 1
                await socket.send_json({"count": counters.counts[sid], "worker": _worker(socket)})
        except WebSocketDisconnect as gone:
            counters.closes[sid] = {"code": gone.code, "reason": gone.reason}

    async def flood(socket: WebSocket) -> None:
        sid = session_id(socket)
        if sid not in counters.counts:
            await refuse_lost(socket, sid)
            return
        await socket.accept()
        payload = b"x" * FLOOD_MESSAGE
        counters.flooded[sid] = 0
        try:
            while True:
                await socket.send_bytes(payload)
                counters.flooded[sid] += len(payload)
        except (WebSocketDisconnect, OSError):
            return

    app = Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/last_close", last_close),
            Route("/flood_sent", flood_sent),
            WebSocketRoute("/ws", count),
            WebSocketRoute("/flood", flood),
        ],
        middleware=[Middleware(SessionMiddleware, secret_key=SECRET)],
    )
    checkpointable(
        app,
        sessions=cookie_kind(app, release=counters.release),
        state=counters,
        state_version="wscounter/1",
    )
    return app


app = in_process(create_app())
