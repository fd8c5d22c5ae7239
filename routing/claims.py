"""Claims: which worker holds each session.

`ClaimStore` is the shared map (one file per session by default, replaceable by a store
on a distributed engine). `WorkerClaims` is one worker's side of it: its own claims in
memory, the requests in progress for each, and the one place a claim ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from tether.routing.dirwatch import DirectoryWatch
from tether.routing.errors import TetherError
from tether.routing.lifetimes import Lifetimes, Role
from tether.routing.types import LATER, Later, SessionId, WorkerId, worker_id_or_none

log = structlog.get_logger("tether.claims")

Clock = Callable[[], float]
Reassert = Callable[[WorkerId, list[SessionId]], Awaitable[dict[SessionId, WorkerId]]]
TakeOver = Callable[
    [WorkerId, list[tuple[SessionId, WorkerId | None]]],
    Awaitable[dict[SessionId, WorkerId | None]],
]


class ClaimStore(Protocol):
    """The claims shared by one server's workers (or by every host's, on a cluster).

    Asynchronous because a shared engine answers over the network; the embedded file
    store answers inline, so awaiting it never suspends."""

    async def claim(
        self, session_id: SessionId, worker: WorkerId, *, fresh: bool = False
    ) -> WorkerId:
        """Claim the ID for `worker` unless another worker has; return the claimant.
        `fresh`: the ID was just minted here, so nobody can have held it before."""
        ...

    async def claimant(self, session_id: SessionId) -> WorkerId | None:
        """The worker that claims the ID, or None."""
        ...

    async def release(self, session_id: SessionId, worker: WorkerId) -> None:
        """Remove `worker`'s claim on the ID (only the claimant calls this)."""
        ...


KNOWN_MAX = 1 << 16
"""Claimants a watched store remembers at most (then it starts again from none)."""
CLAIM_ATTEMPTS = 3
"""Links tried before a claim file that names no worker is reported, not looped on."""


