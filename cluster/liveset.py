"""The live set (SPEC 12): which hosts and workers of a service are alive, and where.

Each host writes `tether:{service}:host:{host_id}`, a JSON `HostRecord` with a TTL,
refreshed every quarter of it; a worker is live while its host's record exists and lists
it. The record is fenced by the host's epoch (`INCR` at start, taken only when no record
of the host ID exists): a write succeeds only while the key holds this epoch and no newer
epoch was started, or when Redis lost the key and the counter both (it came back empty).
So an old incarnation never overwrites a newer one's record, nor brings back its own
once it expired (other hosts may have seen its workers dead by then).

Reading the live set costs two round trips (`SMEMBERS` of the `hosts` set, then `MGET`
of their records) plus one to prune hosts whose record expired, instead of a `SCAN` of a
keyspace that holds every claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import redis.asyncio
import redis.exceptions
import structlog

from tether.cluster.claims import answered, text
from tether.cluster.keys import ServiceKeys, name_problem
from tether.routing.errors import TetherError
from tether.routing.types import WorkerId, worker_id_or_none

log = structlog.get_logger("tether.cluster")

Clock = Callable[[], float]

DEFAULT_TTL_S = 10.0
MAX_ADDRESS_LENGTH = 262  # a 255-byte host name, a colon, a port
MAX_ROUND_LENGTH = 80  # a 40-character run ID, a space, milliseconds
LEASE_MARGIN = 0.2
"""Of the TTL: a host stops serving this much before its record may expire, for the
time a write takes to land and for clocks that run at slightly different rates."""
_FIELDS = {"host_id", "epoch", "workers"}


class ClusterError(RuntimeError):
    """This host cannot join the service; the message is the one line `tether serve`
    prints: the problem and what to do."""


def address_or_none(value: Any) -> str | None:
    """The value as a hop address `host:port` (port 1 to 65535), else None."""
    if not isinstance(value, str) or not 3 <= len(value) <= MAX_ADDRESS_LENGTH:
        return None
    host, colon, port = value.rpartition(":")
    if not colon or not host or not value.isascii() or any(c.isspace() for c in host):
        return None
    if not port.isdigit() or port != str(int(port)):
        return None
    return value if 1 <= int(port) <= 65535 else None


@dataclass(frozen=True)
class HostRecord:
    """One host's entry in the live set: its incarnation, its workers' hop addresses, and
    the last re-assertion round (`RedisClaimStore.trust`) it re-asserted its claims in."""

    host_id: str
    epoch: int
    workers: Mapping[WorkerId, str] = field(default_factory=dict)
    asserted: str = ""

    def __post_init__(self) -> None:
        # A read-only copy, so a record stays what was written or read.
        object.__setattr__(self, "workers", MappingProxyType(dict(self.workers)))

    def encode(self) -> str:
        """The record as compact JSON (what the host key holds)."""
        body = {"host_id": self.host_id, "epoch": self.epoch, "workers": dict(self.workers),
                "asserted": self.asserted}
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, data: str | bytes) -> HostRecord | None:
        """The record in `data`, or None for anything malformed (every field is checked)."""
        try:
            body = json.loads(data)
        except (ValueError, TypeError):
            return None
        if not isinstance(body, dict) or not _FIELDS <= set(body) <= {*_FIELDS, "asserted"}:
            return None
        host_id, epoch, workers = body["host_id"], body["epoch"], body["workers"]
        asserted = body.get("asserted", "")
        if not isinstance(asserted, str) or len(asserted) > MAX_ROUND_LENGTH:
            return None
        if name_problem(host_id) is not None:
            return None
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
            return None
        if not isinstance(workers, dict):
            return None
        checked: dict[WorkerId, str] = {}
        for worker, address in workers.items():
            worker_id, hop = worker_id_or_none(worker), address_or_none(address)
            if worker_id is None or hop is None:
                return None
            checked[worker_id] = hop
        return cls(host_id, epoch, checked, asserted)


class LiveWorker(NamedTuple):
    """A live worker of the service: the host it runs on and its hop address."""

    host_id: str
    address: str


# KEYS[1] host record, KEYS[2] epoch counter, KEYS[3] hosts set, KEYS[4] the host's last
# join; ARGV[1] the host ID, ARGV[2] TTL in ms, ARGV[3] this join's token. Takes the next
# epoch and writes an empty record (as `HostRecord.encode` would), unless a record of the
# host ID exists: then answers 0 and leaves the counter alone, so a refused start never
# fences out the live incarnation; but the same join again (the client's retry of a
# reply it lost) answers the epoch it took.
_JOIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local token, epoch = string.match(redis.call('GET', KEYS[4]) or '', '^(%x+) (%d+)$')
  if token == ARGV[3] then return tonumber(epoch) end
  return 0
end
local epoch = redis.call('INCR', KEYS[2])
local record = '{"epoch":' .. epoch .. ',"host_id":"' .. ARGV[1] .. '","workers":{}}'
redis.call('SET', KEYS[1], record, 'PX', ARGV[2])
redis.call('SET', KEYS[4], ARGV[3] .. ' ' .. epoch, 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return epoch
"""

