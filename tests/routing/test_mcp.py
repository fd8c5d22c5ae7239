"""The MCP preset (SPEC 4.7) on in-process workers: an unmodified official-SDK server (the
reference app of the installed SDK line) and that line's own client.

Every worker gets a fresh copy of the app with its lifespan running (the SDK's session
manager lives there). The client's HTTP transport sends each request to the worker a
`Pick` chooses, as the shared port of `tether serve` would, on a new connection each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette

from tests.mcp_lines import (
    ACCEPT,
    LINE,
    MODES,
    SESSIONLESS,
    Connected,
    McpError,
    connect,
    ended_session,
    example,
    http,
    leaf,
)
from tests.routing.conftest import Cluster, Node
from tether.checkpoint.participant import Participant
from tether.routing.errors import ERRORS, TetherError
from tether.routing.kinds import SessionKind, mcp_kind
from tether.routing.mcp import TETHER_ERROR, jsonrpc_error, share_request_state_key
from tether.routing.types import SessionId, new_worker_id

Pick = Callable[[Any], Node]


def only_2x(why: str) -> pytest.MarkDecorator:
    """For what the 1.x line does not have."""
    return pytest.mark.skipif(LINE != 2, reason=f"1.x has no {why}")


class Spread(http.AsyncBaseTransport):
    """Sends each request to the worker `pick` chooses, on a new connection."""

    def __init__(self, pick: Pick) -> None:
        self.pick = pick
        self.inner = http.AsyncHTTPTransport(limits=http.Limits(max_keepalive_connections=0))

    async def handle_async_request(self, request: Any) -> Any:
        request.url = request.url.copy_with(port=http.URL(self.pick(request).url).port)
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
    pick: Pick, node: Node, mode: str = "legacy", **options: Any
) -> AsyncIterator[Connected]:
    """A connected client whose requests go where `pick` says; a session ends with a DELETE."""
    async with connect(f"{node.url}/mcp", mode=mode, transport=Spread(pick), **options) as client:
        if mode == "legacy":
            assert client.session_id is not None
        yield client


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
    """Adds a worker serving a fresh MCP counter app under `kind` (the MCP preset), built
    as a `tether serve` worker builds it: after the server's requestState key is shared
    (`shared_key=False` builds it as plain uvicorn would)."""
    lifespans: list[Lifespan] = []
    server_secret = secrets.token_hex(32)  # one server: one secret for all its workers

    async def add(
        kind: SessionKind | None = None, preset: bool = True, shared_key: bool = True
    ) -> Node:
        undo = share_request_state_key(server_secret) if shared_key else None
        try:
            app = example.create_app()
        finally:
            if undo is not None:
                undo()
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


async def open_raw_session(client: Any) -> str:
    """Initialize by hand (no standing GET stream); return the ID the server minted."""
    headers = {"accept": ACCEPT}
    reply = await client.post("/mcp", json=INITIALIZE, headers=headers)
    assert reply.status_code == 200, reply.text
    session_id: str = reply.headers["mcp-session-id"]
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


def parked(node: Node) -> Participant:
    """Close `node`'s admission as an open checkpoint does (SPEC 5.3)."""
    participant = Participant()
    participant.close_admission()
    node.routing.router.admission = participant
    return participant


# The tests


async def test_a_session_the_server_minted_is_served_by_its_worker_through_every_worker(
    add_mcp: AddNode,
) -> None:
    nodes = [await add_mcp() for _ in range(3)]
    async with mcp_session(rotating(nodes), nodes[0]) as session:
        assert await session.tool_names() >= {"increment", "get"}
        counts = [await session.call("increment") for _ in range(5)]
        final = await session.call("get")
        session_id = session.session_id
    holder = nodes[0].id  # the initialize went to the first worker
    assert [c["count"] for c in counts] == [1, 2, 3, 4, 5]
    assert final == {"count": 5, "worker": holder}
    assert {c["worker"] for c in counts} == {holder}
    assert sum(node.routing.router.stats.forwarded for node in nodes[1:]) >= 6
    assert nodes[0].routing.claims is not None
    assert session_id is not None
    assert nodes[0].routing.claims.mine(SessionId(session_id))


async def test_many_interleaved_sessions_each_read_their_own_count(add_mcp: AddNode) -> None:
    nodes = [await add_mcp() for _ in range(3)]

    async def one(index: int) -> tuple[int, str]:
        async with mcp_session(rotating(nodes, index), nodes[index % 3]) as session:
            for _ in range(index % 4 + 1):
                await session.call("increment")
            final = await session.call("get")
        return final["count"], final["worker"]

    results = await asyncio.gather(*(one(i) for i in range(24)))
    assert [count for count, _ in results] == [i % 4 + 1 for i in range(24)]
    assert [worker for _, worker in results] == [nodes[i % 3].id for i in range(24)]


