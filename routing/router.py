"""The router: the one place a request's worker is decided (SPEC 4.2).

Pure ASGI middleware that sits outside the app (and so outside its
`SessionMiddleware`): it finds the request's session ID, finds the worker that holds it,
and either forwards the request there or serves it here, claiming the session when the
request shows it is being used.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.routing.at_once import ran_at_once
from tether.routing.claims import LEASE_LAPSED, WorkerClaims
from tether.routing.errors import TetherError, send_error
from tether.routing.forward import ClaimantGone, ClaimantUnavailable, Forwarder
from tether.routing.hop import hop_value, strip_hop, take_hop
from tether.routing.kinds import RouteFacts, SessionKind
from tether.routing.lifetimes import Role
from tether.routing.logs import access_line
from tether.routing.mcp import send_jsonrpc_error
from tether.routing.relay import Relays
from tether.routing.replies import ReplyField
from tether.routing.sources import (
    Found,
    body_session_id,
    find,
    read_body,
    replay,
    route_path,
)
from tether.routing.tables import Tables
from tether.routing.tracing import HopTraces
from tether.routing.types import (
    LATER,
    Later,
    SessionId,
    WorkerId,
    new_session_id,
    session_id_or_none,
)

log = structlog.get_logger("tether.router")

CONTROL_PREFIX = "/_tether/"
NO_KIND = SessionKind()
"""What admission assumes of an app that declares no kind: `/health` stays served."""
SCOPE_KEY = "tether.session_id"
WORKER_KEY = "tether.worker"
ROUTER_KEY = "tether.router"
HANDED_KEY = "tether.handed_in"
"""Set in the scope of a connection's first request when another worker handed the
connection here (routing/handoff.py): that request is served as a forwarded one."""
FOUND_KEY = "tether.found"
"""Set in the scope of a request whose head the passthrough (front.py) read and left to
this router: what `find` made of that head, so that the router does not read it again."""


class Admission(Protocol):
    """Who may reach the app now (a checkpoint closes admission; SPEC 5.3)."""

    def admit(
        self, session_id: SessionId | None, stateless: bool, background: bool
    ) -> Callable[[], None] | Later | None:
        """`enter` where it need not wait; LATER where it must."""
        ...

    async def enter(
        self, session_id: SessionId | None, stateless: bool, background: bool
    ) -> Callable[[], None] | None:
        """Wait, admit (returning what ends the request's tracking, if tracked), or
        raise `TetherError("checkpoint_parked")`."""
        ...


FORWARD_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
"""Upper bounds, in seconds, of `tether_forward_seconds`'s buckets (then +Inf)."""
REFUSALS: dict[str, str] = {
    "session_gone": "gone",
    "worker_gone": "gone",
    "session_conflict": "conflict",
    "claimant_unavailable": "unavailable",
    "checkpoint_parked": "parked",
    "session_mismatch": "mismatch",
}
"""The router's refusals counted in `tether_requests_total`: error code -> outcome."""


@dataclass(slots=True)
class RouterStats:
    """What this worker's router counted (status, and `tether_requests_total` and
    `tether_forward_seconds` through the main process; docs/observability.md). Plain
    ints and lists, so that counting costs one increment on the hot path."""

    forwarded: int = 0
    """Requests from the public port handed to another worker's private socket (by the
    router, or by the passthrough, front.py)."""
    served_forwarded: int = 0
    """Requests another worker forwarded here, counted as they arrive."""
    passed_through: int = 0
    """Of `forwarded`, those the passthrough sent on as bytes (front.py)."""
    handed_off: int = 0
    """Of `forwarded`, those whose connection was handed to the holder (handoff.py)."""
    local: int = 0
    """Requests from the public port admitted to this worker's own app."""
    refused: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(REFUSALS.values(), 0)
    )
    """The router's refusals by outcome (`REFUSALS`)."""
    forward_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(FORWARD_BUCKETS) + 1)
    )
    """How many forwarded requests took at most each bound (not cumulative; last: +Inf)."""
    forward_seconds: float = 0.0

    def observe_forward(self, seconds: float) -> None:
        self.forward_buckets[bisect_left(FORWARD_BUCKETS, seconds)] += 1
        self.forward_seconds += seconds

    def report(self) -> dict[str, Any]:
        """The counts as they cross the channel (plain msgpack)."""
        return {
            "requests": {
                "local": self.local,
                "forwarded": self.forwarded,
                "served_forwarded": self.served_forwarded,
                **self.refused,
            },
            "forward_buckets": list(self.forward_buckets),
            "forward_seconds": self.forward_seconds,
        }


