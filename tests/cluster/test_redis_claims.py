"""`RedisClaimStore` against a real redis-server: one claimant per session on any host,
owner-checked releases, sweeps of dead workers and re-assertion after an empty restart."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import redis.asyncio

from e2e.redis_server import RedisServer
from tests.cluster.conftest import Connect
from tether.cluster.claims import BATCH, RedisClaimStore
from tether.cluster.keys import ServiceKeys
from tether.cluster.liveset import HostRecord, LiveSet
from tether.routing.claims import ClaimStore
from tether.routing.errors import TetherError
from tether.routing.types import SessionId, WorkerId, new_worker_id

SERVICE = "svc"


def ids(count: int, prefix: str = "s") -> list[SessionId]:
    return [SessionId(f"{prefix}-{n}") for n in range(count)]


async def trusting(store: RedisClaimStore) -> RedisClaimStore:
    """The store, its claims trusted the way the hosts trust them: a round is started,
    every host (here: none but this one) re-asserted in it, and the TTL (0) passed."""
    run_id = str((await store.client.info("server"))["run_id"])
    trusted, round_ = await store.trust(run_id, 0)
    if not trusted:
        assert round_.startswith(f"{run_id} ")
        assert await store.trust(run_id, 0) == (True, round_)  # no host record to wait for
    return store


async def commands(client: redis.asyncio.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT."""
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


async def test_the_store_is_a_claim_store(connect: Connect) -> None:
    store: ClaimStore = await trusting(RedisClaimStore(connect(), SERVICE))  # mypy checks
    assert await store.claimant(SessionId("s")) is None


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "text"])
async def test_the_first_claim_wins_and_every_lookup_names_it(
    connect: Connect, decode: bool
) -> None:
    a, b = new_worker_id(), new_worker_id()
    store = await trusting(RedisClaimStore(connect(decode=decode), SERVICE))
    assert await store.claimant(SessionId("s")) is None
    assert await store.claim(SessionId("s"), a) == a
    assert await store.claim(SessionId("s"), b) == a
    assert await store.claim(SessionId("s"), a) == a  # claiming again is harmless
    assert await store.claimant(SessionId("s")) == a
    assert await store.claims_of(a) == {"s"}
    assert await store.claims_of(b) == set()


async def test_a_claim_is_one_round_trip_and_a_lookup_one_get(connect: Connect) -> None:
    client = connect()
    store = await trusting(RedisClaimStore(client, SERVICE))
    worker = new_worker_id()
    await store.claim(SessionId("warm-up"), worker)  # loads the scripts
    await store.claimant(SessionId("warm-up"))
    await client.config_resetstat()
    await store.claim(SessionId("s"), worker)
    await store.claimant(SessionId("s"))
    used = await commands(client)
    used.pop("config|resetstat", None)
    # The claim: one script (the claim's get, the marker's get and the run ID's info,
    # set, two sadd inside it); the lookup: one get.
    assert used == {"evalsha": 1, "get": 3, "info": 1, "set": 1, "sadd": 2}


async def test_two_workers_claiming_the_same_ids_at_once_have_one_winner_each(
    connect: Connect,
) -> None:
    a, b = new_worker_id(), new_worker_id()
    store_a = await trusting(RedisClaimStore(connect(), SERVICE))  # two hosts: two clients
    store_b = await trusting(RedisClaimStore(connect(decode=True), SERVICE))
    sessions = ids(300)
    results = await asyncio.gather(
        *(store.claim(sid, worker) for sid in sessions for store, worker in
          ((store_a, a), (store_b, b)))
    )
    won: dict[WorkerId, set[SessionId]] = {a: set(), b: set()}
    for sid, first, second in zip(sessions, results[::2], results[1::2], strict=True):
        assert first == second, sid
        assert await store_a.claimant(sid) == first
        won[first].add(sid)
    assert won[a] | won[b] == set(sessions)
    assert await store_a.claims_of(a) == won[a]
    assert await store_b.claims_of(b) == won[b]


async def test_only_the_claimant_removes_its_claim(connect: Connect) -> None:
    a, b = new_worker_id(), new_worker_id()
    store = await trusting(RedisClaimStore(connect(), SERVICE))
    await store.claim(SessionId("s"), a)
    await store.release(SessionId("s"), b)
    assert await store.claimant(SessionId("s")) == a
    await store.release(SessionId("s"), a)
    assert await store.claimant(SessionId("s")) is None
    assert await store.claims_of(a) == set()
    await store.release(SessionId("s"), a)  # releasing again is harmless
    assert await store.claim(SessionId("s"), b) == b


