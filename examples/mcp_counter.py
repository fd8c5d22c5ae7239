"""A stateful MCP server on the official SDK (2.x, `MCPServer`): the MCP reference app of
SPEC section 10. Its twin on the 1.x line (`FastMCP`) is `examples/mcp_counter_v1.py`.

Streamable HTTP at `/mcp`; tools `increment` and `get` answer `{"count", "worker"}` for a
counter kept per MCP session in this worker's memory, and `confirm` is a multi-round-trip
tool (it asks the client a question and answers once the client replies). The app
declares no tether kind: it is an ordinary SDK server, and runs on several workers with
one flag::

    tether serve tether.examples.mcp_counter:app --workers 4 --sessions mcp

A 2.x client in `mode="legacy"` (or any 1.x client) opens a session with `initialize`.
In `mode="auto"` a 2.x client speaks the sessionless 2026-07-28 protocol to this server:
there is no MCP session then, each call is served where it lands and counts on its own
(`increment` answers 1, `get` 0), and `confirm`'s retry carries the round's state back in
the SDK's sealed `requestState`, to whichever worker it reaches.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, TypedDict

try:
    from mcp.server.mcpserver import Context, MCPServer
except ImportError as error:  # pragma: no cover - depends on the installed SDK line
    raise ImportError(
        "examples/mcp_counter.py is written for the MCP SDK 2.x (MCPServer); with mcp<2 "
        "serve tether.examples.mcp_counter_v1:app"
    ) from error
from mcp.server.elicitation import AcceptedElicitation
from mcp.server.streamable_http_manager import DEFAULT_MAX_SESSIONS
from mcp.types import ElicitRequest, ElicitRequestFormParams, ElicitResult, InputRequiredResult
from mcp.types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from tether import worker_of

ToolContext = Context[Any, Request]

SESSION_HEADER = "mcp-session-id"
QUESTION = "Go ahead?"
ANSWER_KEY = "go"
"""The key of `confirm`'s one question, in its `inputRequests` and the client's answers."""


class Count(TypedDict):
    """What `increment` and `get` answer."""

    count: int
    worker: str


class Confirmed(TypedDict):
    """What `confirm` answers: the client's reply, and the workers of its two rounds."""

    confirmed: bool
    asked_on: str
    answered_on: str


class GoAhead(BaseModel):
    """The form `confirm` asks the client to fill in."""

    go: bool


ASK = ElicitRequest(
    params=ElicitRequestFormParams(
        message=QUESTION,
        requested_schema={
            "type": "object",
            "properties": {ANSWER_KEY: {"type": "boolean"}},
            "required": [ANSWER_KEY],
        },
    )
)


def _worker(ctx: ToolContext) -> str:
    """The tether worker ID of the request that called the tool, else this process's PID."""
    request = ctx.request_context.request
    worker = worker_of(request.scope) if request is not None else None
    return worker or f"pid-{os.getpid()}"


def _session(ctx: ToolContext) -> str | None:
    """The MCP session the call belongs to (its `mcp-session-id` header), if any.

    A 2.x server builds a new `ServerSession` for every request, so per-session state is
    keyed by the header that names the transport session, as the SDK's migration guide
    says; the sessionless 2026-07-28 protocol sends none.
    """
    headers = ctx.headers
    return headers.get(SESSION_HEADER) if headers is not None else None


class Counters:
    """Counters by MCP session ID, the least recently used dropped past `limit` (the SDK's
    own cap on open sessions), so ended sessions do not accumulate."""

    def __init__(self, limit: int = DEFAULT_MAX_SESSIONS) -> None:
        self.limit = limit
        self._counts: OrderedDict[str, int] = OrderedDict()

    def get(self, session: str | None) -> int:
        if session is None or session not in self._counts:
            return 0
        self._counts.move_to_end(session)
        return self._counts[session]

    def increment(self, session: str | None) -> int:
        count = self.get(session) + 1
        if session is not None:
            self._counts[session] = count
            self._counts.move_to_end(session)
            while len(self._counts) > self.limit:
                self._counts.popitem(last=False)
        return count


def create_app() -> Starlette:
    """A fresh server with its own counters (one per worker process).

    Each call builds its own SDK session manager, which runs once, in the app's lifespan.
    """
    # The SDK logs a line per session and per request at INFO; the server that received
    # a request already logs it once.
    mcp = MCPServer("tether-counter", log_level="WARNING")
    counters = Counters()

    @mcp.tool()
    async def increment(ctx: ToolContext) -> Count:
        """Add one to this session's counter and return it."""
        count = counters.increment(_session(ctx))
        await ctx.report_progress(1, 1, "counted")  # sent only if the caller asked for it
        return {"count": count, "worker": _worker(ctx)}

    @mcp.tool()
    async def get(ctx: ToolContext) -> Count:
        """Return this session's counter."""
        return {"count": counters.get(_session(ctx)), "worker": _worker(ctx)}

    @mcp.tool()
    async def confirm(ctx: ToolContext) -> Confirmed | InputRequiredResult:
        """Ask the client to go ahead; answer its reply and the workers that asked and
        answered."""
        here = _worker(ctx)
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            # A session's protocol: ask over its back-channel, within this one call.
            reply = await ctx.elicit(QUESTION, GoAhead)
            go = isinstance(reply, AcceptedElicitation) and reply.data.go
            return {"confirmed": go, "asked_on": here, "answered_on": here}
        answer = (ctx.input_responses or {}).get(ANSWER_KEY)
        if ctx.request_state is None or not isinstance(answer, ElicitResult):
            # Round one: ask, and keep who asked in the state the client echoes back
            # (the SDK seals it; only a worker holding the key can read it again).
            return InputRequiredResult(input_requests={ANSWER_KEY: ASK}, request_state=here)
        go = answer.action == "accept" and (answer.content or {}).get(ANSWER_KEY) is True
        return {"confirmed": go, "asked_on": ctx.request_state, "answered_on": here}

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    # Called, not used as a decorator: the SDK leaves `custom_route` untyped.
    mcp.custom_route("/health", methods=["GET"])(health)
    app = mcp.streamable_http_app()
    app.state.mcp = mcp
    return app


app = create_app()
