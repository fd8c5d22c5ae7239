"""A start route's JSON reply that names the new session (SPEC 4.1): `POST /api/kernels`
→ `{"id": ...}`. The reply is held back until its body is whole, so the ID it names is
claimed before the reply's first byte leaves the worker, as for a reply header.

Replies up to `MAX_REPLY` bytes are read; a larger one, one that is not JSON, or one
without a usable field is passed on unchanged (and logged): the session then goes
unclaimed, as if the app had named none.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import structlog
from starlette.types import Message, Send

from tether.routing.types import SessionId, session_id_or_none

log = structlog.get_logger("tether.router")

MAX_REPLY = 1 << 20

Named = Callable[[SessionId | None], Awaitable[None]]
"""Told the ID the reply names (None if it names none) before the reply is passed on."""


class ReplyField:
    """An ASGI `send` that holds a reply back until its body names the session in
    `field`, tells `named`, then passes everything on to `send` unchanged."""

    def __init__(self, send: Send, field: str, named: Named) -> None:
        self._send = send
        self._field = field
        self._named = named
        self._held: list[Message] = []
        self._size = 0
        self._holding = True

    async def __call__(self, message: Message) -> None:
        if not self._holding:
            await self._send(message)
            return
        self._held.append(message)
        if message["type"] != "http.response.body":
            return
        self._size += len(message.get("body", b""))
        if self._size > MAX_REPLY:
            log.info("reply_field_unread", field=self._field, reason="larger than 1 MiB")
            await self._release(None)
        elif not message.get("more_body", False):
            await self._release(self._read())

    def _read(self) -> SessionId | None:
        start = self._held[0]
        if start.get("status", 500) >= 400:
            return None
        body = b"".join(m.get("body", b"") for m in self._held[1:])
        try:
            document = json.loads(body)
        except (ValueError, RecursionError):
            log.info("reply_field_unread", field=self._field, reason="not JSON")
            return None
        value = document.get(self._field) if isinstance(document, dict) else None
        named = session_id_or_none(value) if isinstance(value, str) else None
        if named is None:
            log.info("reply_field_unread", field=self._field, reason="no usable ID in it")
        return named

    async def _release(self, session_id: SessionId | None) -> None:
        self._holding = False
        await self._named(session_id)
        held, self._held = self._held, []
        for message in held:
            await self._send(message)