async def test_services_do_not_share_claims(connect: Connect) -> None:
    a, b = new_worker_id(), new_worker_id()
    client = connect()
    one = await trusting(RedisClaimStore(client, "one"))
    two = await trusting(RedisClaimStore(client, "two"))
    assert await one.claim(SessionId("s"), a) == a
    assert await two.claim(SessionId("s"), b) == b


async def test_a_dead_workers_claims_are_swept_and_only_its_own(connect: Connect) -> None:
    client = connect()
    dead, live = new_worker_id(), new_worker_id()
    store = await trusting(RedisClaimStore(client, SERVICE))
    mine = ids(BATCH * 2 + 7, "dead")
    await asyncio.gather(*(store.claim(sid, dead) for sid in mine))
    theirs = ids(5, "live")
    await asyncio.gather(*(store.claim(sid, live) for sid in theirs))
    # A session the dead worker released that another claimed since, still in its index
    # (as if the dead worker's release had been cut short).
    moved = mine.pop()
    await store.release(moved, dead)
    await store.claim(moved, live)
    await client.sadd(store.keys.worker_claims(dead), moved)

    assert await store.sweep_worker(dead) == len(mine)

    assert await client.mget([store.keys.claim(sid) for sid in mine]) == [None] * len(mine)
    for sid in [*theirs, moved]:
        assert await store.claimant(sid) == live
    assert not await client.exists(store.keys.worker_claims(dead))
    assert await store.claims_of(live) == {*theirs, moved}
    assert await store.claimants() == {live}  # the swept worker is no claimant any more
    assert await store.sweep_worker(dead) == 0


async def test_reassert_after_an_empty_restart_restores_every_claim_and_reports_conflicts(
    connect: Connect, redis_server: RedisServer
) -> None:
    a, b = new_worker_id(), new_worker_id()
    store_a = await trusting(RedisClaimStore(connect(), SERVICE))
    store_b = await trusting(RedisClaimStore(connect(decode=True), SERVICE))
    held = ids(BATCH + 3)
    await asyncio.gather(*(store_a.claim(sid, a) for sid in held))

    redis_server.restart()
    taken = held[BATCH]  # in the second batch
    assert await store_b.claim(taken, b, fresh=True) == b  # as if minted there meanwhile

    assert await store_a.reassert(a, held) == {taken: b}

    await trusting(store_a)
    for sid in held:
        assert await store_b.claimant(sid) == (b if sid == taken else a)
    assert await store_a.claims_of(a) == set(held) - {taken}
    assert await store_a.reassert(a, held) == {taken: b}  # again: nothing changes
    assert await store_a.reassert(a, []) == {}


async def test_reassert_restores_the_rest_before_reporting_a_garbage_claim(
    connect: Connect,
) -> None:
    client = connect()
    worker = new_worker_id()
    store = await trusting(RedisClaimStore(client, SERVICE))
    await client.set(store.keys.claim(SessionId("bad")), "not a worker")
    with pytest.raises(TetherError) as caught:
        await store.reassert(worker, [SessionId("a"), SessionId("bad"), SessionId("b")])
    assert caught.value.code == "session_conflict"
    assert await store.claims_of(worker) == {"a", "b"}


@pytest.mark.parametrize(
    "garbage", ["not a worker", "A" * 32, "", b"\xff" * 32], ids=["text", "upper", "empty", "utf8"]
)
async def test_a_garbage_claim_value_is_a_conflict(connect: Connect, garbage: str | bytes) -> None:
    client = connect()
    store = await trusting(RedisClaimStore(client, SERVICE))
    await client.set(store.keys.claim(SessionId("s")), garbage)
    for call in (store.claimant(SessionId("s")), store.claim(SessionId("s"), new_worker_id())):
        with pytest.raises(TetherError) as caught:
            await call
        assert caught.value.code == "session_conflict"
        assert caught.value.status == 409
    await store.release(SessionId("s"), new_worker_id())
    assert await client.get(store.keys.claim(SessionId("s"))) is not None  # kept


