"""Session kinds: where one kind of app's requests name their session, and its presets.

An app declares a `SessionKind` (or `tether serve --sessions cookie|mcp` picks a
preset for an app that declares nothing). The router reads it; nothing else does.
"""

from __future__ import annotations

import json
import re
import time
from base64 import b64decode, b64encode
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

import itsdangerous
from itsdangerous.exc import BadData, BadSignature
from starlette.middleware.sessions import SessionMiddleware

from tether.routing.hop import HOP_HEADER
from tether.routing.types import SessionId, session_id_or_none

TOKEN_HEADER = "x-tether-session-token"
TOKEN_SALT = "tether.session-token"
CLOSE_FOLLOWS_HEADER = "x-tether-close-follows"
WORKER_HEADER = "x-tether-worker"
COOKIE, LENGTH, WORKER, HOP, ID_HEADER, TOKEN, CLOSE_FOLLOWS = range(7)
"""What a request header says to `sources.find`: its cookies, its body's length, the
worker it names, that it carries a hop header (hop.py), and, of a kind's own, the ID, a
signed token naming it, or the close-follows flag."""
ANY_KIND_SLOTS: dict[bytes, int] = {
    b"cookie": COOKIE,
    b"content-length": LENGTH,
    WORKER_HEADER.encode(): WORKER,
    HOP_HEADER: HOP,
}
"""The headers `sources.find` reads whatever the kind (`SessionKind.header_slots`)."""
DEFAULT_CLOSE_WINDOW_S = 300.0


class SessionHolder(Protocol):
    """An app that decides its claims' lifetimes itself: the claim lasts while it holds."""

    def holds(self, session_id: SessionId) -> bool:
        """Whether this worker still keeps anything of the session."""
        ...


Release = Callable[[SessionId], Awaitable[None]]
"""Drop a session's state on this worker (called when a post-handler claim loses a race)."""


VERIFIED_S = 60.0
VERIFIED_MAX = 4096
"""How long, and for how many values at most, a verified session cookie is remembered."""


@dataclass(frozen=True)
class CookieCodec:
    """Reads and writes Starlette `SessionMiddleware` cookies with the app's own settings."""

    secret: str
    name: str = "session"
    max_age: int | None = 14 * 24 * 60 * 60
    path: str = "/"
    flags: str = "httponly; samesite=lax"

    @cached_property
    def signer(self) -> itsdangerous.TimestampSigner:
        return itsdangerous.TimestampSigner(self.secret)

    @cached_property
    def _verified(self) -> dict[str, tuple[float, dict[str, Any]]]:
        return {}

    def decode(self, value: str) -> dict[str, Any] | None:
        """The session in a cookie value, or None where `SessionMiddleware` would reject it."""
        session = self.read(value)[0]
        return None if session is None else dict(session)

    def read(self, value: str) -> tuple[dict[str, Any] | None, float]:
        """`decode` (the session it gives is shared: read it only), and until when
        (`time.monotonic`) that answer holds.

        A value that verified is remembered for `VERIFIED_S` (every request of a session
        names it, and the signature check is most of a routing decision's cost), and
        never past the cookie's own `max_age`; one that did not is read again after
        `VERIFIED_S` too."""
        now = time.monotonic()
        verified = self._verified
        known = verified.get(value)
        if known is not None and known[0] > now:
            return known[1], known[0]
        try:
            data, signed_at = self.signer.unsign(
                value.encode("utf-8"), max_age=self.max_age, return_timestamp=True
            )
            session = json.loads(b64decode(data))
        except (BadSignature, ValueError, UnicodeError, RecursionError):
            return None, now + VERIFIED_S
        if not isinstance(session, dict):
            return None, now + VERIFIED_S
        if len(verified) >= VERIFIED_MAX:
            verified.clear()
        keep = VERIFIED_S
        if self.max_age is not None:  # never past the cookie's own expiry
            keep = min(keep, signed_at.timestamp() + self.max_age - time.time())
        verified[value] = (now + keep, session)
        return session, now + keep

    def encode(self, session: dict[str, Any]) -> str:
        """A cookie value `SessionMiddleware` accepts, holding `session`."""
        data = b64encode(json.dumps(session).encode("utf-8"))
        return self.signer.sign(data).decode("utf-8")

    def set_cookie(self, session: dict[str, Any]) -> bytes:
        """A `Set-Cookie` value shaped as `SessionMiddleware` shapes its own."""
        max_age = f"Max-Age={self.max_age}; " if self.max_age is not None else ""
        return (
            f"{self.name}={self.encode(session)}; path={self.path}; {max_age}{self.flags}"
        ).encode("latin-1")

    @classmethod
    def from_app(cls, app: Any) -> CookieCodec:
        """The codec of the app's `SessionMiddleware`; `ValueError` if it has none."""
        for middleware in getattr(app, "user_middleware", ()):
            if middleware.cls is SessionMiddleware:
                options = dict(middleware.kwargs)
                if middleware.args:
                    options.setdefault("secret_key", middleware.args[0])
                flags = "httponly; samesite=" + options.get("same_site", "lax")
                if options.get("https_only"):
                    flags += "; secure"
                if options.get("domain") is not None:
                    flags += f"; domain={options['domain']}"
                if options.get("partitioned"):
                    flags += "; partitioned"
                return cls(
                    secret=str(options["secret_key"]),
                    name=options.get("session_cookie", "session"),
                    max_age=options.get("max_age", 14 * 24 * 60 * 60),
                    path=options.get("path", "/"),
                    flags=flags,
                )
        raise ValueError(
            "the app has no starlette SessionMiddleware, so the cookie preset cannot read "
            "its session cookie; add SessionMiddleware or declare a SessionKind in code"
        )


