"""The session fence: helpers that make an app's session routes safe to retry (SPEC 4.6).

A lock per session ID, closed records kept for the close window (counted from the first
close), episode bindings, and the errors and masked results the contract names.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tether.routing.errors import TetherError
from tether.routing.kinds import DEFAULT_CLOSE_WINDOW_S

SESSION_LOST = "session_lost"


def seed_rejected(detail: Any) -> TetherError:
    """422: seed input that fails validation; no retry can fix it."""
    return TetherError("seed_rejected", detail)


def session_lost(session_id: str, failure_kind: str = SESSION_LOST) -> TetherError:
    """404: a call for a session this server no longer holds."""
    return TetherError(
        "session_lost", f"session {session_id!r} is not held here", failure_kind=failure_kind
    )


def lost_verification(session_id: str, failure_kind: str = SESSION_LOST) -> dict[str, Any]:
    """The masked result of verifying a lost session: never a plain 0."""
    return {"session_id": session_id, "reward": 0, "masked": True, "failure_kind": failure_kind}


async def tether_error_response(request: Request, exc: Exception) -> Response:
    """A Starlette exception handler answering a `TetherError` with its status and code."""
    assert isinstance(exc, TetherError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=dict(exc.headers()))


_server_window_s = DEFAULT_CLOSE_WINDOW_S


def set_close_window(seconds: float) -> None:
    """The close window of the server this process serves (`tether serve` sets it at
    start from the session kind); fences made without a window of their own follow it."""
    global _server_window_s
    _server_window_s = seconds


class SessionFence:
    """Per-session locks, closed records and episode bindings for one worker's app."""

    def __init__(
        self, window_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`window_s`: how long closed records are kept; by default the server's close
        window (`--close-window`), so a fence never outlives or undercuts the claim."""
        self._window_s = window_s
        self.clock = clock
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._closed: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        self._bound: dict[str, str] = {}

    @property
    def window_s(self) -> float:
        return _server_window_s if self._window_s is None else self._window_s

    @asynccontextmanager
    async def locked(self, session_id: str) -> AsyncIterator[None]:
        """Hold the session's lock; the lock is dropped once nobody holds or waits for it."""
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session_id]
            if users == 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    def is_closed(self, session_id: str) -> bool:
        self._expire()
        return session_id in self._closed

    def raise_if_closed(self, session_id: str) -> None:
        """409 `session_closed` for a session closed within the window."""
        if self.is_closed(session_id):
            raise TetherError("session_closed", f"session {session_id!r} was closed")

    def bind(self, session_id: str, episode: str | None) -> None:
        """Bind the session to an episode; 409 `session_conflict` if bound to another."""
        if episode is None:
            return
        self._expire()
        closed = self._closed.get(session_id)
        bound = self._bound.get(session_id) or (closed[1] if closed else None)
        if bound is not None and bound != episode:
            raise TetherError(
                "session_conflict", f"session {session_id!r} belongs to episode {bound!r}"
            )
        self._bound[session_id] = episode

    def close(self, session_id: str, episode: str | None = None) -> None:
        """Record the close (a retried close keeps the first record) and drop the binding.

        Call it only after the session's state was released, so a failed release can be
        retried rather than fenced.
        """
        self.bind(session_id, episode)
        bound = self._bound.pop(session_id, None)
        if session_id not in self._closed:
            self._closed[session_id] = (self.clock(), bound)

    def closed_count(self) -> int:
        self._expire()
        return len(self._closed)

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._closed:
            session_id, (closed_at, _) = next(iter(self._closed.items()))
            if closed_at > horizon:
                break
            del self._closed[session_id]