async def test_without_the_preset_the_same_server_loses_its_sessions(add_mcp: AddNode) -> None:
    # The control: an unmodified server on two workers, nothing routed.
    a = await add_mcp(preset=False)
    b = await add_mcp(preset=False)
    async with mcp_session(starts_on(a, b), a) as session:
        with pytest.raises(McpError) as lost:
            await session.call("increment")
    assert ended_session(lost.value)


async def test_progress_notifications_stream_through_the_hop_before_the_result(
    add_mcp: AddNode,
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    seen: list[str] = []
    both = asyncio.Event()

    async def slow(ctx: example.ToolContext) -> str:
        await ctx.report_progress(1, 2, "half way")
        await ctx.report_progress(2, 2, "nearly")
        # Returns only once the client saw both: a hop that held the reply back until it
        # was complete would hang here until the bound below.
        await both.wait()
        return "done"

    a.app.state.mcp.add_tool(slow)  # only `a` has it, so only `a` can answer the call

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(f"progress {progress}/{total} {message}")
        if len(seen) == 2:
            both.set()

    async with mcp_session(starts_on(a, b), a) as session:
        forwarded = b.routing.router.stats.forwarded
        async with asyncio.timeout(10):
            result = await session.call("slow", progress=on_progress)
        seen.append("result")
        assert b.routing.router.stats.forwarded > forwarded
    assert result == {"result": "done"}
    assert seen == ["progress 1.0/2.0 half way", "progress 2.0/2.0 nearly", "result"]


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
        async with mcp_session(starts_on(a, b), a) as session:
            assert session.session_id is not None
            session_ids.append(SessionId(session.session_id))
            await session.call("increment")
            await opened.wait()
            await proceed.wait()
            return await session.call("get")

    async def all_streams_open() -> None:
        await opened.wait()
        # Nothing but its standing stream is in progress for a session now.
        await wait_until(lambda: all(claims.in_progress(s) for s in session_ids), 30)
        proceed.set()

    async with asyncio.timeout(90):
        _, *finals = await asyncio.gather(all_streams_open(), *(one() for _ in range(sessions)))
    assert finals == [{"count": 1, "worker": a.id}] * sessions
    assert a.routing.router.stats.served_forwarded >= 2 * sessions


async def test_a_session_of_a_stopped_worker_answers_404_session_not_found_then_new_ones_work(
    cluster: Cluster, add_mcp: AddNode
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    limits = http.Limits(max_keepalive_connections=0)
    async with http.AsyncClient(base_url=a.url, limits=limits) as ca:
        session_id = await open_raw_session(ca)
    await cluster.kill(a)
    call = _rpc("tools/call", 2, name="get", arguments={})
    async with http.AsyncClient(base_url=b.url, limits=limits) as cb:
        gone = await cb.post("/mcp", json=call, headers=call_headers(session_id))
    assert gone.status_code == 404
    assert gone.headers["content-type"] == "application/json"
    assert gone.json() == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": -32600,
            "message": "Session not found",
            "data": {
                "code": "session_gone",
                "detail": f"the worker of session {session_id!r} exited",
            },
        },
    }
    # A new session through the surviving worker works.
    async with mcp_session(rotating([b]), b) as session:
        assert await session.call("increment") == {"count": 1, "worker": b.id}


