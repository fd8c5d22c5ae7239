"""How long a worker keeps its claim on a session: pure rules, events and time in.

Nothing here does I/O. `WorkerClaims` (claims.py) feeds it the requests it served and
asks which sessions are due for release; the in-progress rule lives there.
"""

from __future__ import annotations

import heapq
from typing import Literal

from tether.routing.kinds import SessionHolder
from tether.routing.types import SessionId

Role = Literal["start", "end", "other"]
"""What a served request did: a session start, a session end, or anything else."""


class Lifetimes:
    """The window rule: an open session keeps its claim; any other, `window_s` past its
    last request.

    A successful start opens a session; a successful end (a close, a verify without
    close-follows, or `ended`) closes it. A failed start or end changes nothing.
    With a `holder`, the app decides instead: a session is due once it no longer holds it.
    """

    def __init__(self, window_s: float, holder: SessionHolder | None = None) -> None:
        self.window_s = window_s
        self.holder = holder
        self._open: set[SessionId] = set()
        self._deadline: dict[SessionId, float] = {}
        """Each closed session's current deadline (a later request moves it out)."""
        self._heap: list[tuple[float, SessionId]] = []
        self._queued: set[SessionId] = set()
        """Sessions with an entry in `_heap`, one each: a later request moves only
        `_deadline`, and the entry goes back in with it when it comes up early."""

    def __len__(self) -> int:
        return len(self._open) + len(self._deadline)

    def is_open(self, session_id: SessionId) -> bool:
        return session_id in self._open

    def served(self, session_id: SessionId, role: Role, ok: bool, now: float) -> None:
        """Record a request for a claimed session, once served (`ok`: a 2xx or 3xx reply)."""
        if ok and role == "start":
            self._open.add(session_id)
            self._deadline.pop(session_id, None)
        elif ok and role == "end":
            self._open.discard(session_id)
        if session_id not in self._open:
            self._expire_at(session_id, now + self.window_s)

    def ended(self, session_id: SessionId, now: float) -> None:
        """End a session from a route that ends it under another name."""
        self._open.discard(session_id)
        self._expire_at(session_id, now + self.window_s)

    def renamed(self, old: SessionId, new: SessionId, now: float) -> None:
        """The app renamed a session (rotated its ID): `new` is open if `old` was, and
        `old` ends as a closed session does, `window_s` from now."""
        if old in self._open:
            self._open.add(new)
            self._deadline.pop(new, None)
        self.ended(old, now)

    def forget(self, session_id: SessionId) -> None:
        self._open.discard(session_id)
        self._deadline.pop(session_id, None)

    def due(self, now: float, tracked: set[SessionId]) -> list[SessionId]:
        """Sessions among `tracked` whose claim may end now."""
        if self.holder is not None:
            return [sid for sid in tracked if not self.holder.holds(sid)]
        due: list[SessionId] = []
        heap, queued = self._heap, self._queued
        while heap and heap[0][0] <= now:
            _, sid = heapq.heappop(heap)
            queued.discard(sid)
            deadline = self._deadline.get(sid)
            if deadline is None:
                continue  # opened or forgotten since
            if deadline <= now:
                del self._deadline[sid]
                due.append(sid)
            else:
                self._queue(sid, deadline)
        return due

    def queued(self) -> int:
        """Deadlines waiting in the queue: at most one per session, however many
        requests moved it."""
        return len(self._heap)

    def _expire_at(self, session_id: SessionId, deadline: float) -> None:
        self._deadline[session_id] = deadline
        if self.holder is None and session_id not in self._queued:  # (a holder decides)
            self._queue(session_id, deadline)

    def _queue(self, session_id: SessionId, deadline: float) -> None:
        self._queued.add(session_id)
        heapq.heappush(self._heap, (deadline, session_id))
