"""The installed line of the official MCP SDK (1.x or 2.x), for the MCP suites: its
reference app and its own client behind one small interface, so that
`tests/routing/test_mcp.py` and `e2e/test_mcp_e2e.py` run unchanged on either line.

Each line is driven the way its users drive it: 1.x with `streamable_http_client` and
`ClientSession` over an `httpx` client; 2.x with `Client` (in `legacy` or `auto` mode)
over an `httpx2` client, since 2.x clients mishandle `httpx` ones. Both keep no
connection for a second request unless a test passes its own transport.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mcp.types import ElicitResult

from tether.examples import mcp_counter_app
from tether.routing.mcp import sdk_line

LINE = sdk_line()
APP = mcp_counter_app()
"""`module:attribute` of the reference app for this line."""
example: ModuleType = importlib.import_module(APP.partition(":")[0])
"""The reference app's module (`create_app`, `ToolContext`)."""

if LINE == 2:
    import httpx2 as http
    from mcp import Client
    from mcp import MCPError as McpError
    from mcp.client.streamable_http import streamable_http_client
else:
    import httpx as http
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import McpError

MODES: tuple[str, ...] = ("legacy", "auto") if LINE == 2 else ("legacy",)
"""How the client connects: `legacy` is the initialize handshake (a session); 2.x also
has `auto`, which speaks the sessionless 2026-07-28 protocol to a 2.x server."""
SESSIONLESS = "2026-07-28"
ACCEPT = "application/json, text/event-stream"

Callback = Callable[..., Awaitable[Any]]


def ended_session(error: BaseException) -> bool:
    """Whether the client raised the error of a session the server no longer knows
    (JSON-RPC INVALID_REQUEST: -32600 on 2.x, a positive 32600 on 1.x)."""
    return isinstance(error, McpError) and abs(error.error.code) == 32600


def leaf(error: BaseException) -> BaseException:
    """The first error inside the SDK's exception groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def go_ahead(context: Any, params: Any) -> ElicitResult:
    """An elicitation callback that accepts `confirm`'s question."""
    return ElicitResult(action="accept", content={"go": True})


def new_connection_client(
    transport: Any = None, timeout_s: float = 30.0, headers: dict[str, str] | None = None
) -> Any:
    """This line's HTTP client, keeping no connection for a second request."""
    return http.AsyncClient(
        transport=transport,
        limits=http.Limits(max_keepalive_connections=0),
        timeout=http.Timeout(timeout_s, read=300.0),
        headers=headers,
    )


@dataclass
class Connected:
    """One connected client of the installed line."""

    handle: Any
    protocol_version: str
    session_ids: list[str] = field(default_factory=list)

    @property
    def session_id(self) -> str | None:
        """The MCP session the server named (None on the sessionless protocol)."""
        return self.session_ids[-1] if self.session_ids else None

    async def tool_names(self) -> set[str]:
        tools = await self.handle.list_tools()
        return {tool.name for tool in tools.tools}

    async def call(
        self, tool: str, arguments: dict[str, Any] | None = None, progress: Callback | None = None
    ) -> dict[str, Any]:
        """Call `tool`; its structured result (a tool error fails the test)."""
        result = await self.handle.call_tool(tool, arguments or {}, progress_callback=progress)
        if LINE == 2:
            failed, content = result.is_error, result.structured_content
        else:
            failed, content = result.isError, result.structuredContent
        assert not failed, result.content
        assert content is not None
        return dict(content)


@contextlib.asynccontextmanager
async def connect(
    url: str,
    *,
    mode: str = "legacy",
    transport: Any = None,
    headers: dict[str, str] | None = None,
    logging_callback: Callback | None = None,
    elicitation_callback: Callback | None = go_ahead,
) -> AsyncIterator[Connected]:
    """A client of the installed line connected to `url` (the session, if any, is ended
    with a DELETE on leaving); `transport` replaces the HTTP client's own."""
    session_ids: list[str] = []

    async def named(response: Any) -> None:
        session_id = response.headers.get("mcp-session-id")
        if session_id and session_id not in session_ids:
            session_ids.append(session_id)

    http_client = new_connection_client(transport, headers=headers)
    http_client.event_hooks["response"].append(named)
    callbacks = {"logging_callback": logging_callback,
                 "elicitation_callback": elicitation_callback}
    if LINE == 2:
        async with (
            http_client,
            Client(streamable_http_client(url, http_client=http_client), mode=mode,
                   **callbacks) as client,
        ):
            yield Connected(client, client.protocol_version, session_ids)
        return
    assert mode == "legacy", f"the 1.x client has no {mode!r} mode"
    async with (
        http_client,
        streamable_http_client(url, http_client=http_client) as (read, write, _),
        ClientSession(read, write, **callbacks) as session,
    ):
        done = await session.initialize()
        yield Connected(session, str(done.protocolVersion), session_ids)