@only_2x("client that reads an error body")
async def test_the_2x_client_raises_a_gone_sessions_error_as_tether_sent_it(
    cluster: Cluster, add_mcp: AddNode
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    async with mcp_session(starts_on(a, b), a) as session:
        await session.call("increment")
        await cluster.kill(a)
        with pytest.raises(McpError) as gone:
            await session.call("get")
    assert (gone.value.code, gone.value.message) == (-32600, "Session not found")
    assert gone.value.data["code"] == "session_gone"
    assert ended_session(gone.value)


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
    async with mcp_session(starts_on(a, b), a) as session:
        await session.call("increment")
        assert session.session_id is not None
        session_id = session.session_id
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


# The sessionless protocol and multi-round-trip tools (2.x)


@only_2x("sessionless protocol")
async def test_auto_mode_is_sessionless_and_each_request_is_served_where_it_lands(
    cluster: Cluster, add_mcp: AddNode
) -> None:
    nodes = [await add_mcp() for _ in range(3)]
    async with mcp_session(rotating(nodes), nodes[0], mode="auto") as client:
        assert client.protocol_version == SESSIONLESS
        counts = [await client.call("increment") for _ in range(6)]
        final = await client.call("get")
        assert client.session_id is None
    assert [c["count"] for c in counts] == [1] * 6  # no session: each call counts alone
    assert final["count"] == 0
    assert {c["worker"] for c in counts} == {node.id for node in nodes}
    assert sum(node.routing.router.stats.forwarded for node in nodes) == 0
    assert claim_files(cluster) == []


@only_2x("requestState")
async def test_a_retried_round_that_lands_on_another_worker_is_accepted(
    add_mcp: AddNode,
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    async with mcp_session(rotating([a, b]), a, mode="auto") as client:
        answers = [await client.call("confirm") for _ in range(4)]
    assert all(answer["confirmed"] for answer in answers)
    # Every round went to the other worker than the one before it.
    assert all(answer["asked_on"] != answer["answered_on"] for answer in answers)
    assert {answer["answered_on"] for answer in answers} == {a.id, b.id}


@only_2x("requestState")
async def test_without_the_shared_key_a_retried_round_on_another_worker_is_refused(
    add_mcp: AddNode,
) -> None:
    # The control: the SDK's default key is made per process, as under plain uvicorn.
    a = await add_mcp(shared_key=False)
    b = await add_mcp(shared_key=False)
    async with mcp_session(rotating([a, b]), a, mode="auto") as client:
        with pytest.raises(McpError) as refused:
            await client.call("confirm")
    assert (refused.value.code, refused.value.message) == (
        -32602, "Invalid or expired requestState"
    )


@only_2x("multi-round-trip tool in its example")
async def test_a_multi_round_trip_tool_on_a_session_asks_over_its_back_channel(
    add_mcp: AddNode,
) -> None:
    a = await add_mcp()
    b = await add_mcp()
    async with mcp_session(starts_on(a, b), a) as session:
        answer = await session.call("confirm")
    assert answer == {"confirmed": True, "asked_on": a.id, "answered_on": a.id}


# Every tether error under the preset is a JSON-RPC error body


@pytest.mark.parametrize("code", sorted(ERRORS))
def test_every_tether_error_has_a_jsonrpc_body_carrying_its_own_body(code: str) -> None:
    error = TetherError(code, "why")
    status, body = jsonrpc_error(error)
    assert body["jsonrpc"] == "2.0"
    assert body["id"] is None
    assert body["error"]["data"] == {"code": code, "detail": "why"}
    if code == "session_gone":
        assert status == 404
        assert body["error"]["code"] == -32600
        assert body["error"]["message"] == "Session not found"
    else:
        assert status == error.status
        assert body["error"]["code"] == TETHER_ERROR
        assert body["error"]["message"].startswith(f"{code}: ")


async def test_a_parked_request_is_a_503_jsonrpc_body_with_retry_after(
    add_mcp: AddNode,
) -> None:
    node = await add_mcp()
    parked(node)
    async with node.client() as client:
        reply = await client.post("/mcp", json=INITIALIZE, headers={"accept": ACCEPT})
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["error"]["code"] == TETHER_ERROR
    assert body["error"]["data"]["code"] == "checkpoint_parked"


async def test_a_request_for_a_dead_named_worker_is_a_410_jsonrpc_body(
    add_mcp: AddNode,
) -> None:
    node = await add_mcp()
    async with node.client() as client:
        reply = await client.post(
            "/mcp", json=INITIALIZE,
            headers={"accept": ACCEPT, "x-tether-worker": new_worker_id()},
        )
    assert reply.status_code == 410
    assert reply.json()["error"]["data"]["code"] == "worker_gone"


@only_2x("client that reads an error body")
@pytest.mark.parametrize("mode", MODES)
async def test_the_2x_client_raises_tethers_error_code_rather_than_a_generic_one(
    add_mcp: AddNode, mode: str
) -> None:
    node = await add_mcp()
    parked(node)
    # The client raises it from inside its task groups, as it raises any connect error.
    with pytest.raises(ExceptionGroup) as refused:
        async with mcp_session(rotating([node]), node, mode=mode):
            pass
    error = leaf(refused.value)
    assert isinstance(error, McpError)
    assert error.code == TETHER_ERROR  # not -32603 "Server returned an error response"
    assert error.data["code"] == "checkpoint_parked"
    assert str(error) == "checkpoint_parked: admission closed by an open checkpoint"
