"""Where a request's session ID comes from (SPEC 4.1), read from the raw ASGI scope.

One pass over the headers collects everything the router needs; the body is read only
on seed and close routes, capped, and replayed to the app unchanged.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import cookie_parser
from starlette.types import Message, Receive, Scope

from tether.routing.errors import TetherError
from tether.routing.kinds import (
    ANY_KIND_SLOTS,
    COOKIE,
    HOP,
    ID_HEADER,
    LENGTH,
    TOKEN,
    WORKER,
    SessionKind,
)
from tether.routing.types import SessionId, WorkerId, session_id_or_none

MAX_BODY = 64 * 1024 * 1024


@dataclass(slots=True)
class Found:
    """What the headers, query and cookie of one request say about its session."""

    session_id: SessionId | None = None
    cookie_session: dict[str, Any] | None = None
    """The session its cookie holds (shared with `CookieCodec`'s memory: read only)."""
    cookie_id: SessionId | None = None
    worker: str | None = None
    close_follows: bool = False
    content_length: int | None = None
    hop: bool = False
    """The request carries a hop header (on the public port, a client's forgery)."""
    until: float = math.inf
    """Until when (`time.monotonic`) this reading of the request holds: its cookie's
    signature check is remembered only so long (`CookieCodec.read`)."""
    located: tuple[SessionId, WorkerId | TetherError | None] | None = None
    """A session's claimant as the passthrough looked it up in the claim store (front.py),
    or the error the store gave, for the router to go by if the request is left to it,
    rather than ask again."""
    since: float | None = None
    """When (`time.perf_counter`) the passthrough took a request it then left to the
    router (after waiting for a lookup, or a link that failed): where its time starts."""
    resent: bool = False
    """The passthrough sent it on a kept-alive link that closed unanswered: the router
    sends it again only on a new connection (SPEC 4.5's one retry)."""

    def copy(self) -> Found:
        """Another reading of the same head (its `cookie_session` shared: read only)."""
        return Found(
            self.session_id, self.cookie_session, self.cookie_id, self.worker,
            self.close_follows, self.content_length, self.hop, self.until, self.located,
            self.since, self.resent,
        )


def find(kind: SessionKind | None, scope: Scope) -> Found:
    """The session ID from the header, query, cookie, token or path, in that order."""
    found = Found()
    header_id = token_id = None
    cookie_header = None
    slots = kind.header_slots if kind is not None else ANY_KIND_SLOTS
    for name, value in scope["headers"]:
        slot = slots.get(name)
        if slot is None:
            continue
        if slot == COOKIE:
            if cookie_header is None:
                cookie_header = value
        elif slot == LENGTH:
            found.content_length = int(value) if value.isdigit() else None
        elif slot == WORKER:
            found.worker = value.decode("latin-1")
        elif slot == HOP:
            found.hop = True
        elif kind is None:
            continue
        elif slot == ID_HEADER:
            if header_id is None:
                header_id = kind.read_header(value.decode("latin-1"))
                if kind.header_reader is not None:  # the app's own code: never remembered
                    found.until = -math.inf
        elif slot == TOKEN:
            if token_id is None:
                token_id = kind.read_token(value.decode("latin-1"))
        else:
            found.close_follows = value.strip() == b"1"
    if kind is None:
        return found
    if cookie_header is not None and kind.cookie is not None:
        value = _cookie_value(cookie_header, kind.cookie.name)
        if value is not None:
            found.cookie_session, until = kind.cookie.read(value)
            found.until = min(found.until, until)  # (the app's reader may have set it)
            if found.cookie_session is not None:
                found.cookie_id = session_id_or_none(found.cookie_session.get(kind.cookie_key))
    query_id = None
    if kind.query_param and scope.get("query_string"):
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        query_id = next(
            (session_id_or_none(v) for k, v in query if k == kind.query_param), None
        )
    path_id = None
    if kind.path_pattern is not None:
        match = kind.path_pattern.match(route_path(scope))
        if match is not None:
            path_id = session_id_or_none(match.group(match.lastindex or 0))
    found.session_id = header_id or query_id or found.cookie_id or token_id or path_id
    return found


@functools.lru_cache(maxsize=4096)
def _cookie_value(header: bytes, name: str) -> str | None:
    """The value of cookie `name` in a `cookie` header, parsed as Starlette parses it
    (a session's requests repeat one header, so the parse is remembered)."""
    return cookie_parser(header.decode("latin-1")).get(name)


def route_path(scope: Scope) -> str:
    """The path the app's routes match: `path` less the `root_path` uvicorn put in front
    of it (`--root-path`), as Starlette's router reads it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        if path == root:
            return ""
        if path[len(root)] == "/":
            return path[len(root) :]
    return path



async def read_body(receive: Receive, content_length: int | None) -> bytes | None:
    """The whole request body, or None if the client disconnected first.

    Raises `body_too_large` before reading when the declared length is over the cap,
    and as soon as the body read so far passes it.
    """
    if content_length is not None and content_length > MAX_BODY:
        raise TetherError("body_too_large", f"body over {MAX_BODY} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise TetherError("body_too_large", f"body over {MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def body_session_id(kind: SessionKind, body: bytes) -> SessionId | None:
    """The session ID in a seed or close body; a body that is not a JSON object names none."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # (nested past the stack)
        return None
    return session_id_or_none(data.get(kind.body_field)) if isinstance(data, dict) else None


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then passes on what follows."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