# Keys as _JOIN; ARGV[1] the record, ARGV[2] its epoch, ARGV[3] TTL in ms, ARGV[4] the
# host ID, ARGV[5] '1' while the host's lease holds by its own clock; KEYS[4] the claims'
# `trusted` marker. Answers 0 without writing if a newer epoch started, the key holds
# another epoch, or the key is gone while the counter still names this epoch (the record
# expired: other hosts may have seen this incarnation dead). A counter that is gone too
# means Redis came back empty: then the record and the counter are written again, if the
# lease still holds (else the host may have been seen dead before Redis went away) and
# the claims are not trusted yet (else the others trusted them without this host's).
_PUBLISH = """
local epoch = tonumber(ARGV[2])
local newest = tonumber(redis.pcall('GET', KEYS[2]))
if newest and newest > epoch then return 0 end
local current = redis.pcall('GET', KEYS[1])
if current then
  local ok, record = pcall(cjson.decode, current)
  if not ok or type(record) ~= 'table' or record['epoch'] ~= epoch then return 0 end
elseif newest or ARGV[5] ~= '1' or redis.call('EXISTS', KEYS[4]) == 1 then
  return 0
end
if not newest or newest < epoch then redis.call('SET', KEYS[2], ARGV[2]) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""

# KEYS[1] host record, KEYS[2] hosts set; ARGV[1] this incarnation's epoch, ARGV[2] the
# host ID. Deletes the record only if it holds this epoch; answers 1 if it did.
_LEAVE = """
local current = redis.pcall('GET', KEYS[1])
if type(current) ~= 'string' then return 0 end
local ok, record = pcall(cjson.decode, current)
if not ok or type(record) ~= 'table' or record['epoch'] ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS[1] hosts set, KEYS[2..] host records; ARGV[1..] their host IDs. Drops from the set
# the hosts whose record is gone (checked here, atomically, so a host that just wrote its
# record again is kept).
_PRUNE = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[1], ARGV[i - 1]) end
end
return 0
"""


class LiveSet:
    """This host's place in the live set of `service`, and a reader of everyone's.

    `join` starts an incarnation (a new epoch) and takes the host ID; `publish` refreshes
    the record; `lease_valid` says whether the record is surely still there, measured on
    the monotonic `clock` from the start of the last write that succeeded. Takes any
    `redis.asyncio.Redis` client, decoding or not. One-shot calls raise
    `TetherError("cluster_unavailable")` when Redis cannot answer.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        service: str,
        host_id: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Clock = time.monotonic,
    ) -> None:
        problem = name_problem(host_id)
        if problem is not None:
            raise ValueError(f"host ID: {problem}")
        if ttl_s <= 0:
            raise ValueError(f"the live set's TTL must be positive, got {ttl_s}")
        self.client = client
        self.keys = ServiceKeys(service)
        self.host_id = host_id
        self.ttl_s = ttl_s
        self.clock = clock
        self.epoch: int | None = None
        self.last_good_write_started: float | None = None
        self._host_key = self.keys.host(host_id)
        self._join = client.register_script(_JOIN)
        self._publish = client.register_script(_PUBLISH)
        self._leave = client.register_script(_LEAVE)
        self._prune = client.register_script(_PRUNE)

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    async def join(self) -> int:
        """Start a new incarnation of this host: take the next epoch and write an empty
        record, in one script; returns the epoch. Refused with `ClusterError` while a
        record of this host ID exists (another live incarnation, or this host's own
        previous one until it leaves or its record expires)."""
        keys = (self._host_key, self.keys.epoch(self.host_id), self.keys.hosts,
                self.keys.joined(self.host_id))
        started = self.clock()
        try:
            with answered():
                epoch = int(await self._join(
                    keys=keys, args=(self.host_id, self.ttl_ms, secrets.token_hex(16))
                ))
        except redis.exceptions.ResponseError as error:
            raise ClusterError(
                f"the Redis key {keys[1]!r} holds no epoch number ({error}); delete it"
            ) from None
        if epoch == 0:
            raise ClusterError(
                f"host ID {self.host_id!r} is already live in service {self.keys.service!r}: "
                "give this host another --host-id, or stop the other one "
                f"(a host that died frees its ID within {self.ttl_s:g} s)"
            )
        self.epoch = epoch
        self.last_good_write_started = started
        return epoch

    async def publish(self, workers: Mapping[WorkerId, str], asserted: str = "") -> bool:
        """Write this host's record (its workers and their hop addresses) with the TTL.
        Returns False, writing nothing, once this incarnation is over: a newer epoch of
        the host ID started, or its record expired (other hosts may have seen its workers
        dead). It must then join again. A record still there never expired, so a host
        whose own clock says its lease lapsed (it was paused, its loop stalled) goes on
        when Redis still holds it."""
        if self.epoch is None:
            raise RuntimeError("publish before join")
        leased = "1" if self.lease_until() > self.clock() else ""
        record = HostRecord(self.host_id, self.epoch, workers, asserted).encode()
        keys = (self._host_key, self.keys.epoch(self.host_id), self.keys.hosts,
                self.keys.trusted)
        started = self.clock()
        with answered():
            written = await self._publish(
                keys=keys, args=(record, self.epoch, self.ttl_ms, self.host_id, leased)
            )
        if int(written) != 1:
            self.last_good_write_started = None  # over: only `join` starts another
            return False
        self.last_good_write_started = started
        return True

    def lease_until(self) -> float:
        """Until when, on the monotonic clock, this host may serve sessions: the TTL less
        `LEASE_MARGIN` after the last good write started (0 when there is none)."""
        if self.last_good_write_started is None:
            return 0.0
        return self.last_good_write_started + self.ttl_s * (1 - LEASE_MARGIN)

    def lease_valid(self, margin_s: float) -> bool:
        """Whether this host's record surely still exists: less than the TTL minus
        `margin_s` passed since the last good write started."""
        if self.last_good_write_started is None:
            return False
        return self.clock() - self.last_good_write_started < self.ttl_s - margin_s

    async def read(self) -> dict[str, HostRecord]:
        """Every live host's record of the service, by host ID (this host's included).
        A record that is malformed, or names another host than its key, is left out."""
        with answered():
            members = await self.client.smembers(self.keys.hosts)
            ids = sorted(
                host_id
                for host_id in (text(member) for member in members)
                if host_id is not None and name_problem(host_id) is None
            )
            if not ids:
                return {}
            keys = [self.keys.host(host_id) for host_id in ids]
            values = await self.client.mget(keys)
            gone = [host_id for host_id, value in zip(ids, values, strict=True) if value is None]
            if gone:
                await self._prune(
                    keys=[self.keys.hosts, *(self.keys.host(h) for h in gone)], args=gone
                )
        records: dict[str, HostRecord] = {}
        for host_id, value in zip(ids, values, strict=True):
            record = None if value is None else HostRecord.decode(value)
            if record is not None and record.host_id == host_id:
                records[host_id] = record
        return records

    async def run_id(self) -> str:
        """The Redis server's run ID: a new one means Redis restarted (perhaps empty) or
        failed over, so claims must be re-asserted."""
        with answered():
            info = await self.client.info("server")
        run_id = text(info.get("run_id"))
        if not run_id:
            raise TetherError("cluster_unavailable", "Redis reported no run ID")
        return run_id

    async def leave(self) -> bool:
        """Delete this host's record if it still holds this incarnation's epoch (a
        graceful stop, so the host ID can join again at once); returns whether it did."""
        if self.epoch is None:
            return False
        with answered():
            left = await self._leave(
                keys=(self._host_key, self.keys.hosts), args=(self.epoch, self.host_id)
            )
        self.last_good_write_started = None
        return int(left) == 1


