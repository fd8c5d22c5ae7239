"""The forwarder a user would write without tether: the routing benchmark's baseline.

A plain Starlette app with one catch-all route that reads the request with Starlette's
`Request`, sends it on with an aiohttp `ClientSession` over a `UnixConnector`, and answers
with a `StreamingResponse` of the upstream body. It is served by its own uvicorn (httptools,
the default event loop, no access log) and forwards to one worker's private socket.

Run as `python -m e2e.bench.baseline_forwarder SOCKET_PATH`: it listens on 127.0.0.1,
port 0, and prints `port N` on stdout (connections made before it serves wait in the
backlog).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)


def create_app(socket_path: str) -> Starlette:
    """A catch-all forwarder to the HTTP server listening on `socket_path`."""
    sessions: list[aiohttp.ClientSession] = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        connector = aiohttp.UnixConnector(path=socket_path)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            sessions.append(session)
            yield

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
        url = f"http://claimant{request.url.path}"
        if request.url.query:
            url += f"?{request.url.query}"
        upstream = await sessions[0].request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        )
        reply_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(
            upstream.content.iter_any(),
            status_code=upstream.status,
            headers=reply_headers,
            background=BackgroundTask(upstream.release),
        )

    return Starlette(
        routes=[Route("/{path:path}", forward, methods=METHODS)],
        lifespan=lifespan,
    )


def main() -> None:
    socket_path = sys.argv[1]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    config = uvicorn.Config(
        create_app(socket_path),
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_keep_alive=75,
    )
    # Connections made before uvicorn starts wait in the listen backlog.
    print(f"port {listener.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
