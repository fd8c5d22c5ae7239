"""WebSockets: the router's branch for a handshake (SPEC 4.8).

A handshake is routed by the same rule and the same sources as a request (`find`: the
header, the query, the cookie, the token, the path): served here if this worker holds
its session (or nobody does), relayed to the holder's private socket if another worker
does (`relay.py`), refused with the HTTP denial response 410 `session_gone` if that
worker is gone (or accepted and closed with 4410 where the server cannot send one).

Served here, a WebSocket is a request that lasts: its session's claim is made before the
accept leaves the worker if the handler used the session by then (or placed it here),
and kept while the WebSocket is open (`WorkerClaims.begin`/`end`), so no sweep ends it.
For readiness only the handshake counts as in progress: admission (SPEC 5.3) is entered
as for a request and left once the app accepted or denied it, so an open WebSocket never
blocks a prepare. A handshake matches the kind's routes as `GET <path>`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from starlette.types import Message, Receive, Scope, Send

from tether.routing.errors import TetherError, encode_error, with_error_headers
from tether.routing.forward import ClaimantGone, ClaimantUnavailable
from tether.routing.hop import hop_value, strip_hop
from tether.routing.relay import send_denial
from tether.routing.router import (
    NO_KIND,
    REFUSALS,
    ROUTER_KEY,
    SCOPE_KEY,
    WORKER_KEY,
    Router,
    _conflict,
    _release,
    _with_session_cookie,
    session_gone,
)
from tether.routing.sources import Found, find, route_path
from tether.routing.types import SessionId, WorkerId

__all__ = ["route_websocket"]

log = structlog.get_logger("tether.router")


async def route_websocket(
    router: Router, scope: Scope, receive: Receive, send: Send, *, forwarded: bool
) -> None:
    """Route one WebSocket handshake: serve it here, relay it, or refuse it. `forwarded`:
    it came over the private socket (served here, never relayed again)."""
    if forwarded or not router.access_log:
        await _route(router, scope, receive, send, forwarded)
        return
    started = time.perf_counter()
    status = 0

    async def logged_send(message: Message) -> None:
        nonlocal status
        if not status:
            if message["type"] == "websocket.accept":
                status = 101
            elif message["type"] == "websocket.http.response.start":
                status = message["status"]
            elif message["type"] == "websocket.close":
                status = 403  # what uvicorn answers a close before the accept
        await send(message)

    try:
        await _route(router, scope, receive, logged_send, forwarded)
    finally:
        log.info(
            "websocket",
            path=scope["path"],
            status=status,
            session_id=scope.get(SCOPE_KEY),
            ms=round((time.perf_counter() - started) * 1000, 3),
        )


async def _route(
    router: Router, scope: Scope, receive: Receive, send: Send, forwarded: bool
) -> None:
    found = find(router.kind, scope)
    if found.hop:
        strip_hop(scope)  # a client's forgery: only our relay may send one
    session_id = found.session_id
    scope[SCOPE_KEY] = session_id
    scope[WORKER_KEY] = router.worker
    scope[ROUTER_KEY] = router
    where = await router.destination(session_id, found.worker, forwarded)
    if where is None:
        await _serve(router, session_id, found, scope, receive, send, forwarded)
    elif isinstance(where, TetherError):
        await refuse(router, scope, send, where)
    else:
        gone = "worker_gone" if session_id is None else "session_gone"
        await _relay(router, where, scope, receive, send, gone)


async def refuse(router: Router, scope: Scope, send: Send, error: TetherError) -> None:
    """Refuse a handshake with a tether error: its status and JSON body as the HTTP denial
    response (whatever the kind's protocol; a WebSocket client reads the status)."""
    outcome = REFUSALS.get(error.code)
    if outcome is not None:
        router.stats.refused[outcome] += 1
    body = encode_error(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        *with_error_headers(error, None),
    ]
    await send_denial(scope, send, error.status, headers, body, reason=error.code)


async def _relay(
    router: Router,
    owner: WorkerId,
    scope: Scope,
    receive: Receive,
    send: Send,
    gone: str,
) -> None:
    relays = router.relays
    if relays is None or router.socket_path is None:
        await refuse(router, scope, send, TetherError("worker_gone", f"worker {owner}"))
        return
    router.stats.forwarded += 1
    path = router.address(owner)
    try:
        await relays.relay(path, scope, receive, send, hop_value(scope), owner)
    except ClaimantGone:
        if router.forwarder is not None:
            router.forwarder.discard(path)
        error = (
            TetherError("worker_gone", f"worker {owner}")
            if gone == "worker_gone"
            else session_gone(scope.get(SCOPE_KEY))
        )
        await refuse(router, scope, send, error)
    except ClaimantUnavailable as error:
        await refuse(router, scope, send, TetherError("claimant_unavailable", str(error)))


async def _serve(
    router: Router,
    session_id: SessionId | None,
    found: Found,
    scope: Scope,
    receive: Receive,
    send: Send,
    forwarded: bool,
) -> None:
    """Serve here: admission for the handshake, the claim at the accept, kept while open."""
    handshake = _Handshake(router, session_id)
    if router.admission is not None:
        facts = (router.kind or NO_KIND).route("GET", route_path(scope))
        try:
            handshake.leave = await router.admission.enter(
                session_id, stateless=facts.stateless, background=facts.background
            )
        except TetherError as error:
            await refuse(router, scope, send, error)
            return
    if not forwarded:
        router.stats.local += 1
    try:
        await _serve_admitted(router, handshake, found, scope, receive, send)
    finally:
        handshake.answered()


async def _serve_admitted(
    router: Router,
    handshake: _Handshake,
    found: Found,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    kind = router.kind
    session_id = handshake.session_id
    if kind is None or session_id is None:
        handshake.scope = scope
        await router.app(scope, receive, handshake.wrap(send))
        return
    claims = router.claims
    placed = router.tables.placed.get(session_id) == router.worker
    if claims is not None and placed and not claims.mine(session_id):
        try:
            owner = await claims.claim(session_id)  # a restored session, first served here
        except TetherError as error:  # the cluster's store is out of reach
            await refuse(router, scope, send, error)
            return
        if owner != router.worker:
            await refuse(router, scope, send, _conflict(session_id, owner))
            return
    if kind.cookie is not None and found.cookie_id != session_id:
        scope = _with_session_cookie(scope, kind, found, session_id)
    handshake.scope = scope
    if claims is None:
        await router.app(scope, receive, handshake.wrap(send))
        return
    claims.begin(session_id)  # held while the WebSocket is open: no sweep ends the claim
    try:
        await router.app(scope, receive, handshake.wrap(send))
    finally:
        claims.end(session_id, "other", handshake.accepted)


class _Handshake:
    """One WebSocket served here: leaves admission once the app answered the handshake,
    and claims the session at the accept if the handler used it."""

    def __init__(self, router: Router, session_id: SessionId | None) -> None:
        self.router = router
        self.session_id = session_id
        self.scope: Scope = {}
        self.leave: Callable[[], None] | None = None
        self.accepted = False
        self.refused = False
        self.over = False

    def answered(self) -> None:
        """The handshake is over (accepted, denied, or the app gave up): from now on the
        WebSocket is not in progress for readiness."""
        leave, self.leave = self.leave, None
        if leave is not None:
            leave()

    def wrap(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if self.refused:
                return  # the router answered the handshake instead of the app
            kind = message["type"]
            if not self.over:
                if kind == "websocket.accept":
                    self.over = True
                    error = await self._claim()
                    self.answered()
                    if error is not None:
                        self.refused = True
                        await refuse(self.router, self.scope, send, error)
                        return
                    self.accepted = True
                elif kind in ("websocket.close", "websocket.http.response.start"):
                    self.over = True
                    self.answered()
            await send(message)

        return wrapped

    async def _claim(self) -> TetherError | None:
        """Claim the session before the accept leaves, if the handler used it."""
        router, sid = self.router, self.session_id
        kind, claims = router.kind, router.claims
        if sid is None or kind is None or claims is None or claims.mine(sid):
            return None
        session = self.scope.get("session")
        used = bool(getattr(session, "accessed", False))
        if not (used or (kind.holder is not None and kind.holder.holds(sid))):
            return None
        try:
            owner = await claims.claim(sid)
        except TetherError as error:
            return error
        if owner == router.worker:
            return None
        await _release(kind, sid)
        return _conflict(sid, owner)
