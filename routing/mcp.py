"""What the MCP preset (SPEC 4.7) needs beyond routing by a header: tether's errors as
JSON-RPC error bodies, and the 2.x SDK's `requestState` key made the same on every worker.

Nothing here imports the MCP SDK until a key is shared: tether runs without it.

**Errors.** Under a kind with `gone_as_jsonrpc` (the MCP preset) the router sends every
error it makes as a JSON-RPC error object with no request ID, `data` holding the body it
would send otherwise (`{"code", "detail", ...}`). A 2.x client raises the error in such a
body as it is (`MCPError`, `.code`, `.data["code"]`); without one it can only report
`-32603 "Server returned an error response"` (or, for a 404, "Session terminated").

==================  ======  ======  =============================================
tether code         status  code    message
==================  ======  ======  =============================================
``session_gone``    404     -32600  ``Session not found`` (the SDK's own 404)
anything else       table   -32003  ``<code>: <meaning>`` (the table's meaning)
==================  ======  ======  =============================================

-32003 is the first code of the implementation-defined band (-32000 to -32019) that
nothing in MCP gives a meaning: -32000 and -32001 are the SDKs' own codes for a closed
connection and a timed-out request (a client that retries on -32001 would retry a gone
session forever), -32002 is retired, -32603 is what a client reports for any error it
cannot read, and -32020 to -32099 belong to the specification (-32020 makes a 2.x client
list the tools again and resend, -32022 ends or repeats an auto-mode probe).

**The requestState key.** A 2.x `MCPServer` seals every multi-round-trip `requestState`
under `RequestStateSecurity.ephemeral()` unless the app passes its own policy: a key made
at construction and known only to that process. `share_request_state_key` makes that
default a key derived from the server's secret, the same in every worker of one server,
so a retried round that reaches another worker is accepted there. An app's own policy
(`request_state_security=...`) is left as it is.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from importlib import metadata
from typing import Any

from starlette.types import Send

from tether.routing.errors import ERRORS, TetherError, send_json, with_error_headers

SESSION_NOT_FOUND = -32600
"""JSON-RPC `INVALID_REQUEST`, as the SDK's own 404 for a session it does not know."""
TETHER_ERROR = -32003
"""Every other tether error (see the module docstring for why this code)."""

KEY_INFO = b"tether.mcp.request-state.v1"
MIN_SECRET_CHARS = 32


def jsonrpc_error(error: TetherError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON-RPC error body `error` is sent as under the MCP preset."""
    if error.code == "session_gone":
        status, code, message = 404, SESSION_NOT_FOUND, "Session not found"
    else:
        status, code = error.status, TETHER_ERROR
        message = f"{error.code}: {ERRORS[error.code][1]}"
    body = {"jsonrpc": "2.0", "id": None,
            "error": {"code": code, "message": message, "data": error.body()}}
    return status, body


async def send_jsonrpc_error(
    send: Send, error: TetherError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer a request with `error` as a JSON-RPC error body, on a raw ASGI send."""
    status, body = jsonrpc_error(error)
    await send_json(send, status, body, with_error_headers(error, headers))


def sdk_line() -> int | None:
    """The major version of the installed MCP SDK (1 or 2), or None if none is installed.

    Read from the installed distribution's metadata: the SDK itself is not imported."""
    try:
        version = metadata.version("mcp")
    except metadata.PackageNotFoundError:
        return None
    major = version.split(".", 1)[0]
    return int(major) if major.isdigit() else None


def request_state_key(secret: str) -> str:
    """The key a server's workers seal `requestState` under, derived from the server's
    secret so that the secret itself seals nothing."""
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the server secret must have at least {MIN_SECRET_CHARS} characters, "
            f"got {len(secret)}"
        )
    return hmac.new(secret.encode(), KEY_INFO, hashlib.sha256).hexdigest()


def share_request_state_key(secret: str) -> Callable[[], None]:
    """Make the 2.x SDK's default `requestState` key the one derived from `secret`.

    The SDK picks its key when the app builds its `MCPServer`, at import, so call this
    before the app is imported. It changes `RequestStateSecurity.ephemeral()`, the policy
    `MCPServer` installs when the app passes none (and the one low-level servers are told
    to append); policies an app passes itself are untouched. Does nothing on the 1.x line,
    which has no `requestState`. Returns what undoes it (for tests: a worker never does).
    """
    key = request_state_key(secret)
    if sdk_line() != 2:
        return _nothing
    from mcp.server.request_state import RequestStateSecurity

    default = RequestStateSecurity.__dict__["ephemeral"]

    def shared(cls: type[RequestStateSecurity], /, **options: Any) -> RequestStateSecurity:
        """The SDK's default policy (same options), under the server's key."""
        return cls(keys=[key], **options)

    # The SDK documents `ephemeral()` as the default policy; replacing it changes the
    # default and nothing an app configures.
    RequestStateSecurity.ephemeral = classmethod(shared)  # type: ignore[method-assign,assignment]

    def undo() -> None:
        RequestStateSecurity.ephemeral = default  # type: ignore[method-assign]

    return undo


def _nothing() -> None:
    return None