@dataclass
class Router:
    """Routes each request to the worker that holds its session.

    `claims` and `forwarder` are None on a server with one worker: nothing is claimed or
    forwarded there, but IDs are still read, minted and checked.
    """

    app: ASGIApp
    worker: WorkerId
    kind: SessionKind | None = None
    claims: WorkerClaims | None = None
    forwarder: Forwarder | None = None
    socket_path: Callable[[WorkerId], str] | None = None
    tables: Tables = field(default_factory=Tables)
    control: ASGIApp | None = None
    admission: Admission | None = None
    access_log: bool = True
    stats: RouterStats = field(default_factory=RouterStats)
    tracing: HopTraces | None = None
    """Set when this process traces (routing/tracing.py): forwards go through it."""
    relays: Relays | None = None
    """Relayed WebSockets (routing/relay.py); None where nothing is forwarded."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The public entry: requests that reached this worker on the shared port."""
        if scope["type"] != "http":
            if scope["type"] == "websocket" and not route_path(scope).startswith(CONTROL_PREFIX):
                # Imported here: the WebSocket branch builds on this module.
                from tether.routing.websocket import route_websocket

                await route_websocket(self, scope, receive, send, forwarded=False)
                return
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path.startswith(CONTROL_PREFIX):
            await self._control(scope, receive, send)
            return
        forwarded = HANDED_KEY in scope
        if forwarded:
            self.stats.served_forwarded += 1
        if not self.access_log:
            await self._route(scope, receive, send, forwarded, path)
        else:
            await self._logged(scope, receive, send, forwarded, path)

    async def _logged(
        self, scope: Scope, receive: Receive, send: Send, forwarded: bool, path: str
    ) -> None:
        """`_route`, with the request's access log line once it ends."""
        found: Found | None = scope.get(FOUND_KEY)
        since = None if found is None else found.since
        started = time.perf_counter() if since is None else since
        status = 0

        async def logged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._route(scope, receive, logged_send, forwarded, path)
        finally:
            self.log_request(scope["method"], scope["path"], status, scope.get(SCOPE_KEY),
                             time.perf_counter() - started)

    def log_request(
        self, method: str, path: str, status: int, session_id: str | None, seconds: float
    ) -> None:
        """The one access log line of a request, written by the worker that received it
        (for one the passthrough sent, once its reply ended: front.py)."""
        access_line(method, path, status, session_id, seconds)

    async def serve_forwarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The private entry: requests another worker forwarded here; never forwarded again."""
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                from tether.routing.websocket import route_websocket

                self.stats.served_forwarded += 1
                take_hop(scope)
                await route_websocket(self, scope, receive, send, forwarded=True)
                return
            await self.app(scope, receive, send)
            return
        self.stats.served_forwarded += 1
        take_hop(scope)  # the caller as the receiving worker saw it
        await self._route(scope, receive, send, True, route_path(scope))

    def ended(self, session_id: SessionId) -> None:
        """The app ended a session under a route its kind does not name."""
        if self.claims is not None:
            self.claims.ended(session_id)

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.control is None:
            await send_error(send, TetherError("invalid_request", "no control API here"))
        else:
            await self.control(scope, receive, send)

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, forwarded: bool, path: str
    ) -> None:
        """`path`: the one the app's routes match (`route_path`)."""
        kind = self.kind
        found: Found | None = scope.pop(FOUND_KEY, None)
        if found is None:
            found = find(kind, scope)
        if found.hop:
            strip_hop(scope)  # a client's forgery: only our forwarder may send one
        facts = (kind or NO_KIND).route(scope["method"], path)
        body: bytes | None = None
        if kind is not None and facts.body:
            try:
                body = await read_body(receive, found.content_length)
            except TetherError as error:
                await self._refuse(send, error)
                return
            if body is None:
                return  # the client left before its body arrived
            receive = replay(body, receive)
            body_id = body_session_id(kind, body)
            if body_id is not None:
                if found.session_id is not None and found.session_id != body_id:
                    await self._refuse(
                        send,
                        TetherError(
                            "session_mismatch",
                            f"the request names {found.session_id!r}, the body {body_id!r}",
                        ),
                    )
                    return
                found.session_id = body_id
        session_id = found.session_id
        scope[SCOPE_KEY] = session_id
        scope[WORKER_KEY] = self.worker
        scope[ROUTER_KEY] = self
        where = self.destination_now(session_id, found.worker, forwarded)
        if where is LATER:
            located = found.located
            where = await self.destination(
                session_id, found.worker, forwarded,
                located[1] if located is not None and located[0] == session_id else LATER,
            )
        if where is None:
            await self._serve(session_id, found, facts, scope, receive, send, forwarded)
        elif isinstance(where, TetherError):
            await self._refuse(send, where)
        else:
            gone = "worker_gone" if session_id is None else "session_gone"
            await self._timed_forward(where, scope, receive, send, body, gone, found.resent)

    async def destination(
        self, session_id: SessionId | None, named: str | None, forwarded: bool,
        located: WorkerId | TetherError | Later | None = LATER,
    ) -> WorkerId | TetherError | None:
        """Where a request or a WebSocket handshake goes (SPEC 4.2): None to serve it
        here, the live worker to forward it to, or the error that refuses it. The one
        place a routing decision is made. `located`: the session's claimant (or the
        store's error) as the passthrough just looked it up (`passthrough_located`)."""
        where = self.destination_now(session_id, named, forwarded)
        if where is not LATER:
            return where
        assert session_id is not None
        if located is LATER:
            try:
                located = await self._locate(session_id)
            except TetherError as error:
                return error
        if isinstance(located, TetherError):
            return located
        return self._to_owner(session_id, located)

    def destination_now(
        self, session_id: SessionId | None, named: str | None, forwarded: bool
    ) -> WorkerId | TetherError | Later | None:
        """`destination` where it is known without a lookup in the claim store (LATER
        where it is not): a request of no session, or of one this worker holds."""
        claims = self.claims
        if session_id is not None and claims is not None and not claims.leased():
            return TetherError("cluster_unavailable", LEASE_LAPSED)  # forwarded or not
        if forwarded:
            return None
        if session_id is None:
            if named is None or named == self.worker:
                return None
            target = self.tables.resolve(WorkerId(named))
            return target if target is not None else TetherError("worker_gone", f"worker {named}")
        if claims is None or claims.mine(session_id):
            return None
        return LATER

    def refusal(self, error: TetherError) -> list[Message]:
        """The ASGI messages that refuse a request with `error` (as `_refuse` sends them:
        JSON, or JSON-RPC under the MCP preset), for a caller that writes replies itself
        (front.py)."""
        messages: list[Message] = []

        async def collect(message: Message) -> None:
            messages.append(message)

        if ran_at_once(self._refuse(collect, error)):
            return messages
        raise RuntimeError("a refusal waited")  # (it never does: `collect` does not)

    def _to_owner(
        self, session_id: SessionId, owner: WorkerId | None
    ) -> WorkerId | TetherError | None:
        if owner is None or owner == self.worker:
            return None
        if self.tables.is_live(owner):
            return owner
        if self.tables.is_gone(owner):
            return session_gone(session_id)
        return TetherError("claimant_unavailable", f"worker {owner} is not known to be live yet")

    def passthrough_target(self, scope: Scope) -> WorkerId | Later | None:
        """The worker of this host whose private socket the passthrough (front.py) may
        send a request with this head to: the live one that holds its session, when that
        is known without waiting (this worker's memory, a claim file, the placed-session
        table); the session's ID is then in the scope. LATER: only the claim store can
        tell (a cluster's Redis), and `passthrough_located` asks it. None: the request
        goes through `__call__`, where `destination` decides as for any request. What
        `find` made of the head, once read, is in the scope under `FOUND_KEY`."""
        kind, claims = self.kind, self.claims
        if kind is None or claims is None:
            return None
        path = route_path(scope)
        if path.startswith(CONTROL_PREFIX) or kind.route(scope["method"], path).body:
            return None
        found: Found | None = scope.get(FOUND_KEY)
        if found is None:
            found = scope[FOUND_KEY] = find(kind, scope)
        session_id = found.session_id
        if session_id is None or found.hop or claims.mine(session_id) or not claims.leased():
            return None
        try:
            owner = claims.claimant_now(session_id)
        except TetherError:
            return None
        if owner is LATER:
            return LATER
        if owner is None:
            owner = self.tables.placed.get(session_id)
        return self._passable(scope, session_id, owner)

    async def passthrough_located(self, scope: Scope) -> WorkerId | None:
        """`passthrough_target` for a request it answered LATER, once the claim store
        has: by the same rule, but that the worker may be another host's (the
        passthrough then reaches its hop listener). The claimant found, or the store's
        error (the request then goes the router's way), goes into the request's `Found`,
        so that the router goes by it (`destination`) and does not ask the store a
        second time."""
        found: Found = scope[FOUND_KEY]
        session_id = found.session_id
        assert session_id is not None
        try:
            owner = await self._locate(session_id)
        except TetherError as error:
            found.located = (session_id, error)
            return None
        found.located = (session_id, owner)
        return self._passable(scope, session_id, owner, other_hosts=True)

    def _passable(
        self, scope: Scope, session_id: SessionId, owner: WorkerId | None,
        other_hosts: bool = False,
    ) -> WorkerId | None:
        where = self._to_owner(session_id, owner)
        if not isinstance(where, str) or (not other_hosts and where in self.tables.addresses):
            return None  # refused, served here, or (unasked for) another host's worker
        scope[SCOPE_KEY] = session_id
        return where

    async def _locate(self, session_id: SessionId) -> WorkerId | None:
        """Lookup order: this worker's claims, the claim store, the placed-session table."""
        if self.claims is None:
            return None
        try:
            owner = await self.claims.lookup(session_id)
        except TetherError as error:
            if error.code == "cluster_unavailable":
                raise  # nobody can tell who holds it: refused, never served here
            return None
        return owner if owner is not None else self.tables.placed.get(session_id)

    async def _timed_forward(
        self,
        owner: WorkerId,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes | None,
        gone: str,
        fresh: bool = False,
    ) -> None:
        """`_forward`, timed for `tether_forward_seconds`: what this worker spends on the
        request it forwards, the reply streamed back included."""
        started = time.perf_counter()
        try:
            await self._forward(owner, scope, receive, send, body, gone, fresh)
        finally:
            if self.forwarder is not None:
                self.stats.observe_forward(time.perf_counter() - started)

    async def _forward(
        self,
        owner: WorkerId,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes | None,
        gone: str,
        fresh: bool = False,
    ) -> None:
        """`fresh`: only on a new connection (the passthrough's link already failed it)."""
        if self.forwarder is None or self.socket_path is None:
            await self._refuse(send, TetherError("worker_gone", f"worker {owner}"))
            return
        self.stats.forwarded += 1
        address = self.address(owner)
        try:
            forward = self.forwarder.forward if self.tracing is None else self.tracing.forward
            await forward(address, scope, receive, send, body, hop_value(scope), owner, fresh)
        except ClaimantGone:
            self.forwarder.discard(address)
            if gone == "worker_gone":
                await self._refuse(send, TetherError("worker_gone", f"worker {owner}"))
            else:
                await self._gone(send, scope.get(SCOPE_KEY))
        except ClaimantUnavailable as error:
            await self._refuse(send, TetherError("claimant_unavailable", str(error)))

    def address(self, worker: WorkerId) -> str:
        """Where `worker` takes forwarded requests: its hop listener on another host
        (`tcp://H:P`), else its private socket here."""
        assert self.socket_path is not None
        return self.tables.addresses.get(worker) or self.socket_path(worker)

    async def _gone(self, send: Send, session_id: SessionId | None) -> None:
        await self._refuse(send, session_gone(session_id))

    async def _refuse(
        self, send: Send, error: TetherError, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """Answer with an error the router made: as the kind's protocol wants it (a
        JSON-RPC error body under the MCP preset), else as tether's JSON."""
        outcome = REFUSALS.get(error.code)
        if outcome is not None:
            self.stats.refused[outcome] += 1
        if self.kind is not None and self.kind.gone_as_jsonrpc:
            await send_jsonrpc_error(send, error, headers)
        else:
            await send_error(send, error, headers)

    async def _serve(
        self,
        session_id: SessionId | None,
        found: Found,
        facts: RouteFacts,
        scope: Scope,
        receive: Receive,
        send: Send,
        forwarded: bool,
    ) -> None:
        """Serve here, claiming the session before the reply's first byte if it was used.
        (One coroutine, admission included: every request served here runs it.)"""
        leave = None
        admission = self.admission
        if admission is not None:
            try:
                admitted = admission.admit(session_id, facts.stateless, facts.background)
                if admitted is LATER:  # a checkpoint is open: it waits, or is refused
                    leave = await admission.enter(
                        session_id, stateless=facts.stateless, background=facts.background
                    )
                else:
                    leave = admitted
            except TetherError as error:
                await self._refuse(send, error)
                return
        if not forwarded:
            self.stats.local += 1
        try:
            kind = self.kind
            if kind is None:
                await self.app(scope, receive, send)
                return
            minted = False
            if session_id is None:
                if not (kind.mints and kind.cookie is not None):
                    await self._serve_with_reply_header(facts, scope, receive, send)
                    return
                session_id = new_session_id()
                minted = True
            role: Role = "other"
            if facts.start:
                role = "start"
            elif facts.end and not (found.close_follows and not facts.close):
                role = "end"
            claims = self.claims
            if claims is not None and not claims.mine(session_id):
                placed = self.tables.placed.get(session_id) == self.worker
                if role == "start" or facts.close or placed:
                    try:
                        owner = await claims.claim(session_id, fresh=minted)
                    except TetherError as error:  # the cluster's store is out of reach
                        await self._refuse(send, error)
                        return
                    if owner != self.worker:
                        await self._refuse(send, _conflict(session_id, owner))
                        return
            if kind.cookie is not None and found.cookie_id != session_id:
                scope = _with_session_cookie(scope, kind, found, session_id)
            session = _Served(self, session_id, role, minted, scope, send)
            if claims is None:
                await self.app(scope, receive, session.send)
                return
            claims.begin(session_id)
            try:
                await self.app(scope, receive, session.send)
            finally:
                claims.end(session_id, role, session.ok)
                if minted and not session.ok and not session.named_by_app:
                    await claims.drop(session_id)  # no cookie named it, so nobody can
                if session.reply_id is not None:
                    claims.end(session.reply_id, "start", session.ok)
                if session.rotated_id is not None:
                    claims.end(session.rotated_id, "other", session.ok)
                    claims.renamed(session_id, session.rotated_id)
        finally:
            if leave is not None:
                leave()

    async def _serve_with_reply_header(
        self, facts: RouteFacts, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A request with no session, for a kind whose app names sessions in its reply:
        in a reply header, or in the JSON body of a start route's reply."""
        kind = self.kind
        assert kind is not None
        field = kind.reply_field
        if field is not None and not facts.start:
            field = None
        if (kind.reply_header is None and field is None) or self.claims is None:
            await self.app(scope, receive, send)
            return
        session = _Served(self, None, "other", False, scope, send)
        wrapped: Send = session.send
        if field is not None:
            wrapped = ReplyField(wrapped, field, session.named_in_body)
        try:
            await self.app(scope, receive, wrapped)
        finally:
            if session.reply_id is not None:
                self.claims.end(session.reply_id, "start", session.ok)


def session_gone(session_id: SessionId | None) -> TetherError:
    """410: the worker that holds the session is dead."""
    return TetherError("session_gone", f"the worker of session {session_id!r} exited")


def worker_of(scope: Scope) -> str | None:
    """The ID of the worker serving this request, or None outside tether."""
    worker = scope.get(WORKER_KEY)
    return worker if isinstance(worker, str) else None


def ended(scope: Scope, session_id: str) -> None:
    """Tell the router a session ended under a route its kind does not name; its claim
    then lasts one close window more. Does nothing outside tether."""
    router = scope.get(ROUTER_KEY)
    if isinstance(router, Router):
        router.ended(SessionId(session_id))


class _Served:
    """One request served here: claims its session at the reply's first byte if used, and
    the new ID if the handler rotated it."""

    # What a request has not changed yet (set here: one is made for every request).
    ok = False
    used = False
    """The handler read or wrote the session (Starlette's `Session.accessed`)."""
    reply_id: SessionId | None = None
    body_id: SessionId | None = None
    """The ID the reply's JSON body names (`SessionKind.reply_field`)."""
    rotated: SessionId | None = None
    """The new ID the handler set in the session, seen at the reply's start."""
    rotated_id: SessionId | None = None
    """`rotated`, once claimed here."""
    named_by_app = False
    """A failed reply of a minted ID sets the app's own session cookie (its handler wrote
    the session): the client names the ID after all, so its claim stays."""
    refused = False

    def __init__(
        self, router: Router, session_id: SessionId | None, role: Role, minted: bool,
        scope: Scope, send: Send,
    ) -> None:
        self.router = router
        self.session_id = session_id
        self.role = role
        self.minted = minted
        self.scope = scope
        self._send = send

    async def named_in_body(self, session_id: SessionId | None) -> None:
        self.body_id = session_id

    async def send(self, message: Message) -> None:
        """The app's `send`: the reply's start is checked (and its claims made) before
        it goes on."""
        if self.refused:
            return
        if message["type"] == "http.response.start":
            scope = self.scope
            try:
                claims = self._read_start(scope, message)
                error = await self._claim_at_start(message) if claims else None
            except TetherError as unclaimable:  # the cluster's store is out of reach
                error = unclaimable
            if error is not None:
                self.refused = True
                await self.router._refuse(self._send, error)
                return
            if self.role == "start" or (self.minted and self.used):
                self._name_in_cookie(scope, message)
        await self._send(message)

    def _read_start(self, scope: Scope, message: Message) -> bool:
        """Read the reply's start and the session the handler left: whether anything is
        to be claimed now (`_claim_at_start`). Raises `cluster_unavailable` for a reply
        of a session once this host's lease lapsed (SPEC 12: it serves no session it
        cannot prove it holds, and the lease was checked only as the request arrived)."""
        router = self.router
        kind = router.kind
        assert kind is not None
        status: int = message["status"]
        self.ok = ok = 200 <= status < 400
        if self.minted and not ok and kind.cookie is not None:
            self.named_by_app = _sets_cookie(kind, message)
        claims = router.claims
        if claims is None:
            self.used = bool(getattr(scope.get("session"), "accessed", False))
            return False
        if self.session_id is not None and claims.lease_until < math.inf:
            claims.check_lease()  # it may have lapsed while the handler ran
        session = scope.get("session")
        self.used = used = bool(getattr(session, "accessed", False))
        sid = self.session_id
        if getattr(session, "modified", False):
            self.rotated = _rotated(kind, sid, session, message)
        rotated = self.rotated
        if rotated is not None or kind.reply_header is not None or self.body_id is not None:
            return True
        evidence = used or (sid is not None and kind.holder is not None and kind.holder.holds(sid))
        return sid is not None and evidence and not claims.mine(sid)

    async def _claim_at_start(self, message: Message) -> TetherError | None:
        """Claim, before the reply's first byte, the session the request used, the ID the
        handler rotated it to and the one the reply names; the error that refuses the
        reply if another worker holds one of them."""
        router = self.router
        kind = router.kind
        claims = router.claims
        assert kind is not None
        assert claims is not None
        sid, rotated = self.session_id, self.rotated
        evidence = self.used or (
            sid is not None and kind.holder is not None and kind.holder.holds(sid)
        )
        # A minted ID the handler replaced was never named by a cookie: nothing to claim.
        if rotated is not None and self.minted:
            evidence = False
        if sid is not None and evidence and not claims.mine(sid):
            owner = await claims.claim(sid, fresh=self.minted)
            if owner != router.worker:
                await _release(kind, sid)
                if rotated is not None:
                    await _release(kind, rotated)
                return _conflict(sid, owner)
        if rotated is not None:
            owner = await claims.claim(rotated, fresh=True)
            if owner != router.worker:
                await _release(kind, rotated)
                return _conflict(rotated, owner)
            self.rotated_id = rotated
            claims.begin(rotated)
        if kind.reply_header is not None or self.body_id is not None:
            reply_id = self.body_id
            if kind.reply_header is not None:
                named = _header(message, kind.reply_header.encode())
                reply_id = session_id_or_none(named) or reply_id
            if reply_id is not None and reply_id != sid and not claims.mine(reply_id):
                owner = await claims.claim(reply_id, fresh=True)  # the app named it
                if owner != router.worker:
                    await _release(kind, reply_id)
                    return _conflict(reply_id, owner)
            if reply_id is not None and reply_id != sid:
                self.reply_id = reply_id
                claims.begin(reply_id)
        return None

    def _name_in_cookie(self, scope: Scope, message: Message) -> None:
        """A start's reply names its session; a minted ID is named once the handler used
        it (`send` calls this for those two only); a failed request never hands out a
        minted ID."""
        kind = self.router.kind
        assert kind is not None
        sid = self.session_id
        if sid is None or kind.cookie is None or not (self.ok or not self.minted):
            return
        prefix = kind.cookie.name.encode() + b"="
        headers = message.setdefault("headers", [])
        if not any(k == b"set-cookie" and v.startswith(prefix) for k, v in headers):
            session = scope.get("session")
            base = session if isinstance(session, dict) and session else {}
            cookie = {**base, kind.cookie_key: sid}
            message["headers"] = [*headers, (b"set-cookie", kind.cookie.set_cookie(cookie))]


def _rotated(
    kind: SessionKind, sid: SessionId | None, session: Any, message: Message
) -> SessionId | None:
    """The new ID the handler set in the session (rotation), or None. It counts once the
    reply carries the app's own session cookie, which then names it: a reply without one
    (an error page sent past `SessionMiddleware`) leaves the client with the old ID."""
    if kind.cookie is None or sid is None or not getattr(session, "modified", False):
        return None
    if not isinstance(session, dict):
        return None
    new = session_id_or_none(session.get(kind.cookie_key))
    if new is None or new == sid:
        return None
    return new if _sets_cookie(kind, message) else None


def _sets_cookie(kind: SessionKind, message: Message) -> bool:
    """Whether a reply's start sets the app's own session cookie."""
    assert kind.cookie is not None
    prefix = kind.cookie.name.encode() + b"="
    return any(
        name.lower() == b"set-cookie" and value.startswith(prefix)
        for name, value in message.get("headers", ())
    )


def _conflict(session_id: SessionId, owner: WorkerId) -> TetherError:
    return TetherError("session_conflict", f"session {session_id!r} is held by worker {owner}")


async def _release(kind: SessionKind, session_id: SessionId) -> None:
    if kind.release is not None:
        try:
            await kind.release(session_id)
        except Exception:
            log.exception("release_failed", session_id=session_id)


def _header(message: Message, name: bytes) -> str | None:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _with_session_cookie(
    scope: Scope, kind: SessionKind, found: Found, session_id: SessionId
) -> Scope:
    """The scope with a session cookie naming `session_id`, so the app's
    `SessionMiddleware` hands the handler the ID the router routed by."""
    assert kind.cookie is not None
    session: dict[str, Any] = {**(found.cookie_session or {}), kind.cookie_key: session_id}
    pair = f"{kind.cookie.name}={kind.cookie.encode(session)}".encode("latin-1")
    headers = list(scope["headers"])
    for index, (name, value) in enumerate(headers):
        if name == b"cookie":
            headers[index] = (name, value + b"; " + pair)
            break
    else:
        headers.append((b"cookie", pair))
    return {**scope, "headers": headers}