async def test_a_claim_key_of_another_type_is_a_conflict(connect: Connect) -> None:
    client = connect()
    store = await trusting(RedisClaimStore(client, SERVICE))
    await client.sadd(store.keys.claim(SessionId("s")), "x")
    for call in (store.claimant(SessionId("s")), store.claim(SessionId("s"), new_worker_id())):
        with pytest.raises(TetherError) as caught:
            await call
        assert caught.value.code == "session_conflict"
    await store.release(SessionId("s"), new_worker_id())  # not an error: nothing to release


async def test_a_killed_redis_is_cluster_unavailable_not_a_traceback(
    connect: Connect, redis_server: RedisServer
) -> None:
    worker = new_worker_id()
    store = await trusting(RedisClaimStore(connect(), SERVICE))
    await store.claim(SessionId("s"), worker)
    redis_server.kill()
    calls = [
        store.claim(SessionId("t"), worker),
        store.claimant(SessionId("s")),
        store.release(SessionId("s"), worker),
        store.claims_of(worker),
        store.sweep_worker(worker),
        store.reassert(worker, [SessionId("s")]),
    ]
    for call in calls:
        with pytest.raises(TetherError) as caught:
            await call
        assert caught.value.code == "cluster_unavailable"
        assert caught.value.status == 503
        assert ("retry-after", "1") in caught.value.headers()

    redis_server.restart()
    assert await store.claim(SessionId("t"), worker, fresh=True) == worker  # back, empty


async def test_a_redis_that_stopped_taking_writes_is_cluster_unavailable_not_a_traceback(
    connect: Connect, redis_server: RedisServer
) -> None:
    """A snapshot that failed (its disk gone or full) makes Redis refuse writes with a
    MISCONF error reply, which redis-py raises as a plain `ResponseError`: a claim is
    503 `cluster_unavailable`, as when Redis does not answer, and so is a host's join;
    reads still answer."""
    client = connect()
    worker = new_worker_id()
    store = await trusting(RedisClaimStore(client, SERVICE))
    await store.claim(SessionId("s"), worker)
    await client.config_set("save", "3600 1")
    try:
        shutil.rmtree(redis_server.directory)
        await client.bgsave()
        for _ in range(100):
            if (await client.info("persistence"))["rdb_last_bgsave_status"] == "err":
                break
            await asyncio.sleep(0.05)
        with pytest.raises(TetherError) as claimed:
            await store.claim(SessionId("t"), worker)
        with pytest.raises(TetherError) as joined:
            await LiveSet(client, SERVICE, "h1").join()
        assert await store.claimant(SessionId("s")) == worker
    finally:
        await client.config_set("save", "")  # (else it cannot stop: its exit saves)
    for caught in (claimed, joined):
        assert caught.value.code == "cluster_unavailable"
        assert "ResponseError" in str(caught.value.detail)


async def test_until_the_claims_are_trusted_an_unclaimed_id_is_refused_unless_just_minted(
    connect: Connect, redis_server: RedisServer
) -> None:
    client = connect()
    a, b = new_worker_id(), new_worker_id()
    store = await trusting(RedisClaimStore(client, SERVICE))
    await store.claim(SessionId("held"), a)
    redis_server.restart()  # empty: the claim and the trust are gone

    for call in (store.claimant(SessionId("held")), store.claim(SessionId("held"), b)):
        with pytest.raises(TetherError) as caught:
            await call
        assert caught.value.code == "cluster_unavailable"
        assert "re-asserting" in caught.value.detail
    assert await client.exists(store.keys.claim(SessionId("held"))) == 0  # nothing written
    assert await store.claim(SessionId("minted"), b, fresh=True) == b
    assert await store.claimant(SessionId("minted")) == b  # a claim found is an answer

    assert await store.reassert(a, [SessionId("held")]) == {}
    await trusting(store)
    assert await store.claimant(SessionId("held")) == a
    assert await store.claimant(SessionId("new")) is None
    assert await store.claim(SessionId("new"), b) == b


