"""The MCP reference app of SPEC section 10 on the official SDK's 1.x line (`FastMCP`):
the twin of `examples/mcp_counter.py`, which is on 2.x, for servers that pin `mcp<2`.

Streamable HTTP at `/mcp`; tools `increment` and `get` answer `{"count", "worker"}` for a
counter kept per MCP session in this worker's memory. The app declares no tether kind: it
is an ordinary SDK server, and runs on several workers with one flag::

    tether serve tether.examples.mcp_counter_v1:app --workers 4 --sessions mcp

mypy skips this file (see `[tool.mypy]` in pyproject): the package is type-checked
against the 2.x SDK, which no longer ships `mcp.server.fastmcp`.
"""

from __future__ import annotations

import os
from typing import Any, TypedDict
from weakref import WeakKeyDictionary

try:
    from mcp.server.fastmcp import Context, FastMCP
except ImportError as error:  # pragma: no cover - depends on the installed SDK line
    raise ImportError(
        "examples/mcp_counter_v1.py is written for the MCP SDK 1.x (FastMCP); with mcp>=2 "
        "serve tether.examples.mcp_counter:app"
    ) from error
from mcp.server.session import ServerSession
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from tether import worker_of

ToolContext = Context[ServerSession, Any, Request]


class Count(TypedDict):
    """What both tools answer."""

    count: int
    worker: str


def _worker(ctx: ToolContext) -> str:
    """The tether worker ID of the request that called the tool, else this process's PID."""
    request = ctx.request_context.request
    worker = worker_of(request.scope) if request is not None else None
    return worker or f"pid-{os.getpid()}"


def create_app() -> Starlette:
    """A fresh server with its own counters (one per worker process).

    Each call builds its own SDK session manager, which runs once, in the app's lifespan.
    """
    # The SDK logs a line per session and per request at INFO; the server that received
    # a request already logs it once.
    mcp = FastMCP("tether-counter", log_level="WARNING")
    # Keyed by the SDK's session object, so a counter ends with its session (a DELETE or
    # the SDK's idle timeout) without a hook of its own.
    counts: WeakKeyDictionary[ServerSession, int] = WeakKeyDictionary()

    @mcp.tool()
    async def increment(ctx: ToolContext) -> Count:
        """Add one to this session's counter and return it."""
        counts[ctx.session] = counts.get(ctx.session, 0) + 1
        await ctx.report_progress(1, 1, "counted")  # sent only if the caller asked for it
        return {"count": counts[ctx.session], "worker": _worker(ctx)}

    @mcp.tool()
    async def get(ctx: ToolContext) -> Count:
        """Return this session's counter."""
        return {"count": counts.get(ctx.session, 0), "worker": _worker(ctx)}

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    # Called, not used as a decorator: the SDK leaves `custom_route` untyped.
    mcp.custom_route("/health", methods=["GET"])(health)
    app = mcp.streamable_http_app()
    app.state.mcp = mcp
    return app


app = create_app()
