"""The control API on every worker's public port (SPEC 6): bearer auth, then a relay of
the call to the coordinator."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from routing.errors import TetherError, send_error, send_json

Relay = Callable[[str, Any], Awaitable[Any]]

_ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/_tether/status"): "status",
}


class ControlApp:
    """Serves `/_tether/*`: checks the token in constant time, then relays the call."""

    def __init__(self, token: str, relay: Relay) -> None:
        self._token = f"Bearer {token}".encode()
        self._relay = relay

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._token)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.authorized(scope):
            await send_error(send, TetherError("unauthorized"), [(b"www-authenticate", b"Bearer")])
            return
        call = _ROUTES.get((scope["method"], scope["path"]))
        if call is None:
            await send_json(send, 404, {"code": "not_found", "detail": scope["path"]})
            return
        try:
            answer = await self._relay(call, None)
        except TetherError as error:
            await send_error(send, error)
            return
        await send_json(send, 200, answer)
