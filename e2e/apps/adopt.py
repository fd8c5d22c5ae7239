"""A test app whose `/adopt` puts state for a named session on the worker that serves it
without claiming it (it never touches `request.session`), so two workers can end up
holding one session: what `session_duplicate` guards against."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether.checkpoint.participant import Participant, declare_participant
from tether.routing.kinds import cookie_kind, declare


class States:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def sessions(self) -> Iterable[str]:
        return self.values.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.values

    def export(self, session_id: str) -> Any:
        return self.values[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        self.values[session_id] = state

    async def release(self, session_id: str) -> None:
        self.values.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False


states = States()


async def adopt(request: Request) -> JSONResponse:
    body = await request.json()
    states.values[body["session_id"]] = "adopted"
    return JSONResponse({"held": sorted(states.values)})


app = Starlette(
    routes=[Route("/adopt", adopt, methods=["POST"])],
    middleware=[Middleware(SessionMiddleware, secret_key="adopt-secret")],
)
declare(app, cookie_kind(app))
participant = Participant(state_version="adopt/1")
participant.register_sessions(states)
declare_participant(app, participant)
