"""`--metrics-port`: the main process serves `/metrics` itself, without a token (SPEC 9).

Off by default, and bound to `--metrics-host` (127.0.0.1 unless told otherwise), since
it needs no token. The socket is bound before any worker starts, so a port in use is one
line and exit 2 like every other start-up mistake.
"""

from __future__ import annotations

import errno
import socket

from aiohttp import web

from tether.coordinator.metrics import CONTENT_TYPE_LATEST, Metrics
from tether.coordinator.runtime import StartupError

SHUTDOWN_TIMEOUT_S = 2.0


def bind_metrics(host: str, port: int) -> socket.socket:
    """The listening socket of `--metrics-port`; raises `StartupError` with the line to
    print."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        fix = ("another process listens there; pick another --metrics-port"
               if error.errno == errno.EADDRINUSE else "pick another --metrics-host")
        raise StartupError(
            f"cannot serve metrics on {host}:{port} ({error.strerror}); {fix}"
        ) from None
    return sock


def metrics_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    return f"http://{where}:{port}/metrics"


class MetricsServer:
    """`GET /metrics` on its own socket, in the main process's event loop."""

    def __init__(self, metrics: Metrics, sock: socket.socket) -> None:
        self.metrics = metrics
        self.sock = sock
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        self._started = False

    async def start(self) -> None:
        self._started = True
        await self._runner.setup()
        await web.SockSite(self._runner, self.sock).start()

    async def close(self) -> None:
        """Stop serving and close every connection (the socket included)."""
        if self._started:
            self._started = False
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        text = await self.metrics.render()
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE_LATEST})
