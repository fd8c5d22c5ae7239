"""The private socket: where a worker serves requests other workers forward to it.

It runs uvicorn's HTTP protocol on the worker's own event loop, on a Unix socket we bind
ourselves (mode 0600). It leaves the process alone: no signal handlers (we never call
`Server.serve`), no logging configuration, no access log lines (the worker that received
a request logs it), and no `server` or `date` headers (the receiving worker adds its own).

Relayed WebSockets (`relay.py`) arrive here too, on uvicorn's websockets-sansio protocol
without compression, with no size limit of its own (the receiving worker's server
applied the client's), and without its "[accepted]" lines, for the same reason as the
access log. The relaying worker pings this side (`--ws-ping-*`); this side pings it back
only on a TCP hop listener (another host may be cut off without a reset; a worker of
this host that dies closes its Unix socket).

`PrivateServer.tcp` serves the same way on a TCP port instead: the hop listener other
hosts' workers reach (SPEC 12). There every request and every WebSocket handshake must
carry, in its hop header, a signature for this worker (hopsign.py); any other is answered
401 `hop_unauthorized` (a WebSocket's as the ASGI denial response) and never reaches the
app. What passes is served as a forwarded request, as one from the Unix socket is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from tether.routing.errors import TetherError, encode_error, send_error, with_error_headers
from tether.routing.hop import take_signature
from tether.routing.hopsign import FULL, HopVerifier, request_target
from tether.routing.relay import send_denial
from tether.routing.types import WorkerId
from tether.routing.writes import JoinedWrites

__all__ = ["PrivateServer"]

log = structlog.get_logger("tether.private")

BACKLOG = 2048
# Longer than the forwarder's idle timeout, so the client side always closes first.
KEEP_ALIVE_S = 75
WS_MAX_SIZE = 1 << 40
"""No limit of its own: a relayed message already passed the public server's."""


class PrivateServer:
    """Serves an ASGI app on a Unix socket for requests other workers forward here (or,
    made by `tcp`, on a TCP port for signed requests from other hosts)."""

    def __init__(
        self, app: ASGIApp, path: str, *, timeout_graceful_shutdown: int | None = None,
        ws_ping: tuple[float | None, float | None] = (None, None),
    ) -> None:
        """`timeout_graceful_shutdown`: how long `stop` lets in-flight requests run before
        cancelling them (None: as long as they take, like uvicorn's default). `ws_ping`:
        uvicorn's `ws_ping_interval` and `ws_ping_timeout` for relayed WebSockets (None:
        no pings)."""
        self.app = app
        self.path = path
        self.ws_ping = ws_ping
        """The Unix socket's path; empty on a TCP listener."""
        self.host = ""
        self.port = 0
        """A TCP listener's host and port (the bound one once started, if asked for 0)."""
        self.timeout_graceful_shutdown = timeout_graceful_shutdown
        self.connections_accepted: int = 0
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None

    @classmethod
    def tcp(
        cls,
        app: ASGIApp,
        host: str,
        port: int,
        verifier: HopVerifier,
        worker: WorkerId,
        *,
        timeout_graceful_shutdown: int | None = None,
        ws_ping: tuple[float | None, float | None] = (None, None),
    ) -> PrivateServer:
        """A hop listener on TCP `host`:`port` (0: any free port) for worker `worker`:
        it serves `app` only the requests `verifier` finds signed for `worker`."""
        server = cls(
            _HopGuard(app, verifier, worker), "",
            timeout_graceful_shutdown=timeout_graceful_shutdown, ws_ping=ws_ping,
        )
        server.host, server.port = host, port
        return server

    @property
    def address(self) -> str:
        """Where a forwarder reaches it: the socket path, or `tcp://host:port`."""
        if self.path:
            return self.path
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    async def start(self) -> None:
        """Bind the socket (a Unix one 0600) and start serving it on the running loop."""
        sock = self._bind_unix() if self.path else self._bind_tcp()
        try:
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
                ws_ping_interval=self.ws_ping[0],
                ws_ping_timeout=self.ws_ping[1],
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
            self._unlink()
            raise
        self._socket = sock
        self._server = server

    def _bind_unix(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
        except BaseException:
            sock.close()  # the path may be another server's socket: leave it
            raise
        try:
            # The runtime directory is 0700, so nobody can connect before this chmod.
            os.chmod(self.path, 0o600)
        except BaseException:
            sock.close()
            self._unlink()
            raise
        return sock

    def _bind_tcp(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            self.port = sock.getsockname()[1]
        except BaseException:
            sock.close()
            raise
        return sock

    def _unlink(self) -> None:
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

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
            self._unlink()

    def _protocol_class(self) -> type[asyncio.Protocol]:
        owner = self
        tcp = not self.path

        class PrivateProtocol(HttpToolsProtocol):
            """uvicorn's httptools protocol without access lines, counting connections."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                # uvicorn decides per connection from whether "uvicorn.access" has handlers;
                # the worker's own server logs each request once, so this one never does.
                self.access_log = False

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                owner.connections_accepted += 1
                if tcp:
                    # asyncio sets it only on sockets made with proto IPPROTO_TCP, which
                    # ours is not; without it a reply's head and body, written apart, wait
                    # for the client's delayed ACK (40 ms a request).
                    sock = transport.get_extra_info("socket")
                    if sock is not None:
                        with contextlib.suppress(OSError):
                            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                super().connection_made(JoinedWrites(transport, self.loop))

        return PrivateProtocol


class _HopGuard:
    """The hop listener's gate: a request passes to the app only with a valid signature
    for this worker; any other is answered 401 `hop_unauthorized`."""

    def __init__(self, app: ASGIApp, verifier: HopVerifier, worker: WorkerId) -> None:
        self.app = app
        self.verifier = verifier
        self.worker = worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":  # (off on this server) http and websocket
            method = scope.get("method", "GET")  # a handshake is checked as its GET
            reason = self.verifier.check(
                take_signature(scope), method, request_target(scope), self.worker
            )
            if reason is not None:
                await self._refuse(scope, send, method, reason)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, method: str, reason: str) -> None:
        client = scope.get("client")
        log.warning(
            "hop_refused",
            reason=reason,
            method=method,
            path=scope["path"],
            client=f"{client[0]}:{client[1]}" if client else None,
        )
        # A valid signature refused only because too many are remembered: a transient 503.
        error = TetherError(
            "claimant_unavailable" if reason == FULL else "hop_unauthorized", reason
        )
        if scope["type"] == "http":
            await send_error(send, error)
            return
        body = encode_error(error)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            *with_error_headers(error, None),
        ]
        await send_denial(scope, send, error.status, headers, body, reason=error.code)


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
