"""A small app of blob sessions, served by `tether serve e2e.apps.blobs:app` and used
in process by tests/checkpoint: `POST /seed_session {session_id, size}` stores `size`
deterministic bytes as the session's state, `GET /blob` answers their sha256 and
length."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether.checkpoint.participant import Participant, declare_participant
from tether.routing.errors import TetherError
from tether.routing.fence import tether_error_response
from tether.routing.kinds import cookie_kind, declare


class Blobs:
    """Session state of arbitrary bytes; an export of a `poisoned` session fails the way
    an app bug would."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.poisoned: set[str] = set()

    def sessions(self) -> Iterable[str]:
        return self.data.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.data

    def export(self, session_id: str) -> bytes:
        if session_id in self.poisoned:
            raise RuntimeError(f"the app cannot export {session_id!r}")
        return self.data[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        if not isinstance(state, bytes):
            raise TypeError(f"a blob is bytes, not {type(state).__name__}")
        self.data[session_id] = state

    async def release(self, session_id: str) -> None:
        self.data.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False


def blob_bytes(session_id: str, size: int) -> bytes:
    """The deterministic blob a seed of `size` bytes stores for `session_id`."""
    return random.Random(session_id).randbytes(size)


def blob_app() -> Starlette:
    """`POST /seed_session {session_id, size}` stores `size` deterministic bytes;
    `GET /blob` answers their sha256 and length."""
    blobs = Blobs()

    async def seed(request: Request) -> JSONResponse:
        body: Mapping[str, Any] = await request.json()
        session_id = str(body["session_id"])
        blobs.data[session_id] = blob_bytes(session_id, int(body.get("size", 0)))
        request.session["session_id"] = session_id
        return JSONResponse({"session_id": session_id})

    async def blob(request: Request) -> JSONResponse:
        session_id = request.session.get("session_id", "")
        if session_id not in blobs.data:
            raise TetherError("session_lost", session_id)
        data = blobs.data[session_id]
        return JSONResponse({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})

    app = Starlette(
        routes=[Route("/seed_session", seed, methods=["POST"]), Route("/blob", blob)],
        middleware=[Middleware(SessionMiddleware, secret_key="blob-secret")],
        exception_handlers={TetherError: tether_error_response},
    )
    app.state.blobs = blobs
    declare(app, cookie_kind(app, release=blobs.release))
    participant = Participant(state_version="blobs/1")
    participant.register_sessions(blobs)
    declare_participant(app, participant)
    return app


app = blob_app()
