"""The Jupyter-like kernel server (`examples/kernels.py`) at 4 workers: kernels minted in
a start route's JSON reply and named in the URL path reach their holder from any worker,
over HTTP and over their WebSocket channel, with a declared kind and no routing code in
the app (SPEC 4.1, 4.8)."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect

from e2e.conftest import Serve
from e2e.harness import Http, bounded

pytestmark = pytest.mark.e2e

APP = "tether.examples.kernels:app"
KERNELS = 200
EXECUTES = 5
OVER_WEBSOCKET = 3


async def test_200_kernels_each_executing_5_times_over_http_and_3_over_a_websocket_are_all_right(
    serve: Serve,
) -> None:
    server = serve(APP, 4)
    async with Http(server.url) as http:

        async def one_kernel() -> list[tuple[int, int, str]]:
            started = await http.request("POST", "/api/kernels")
            assert started.status == 201, started
            kernel, holder = started.json["id"], started.json["worker"]
            seen = []
            for _ in range(EXECUTES):
                reply = await http.request("POST", f"/api/kernels/{kernel}/execute",
                                           json={"code": "x += 3"})
                assert reply.status == 200, reply
                seen.append((reply.json["execution_count"], reply.json["result"],
                             reply.json["worker"] == holder))
            channel = f"{server.url.replace('http://', 'ws://', 1)}/api/kernels/{kernel}/channels"
            async with connect(channel, open_timeout=30) as ws:
                for _ in range(OVER_WEBSOCKET):
                    await ws.send(json.dumps({"code": "x += 3"}))
                    reply = json.loads(await ws.recv())
                    seen.append((reply["execution_count"], reply["result"],
                                 reply["worker"] == holder))
            info = await http.request("GET", f"/api/kernels/{kernel}")
            assert info.json["execution_count"] == EXECUTES + OVER_WEBSOCKET
            assert (await http.request("DELETE", f"/api/kernels/{kernel}")).status == 204
            return seen

        results = await bounded(one_kernel() for _ in range(KERNELS))
        status = await server.status(http)
    expected = [(n, 3 * n, True) for n in range(1, EXECUTES + OVER_WEBSOCKET + 1)]
    assert results == [expected] * KERNELS
    assert sum(w["forwarded"] for w in status["workers"]) > KERNELS, "most calls crossed"