async def test_a_trust_marker_a_snapshot_brought_back_from_another_run_trusts_nothing(
    connect: Connect, redis_server: RedisServer
) -> None:
    """A Redis restarted from a snapshot (or a replica promoted) holds the `trusted`
    marker of the run the snapshot was taken in and has lost the claims written since:
    under its new run ID a miss is no answer and a claim of a named ID writes nothing,
    until the hosts re-assert and trust it again."""
    client = connect()
    a, b = new_worker_id(), new_worker_id()
    store = await trusting(RedisClaimStore(client, SERVICE))
    await store.claim(SessionId("kept"), a)
    await client.save()
    await store.claim(SessionId("lost"), a)
    redis_server.restart()  # from the snapshot: the marker is back, "lost" is not

    assert await client.exists(store.keys.trusted) == 1
    assert await store.claimant(SessionId("kept")) == a
    with pytest.raises(TetherError) as looked_up:
        await store.claimant(SessionId("lost"))
    with pytest.raises(TetherError) as claimed:
        await store.claim(SessionId("lost"), b)
    assert looked_up.value.code == claimed.value.code == "cluster_unavailable"
    assert await client.exists(store.keys.claim(SessionId("lost"))) == 0  # nothing written
    assert await store.reassert(a, [SessionId("kept"), SessionId("lost")]) == {}
    await trusting(store)
    assert await store.claimant(SessionId("lost")) == a


async def test_the_claims_are_trusted_once_every_host_asserted_and_a_ttl_passed(
    connect: Connect,
) -> None:
    client = connect()
    store = RedisClaimStore(client, SERVICE)
    keys = ServiceKeys(SERVICE)
    run_id = str((await client.info("server"))["run_id"])

    async def record(host_id: str, asserted: str) -> None:
        await client.set(keys.host(host_id), HostRecord(host_id, 1, {}, asserted).encode())
        await client.sadd(keys.hosts, host_id)

    trusted, round_ = await store.trust(run_id, 300)
    assert not trusted
    await record("a", round_)
    await record("b", "")  # has not re-asserted in this round yet
    assert await store.trust(run_id, 300) == (False, round_)  # a TTL has not passed
    await asyncio.sleep(0.35)
    assert await store.trust(run_id, 300) == (False, round_)  # b has not
    await record("b", round_)
    await record("c", "")  # came back after the caller read the live set: it counts too
    assert await store.trust(run_id, 300) == (False, round_)
    await record("c", round_)
    await client.set(keys.host("garbage"), "not a record")  # nobody's: it blocks nothing
    await client.sadd(keys.hosts, "garbage", "expired")  # "expired": its record is gone
    assert await store.trust(run_id, 300) == (True, round_)
    assert await store.trust(run_id, 300) == (True, "")
    await record("d", "")  # a host that joins once the claims are trusted changes nothing
    assert await store.trust(run_id, 300) == (True, "")


async def test_a_new_redis_run_id_takes_the_trust_back(connect: Connect) -> None:
    """A failover keeps the keys it replicated, `trusted` among them, but may have lost
    the newest claims: a host that reads another run ID starts a new round."""
    store = await trusting(RedisClaimStore(connect(), SERVICE))
    trusted, round_ = await store.trust("another-run-id", 0)
    assert not trusted and round_.startswith("another-run-id ")
    with pytest.raises(TetherError) as caught:
        await store.claimant(SessionId("nobody"))
    assert caught.value.code == "cluster_unavailable"


async def test_a_restore_takes_over_what_the_checkpointed_holder_left_and_nothing_else(
    connect: Connect,
) -> None:
    client = connect()
    store = await trusting(RedisClaimStore(client, SERVICE))
    before, restored_to, elsewhere = new_worker_id(), new_worker_id(), new_worker_id()
    await store.claim(SessionId("left"), before)  # its host died before anyone swept it
    await store.claim(SessionId("retaken"), elsewhere)  # another worker claimed it since
    await client.sadd(store.keys.claim(SessionId("garbage")), "x")
    many = ids(BATCH + 2, "bulk")
    restored = [
        (SessionId("left"), before),
        (SessionId("retaken"), before),
        (SessionId("unclaimed"), before),
        (SessionId("new-on-one-worker"), None),
        (SessionId("garbage"), before),
        *((sid, before) for sid in many),
    ]
    expected = {SessionId("retaken"): elsewhere, SessionId("garbage"): None}
    assert await store.take_over(restored_to, restored) == expected
    assert await store.take_over(restored_to, restored) == expected  # again: the same

    for sid in ("left", "unclaimed", "new-on-one-worker", *many):
        assert await store.claimant(SessionId(sid)) == restored_to
    assert await store.claimant(SessionId("retaken")) == elsewhere
    assert await store.claims_of(restored_to) == {
        "left", "unclaimed", "new-on-one-worker", *many
    }
    assert await store.take_over(restored_to, []) == {}
    assert await store.claimants() == {before, restored_to, elsewhere}