@dataclass(frozen=True)
class LiveView:
    """What one refresh saw: every live worker of the service (this host's too), the
    Redis run ID it was read from (a new one: re-assert claims), and whether this
    incarnation is over (`LiveSet.publish` refused: a newer epoch started, or the record
    lapsed), in which case the host must restart its workers and join again."""

    workers: Mapping[WorkerId, LiveWorker]
    run_id: str
    fenced: bool
    asserted: Mapping[str, str] = field(default_factory=dict)
    """Each live host's last re-assertion round (`HostRecord.asserted`)."""
    claimants: frozenset[WorkerId] = frozenset()
    """Every worker with claims not swept, read before the records: one not in them is
    dead, even if no host saw it die."""

    @classmethod
    def of(
        cls,
        records: Mapping[str, HostRecord],
        run_id: str,
        fenced: bool,
        claimants: Iterable[WorkerId] = (),
    ) -> LiveView:
        """The view of the records `LiveSet.read` returned."""
        workers = {
            worker: LiveWorker(record.host_id, address)
            for record in records.values()
            for worker, address in record.workers.items()
        }
        asserted = {host_id: record.asserted for host_id, record in records.items()}
        return cls(MappingProxyType(workers), run_id, fenced, MappingProxyType(asserted),
                   frozenset(claimants))