ROUTES_REMEMBERED = 1024
"""How many requests (method, path) a kind remembers the routes of (`SessionKind.route`)."""


class Routes:
    """A set of routes, each `/path` (any method) or `METHOD /path`, bare or under a prefix;
    a `{session_id}` segment matches any one segment (`DELETE /api/kernels/{session_id}`)."""

    def __init__(self, routes: Iterable[str], prefix: str | None = None) -> None:
        self._any: list[str] = []
        self._methods: dict[str, list[str]] = {}
        for route in routes:
            method, _, path = route.rpartition(" ")
            pattern = re.escape(path).replace(re.escape("{session_id}"), "[^/]+")
            if method:
                self._methods.setdefault(method.upper(), []).append(pattern)
            else:
                self._any.append(pattern)
        head = f"(?:{prefix})?" if prefix else ""
        self._any_re = re.compile(f"{head}(?:{'|'.join(self._any)})") if self._any else None
        self._method_re = {
            m: re.compile(f"{head}(?:{'|'.join(paths)})") for m, paths in self._methods.items()
        }

    def __contains__(self, request: tuple[str, str]) -> bool:
        method, path = request
        if self._any_re is not None and self._any_re.fullmatch(path):
            return True
        pattern = self._method_re.get(method)
        return pattern is not None and pattern.fullmatch(path) is not None


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """Which of a kind's routes one request (method, path) is, read once per request."""

    body: bool
    """A seed or close route: its body is read for an ID."""
    start: bool
    close: bool
    end: bool
    stateless: bool
    background: bool