class FileClaimStore:
    """Claims as files: one per session, named by a hash of its ID.

    A claim is written completely to a temp file and then hard-linked into place; the
    link fails if the claim exists, so two workers never both claim an ID and a reader
    never sees a partial claim. Each file holds the worker ID and the session ID, so a
    hash collision is detected rather than routed.

    Every operation is one or two small system calls (~10 us), done inline on purpose:
    a thread hop would cost more than the call. The methods are coroutines only to share
    `ClaimStore`'s signature; none of them suspends.

    Once `watch`ed, the claimants `claimant` reads are remembered, each until the loop
    learns (inotify, dirwatch.py) that its file changed: a request routed to another
    worker's session then reads nothing while the claim stands. What is remembered is at
    most one turn of the loop old, no older than a claimant read just before a request
    is sent on (the holder may release the claim before it serves that request either
    way). Claiming and releasing always read the file.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._prefix = os.path.join(directory, "")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._watch: DirectoryWatch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._known: dict[SessionId, WorkerId] = {}
        """Claimants read while watched, by session."""
        self._named: dict[str, SessionId] = {}
        """The session each remembered claim file is of (what inotify names)."""

    def _name(self, session_id: SessionId) -> str:
        return hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()

    def _path(self, session_id: SessionId) -> str:
        return self._prefix + self._name(session_id)

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Remember claimants from now on, while `loop` runs (`close` ends it); where
        inotify is missing, nothing is remembered."""
        if self._watch is not None:
            return
        watch = DirectoryWatch.of(self.directory)
        if watch is None:
            log.warning("claim_watch_unavailable", directory=self.directory)
            return
        self._watch, self._loop = watch, loop
        loop.add_reader(watch.fd, self._changed)

    def close(self) -> None:
        """Stop watching; claimants are read every time again."""
        watch, self._watch = self._watch, None
        if watch is not None and self._loop is not None:
            self._loop.remove_reader(watch.fd)
            watch.close()
        self._known.clear()
        self._named.clear()

    def _changed(self) -> None:
        assert self._watch is not None
        names = self._watch.changes()
        if names is None:  # (the queue overflowed: any claim may have changed)
            self._known.clear()
            self._named.clear()
            if self._watch.ended:
                self.close()
            return
        for name in names:
            session_id = self._named.pop(name, None)
            if session_id is not None:
                self._known.pop(session_id, None)

    async def claim(
        self, session_id: SessionId, worker: WorkerId, *, fresh: bool = False
    ) -> WorkerId:
        path = self._path(session_id)
        temp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, f"{worker}\n{session_id}".encode())
        finally:
            os.close(fd)
        try:
            for _ in range(CLAIM_ATTEMPTS):
                try:
                    os.link(temp, path)
                except FileExistsError:
                    existing = self.read(session_id)
                    if existing is not None:
                        return existing
                    continue  # released between link and read, or names no worker
                return worker
        finally:
            os.unlink(temp)
        raise TetherError("session_conflict", f"the claim file of {session_id!r} names no worker")

    async def claimant(self, session_id: SessionId) -> WorkerId | None:
        return self.claimant_now(session_id)

    def claimant_now(self, session_id: SessionId) -> WorkerId | None:
        """`claimant`, without a coroutine: remembered while watched (see the class)."""
        known = self._known.get(session_id)
        if known is not None:
            return known
        owner = self.read(session_id)
        if owner is not None and self._watch is not None:
            if len(self._known) >= KNOWN_MAX:
                self._known.clear()
                self._named.clear()
            self._known[session_id] = owner
            self._named[self._name(session_id)] = session_id
        return owner

    def read(self, session_id: SessionId) -> WorkerId | None:
        # os.open/read/close: three system calls; buffered open() makes seven.
        try:
            fd = os.open(self._path(session_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            content = os.read(fd, 512)
        finally:
            os.close(fd)
        owner, _, named = content.decode("utf-8", "replace").partition("\n")
        if named != session_id:
            raise TetherError("session_conflict", "claim hash collision with another session")
        return worker_id_or_none(owner)

    async def release(self, session_id: SessionId, worker: WorkerId) -> None:
        if self.read(session_id) == worker:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(session_id))


LEASE_LAPSED = (
    "this host's lease on the cluster's live set lapsed; it restarts its workers once "
    "Redis answers"
)


class WorkerClaims:
    """One worker's claims: held in memory, never released while a request is in progress,
    released by `sweep` once their lifetime says so.

    On a cluster they hold only while this host's lease does (`lease_until`, on the
    host's monotonic clock, pushed by its coordinator): past it, other hosts may have
    seen this worker dead, so no claim is used, made or looked up (SPEC 12)."""

    def __init__(
        self,
        store: ClaimStore,
        worker: WorkerId,
        lifetimes: Lifetimes,
        clock: Clock = time.monotonic,
    ) -> None:
        self.store = store
        self.worker = worker
        self.lifetimes = lifetimes
        self.clock = clock
        self._mine: set[SessionId] = set()
        self._serving: dict[SessionId, int] = {}
        self._ended: set[SessionId] = set()
        """Sessions the app ended while requests of them ran: those requests' ends open
        none of them again (a start route's end would)."""
        self.lease_until = math.inf
        """Until when this worker may use its claims (a cluster's host sets it)."""

    def leased(self) -> bool:
        """Whether this worker may serve sessions now (always, on one host)."""
        return self.clock() < self.lease_until

    def check_lease(self) -> None:
        """Raise `cluster_unavailable` once this worker's lease lapsed."""
        if not self.leased():
            raise TetherError("cluster_unavailable", LEASE_LAPSED)

    def __len__(self) -> int:
        return len(self._mine)

    def mine(self, session_id: SessionId) -> bool:
        return session_id in self._mine

    async def lookup(self, session_id: SessionId) -> WorkerId | None:
        """The claimant: this worker from memory, else the store."""
        self.check_lease()
        if session_id in self._mine:
            return self.worker
        return await self.store.claimant(session_id)

    def claimant_now(self, session_id: SessionId) -> WorkerId | Later | None:
        """The claimant if the store tells without waiting (claim files do), else LATER."""
        if session_id in self._mine:
            return self.worker
        if isinstance(self.store, FileClaimStore):
            return self.store.claimant_now(session_id)
        return LATER

    async def claim(self, session_id: SessionId, *, fresh: bool = False) -> WorkerId:
        """Claim the ID for this worker unless another has; return the claimant.
        `fresh`: the ID was just minted here (by tether or by the app)."""
        self.check_lease()
        if session_id in self._mine:
            return self.worker
        owner = await self.store.claim(session_id, self.worker, fresh=fresh)
        if owner == self.worker:
            self._mine.add(session_id)
        return owner

    async def reassert(self, reassert: Reassert) -> dict[SessionId, WorkerId]:
        """Write every claim held in memory into the store again (a cluster's Redis came
        back without them); those another worker claimed meanwhile are no longer this
        worker's and are returned with their claimant."""
        taken = await reassert(self.worker, sorted(self._mine))
        for session_id in taken:
            self._mine.discard(session_id)
            self.lifetimes.forget(session_id)
        return taken

    async def adopt(
        self, restored: list[tuple[SessionId, WorkerId | None, bool]], take_over: TakeOver
    ) -> dict[SessionId, WorkerId | None]:
        """Claim, before admission opens, sessions a restore placed on this worker (on a
        cluster, so every host finds them), each with its holder in the checkpoint and
        whether it was open then: an open one is held as open, any other keeps its claim
        one close window from now, as after a request. Returns those another worker
        holds. They count as this worker's before the store answers, so a restore given
        up (`release_all`) releases whatever part of them a failed call wrote."""
        now = self.clock()
        for session_id, _, was_open in restored:
            self._mine.add(session_id)
            self.lifetimes.served(session_id, "start" if was_open else "other", True, now)
        taken = await take_over(self.worker, [(sid, owner) for sid, owner, _ in restored])
        for session_id in taken:
            self._mine.discard(session_id)
            self.lifetimes.forget(session_id)
        return taken

    def begin(self, session_id: SessionId) -> None:
        """A request for the session starts being served here."""
        self._serving[session_id] = self._serving.get(session_id, 0) + 1

    def end(self, session_id: SessionId, role: Role, ok: bool) -> None:
        """A request for the session was served here (`begin` must have preceded it)."""
        count = self._serving[session_id] - 1
        if count:
            self._serving[session_id] = count
        else:
            del self._serving[session_id]
        if self._ended and session_id in self._ended:
            if not count:
                self._ended.discard(session_id)
            if role == "start":
                role = "other"
        if session_id in self._mine:
            self.lifetimes.served(session_id, role, ok, self.clock())

    def ended(self, session_id: SessionId) -> None:
        """The app ended the session under a route the kind does not name (maybe in the
        handler of a start route, or while one runs: its end does not open it again)."""
        if session_id in self._serving:
            self._ended.add(session_id)
        if session_id in self._mine:
            self.lifetimes.ended(session_id, self.clock())

    def renamed(self, old: SessionId, new: SessionId) -> None:
        """A handler here rotated session `old` to `new`, both claimed here: `new` keeps
        `old`'s lifetime and `old` lasts one close window more, as a closed session."""
        if old in self._mine and new in self._mine:
            self.lifetimes.renamed(old, new, self.clock())

    def in_progress(self, session_id: SessionId) -> bool:
        return session_id in self._serving

    async def drop(self, session_id: SessionId) -> bool:
        """Release a claim nobody can name (a minted ID whose start failed) right away,
        unless a request for it is in progress."""
        if session_id in self._serving or session_id not in self._mine:
            return False
        self._mine.discard(session_id)
        self.lifetimes.forget(session_id)
        await self.store.release(session_id, self.worker)
        return True

    async def release_all(self) -> int:
        """Release every claim of this worker that no request is using (a restore given
        up: what it placed here is gone again); returns how many."""
        released = [sid for sid in self._mine if sid not in self._serving]
        for session_id in released:
            self._mine.discard(session_id)
            self.lifetimes.forget(session_id)
            await self.store.release(session_id, self.worker)
        return len(released)

    async def sweep(self) -> list[SessionId]:
        """Release every claim whose lifetime has ended and that no request is using. A
        release that fails (a cluster's Redis out of reach, a claim file that cannot be
        read or removed now) is tried again one window later, with those after it; the
        claims stay this worker's meanwhile."""
        released: list[SessionId] = []
        due = self.lifetimes.due(self.clock(), self._mine)
        for index, session_id in enumerate(due):
            if session_id in self._serving or session_id not in self._mine:
                continue  # its request's end records it again
            try:
                await self.store.release(session_id, self.worker)
            except (TetherError, OSError):
                for later in due[index:]:
                    if later in self._mine and later not in self._serving:
                        self.lifetimes.ended(later, self.clock())
                raise
            self._mine.discard(session_id)
            self.lifetimes.forget(session_id)
            released.append(session_id)
        return released