OnChange = Callable[[LiveView], Awaitable[None]]


class Refresher:
    """Owns the background task that keeps this host in the live set: every quarter of
    the TTL it publishes `workers()` and reads the live set, and awaits `on_change`
    with the new `LiveView` whenever it differs from the last one (the first always).

    A failed round (Redis down, a slow answer, a failing callback) is logged and the next
    one runs on time; whether the host may still serve is `LiveSet.lease_valid`'s answer.
    """

    def __init__(
        self,
        live: LiveSet,
        workers: Callable[[], Mapping[WorkerId, str]],
        on_change: OnChange,
        *,
        interval_s: float | None = None,
        after_round: Callable[[LiveView], Awaitable[None]] | None = None,
        asserted: Callable[[], str] = lambda: "",
        claimants: Callable[[], Awaitable[set[WorkerId]]] | None = None,
    ) -> None:
        """`after_round`: awaited with the view after every round that reached Redis
        (what is due on a clock rather than on a change: sweeps, the lease pushed on);
        `asserted`: the re-assertion round this host last took part in."""
        self.live = live
        self.workers = workers
        self.asserted = asserted
        self.claimants = claimants
        self.on_change = on_change
        self.after_round = after_round
        self.interval_s = live.ttl_s / 4 if interval_s is None else interval_s
        self.view: LiveView | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._wake = asyncio.Event()

    def start(self) -> None:
        """Start refreshing (after `LiveSet.join`)."""
        if self._task is None:
            self._stopped = False
            self._task = asyncio.create_task(self._run(), name="tether-live-set")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def refresh_soon(self) -> None:
        """Run the next round now (this host's workers changed)."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop refreshing: cancel the task and wait until it ended. The cancel is
        repeated until it takes: on Python 3.11 one that meets an expiring timeout inside
        a round (the round's bound, a broadcast's) can come out as a TimeoutError, which
        the round logs and survives."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopped = True
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if not task.cancelled() and task.exception() is not None:
            log.error("live_set_refresher_failed", error=repr(task.exception()))

    async def refresh(self) -> LiveView:
        """One round: publish, read, and report a changed view; returns the view. The run
        ID is read after the write, so a write that reached a Redis that came back empty
        is seen to have in the same round."""
        fenced = not await self.live.publish(self.workers(), self.asserted())
        run_id = await self.live.run_id()
        # A worker claims only once its host's record lists it: read before the records,
        # a claimant they do not list is dead.
        claimants = set() if self.claimants is None else await self.claimants()
        records = await self.live.read()
        if await self.live.run_id() != run_id:  # the records may be a restarted Redis's
            raise TetherError("cluster_unavailable", "Redis restarted during the refresh")
        view = LiveView.of(records, run_id, fenced, claimants)
        if view != self.view:
            await self.on_change(view)
            self.view = view  # only once delivered: a failed push is tried again
        if self.after_round is not None:
            await self.after_round(view)
        return view

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()  # paces the rounds; the lease has its own clock
        while not self._stopped:
            started = loop.time()
            self._wake.clear()
            try:
                # Bounded, so a Redis that stopped answering cannot stall the rounds.
                async with asyncio.timeout(self.live.ttl_s / 2):
                    await self.refresh()
            except TetherError as error:
                log.warning("live_set_refresh_failed", code=error.code, detail=error.detail)
            except TimeoutError:
                log.warning("live_set_refresh_failed", code="cluster_unavailable",
                            detail="Redis answered too slowly")
            except Exception:
                log.exception("live_set_refresh_failed")
            wait = self.interval_s - (loop.time() - started)
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