@dataclass(frozen=True)
class SessionKind:
    """Where one kind of app's requests name their session, and which routes do what.

    Sources are read in this order: `header`, `query_param`, the cookie, `token_header`,
    a path template of `paths`, then the JSON body's `body_field` on seed and close routes
    only.
    """

    cookie: CookieCodec | None = None
    cookie_key: str = "session_id"
    header: str | None = None
    header_reader: Callable[[str], str | None] | None = None
    query_param: str | None = None
    paths: tuple[str, ...] = ()
    """Path templates naming the session, such as `/api/kernels/{session_id}`; each
    covers everything under it (`/api/kernels/{session_id}/channels`)."""
    token_header: str | None = TOKEN_HEADER
    token_secret: str | None = None
    body_field: str = "session_id"
    seeds: tuple[str, ...] = ("/seed_session",)
    closes: tuple[str, ...] = ("/close_session",)
    starts: tuple[str, ...] = ()
    ends: tuple[str, ...] = ("/verify",)
    stateless: tuple[str, ...] = ("/health",)
    background: tuple[str, ...] = ()
    prefix: str | None = None
    reply_header: str | None = None
    reply_field: str | None = None
    """A field of a start route's JSON reply that names the new session (`"id"` for
    `POST /sessions` → `{"id": ...}`), claimed before the reply leaves the worker."""
    close_follows_header: str = CLOSE_FOLLOWS_HEADER
    close_window_s: float = DEFAULT_CLOSE_WINDOW_S
    gone_as_jsonrpc: bool = False
    """Send every error the router makes as a JSON-RPC error body, a gone session as 404
    (the MCP preset; `routing/mcp.py` has the bodies)."""
    mints: bool = True
    release: Release | None = field(default=None, compare=False)
    holder: SessionHolder | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for template in self.paths:
            _template(template)  # a bad template fails when the kind is declared

    def with_close_window(self, seconds: float) -> SessionKind:
        return replace(self, close_window_s=seconds)

    @cached_property
    def header_slots(self) -> dict[bytes, int]:
        """The request headers `sources.find` reads for this kind, by name as a scope
        holds names, to what each says (read on every request)."""
        slots: dict[bytes, int] = {}
        if self.header:
            slots[self.header.encode()] = ID_HEADER
        if self.token_header:
            slots[self.token_header.encode()] = TOKEN
        slots[self.close_follows_header.encode()] = CLOSE_FOLLOWS
        return {**slots, **ANY_KIND_SLOTS}  # (a name in both is read as the latter)

    @cached_property
    def path_pattern(self) -> re.Pattern[str] | None:
        """All the path templates as one compiled pattern (one match per request);
        group i holds template i's ID segment."""
        if not self.paths:
            return None
        head = f"(?:{self.prefix})?" if self.prefix else ""
        return re.compile(f"{head}(?:{'|'.join(_template(t) for t in self.paths)})(?:/|$)")

    @cached_property
    def body_routes(self) -> Routes:
        """Seed and close routes: the only ones whose body is read."""
        return Routes((*self.seeds, *self.closes), self.prefix)

    @cached_property
    def start_routes(self) -> Routes:
        return Routes((*self.seeds, *self.starts), self.prefix)

    @cached_property
    def close_routes(self) -> Routes:
        return Routes(self.closes, self.prefix)

    @cached_property
    def end_routes(self) -> Routes:
        return Routes((*self.closes, *self.ends), self.prefix)

    @cached_property
    def stateless_routes(self) -> Routes:
        return Routes(self.stateless, self.prefix)

    @cached_property
    def background_routes(self) -> Routes:
        return Routes(self.background, self.prefix)

    @cached_property
    def _facts(self) -> dict[tuple[str, str], RouteFacts]:
        return {}

    def route(self, method: str, path: str) -> RouteFacts:
        """Which of this kind's routes the request is (remembered: every request asks)."""
        request = (method, path)
        facts = self._facts.get(request)
        if facts is None:
            facts = RouteFacts(
                body=request in self.body_routes,
                start=request in self.start_routes,
                close=request in self.close_routes,
                end=request in self.end_routes,
                stateless=request in self.stateless_routes,
                background=request in self.background_routes,
            )
            if len(self._facts) >= ROUTES_REMEMBERED:
                self._facts.clear()
            self._facts[request] = facts
        return facts

    @cached_property
    def serializer(self) -> itsdangerous.URLSafeSerializer | None:
        secret = self.token_secret or (self.cookie.secret if self.cookie else None)
        if self.token_header is None or secret is None:
            return None
        return itsdangerous.URLSafeSerializer(secret, salt=TOKEN_SALT)

    def read_header(self, value: str) -> SessionId | None:
        """The session ID a `header` value names; an unreadable value names none."""
        if self.header_reader is None:
            return session_id_or_none(value)
        try:
            return session_id_or_none(self.header_reader(value))
        except Exception:
            return None

    def read_token(self, token: str) -> SessionId | None:
        """The session ID in a signed token; a bad signature names none."""
        serializer = self.serializer
        if serializer is None:
            return None
        try:
            payload = serializer.loads(token)
        except BadData:  # a bad signature, or a signed payload that does not decode
            return None
        return session_id_or_none(payload.get("sid")) if isinstance(payload, dict) else None

    def read_cookie(self, value: str) -> SessionId | None:
        if self.cookie is None:
            return None
        session = self.cookie.decode(value)
        return session_id_or_none(session.get(self.cookie_key)) if session else None


SESSION_SEGMENT = "{session_id}"


def _template(template: str) -> str:
    """One path template as a regex whose one group is the ID segment."""
    template = template.removesuffix("/...")
    before, found, after = template.partition(SESSION_SEGMENT)
    if not found or SESSION_SEGMENT in after or not template.startswith("/"):
        raise ValueError(
            f"path template {template!r} must start with / and name {SESSION_SEGMENT} once"
        )
    return f"{re.escape(before)}([^/]+){re.escape(after)}"


def mint_session_token(secret: str, session_id: str) -> str:
    """A signed token naming `session_id`, for clients that send no cookie."""
    serializer = itsdangerous.URLSafeSerializer(secret, salt=TOKEN_SALT)
    return str(serializer.dumps({"sid": session_id}))


def cookie_kind(app: Any, **options: Any) -> SessionKind:
    """The cookie preset: the app's own `SessionMiddleware` cookie plus the default routes."""
    return SessionKind(cookie=CookieCodec.from_app(app), **options)


def mcp_kind(**options: Any) -> SessionKind:
    """The MCP preset: `mcp-session-id` minted by the server in its reply, `DELETE` ends it."""
    settings: dict[str, Any] = {
        "header": "mcp-session-id",
        "token_header": None,
        "seeds": (),
        "closes": (),
        "starts": (),
        "ends": ("DELETE /mcp",),
        "background": ("GET /mcp",),
        "reply_header": "mcp-session-id",
        "gone_as_jsonrpc": True,
        "mints": False,
    }
    settings.update(options)
    return SessionKind(**settings)


_DECLARED = "tether_kind"


def declare(app: Any, kind: SessionKind) -> None:
    """Declare the app's session kind in code; `tether serve` then uses it."""
    setattr(app.state, _DECLARED, kind)


def declared_kind(app: Any) -> SessionKind | None:
    """The kind an app declared with `declare`, or None."""
    state = getattr(app, "state", None)
    kind = getattr(state, _DECLARED, None) if state is not None else None
    return kind if isinstance(kind, SessionKind) else None
