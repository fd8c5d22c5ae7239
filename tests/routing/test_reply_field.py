"""A start route's JSON reply that names the new session (SPEC 4.1), and the path source,
on in-process workers: the kernel server of `examples/kernels.py`, and replies that name
nothing usable."""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.routing.conftest import Cluster
from tether.examples.kernels import KIND, create_app
from tether.routing.types import SessionId


async def test_a_kernel_minted_in_a_reply_is_claimed_and_reached_by_its_path(
    cluster: Cluster,
) -> None:
    a = await cluster.add(create_app())
    b = await cluster.add(create_app())
    cluster.set_live()
    async with a.client() as on_a, b.client() as on_b:
        started = await on_a.post("/api/kernels")
        assert started.status_code == 201
        kernel = started.json()["id"]
        assert b.routing.claims is not None
        assert await b.routing.claims.lookup(SessionId(kernel)) == a.id, "claimed before the reply"
        for expected in range(1, 4):
            reply = await on_b.post(f"/api/kernels/{kernel}/execute", json={"code": "x += 2"})
            assert reply.status_code == 200, reply.text
            assert reply.json() == {"execution_count": expected, "result": 2 * expected,
                                    "worker": a.id}
        for bad in (b"not json", b"[" * 100_000):  # a clear error, not a 500
            refused = await on_b.post(f"/api/kernels/{kernel}/execute", content=bad)
            assert (refused.status_code, refused.json()["code"]) == (422, "invalid_request")
        assert (await on_b.delete(f"/api/kernels/{kernel}")).status_code == 204
        assert a.routing.claims is not None
        assert not a.routing.claims.lifetimes.is_open(SessionId(kernel)), "DELETE ends it"


def replying(body: bytes, status: int = 200, media: str = "application/json") -> Starlette:
    async def start(request: Request) -> Response:
        return Response(body, status_code=status, media_type=media)

    async def named(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.url.path})

    app = Starlette(routes=[Route("/api/kernels", start, methods=["POST"]),
                            Route("/api/kernels/{kernel_id}", named)])
    return app


async def test_replies_that_name_no_usable_id_pass_unchanged_and_claim_nothing(
    cluster: Cluster,
) -> None:
    long_id = "k" * 300
    bodies: list[tuple[bytes, int, str]] = [
        (b"not json at all", 200, "text/plain"),
        (b'{"other": "x"}', 200, "application/json"),
        (b'{"id": 17}', 200, "application/json"),
        (b'{"id": ["k"]}', 200, "application/json"),
        (('{"id": "' + long_id + '"}').encode(), 200, "application/json"),
        (b'{"id": "bad\\u0001id"}', 200, "application/json"),
        (b'{"id": "failed"}', 500, "application/json"),
        (b'[1, 2]', 200, "application/json"),
        (b'{"id": "big", "pad": "' + b"x" * (1 << 20) + b'"}', 200, "application/json"),
    ]
    for body, status, media in bodies:
        node = await cluster.add(replying(body, status, media), kind=KIND)
        async with node.client() as client:
            reply = await client.post("/api/kernels")
        assert (reply.status_code, reply.content) == (status, body), "passed on unchanged"
        assert node.routing.claims is not None
        assert len(node.routing.claims) == 0, body[:40]


async def test_a_reply_named_id_another_worker_holds_is_409_and_released(
    cluster: Cluster,
) -> None:
    released: list[Any] = []

    async def release(session_id: SessionId) -> None:
        released.append(session_id)

    kind = dataclasses.replace(KIND, release=release)
    a = await cluster.add(replying(b'{"id": "taken"}'), kind=kind)
    b = await cluster.add(replying(b'{"id": "taken"}'), kind=kind)
    cluster.set_live()
    async with a.client() as on_a, b.client() as on_b:
        assert (await on_a.post("/api/kernels")).status_code == 200
        refused = await on_b.post("/api/kernels")
    assert refused.status_code == 409 and refused.json()["code"] == "session_conflict"
    assert released == ["taken"]
