"""The private socket: where a worker serves requests other workers forward to it.

It runs uvicorn's HTTP protocol on the worker's own event loop, on a Unix socket we bind
ourselves (mode 0600). It leaves the process alone: no signal handlers (we never call
`Server.serve`), no logging configuration, no access log lines (the worker that received
a request logs it), and no `server` or `date` headers (the receiving worker adds its own).

Relayed WebSockets (`relay.py`) arrive here too, on uvicorn's websockets-sansio protocol
without compression or keep-alive pings (the hop is a local socket), with no size limit
of its own (the receiving worker's server applied the client's), and without its
"[accepted]" lines, for the same reason as the access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["PrivateServer"]

BACKLOG = 2048
# Longer than the forwarder's idle timeout, so the client side always closes first.
KEEP_ALIVE_S = 75
WS_MAX_SIZE = 1 << 40
"""No limit of its own: a relayed message already passed the public server's."""


class PrivateServer:
    """Serves an ASGI app on a Unix socket for requests other workers forward here."""

    def __init__(
        self, app: ASGIApp, path: str, *, timeout_graceful_shutdown: int | None = None
    ) -> None:
        """`timeout_graceful_shutdown`: how long `stop` lets in-flight requests run before
        cancelling them (None: as long as they take, like uvicorn's default)."""
        self.app = app
        self.path = path
        self.timeout_graceful_shutdown = timeout_graceful_shutdown
        self.connections_accepted: int = 0
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None

    async def start(self) -> None:
        """Bind the socket (0600) and start serving it on the running loop."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
        except BaseException:
            sock.close()  # the path may be another server's socket: leave it
            raise
        try:
            # The runtime directory is 0700, so nobody can connect before this chmod.
            os.chmod(self.path, 0o600)
            sock.listen(BACKLOG)
            sock.setblocking(False)
            # log_config=None and the default access_log=True make Config leave every
            # logger alone (access_log=False would strip the handlers of the process-wide
            # "uvicorn.access" logger); our protocol class turns access lines off instead.
            config = uvicorn.Config(
                self.app,
                http=self._protocol_class(),
                ws=_PrivateWebSocket,
                ws_max_size=WS_MAX_SIZE,
                ws_ping_interval=None,
                ws_per_message_deflate=False,
                # Set, not detected: uvicorn takes a bound method (a router's entry) for ASGI2.
                interface="asgi3",
                lifespan="off",
                log_config=None,
                proxy_headers=False,
                server_header=False,
                date_header=False,
                timeout_keep_alive=KEEP_ALIVE_S,
                backlog=BACKLOG,
                timeout_graceful_shutdown=self.timeout_graceful_shutdown,
            )
            config.load()
            server = uvicorn.Server(config)
            # Server.serve() would set this up (and take over signal handlers); we don't call it.
            server.lifespan = config.lifespan_class(config)
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self._socket = sock
        self._server = server

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, close idle connections, unlink."""
        server, sock = self._server, self._socket
        self._server = self._socket = None
        if server is None or sock is None:
            return
        try:
            server.should_exit = True
            await server.shutdown(sockets=[sock])
        finally:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _protocol_class(self) -> type[asyncio.Protocol]:
        owner = self

        class PrivateProtocol(HttpToolsProtocol):
            """uvicorn's httptools protocol without access lines, counting connections."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                # uvicorn decides per connection from whether "uvicorn.access" has handlers;
                # the worker's own server logs each request once, so this one never does.
                self.access_log = False

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                owner.connections_accepted += 1
                super().connection_made(transport)

        return PrivateProtocol


class _QuietLogger(logging.Logger):
    """uvicorn's error logger without its info lines (a WebSocket's "[accepted]")."""

    def info(self, *args: Any, **kwargs: Any) -> None:
        pass


_QUIET = _QuietLogger("uvicorn.error.private")
_QUIET.parent = logging.getLogger("uvicorn.error")


class _PrivateWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, logging errors only: the worker that received
    a WebSocket logs its handshake."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _QUIET
        self.conn.logger = _QUIET  # websockets' own "connection closed"
