"""Claims on Redis (SPEC 12): the `ClaimStore` every host's workers share.

`tether:{service}:claim:{session_id}` holds the claimant's worker ID; it is created with
`SET NX` and removed only by an owner-checked delete, both in Lua scripts, so two workers
on any hosts never both claim an ID and only the claimant removes its claim. Each claim
is also added to its worker's index set, so a dead worker's claims can be swept and a
live worker's re-asserted after Redis comes back empty.

Every script is idempotent, so redis-py's retry of a command whose reply was lost is safe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis.asyncio
import redis.exceptions

from tether.cluster.keys import ServiceKeys
from tether.routing.errors import TetherError
from tether.routing.types import SessionId, WorkerId, session_id_or_none, worker_id_or_none

UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # also BusyLoadingError, AuthenticationError
    redis.exceptions.TimeoutError,
    TimeoutError,
    OSError,
    redis.exceptions.ReadOnlyError,  # a failover: the client still talks to the old primary
    redis.exceptions.ClusterDownError,  # also MasterDownError
    redis.exceptions.TryAgainError,
    redis.exceptions.OutOfMemoryError,
)
"""What a Redis call raises when Redis cannot serve it now: all become `cluster_unavailable`."""
NOT_NOW = ("MISCONF ", "BUSY ", "NOREPLICAS ")
"""Error replies that mean the same, which redis-py raises as a plain `ResponseError`: a
failed snapshot stops writes (a full disk), a script runs past its time limit, too few
replicas take writes."""

BATCH = 500
"""Claims per script call in `sweep_worker` and `take_over` (one pipeline for all batches)."""


@contextlib.contextmanager
def answered() -> Iterator[None]:
    """Around Redis calls: what means "not now" (`UNAVAILABLE`, `NOT_NOW`) is raised as
    `cluster_unavailable`; any other error reply goes on as Redis gave it."""
    try:
        yield
    except UNAVAILABLE as error:
        raise unavailable(error) from error
    except redis.exceptions.ResponseError as error:
        if str(error).startswith(NOT_NOW):
            raise unavailable(error) from error
        raise


def unavailable(error: BaseException) -> TetherError:
    """The `cluster_unavailable` error for a failed Redis call (its cause is kept)."""
    failure = TetherError("cluster_unavailable", f"Redis did not answer ({type(error).__name__})")
    failure.__cause__ = error
    return failure


def text(value: Any) -> str | None:
    """A reply as text: clients may or may not decode replies, so both are accepted."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


# Whether the `trusted` marker (KEYS[1] where `_TRUSTED` is prepended) names this
# Redis's own run: one of another run came back with a snapshot (a restart that loads an
# RDB or AOF file, a replica promoted) that may have lost claims written after it.
_TRUSTED = """
local function trusted(marker)
  local run = redis.call('GET', marker)
  return run and run == string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
end
"""

# KEYS[1] the `trusted` marker; answers 1 if the claims are trusted under this run.
_LOOKUP_MISS = _TRUSTED + """
if trusted(KEYS[1]) then return 1 end
return 0
"""

# KEYS[1] the claim, KEYS[2] the worker's index, KEYS[3] the `trusted` marker, KEYS[4]
# the claimants; ARGV[1] the worker, ARGV[2] the session, ARGV[3] '1' for an ID just
# minted here. Answers the
# claimant; '' for a claim key that is not a string (reported as a conflict); 0, writing
# nothing, for an ID a request named that nobody claims while the claims are not trusted
# (it may be a session whose claim a Redis that came back empty lost).
_CLAIM = _TRUSTED + """
local holder = redis.pcall('GET', KEYS[1])
if type(holder) == 'string' then
  if holder == ARGV[1] then redis.call('SADD', KEYS[2], ARGV[2]) end
  return holder
end
if type(holder) == 'table' then return '' end
if ARGV[3] ~= '1' and not trusted(KEYS[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[1])
return ARGV[1]
"""

# Same keys and arguments as _CLAIM; answers 1 if the claim was this worker's and is gone.
_RELEASE = """
local released = 0
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  released = 1
end
redis.call('SREM', KEYS[2], ARGV[2])
return released
"""

# KEYS[1] the worker's index, KEYS[2..] claims; ARGV[1] the worker, ARGV[2..] sessions.
# Deletes the claims the worker still holds, drops them all from its index; answers how
# many it deleted.
_SWEEP = """
local swept = 0
for i = 2, #KEYS do
  if redis.pcall('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    swept = swept + 1
  end
  redis.call('SREM', KEYS[1], ARGV[i])
end
return swept
"""

