"""The MCP preset (SPEC 4.7) on in-process workers: an unmodified official-SDK server
(examples/mcp_counter.py) and the SDK's own client.

Every worker gets a fresh copy of the app with its lifespan running (the SDK's session
manager lives there). The client's HTTP transport sends each request to the worker a
`Pick` chooses, as the shared port of `tether serve` would, on a new connection each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError
from mcp.types import LoggingMessageNotificationParams
from starlette.applications import Starlette

from tests.routing.conftest import Cluster, Node
from tether.examples.mcp_counter import ToolContext, create_app
from tether.routing.kinds import SessionKind, mcp_kind
from tether.routing.types import SessionId

Pick = Callable[[httpx.Request], Node]
TIMEOUT_S = 20.0
ACCEPT = "application/json, text/event-stream"


class Spread(httpx.AsyncBaseTransport):
    """Sends each request to the worker `pick` chooses, on a new connection."""

    def __init__(self, pick: Pick) -> None:
        self.pick = pick
        self.inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=httpx.URL(self.pick(request).url).port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def starts_on(first: Node, then: Node) -> Pick:
    """An initialize (a POST naming no session) goes to `first`, everything else to `then`."""
    return lambda request: first if "mcp-session-id" not in request.headers else then


def rotating(nodes: list[Node], offset: int = 0) -> Pick:
    """Each request to the next worker in turn."""
    turn = itertools.count(offset)
    return lambda request: nodes[next(turn) % len(nodes)]


@contextlib.asynccontextmanager
async def mcp_session(
    pick: Pick, node: Node, **session_options: Any
) -> AsyncIterator[tuple[ClientSession, str]]:
    """An initialized SDK session whose requests go where `pick` says; closed with a DELETE."""
    timeout = httpx.Timeout(TIMEOUT_S, read=300.0)
    async with (
        httpx.AsyncClient(transport=Spread(pick), timeout=timeout) as http,
        streamable_http_client(f"{node.url}/mcp", http_client=http) as (read, write, session_id),
        ClientSession(read, write, **session_options) as session,
    ):
        await session.initialize()
        named = session_id()
        assert named is not None
        yield session, named


async def counted(session: ClientSession, tool: str) -> dict[str, Any]:
    result = await session.call_tool(tool)
    assert not result.isError, result.content
    assert result.structuredContent is not None
    return result.structuredContent


@dataclass
class Lifespan:
    """An app's own lifespan, run in a task of its own (anyio scopes must exit where they
    were entered, and fixtures and tests run in different tasks)."""

    app: Starlette
    started: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self._run())
        waiter = asyncio.create_task(self.started.wait())
        await asyncio.wait({self.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        if self.task.done():
            await self.task  # raises the start-up failure

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await self.task

    async def _run(self) -> None:
        async with self.app.router.lifespan_context(self.app):
            self.started.set()
            await self.stop.wait()


AddNode = Callable[..., Awaitable[Node]]


@pytest.fixture
async def add_mcp(cluster: Cluster) -> AsyncIterator[AddNode]:
    """Adds a worker serving a fresh MCP counter app under `kind` (the MCP preset)."""
    lifespans: list[Lifespan] = []

    async def add(kind: SessionKind | None = None, preset: bool = True) -> Node:
        app = create_app()
        lifespan = Lifespan(app)
        await lifespan.start()
        lifespans.append(lifespan)
        return await cluster.add(app, kind or (mcp_kind() if preset else None))

    try:
        yield add
    finally:
        await cluster.close()
        for lifespan in lifespans:
            await lifespan.close()


def claim_files(cluster: Cluster) -> list[str]:
    directory = Path(cluster.runtime_dir) / "claims"
    return [n for n in os.listdir(directory) if not n.endswith(".tmp")]


async def wait_until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll `condition` until it holds; fail if it does not within the bound."""
    async with asyncio.timeout(within_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


def _rpc(method: str, request_id: int | None = None, **params: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if request_id is not None:
        message["id"] = request_id
    return message


INITIALIZE = _rpc(
    "initialize",
    1,
    protocolVersion="2025-06-18",
    capabilities={},
    clientInfo={"name": "raw", "version": "0"},
)


async def open_raw_session(client: httpx.AsyncClient) -> str:
    """Initialize by hand (no standing GET stream); return the ID the server minted."""
    headers = {"accept": ACCEPT}
    reply = await client.post("/mcp", json=INITIALIZE, headers=headers)
    assert reply.status_code == 200, reply.text
    session_id = reply.headers["mcp-session-id"]
    headers |= {"mcp-session-id": session_id, "mcp-protocol-version": "2025-06-18"}
    done = await client.post("/mcp", json=_rpc("notifications/initialized"), headers=headers)
    assert done.status_code == 202, done.text
    return session_id


def call_headers(session_id: str) -> dict[str, str]:
    return {
        "accept": ACCEPT,
        "mcp-session-id": session_id,
        "mcp-protocol-version": "2025-06-18",
    }


# The tests


async def test_a_session_the_server_minted_is_served_by_its_worker_through_every_worker(
    add_mcp: AddNode,
) -> None:
    nodes = [await add_mcp() for _ in range(3)]
    async with mcp_session(rotating(nodes), nodes[0]) as (session, session_id):
        tools = await session.list_tools()
        assert {tool.name for tool in tools.tools} == {"increment", "get"}
        counts = [await counted(session, "increment") for _ in range(5)]
        final = await counted(session, "get")
    holder = nodes[0].id  # the initialize went to the first worker
    assert [c["count"] for c in counts] == [1, 2, 3, 4, 5]
    assert final == {"count": 5, "worker": holder}
    assert {c["worker"] for c in counts} == {holder}
    assert sum(node.routing.router.stats.forwarded for node in nodes[1:]) >= 6
    assert nodes[0].routing.claims is not None
    assert nodes[0].routing.claims.mine(SessionId(session_id))


async def test_many_interleaved_sessions_each_read_their_own_count(add_mcp: AddNode) -> None:
    nodes = [await add_mcp() for _ in range(3)]

    async def one(index: int) -> tuple[int, str]:
        async with mcp_session(rotating(nodes, index), nodes[index % 3]) as (session, _):
            for _ in range(index % 4 + 1):
                await counted(session, "increment")
            final = await counted(session, "get")
        return final["count"], final["worker"]

    results = await asyncio.gather(*(one(i) for i in range(24)))
    assert [count for count, _ in results] == [i % 4 + 1 for i in range(24)]
    assert [worker for _, worker in results] == [nodes[i % 3].id for i in range(24)]


async def test_without_the_preset_the_same_server_loses_its_sessions(add_mcp: AddNode) -> None:
    # The control: an unmodified server on two workers, nothing routed.
    a = await add_mcp(preset=False)
    b = await add_mcp(preset=False)
    async with mcp_session(starts_on(a, b), a) as (session, _):
        with pytest.raises(McpError, match="Session terminated"):
            await session.call_tool("increment")


async def test_progress_and_log_notifications_stream_through_the_hop_before_the_result(
    add_mcp: AddNode,
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    seen: list[str] = []
    both = asyncio.Event()

    async def slow(ctx: ToolContext) -> str:
        await ctx.report_progress(1, 2, "half way")
        await ctx.info("still working")
        # Returns only once the client saw both: a hop that held the reply back until it
        # was complete would hang here until the bound below.
        await both.wait()
        return "done"

    a.app.state.mcp.add_tool(slow)  # only `a` has it, so only `a` can answer the call

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(f"progress {progress}/{total} {message}")
        if len(seen) == 2:
            both.set()

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        seen.append(f"log {params.level} {params.data}")
        if len(seen) == 2:
            both.set()

    async with mcp_session(starts_on(a, b), a, logging_callback=on_log) as (session, _):
        forwarded = b.routing.router.stats.forwarded
        async with asyncio.timeout(10):
            result = await session.call_tool("slow", progress_callback=on_progress)
        seen.append("result")
        assert b.routing.router.stats.forwarded > forwarded
    assert not result.isError
    assert sorted(seen[:2]) == ["log info still working", "progress 1.0/2.0 half way"]
    assert seen[2:] == ["result"]


async def test_more_than_a_hundred_standing_streams_reach_one_claimant(
    add_mcp: AddNode,
) -> None:
    # Every session starts on `a` and sends everything else through `b`: 150 standing GET
    # streams forwarded to one claimant at once, past any default pool limit of 100.
    a = await add_mcp()
    b = await add_mcp()
    claims = a.routing.claims
    assert claims is not None
    sessions = 150
    session_ids: list[SessionId] = []
    opened = asyncio.Barrier(sessions + 1)
    proceed = asyncio.Event()

    async def one() -> dict[str, Any]:
        async with mcp_session(starts_on(a, b), a) as (session, session_id):
            session_ids.append(SessionId(session_id))
            await counted(session, "increment")
            await opened.wait()
            await proceed.wait()
            return await counted(session, "get")

    async def all_streams_open() -> None:
        await opened.wait()
        # Nothing but its standing stream is in progress for a session now.
        await wait_until(lambda: all(claims.in_progress(s) for s in session_ids), 30)
        proceed.set()

    async with asyncio.timeout(90):
        _, *finals = await asyncio.gather(all_streams_open(), *(one() for _ in range(sessions)))
    assert finals == [{"count": 1, "worker": a.id}] * sessions
    assert a.routing.router.stats.served_forwarded >= 2 * sessions


async def test_a_session_of_a_stopped_worker_answers_404_session_gone_then_new_ones_work(
    cluster: Cluster, add_mcp: AddNode
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    limits = httpx.Limits(max_keepalive_connections=0)
    async with a.client(limits=limits) as ca:
        session_id = await open_raw_session(ca)
    await cluster.kill(a)
    call = _rpc("tools/call", 2, name="get", arguments={})
    async with b.client(limits=limits) as cb:
        gone = await cb.post("/mcp", json=call, headers=call_headers(session_id))
    assert gone.status_code == 404
    body = gone.json()
    assert body["jsonrpc"] == "2.0"
    assert body["error"]["data"]["code"] == "session_gone"
    # A new session through the surviving worker works.
    async with mcp_session(rotating([b]), b) as (session, _):
        assert await counted(session, "increment") == {"count": 1, "worker": b.id}


async def test_an_id_nobody_minted_gets_the_sdks_own_error_where_it_lands_and_no_claim(
    cluster: Cluster, add_mcp: AddNode
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    call = _rpc("tools/call", 2, name="get", arguments={})
    async with b.client() as cb:
        reply = await cb.post("/mcp", json=call, headers=call_headers("nobody-minted-this"))
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["message"] == "Session not found"
    assert "data" not in error  # the SDK's answer, not tether's session_gone
    assert b.routing.router.stats.forwarded == 0
    assert a.routing.router.stats.served_forwarded == 0
    assert claim_files(cluster) == []


async def test_delete_ends_the_session_and_its_claim_ends_a_window_later(
    cluster: Cluster, add_mcp: AddNode
) -> None:
    kind = mcp_kind(close_window_s=0.3)
    a = await add_mcp(kind)
    b = await add_mcp(kind)
    assert a.routing.claims is not None
    async with mcp_session(starts_on(a, b), a) as (session, session_id):
        await counted(session, "increment")
        sid = SessionId(session_id)
        assert a.routing.claims.lifetimes.is_open(sid)  # open: no window runs
        assert len(claim_files(cluster)) == 1
    # Leaving the client sent DELETE (through `b`): the session is over on `a`, and its
    # claim ends once the window has passed.
    assert not a.routing.claims.lifetimes.is_open(sid)
    async with b.client() as cb:
        after = await cb.post(
            "/mcp", json=_rpc("tools/call", 3, name="get"), headers=call_headers(session_id)
        )
    assert after.status_code == 404  # the SDK ended it on `a`
    assert b.routing.router.stats.forwarded >= 1
    await wait_until(lambda: claim_files(cluster) == [])
    assert not a.routing.claims.mine(sid)
