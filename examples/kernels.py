"""A Jupyter-like kernel server: the REST-style reference app (SPEC 4.1, 4.8).

Kernels live in worker memory; the URL names them, as Jupyter's does:

| route | does |
| --- | --- |
| `POST /api/kernels` | a new kernel; answers `{"id", "worker"}` (the ID is minted here) |
| `GET /api/kernels/{id}` | `{"id", "execution_count", "worker"}` |
| `POST /api/kernels/{id}/execute {"code"}` | one statement; `{execution_count, result, worker}` |
| `WS /api/kernels/{id}/channels` | each text message `{"code"}` runs one statement; same reply |
| `DELETE /api/kernels/{id}` | ends the kernel |
| `GET /health` | `{"ok": true}` |

A statement is a tiny language, never Python: `x = 5`, `x += 2`, `x -= 1` or `x` (an
integer variable per kernel). The app declares its kind (the path names the kernel, the
start route's reply names a new one) and its state, and has no routing code::

    tether serve tether.examples.kernels:app --workers 4
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tether import (
    SessionKind,
    TetherError,
    checkpointable,
    in_process,
    session_lost,
    tether_error_response,
    worker_of,
)

STATEMENT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:(=|\+=|-=)\s*(-?\d{1,18}))?\s*$")

KIND = SessionKind(
    paths=("/api/kernels/{session_id}",),
    starts=("POST /api/kernels",),
    reply_field="id",
    ends=("DELETE /api/kernels/{session_id}",),
    seeds=(),
    closes=(),
    token_header=None,
    mints=False,
)


class Kernels:
    """The kernels this worker holds: each a namespace of integers and a count."""

    def __init__(self) -> None:
        self.kernels: dict[str, dict[str, Any]] = {}

    def sessions(self) -> Iterable[str]:
        return self.kernels.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.kernels

    def export(self, session_id: str) -> dict[str, Any]:
        return self.kernels[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        self.kernels[session_id] = {"count": int(state["count"]),
                                    "names": {str(k): int(v) for k, v in state["names"].items()}}

    async def release(self, session_id: str) -> None:
        self.kernels.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False

    def execute(self, kernel_id: str, code: str) -> dict[str, Any]:
        """Run one statement in a kernel; its count and result."""
        kernel = self.kernels.get(kernel_id)
        if kernel is None:
            raise session_lost(kernel_id)
        match = STATEMENT.match(code)
        if match is None:
            raise TetherError("invalid_request", f"not a statement: {code[:80]!r}")
        name, op, value = match.groups()
        names = kernel["names"]
        if op == "=":
            names[name] = int(value)
        elif op is not None:
            names[name] = names.get(name, 0) + (int(value) if op == "+=" else -int(value))
        kernel["count"] += 1
        return {"execution_count": kernel["count"], "result": names.get(name)}


def _worker(scope: Any) -> str:
    return worker_of(scope) or f"pid-{os.getpid()}"


def create_app() -> Starlette:
    """A fresh kernel server (one per worker process)."""
    kernels = Kernels()

    async def start(request: Request) -> JSONResponse:
        kernel_id = secrets.token_hex(16)
        kernels.kernels[kernel_id] = {"count": 0, "names": {}}
        return JSONResponse({"id": kernel_id, "worker": _worker(request.scope)}, 201)

    async def info(request: Request) -> JSONResponse:
        kernel_id = request.path_params["kernel_id"]
        if not kernels.holds(kernel_id):
            raise session_lost(kernel_id)
        count = kernels.kernels[kernel_id]["count"]
        return JSONResponse({"id": kernel_id, "execution_count": count,
                             "worker": _worker(request.scope)})

    async def execute(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            body = None
        code = body.get("code") if isinstance(body, dict) else None
        if not isinstance(code, str):
            raise TetherError("invalid_request", "the body must be {\"code\": \"...\"}")
        result = kernels.execute(request.path_params["kernel_id"], code)
        return JSONResponse({**result, "worker": _worker(request.scope)})

    async def delete(request: Request) -> Response:
        await kernels.release(request.path_params["kernel_id"])
        return Response(status_code=204)

    async def channels(websocket: WebSocket) -> None:
        kernel_id = websocket.path_params["kernel_id"]
        if not kernels.holds(kernel_id):
            await websocket.close(code=4404, reason="no such kernel here")
            return
        await websocket.accept()
        try:
            while True:
                message = await websocket.receive_json()
                code = message.get("code") if isinstance(message, dict) else None
                try:
                    result = kernels.execute(kernel_id, str(code))
                except TetherError as error:
                    await websocket.send_json({"error": error.body()})
                    continue
                await websocket.send_json({**result, "worker": _worker(websocket.scope)})
        except WebSocketDisconnect:
            return

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/api/kernels", start, methods=["POST"]),
            Route("/api/kernels/{kernel_id}", info, methods=["GET"]),
            Route("/api/kernels/{kernel_id}", delete, methods=["DELETE"]),
            Route("/api/kernels/{kernel_id}/execute", execute, methods=["POST"]),
            WebSocketRoute("/api/kernels/{kernel_id}/channels", channels),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={TetherError: tether_error_response},
    )
    app.state.kernels = kernels
    checkpointable(app, sessions=KIND, state=kernels, state_version="kernels/1")
    return app


# Plain `uvicorn tether.examples.kernels:app` serves the control API in-process.
app = in_process(create_app())
