"""A small app with WebSocket endpoints for the WebSocket routing tests; each instance
has its own memory, like a worker."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tether.routing.kinds import SessionKind, cookie_kind, declare
from tether.routing.router import SCOPE_KEY, worker_of

SECRET = "ws-test-secret"
FLOOD_MESSAGE = 64 * 1024


def websocket_app(kind: SessionKind | None = None, **kind_options: Any) -> Starlette:
    """Counters per session, created by an HTTP seed or by a WebSocket that reads its
    session, and probes: what each WebSocket's app saw when it closed, how much a flood
    got to send, gates that hold a handshake before its accept."""
    counts: dict[str, int] = {}
    closes: dict[str, tuple[int, str | None]] = {}
    sent: dict[str, int] = {}
    gates: dict[str, asyncio.Event] = {}
    entered: dict[str, asyncio.Event] = {}
    released: list[str] = []

    async def release(session_id: str) -> None:
        released.append(session_id)
        counts.pop(session_id, None)

    def session_of(socket: WebSocket | Request) -> str:
        if "session" in socket.scope:
            session_id = socket.session.get("session_id")
            if isinstance(session_id, str):
                return session_id
        return str(socket.scope.get(SCOPE_KEY))

    async def seed_session(request: Request) -> JSONResponse:
        body = await request.json()
        counts.setdefault(body["session_id"], 0)
        return JSONResponse({"worker": worker_of(request.scope)})

    async def count(socket: WebSocket) -> None:
        """Each text message counts one; `close:CODE:REASON` closes; bytes echo back."""
        session_id = session_of(socket)  # read before the accept: claims the session
        gate = socket.query_params.get("gate")
        if gate:
            entered.setdefault(gate, asyncio.Event()).set()
            await gates.setdefault(gate, asyncio.Event()).wait()
        await socket.accept()
        try:
            while True:
                message = await socket.receive()
                if message["type"] == "websocket.disconnect":
                    closes[session_id] = (message.get("code", 1005), message.get("reason"))
                    return
                if message.get("bytes") is not None:
                    await socket.send_bytes(message["bytes"])
                    continue
                text: str = message["text"]
                if text.startswith("close:"):
                    _, code, reason = text.split(":", 2)
                    await socket.close(int(code), reason)
                    return
                counts[session_id] = counts.get(session_id, 0) + 1
                await socket.send_text(json.dumps(
                    {"count": counts[session_id], "worker": worker_of(socket.scope),
                     "text": text}
                ))
        except WebSocketDisconnect as gone:
            closes[session_id] = (gone.code, gone.reason)

    async def protocols(socket: WebSocket) -> None:
        """Accepts the client's last subprotocol, with a header of its own."""
        offered = socket.scope["subprotocols"]
        await socket.accept(
            subprotocol=offered[-1] if offered else None,
            headers=[(b"x-accepted-by", worker_of(socket.scope).encode())],
        )
        await socket.send_text(json.dumps({"worker": worker_of(socket.scope)}))
        await socket.close()

    async def deny(socket: WebSocket) -> None:
        await socket.send_denial_response(
            JSONResponse({"denied": True}, status_code=403, headers={"x-why": "policy"})
        )

    async def whoami(socket: WebSocket) -> None:
        """What a handler learns of its caller; never touches the session."""
        scope = socket.scope
        await socket.accept()
        await socket.send_text(json.dumps({
            "worker": worker_of(scope),
            "session_id": scope.get(SCOPE_KEY),
            "client": scope["client"],
            "scheme": scope["scheme"],
            "path": scope["path"],
            "query": scope["query_string"].decode(),
            "headers": [name.decode("latin-1") for name, _ in scope["headers"]],
            "host": socket.headers.get("host"),
        }))
        await socket.close()

    async def flood(socket: WebSocket) -> None:
        """Sends FLOOD_MESSAGE-byte messages until the client leaves, counting them."""
        session_id = session_of(socket)
        await socket.accept()
        payload = b"x" * FLOOD_MESSAGE
        sent[session_id] = 0
        try:
            while True:
                await socket.send_bytes(payload)
                sent[session_id] += len(payload)
        except (WebSocketDisconnect, OSError):
            return

    app = Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            WebSocketRoute("/ws", count),
            WebSocketRoute("/protocols", protocols),
            WebSocketRoute("/deny", deny),
            WebSocketRoute("/whoami", whoami),
            WebSocketRoute("/k/{kid}/whoami", whoami),
            WebSocketRoute("/flood", flood),
        ],
        middleware=[Middleware(SessionMiddleware, secret_key=SECRET, max_age=3600)],
    )
    app.state.counts = counts
    app.state.closes = closes
    app.state.sent = sent
    app.state.gates = gates
    app.state.entered = entered
    app.state.released = released
    declare(app, kind or cookie_kind(app, release=release, **kind_options))
    return app