# KEYS[1] the worker's index, KEYS[2] the claimants, KEYS[3..] claims; ARGV[1] the
# worker, then per claim its session and the worker that held it when the checkpoint was
# taken ('' for none). Claims each session for the worker unless a worker other than
# that one holds it; answers {position, holder, ...} (position 1 is the first session)
# for those.
_TAKE_OVER = """
local taken = {}
redis.call('SADD', KEYS[2], ARGV[1])
for i = 3, #KEYS do
  local session, before = ARGV[2 * i - 4], ARGV[2 * i - 3]
  local holder = redis.pcall('GET', KEYS[i])
  if type(holder) ~= 'string' or holder == ARGV[1] or holder == before then
    if type(holder) == 'table' then
      taken[#taken + 1] = i - 2
      taken[#taken + 1] = ''
    else
      redis.call('SET', KEYS[i], ARGV[1])
      redis.call('SADD', KEYS[1], session)
    end
  else
    taken[#taken + 1] = i - 2
    taken[#taken + 1] = holder
  end
end
return taken
"""

# KEYS[1] the `trusted` marker, KEYS[2] `untrusted-since`, KEYS[3] the hosts set;
# ARGV[1] the Redis run ID the caller read, ARGV[2] the TTL in ms, ARGV[3] the prefix of
# host records (`tether:{service}:host:`). Answers {1, ''} while the claims are trusted
# under this run ID. Otherwise starts a round (`<run ID> <ms now>`) unless one of this
# run ID is under way, and trusts the claims once a TTL passed since it started and every
# host record says its host re-asserted its claims in it: by then every host that was
# live before Redis lost its claims has either written its record again (re-asserting
# first) or let its lease lapse, so it serves nothing. The records are read here, in the
# same atomic step, so a host whose record came back after the caller read the live set
# still counts. Answers {trusted, round}.
_TRUST = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return {1, ''} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local round = redis.call('GET', KEYS[2])
local prefix = ARGV[1] .. ' '
if not round or string.sub(round, 1, #prefix) ~= prefix then
  round = prefix .. now
  redis.call('SET', KEYS[2], round)
  redis.call('DEL', KEYS[1])
  return {0, round}
end
local started = tonumber(string.sub(round, #prefix + 1)) or now
if now - started < tonumber(ARGV[2]) then return {0, round} end
for _, host in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local raw = redis.pcall('GET', ARGV[3] .. host)
  if type(raw) == 'string' then
    local ok, record = pcall(cjson.decode, raw)
    if ok and type(record) == 'table' and record['asserted'] ~= round then
      return {0, round}
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return {1, round}
"""

CLAIMS_UNTRUSTED = (
    "Redis lost its claims (it came back empty or failed over); the hosts are "
    "re-asserting theirs"
)


class RedisClaimStore:
    """Claims in Redis, shared by every worker of every host of a service.

    Takes any `redis.asyncio.Redis` client, with or without `decode_responses`: replies
    are decoded here. A claim and a release are one round trip each (a script), a lookup
    one `GET` (and a check of the trust marker when it finds nothing). While the claims
    are not trusted under this Redis's own run ID (`trust`), an ID nobody claims answers
    `cluster_unavailable` unless it was just minted. Every Redis failure that means
    "not now" is raised as `TetherError("cluster_unavailable")`; a claim key holding
    anything but a worker ID is `TetherError("session_conflict")`, as a bad claim file is
    for `FileClaimStore`.
    """

    def __init__(self, client: redis.asyncio.Redis, service: str) -> None:
        self.client = client
        self.keys = ServiceKeys(service)
        self._claim = client.register_script(_CLAIM)
        self._lookup_miss = client.register_script(_LOOKUP_MISS)
        self._trust = client.register_script(_TRUST)
        self._take_over = client.register_script(_TAKE_OVER)
        self._release = client.register_script(_RELEASE)
        self._sweep = client.register_script(_SWEEP)

    async def claim(
        self, session_id: SessionId, worker: WorkerId, *, fresh: bool = False
    ) -> WorkerId:
        keys = (self.keys.claim(session_id), self.keys.worker_claims(worker), self.keys.trusted,
                self.keys.claimants)
        with answered():
            holder = await self._claim(keys=keys, args=(worker, session_id, "1" if fresh else ""))
        return _holder(session_id, holder)

    async def claimant(self, session_id: SessionId) -> WorkerId | None:
        """One `GET`; a miss costs a check of the trust marker more (a miss read from a
        Redis that lost its claims is not an answer), a script that compares it with
        this Redis's run ID. Not atomic, and need not be: the marker is set a TTL after
        the claims were lost at the soonest, so a `GET` that missed because they were
        lost never meets it. (`MGET` would be one round trip, but reads a claim key of
        another type as missing.)"""
        try:
            with answered():
                holder = await self.client.get(self.keys.claim(session_id))
                if holder is None and not int(
                    await self._lookup_miss(keys=(self.keys.trusted,))
                ):
                    raise TetherError("cluster_unavailable", CLAIMS_UNTRUSTED)
        except redis.exceptions.ResponseError as error:  # WRONGTYPE: not a claim
            raise TetherError(
                "session_conflict", f"the claim of {session_id!r} holds no worker ID"
            ) from error
        return None if holder is None else _holder(session_id, holder)

    async def trust(self, run_id: str, ttl_ms: int) -> tuple[bool, str]:
        """Whether a lookup that finds no claim may be trusted under Redis run `run_id`,
        and the re-assertion round under way if not (see `_TRUST`)."""
        keys = (self.keys.trusted, self.keys.untrusted_since, self.keys.hosts)
        with answered():
            args = (run_id, ttl_ms, self.keys.host_prefix)
            trusted, round_ = await self._trust(keys=keys, args=args)
        return int(trusted) == 1, text(round_) or ""

    async def release(self, session_id: SessionId, worker: WorkerId) -> None:
        keys = (self.keys.claim(session_id), self.keys.worker_claims(worker))
        with answered():
            await self._release(keys=keys, args=(worker, session_id))

    async def claims_of(self, worker: WorkerId) -> set[SessionId]:
        """The sessions in `worker`'s index (what it claimed and has not released)."""
        members = await self._members(worker)
        found = {session_id_or_none(text(member)) for member in members}
        return {session_id for session_id in found if session_id is not None}

    async def sweep_worker(self, worker: WorkerId) -> int:
        """Release every claim of a dead worker (owner-checked, so a session another
        worker claimed since is kept) and empty its index; returns how many were released.
        Any live host may call it once the close window after the worker's death passed."""
        members = list(await self._members(worker))
        replies = await self._batches(self._sweep, worker, members)
        with answered():
            await self.client.srem(self.keys.claimants, worker)
        return sum(int(reply) for reply in replies)

    async def claimants(self) -> set[WorkerId]:
        """Every worker that claimed sessions and was not swept since."""
        with answered():
            members = await self.client.smembers(self.keys.claimants)
        found = {worker_id_or_none(text(member)) for member in members}
        return {worker for worker in found if worker is not None}

    async def reassert(
        self, worker: WorkerId, session_ids: Iterable[SessionId]
    ) -> dict[SessionId, WorkerId]:
        """Claim again, for `worker`, sessions it holds in memory (after Redis came back
        empty) and put them back in its index; returns those another worker claimed
        meanwhile, with that worker. Every batch runs even if one session's claim holds
        garbage; that is then raised as `session_conflict` at the end."""
        taken = await self.take_over(worker, [(session_id, None) for session_id in session_ids])
        garbage = [session_id for session_id, holder in taken.items() if holder is None]
        if garbage:
            raise TetherError(
                "session_conflict",
                f"the claims of {len(garbage)} sessions hold no worker ID, "
                f"such as {garbage[0]!r}",
            )
        return {session_id: holder for session_id, holder in taken.items() if holder is not None}

    async def take_over(
        self, worker: WorkerId, restored: Sequence[tuple[SessionId, WorkerId | None]]
    ) -> dict[SessionId, WorkerId | None]:
        """Claim, for `worker`, sessions a restore placed on it (or it holds, to
        re-assert), each paired with the worker that held it in the checkpoint (or
        None): a claim that worker (of the host's previous incarnation) left behind is
        taken over, one any other worker holds is kept and returned with its holder
        (None for a claim key holding garbage). One pipeline, a script per `BATCH`."""
        if not restored:
            return {}
        index = self.keys.worker_claims(worker)
        with answered():
            async with self.client.pipeline(transaction=False) as pipe:
                for start in range(0, len(restored), BATCH):
                    batch = restored[start : start + BATCH]
                    keys = [index, self.keys.claimants,
                            *(self.keys.claim(sid) for sid, _ in batch)]
                    args = [worker, *(v for sid, before in batch for v in (sid, before or ""))]
                    await self._take_over(keys=keys, args=args, client=pipe)
                replies = list(await pipe.execute())
        taken: dict[SessionId, WorkerId | None] = {}
        for start, reply in zip(range(0, len(restored), BATCH), replies, strict=True):
            for position, holder in zip(reply[::2], reply[1::2], strict=True):
                taken[restored[start + int(position) - 1][0]] = worker_id_or_none(text(holder))
        return taken

    async def _members(self, worker: WorkerId) -> set[Any]:
        with answered():
            return await self.client.smembers(self.keys.worker_claims(worker))

    async def _batches(
        self, script: Any, worker: WorkerId, members: Sequence[Any]
    ) -> list[Any]:
        """Run `script` on `members` in batches of `BATCH`, all in one pipeline. Members
        are passed back as Redis gave them (bytes or text), so a member that is not valid
        UTF-8 still names its own key and leaves the index."""
        if not members:
            return []
        index = self.keys.worker_claims(worker)
        prefix = self.keys.claim(SessionId(""))
        with answered():
            async with self.client.pipeline(transaction=False) as pipe:
                for start in range(0, len(members), BATCH):
                    batch = members[start : start + BATCH]
                    keys = [index, *(_join(prefix, member) for member in batch)]
                    await script(keys=keys, args=[worker, *batch], client=pipe)
                return list(await pipe.execute())


def _join(prefix: str, member: str | bytes) -> str | bytes:
    return prefix.encode() + member if isinstance(member, bytes) else prefix + member


def _holder(session_id: SessionId, value: Any) -> WorkerId:
    if isinstance(value, int):
        raise TetherError("cluster_unavailable", CLAIMS_UNTRUSTED)
    holder = worker_id_or_none(text(value))
    if holder is None:
        raise TetherError("session_conflict", f"the claim of {session_id!r} holds no worker ID")
    return holder
