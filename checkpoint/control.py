"""The control API (SPEC 6): bearer auth, strict bodies, then one backend call.

The backend is the in-process `Checkpointer` (plain uvicorn, one worker) or a relay to
the coordinator; either way the answers and error codes are the same.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.types import Receive, Scope, Send

from tether.checkpoint.store import validate_checkpoint_id
from tether.routing.errors import TetherError, send_error, send_json
from tether.routing.sources import route_path

Backend = Callable[[str, dict[str, Any]], Awaitable[Any]]

MAX_CONTROL_BODY = 1024 * 1024
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
"""Prometheus's text format, which `GET /_tether/metrics` answers in (SPEC 9)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _WithId(_Body):
    checkpoint_id: str

    @field_validator("checkpoint_id", mode="before")
    @classmethod
    def _valid_id(cls, value: Any) -> Any:
        return value  # checked after validation, so its own code (422) is kept


class Prepare(_WithId):
    deadline_s: float | None = Field(default=None, gt=0)
    lease_s: float | None = Field(default=None, gt=0)


class Commit(_WithId):
    scope: list[str] | None = None
    deadline_s: float | None = Field(default=None, gt=0)


class Resume(_WithId):
    pass


class Renew(_WithId):
    lease_s: float | None = Field(default=None, gt=0)


class Restore(_WithId):
    deadline_s: float | None = Field(default=None, gt=0)
    scope: list[str] | None = None
    dry_run: bool = False


class AbortRestore(_WithId):
    pass


class Retire(_Body):
    episode_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    deadline_s: float | None = Field(default=None, gt=0)


class Forget(_Body):
    episode_ids: list[str]


ROUTES: dict[tuple[str, str], tuple[str, type[_Body] | None]] = {
    ("GET", "/_tether/status"): ("status", None),
    ("GET", "/_tether/metrics"): ("metrics", None),
    ("POST", "/_tether/prepare"): ("prepare", Prepare),
    ("POST", "/_tether/commit"): ("commit", Commit),
    ("POST", "/_tether/resume"): ("resume", Resume),
    ("POST", "/_tether/renew"): ("renew", Renew),
    ("POST", "/_tether/restore"): ("restore", Restore),
    ("POST", "/_tether/abort_restore"): ("abort_restore", AbortRestore),
    ("POST", "/_tether/retire"): ("retire", Retire),
    ("POST", "/_tether/forget"): ("forget", Forget),
}


class ControlApp:
    """Serves `/_tether/*`: 401 → 422 → the backend's answer."""

    def __init__(self, token: str, backend: Backend) -> None:
        self._token = f"Bearer {token}".encode()
        self._backend = backend

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._token)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.authorized(scope):
            await send_error(send, TetherError("unauthorized"), [(b"www-authenticate", b"Bearer")])
            return
        path = route_path(scope)
        route = ROUTES.get((scope["method"], path))
        if route is None:
            # Not a route of the table's (SPEC 6): an invalid request, in the table's terms.
            await send_error(send, TetherError("invalid_request", f"no control route {path}"))
            return
        call, model = route
        try:
            body = await _parse(receive, model)
            answer = await self._backend(call, body)
        except TetherError as error:
            await send_error(send, error)
            return
        if call == "metrics":
            await _send_metrics(send, str(answer))
            return
        await send_json(send, 200, answer)


async def _send_metrics(send: Send, text: str) -> None:
    payload = text.encode()
    headers = [(b"content-type", METRICS_CONTENT_TYPE),
               (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _parse(receive: Receive, model: type[_Body] | None) -> dict[str, Any]:
    raw = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise TetherError("invalid_request", "the client left")
        raw += message.get("body", b"")
        if len(raw) > MAX_CONTROL_BODY:
            raise TetherError("body_too_large", "control bodies are at most 1 MiB")
        if not message.get("more_body", False):
            break
    if model is None:
        return {}
    try:
        data = json.loads(raw or b"{}")
        parsed = model.model_validate(data)
    except (ValueError, RecursionError, ValidationError) as error:
        detail: Any = str(error) or type(error).__name__
        if isinstance(error, ValidationError):
            detail = error.errors(include_url=False, include_context=False)
        raise TetherError("invalid_request", detail) from None
    body = parsed.model_dump()
    if "checkpoint_id" in body:
        validate_checkpoint_id(body["checkpoint_id"])
    return body
