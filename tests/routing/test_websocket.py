"""The router's WebSocket branch: claims made at the accept and kept while open, and a
handshake's place in admission and readiness (SPEC 4.8, 5.2, 5.3)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from e2e.harness import eventually
from tests.routing.conftest import Cluster, Node
from tests.routing.test_relay import seed, ws_url
from tests.routing.ws_apps import websocket_app
from tether.checkpoint.participant import Participant
from tether.routing.types import SessionId


def cookie_for(node: Node, session_id: str) -> str:
    """A session cookie naming `session_id`, as the app's SessionMiddleware would sign it."""
    kind = node.routing.router.kind
    assert kind is not None and kind.cookie is not None
    return f"session={kind.cookie.encode({'session_id': session_id})}"


async def _none(value: Awaitable[object]) -> bool:
    return await value is None


async def claimant(node: Node, session_id: str) -> str | None:
    assert node.routing.claims is not None
    return await node.routing.claims.lookup(SessionId(session_id))


async def test_a_websocket_that_reads_its_session_claims_it_before_the_accept_arrives(
    cluster: Cluster,
) -> None:
    a = await cluster.add(websocket_app())
    b = await cluster.add(websocket_app())
    cookie = cookie_for(a, "fresh")
    async with connect(ws_url(a), additional_headers={"cookie": cookie}) as first:
        assert await claimant(b, "fresh") == a.id  # claimed by the time the accept arrived
        await first.send("n")
        assert json.loads(await first.recv()) == {"count": 1, "worker": a.id, "text": "n"}
        # Its next WebSocket, wherever it lands, reaches the same state.
        async with connect(ws_url(b), additional_headers={"cookie": cookie}) as second:
            await second.send("n")
            assert json.loads(await second.recv())["count"] == 2
    assert b.app.state.counts == {}


async def test_a_websocket_that_never_touches_the_session_leaves_no_claim(
    cluster: Cluster,
) -> None:
    a = await cluster.add(websocket_app())
    await cluster.add(websocket_app())
    async with connect(ws_url(a, "/whoami"),
                       additional_headers={"cookie": cookie_for(a, "untouched")}) as ws:
        assert json.loads(await ws.recv())["session_id"] == "untouched"
    assert await claimant(a, "untouched") is None


async def test_an_open_websocket_keeps_its_claim_which_ends_a_window_after_it_closes(
    cluster: Cluster,
) -> None:
    a = await cluster.add(websocket_app(close_window_s=0.2))
    await cluster.add(websocket_app(close_window_s=0.2))
    for session_id in ("kept", "witness"):  # both claimed, each ending a window from now
        async with connect(ws_url(a),
                           additional_headers={"cookie": cookie_for(a, session_id)}) as ws:
            await ws.send("n")
            await ws.recv()
    async with connect(ws_url(a), additional_headers={"cookie": cookie_for(a, "kept")}) as ws:
        # The witness's claim ends: the sweep ran past both windows' end.
        await eventually(lambda: _none(claimant(a, "witness")), 10, "the witness is swept")
        assert await claimant(a, "kept") == a.id
        await ws.send("n")
        assert json.loads(await ws.recv())["count"] == 2
    await eventually(lambda: _none(claimant(a, "kept")), 10, "the claim ends once closed")


async def test_a_websocket_whose_session_another_worker_claimed_first_is_refused_with_409(
    cluster: Cluster,
) -> None:
    a = await cluster.add(websocket_app())
    b = await cluster.add(websocket_app())
    cookie = cookie_for(a, "contested")
    opening = asyncio.ensure_future(connect(
        ws_url(a, "/ws?gate=g"), additional_headers={"cookie": cookie}
    ))
    try:
        entered = a.app.state.entered
        await eventually(lambda: "g" in entered, 10, "the handshake waits at its gate")
        async with connect(ws_url(b), additional_headers={"cookie": cookie}) as other:
            await other.send("n")  # b's WebSocket read the session first: b claimed it
            assert json.loads(await other.recv())["worker"] == b.id
        a.app.state.gates.setdefault("g", asyncio.Event()).set()
        with pytest.raises(InvalidStatus) as refused:
            await opening
    finally:
        a.app.state.gates.setdefault("g", asyncio.Event()).set()
        if not opening.done():
            opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
    assert refused.value.response.status_code == 409
    assert json.loads(refused.value.response.body)["code"] == "session_conflict"
    assert a.app.state.released == ["contested"]  # no state is left on two workers
    assert await claimant(a, "contested") == b.id


async def test_open_websockets_are_not_in_progress_but_a_handshake_is(cluster: Cluster) -> None:
    a = await cluster.add(websocket_app())
    await cluster.add(websocket_app())
    participant = Participant()
    a.routing.router.admission = participant
    sockets = [
        await connect(ws_url(a), additional_headers={"cookie": cookie_for(a, f"open-{i}")})
        for i in range(100)
    ]
    try:
        for ws in sockets:
            await ws.send("n")
            await ws.recv()
        assert participant.blockers().total == 0  # 100 open WebSockets block nothing
        opening = asyncio.ensure_future(connect(
            ws_url(a, "/ws?gate=h"), additional_headers={"cookie": cookie_for(a, "opening")}
        ))
        await eventually(lambda: "h" in a.app.state.entered, 10, "a handshake is under way")
        busy = participant.blockers()
        assert (busy.total, busy.listed[0]["kind"], busy.listed[0]["id"]) == (
            1, "session_busy", "opening")
        a.app.state.gates["h"].set()
        sockets.append(await opening)
        assert participant.blockers().total == 0
    finally:
        for ws in sockets:
            await ws.close()


async def test_a_handshake_while_admission_is_closed_gets_503_checkpoint_parked(
    cluster: Cluster,
) -> None:
    a = await cluster.add(websocket_app())
    cookie = await seed(a, "parked")
    participant = Participant()
    participant.close_admission()
    a.routing.router.admission = participant
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(a), additional_headers={"cookie": cookie}):
            pass
    response = refused.value.response
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert json.loads(response.body)["code"] == "checkpoint_parked"
