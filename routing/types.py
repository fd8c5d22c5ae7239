"""Shared aliases: the IDs that name sessions and workers, and how they are checked."""

from __future__ import annotations

import enum
import re
import secrets
from typing import Any, NewType

SessionId = NewType("SessionId", str)
WorkerId = NewType("WorkerId", str)

class Later(enum.Enum):
    """What a call that answers without waiting says when only waiting could tell (the
    claim store's `claimant_now`, admission's `admit`); its waiting form then answers."""

    LATER = "later"


LATER = Later.LATER

MAX_SESSION_ID_LENGTH = 256
_WORKER_ID = re.compile(r"[0-9a-f]{32}")


def session_id_or_none(value: Any) -> SessionId | None:
    """The value as a session ID: 1 to 256 printable ASCII characters (0x20 to 0x7e),
    else None. (For ASCII, `str.isprintable` holds for exactly those; a regular
    expression costs several times as much, on every request.)"""
    if (
        isinstance(value, str) and 0 < len(value) <= MAX_SESSION_ID_LENGTH
        and value.isascii() and value.isprintable()
    ):
        return SessionId(value)
    return None


def worker_id_or_none(value: Any) -> WorkerId | None:
    """The value as a worker ID (32 lowercase hex characters), else None."""
    if isinstance(value, str) and _WORKER_ID.fullmatch(value):
        return WorkerId(value)
    return None


def new_worker_id() -> WorkerId:
    """A fresh random worker ID; workers never reuse one, even when replaced."""
    return WorkerId(secrets.token_hex(16))


def new_session_id() -> SessionId:
    """A fresh random session ID, as the router mints for requests that carry none."""
    return SessionId(secrets.token_hex(16))
