"""The live set against a real redis-server: host IDs taken once, epochs fencing old
incarnations, the lease on the monotonic clock, malformed records ignored, and the
refresher's reports and clean stop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from structlog.testing import capture_logs

from e2e.harness import eventually
from e2e.redis_server import RedisServer
from tests.cluster.conftest import Connect
from tether.cluster.client import TIMEOUT_S
from tether.cluster.keys import ServiceKeys
from tether.cluster.liveset import ClusterError, HostRecord, LiveSet, LiveView, Refresher
from tether.routing.errors import TetherError
from tether.routing.types import WorkerId, new_worker_id

SERVICE = "svc"


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def workers(*addresses: str) -> dict[WorkerId, str]:
    return {new_worker_id(): address for address in addresses}


async def test_a_host_joins_and_every_host_reads_its_workers(connect: Connect) -> None:
    a = LiveSet(connect(), SERVICE, "host-a")
    b = LiveSet(connect(decode=True), SERVICE, "host-b")
    assert await a.join() == 1
    assert await b.join() == 1
    mine = workers("127.0.0.2:9001", "127.0.0.2:9002")
    assert await a.publish(mine)
    for reader in (a, b):
        records = await reader.read()
        assert records == {
            "host-a": HostRecord("host-a", 1, mine),
            "host-b": HostRecord("host-b", 1, {}),
        }


async def test_a_second_live_host_with_the_same_id_is_refused(connect: Connect) -> None:
    first = LiveSet(connect(), SERVICE, "host-a")
    await first.join()
    second = LiveSet(connect(), SERVICE, "host-a")
    with pytest.raises(ClusterError) as caught:
        await second.join()
    message = str(caught.value)
    assert "\n" not in message
    assert "'host-a' is already live" in message and "--host-id" in message
    # The refused start took no epoch: the live host is not fenced out by it.
    assert await first.publish(workers("127.0.0.2:9001"))
    assert (await first.read())["host-a"].epoch == 1


async def test_a_join_whose_reply_came_too_late_is_sent_again_and_takes_one_epoch(
    connect: Connect, redis_server: RedisServer
) -> None:
    """Redis stalls past the client's timeout with the join read: the client's one retry
    sends it again, and Redis runs both. The second answers the epoch the first took,
    not "already live" (which would stop the host starting, or keep a fenced one out)."""
    client = connect()
    await LiveSet(client, SERVICE, "warm-up").join()  # the script is loaded, a link kept
    live = LiveSet(client, SERVICE, "host-a")
    redis_server.pause()
    asyncio.get_running_loop().call_later(TIMEOUT_S + 0.5, redis_server.resume)

    epoch = await live.join()

    assert epoch == 1
    assert await client.get(ServiceKeys(SERVICE).epoch("host-a")) in (b"1", "1")  # one INCR
    assert (await live.read())["host-a"].epoch == 1
    with pytest.raises(ClusterError, match="already live"):  # another start still is refused
        await LiveSet(connect(), SERVICE, "host-a").join()


async def test_a_host_whose_key_expired_rejoins_with_a_higher_epoch(
    connect: Connect,
) -> None:
    client = connect()
    old = LiveSet(client, SERVICE, "host-a", ttl_s=0.2)
    assert await old.join() == 1
    await eventually(lambda: _gone(client, "host-a"), within=5.0, what="the record expires")
    new = LiveSet(client, SERVICE, "host-a", ttl_s=0.2)
    assert await new.join() == 2
    assert not await old.publish({})  # the old incarnation is over


async def _gone(client: Any, host_id: str) -> bool:
    return not await client.exists(ServiceKeys(SERVICE).host(host_id))


async def test_an_older_epoch_cannot_overwrite_a_newer_ones_record(connect: Connect) -> None:
    client = connect()
    clock = Clock()  # stands still: the old host's own lease check never stops it
    old = LiveSet(client, SERVICE, "host-a", clock=clock)
    await old.join()
    await client.delete(ServiceKeys(SERVICE).host("host-a"))  # as if it expired
    new = LiveSet(client, SERVICE, "host-a")
    assert await new.join() == 2
    theirs = workers("127.0.0.3:9001")
    assert await new.publish(theirs)

    assert not await old.publish(workers("127.0.0.2:9001"))
    assert not old.lease_valid(0.0)
    assert (await new.read())["host-a"] == HostRecord("host-a", 2, theirs)
    assert not await old.leave()  # nor delete it
    assert (await new.read())["host-a"].epoch == 2


async def test_a_host_whose_record_vanished_does_not_write_it_again(connect: Connect) -> None:
    client = connect()
    clock = Clock()
    live = LiveSet(client, SERVICE, "host-a", clock=clock)
    await live.join()
    await client.delete(ServiceKeys(SERVICE).host("host-a"))  # expired, by Redis's clock
    assert not await live.publish(workers("127.0.0.2:9001"))
    assert await live.read() == {}


async def test_a_graceful_leave_frees_the_host_id_at_once(connect: Connect) -> None:
    client = connect()
    first = LiveSet(client, SERVICE, "host-a")
    await first.join()
    assert await first.leave()
    assert await first.read() == {}
    assert await client.smembers(ServiceKeys(SERVICE).hosts) == set()
    second = LiveSet(client, SERVICE, "host-a")
    assert await second.join() == 2
    assert not await first.leave()  # the record is the new incarnation's
    assert (await second.read())["host-a"].epoch == 2


async def test_the_lease_lapses_when_writes_stop_succeeding(
    connect: Connect, redis_server: RedisServer
) -> None:
    clock = Clock()
    live = LiveSet(connect(), SERVICE, "host-a", ttl_s=10.0, clock=clock)
    assert not live.lease_valid(1.0)  # nothing written yet
    await live.join()
    start = clock.now
    clock.now = start + 5.0
    assert await live.publish({})  # the lease now runs from here
    redis_server.kill()
    clock.now = start + 7.0
    with pytest.raises(TetherError) as caught:
        await live.publish({})
    assert caught.value.code == "cluster_unavailable"
    clock.now = start + 5.0 + 8.99
    assert live.lease_valid(1.0)
    clock.now = start + 5.0 + 9.0
    assert not live.lease_valid(1.0)
    assert live.lease_valid(0.0)

    redis_server.restart()
    clock.now = start + 5.0 + 10.0  # past the TTL: the record may have expired
    assert not await live.publish({})  # over, and nothing written
    assert await live.read() == {}


async def test_a_live_host_writes_its_record_again_into_a_redis_that_came_back_empty(
    connect: Connect, redis_server: RedisServer
) -> None:
    clock = Clock()
    live = LiveSet(connect(), SERVICE, "host-a", clock=clock)
    assert await live.join() == 1
    redis_server.restart()
    mine = workers("127.0.0.2:9001")
    assert await live.publish(mine)  # within its lease: it is still the live host
    assert await live.read() == {"host-a": HostRecord("host-a", 1, mine)}
    other = LiveSet(connect(), SERVICE, "host-a")
    with pytest.raises(ClusterError):
        await other.join()


async def test_restart_empty_changes_the_run_id(
    connect: Connect, redis_server: RedisServer
) -> None:
    live = LiveSet(connect(), SERVICE, "host-a")
    before = await live.run_id()
    assert before == await live.run_id()
    redis_server.restart()
    after = await live.run_id()
    assert after != before
    assert len(after) == 40


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"host_id":"host-x","epoch":1}',
        '{"host_id":"host-x","epoch":1,"workers":{},"extra":1}',
        '{"host_id":"host x","epoch":1,"workers":{}}',
        '{"host_id":"host-x","epoch":0,"workers":{}}',
        '{"host_id":"host-x","epoch":true,"workers":{}}',
        '{"host_id":"host-x","epoch":1.5,"workers":{}}',
        '{"host_id":"host-x","epoch":1,"workers":[]}',
        '{"host_id":"host-x","epoch":1,"workers":{"nothex":"127.0.0.1:1"}}',
        '{"host_id":"host-x","epoch":1,"workers":{"%s":"127.0.0.1"}}' % ("a" * 32),
        '{"host_id":"host-x","epoch":1,"workers":{"%s":"127.0.0.1:0"}}' % ("a" * 32),
        '{"host_id":"host-x","epoch":1,"workers":{"%s":"127.0.0.1:65536"}}' % ("a" * 32),
        '{"host_id":"host-x","epoch":1,"workers":{"%s":":80"}}' % ("a" * 32),
        '{"host_id":"host-x","epoch":1,"workers":{"%s":7}}' % ("a" * 32),
        '{"host_id":"host-x","epoch":1,"workers":{"%s":"h:\u00b2"}}' % ("a" * 32),
        '{"host_id":"host-x","epoch":1,"workers":{"%s":"h:080"}}' % ("a" * 32),
    ],
)
def test_a_malformed_record_decodes_to_none(text: str) -> None:
    assert HostRecord.decode(text) is None
    assert HostRecord.decode(text.encode()) is None


def test_a_record_round_trips() -> None:
    record = HostRecord("host-a", 3, {WorkerId("a" * 32): "[::1]:9001"})
    assert HostRecord.decode(record.encode()) == record
    assert json.loads(record.encode())["workers"] == {"a" * 32: "[::1]:9001"}


async def test_a_malformed_host_record_is_ignored(connect: Connect) -> None:
    client = connect()
    keys = ServiceKeys(SERVICE)
    good = LiveSet(client, SERVICE, "host-a")
    await good.join()
    impostor = HostRecord("host-a", 7, workers("127.0.0.9:1")).encode()
    for host_id, value in (
        ("host-b", "garbage"),
        ("host-c", impostor),  # names another host than its key
        ("bad id!", HostRecord("host-a", 1, {}).encode()),
    ):
        await client.set(keys.prefix + "host:" + host_id, value)
        await client.sadd(keys.hosts, host_id)
    await client.sadd(keys.hosts, b"\xff")
    assert await good.read() == {"host-a": HostRecord("host-a", 1, {})}


async def test_hosts_whose_record_expired_leave_the_hosts_set(connect: Connect) -> None:
    client = connect()
    gone = LiveSet(client, SERVICE, "host-a", ttl_s=0.2)
    await gone.join()
    stays = LiveSet(client, SERVICE, "host-b")
    await stays.join()
    await eventually(lambda: _gone(client, "host-a"), within=5.0, what="host-a expires")
    assert set(await stays.read()) == {"host-b"}
    assert await client.smembers(ServiceKeys(SERVICE).hosts) == {b"host-b"}


async def test_a_killed_redis_is_cluster_unavailable_for_the_live_set(
    connect: Connect, redis_server: RedisServer
) -> None:
    live = LiveSet(connect(), SERVICE, "host-a")
    await live.join()
    redis_server.kill()
    for call in (live.publish({}), live.read(), live.run_id(), live.leave()):
        with pytest.raises(TetherError) as caught:
            await call
        assert caught.value.code == "cluster_unavailable"
    with pytest.raises(TetherError) as caught:
        await LiveSet(connect(), SERVICE, "host-b").join()
    assert caught.value.code == "cluster_unavailable"


def test_bad_names_are_refused_before_any_call() -> None:
    with pytest.raises(ValueError, match="host ID"):
        LiveSet(None, SERVICE, "-host")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="service"):
        LiveSet(None, "a:b", "host")  # type: ignore[arg-type]


# The refresher ----------------------------------------------------------------------


class Views:
    """The views a refresher reported, in order."""

    def __init__(self) -> None:
        self.seen: list[LiveView] = []

    async def __call__(self, view: LiveView) -> None:
        self.seen.append(view)

    @property
    def last(self) -> LiveView:
        return self.seen[-1]


async def test_the_refresher_reports_each_change_of_the_live_set_and_stops_cleanly(
    connect: Connect,
) -> None:
    a_workers = workers("127.0.0.2:9001", "127.0.0.2:9002")
    b_workers = workers("127.0.0.3:9001")
    # A TTL far past the test, so host-b's record stays while it is stopped, however slow
    # the machine: only its `leave` removes it.
    a = LiveSet(connect(), SERVICE, "host-a", ttl_s=60.0)
    b = LiveSet(connect(), SERVICE, "host-b", ttl_s=60.0)
    await a.join()
    await b.join()
    rounds = 0

    def a_current() -> dict[WorkerId, str]:
        nonlocal rounds
        rounds += 1
        return a_workers

    a_views, b_views = Views(), Views()
    a_refresher = Refresher(a, a_current, a_views, interval_s=0.05)
    b_refresher = Refresher(b, lambda: b_workers, b_views, interval_s=0.05)
    a_refresher.start()
    try:
        await eventually(lambda: a_views.seen, what="a first view")
        assert {w: v.address for w, v in a_views.last.workers.items()} == a_workers
        assert {v.host_id for v in a_views.last.workers.values()} == {"host-a"}

        b_refresher.start()
        await eventually(lambda: len(a_views.last.workers) == 3, what="host-a sees host-b")
        assert {w: v.host_id for w, v in a_views.last.workers.items() if w in b_workers} == {
            w: "host-b" for w in b_workers
        }
        await b_refresher.stop()
        assert not b_refresher.running
        reported, now = len(a_views.seen), rounds
        await eventually(lambda: rounds > now + 2, what="three more rounds")
        assert len(a_views.seen) == reported  # nothing changed, nothing reported

        assert await b.leave()
        await eventually(lambda: len(a_views.last.workers) == 2, what="host-b is gone")
        assert not a_views.last.fenced
        assert len({view.run_id for view in a_views.seen}) == 1
    finally:
        await a_refresher.stop()
        await b_refresher.stop()
    assert not a_refresher.running
    await a_refresher.stop()  # stopping again is harmless


async def test_the_refresher_keeps_going_while_redis_is_down_and_reports_the_new_run_id(
    connect: Connect, redis_server: RedisServer
) -> None:
    live = LiveSet(connect(), SERVICE, "host-a", ttl_s=5.0)
    await live.join()
    mine = workers("127.0.0.2:9001")
    views = Views()
    refresher = Refresher(live, lambda: mine, views, interval_s=0.05)
    with capture_logs() as logs:
        refresher.start()
        try:
            await eventually(lambda: views.seen, what="a first view")
            first = views.last
            redis_server.kill()
            await eventually(
                lambda: any(e["event"] == "live_set_refresh_failed" for e in logs),
                what="a failed round is logged",
            )
            redis_server.restart()
            await eventually(lambda: views.last.run_id != first.run_id, what="the new run ID")
        finally:
            await refresher.stop()
    assert not views.last.fenced  # back within its lease: still the live host
    assert {w: v.address for w, v in views.last.workers.items()} == mine
    failed = [e for e in logs if e["event"] == "live_set_refresh_failed"]
    assert failed[0]["code"] == "cluster_unavailable"
    assert failed[0]["log_level"] == "warning"


async def test_a_host_paused_past_its_lease_whose_record_is_still_there_goes_on(
    connect: Connect,
) -> None:
    clock = Clock()
    live = LiveSet(connect(), SERVICE, "host-a", ttl_s=10.0, clock=clock)
    await live.join()
    clock.now += 10.0  # by its own clock the lease lapsed, but Redis kept the record
    assert live.lease_until() < clock.now
    assert await live.publish({})  # it never expired, so nobody saw this host dead
    assert live.lease_until() == clock.now + 8.0


async def test_the_refresher_reports_an_incarnation_whose_lease_lapsed(
    connect: Connect,
) -> None:
    clock = Clock()
    client = connect()
    live = LiveSet(client, SERVICE, "host-a", ttl_s=10.0, clock=clock)
    await live.join()
    views = Views()
    refresher = Refresher(live, dict, views, interval_s=0.05)
    view = await refresher.refresh()
    assert not view.fenced
    clock.now += 10.0  # as if the host was paused past its TTL
    await client.delete(ServiceKeys(SERVICE).host("host-a"))  # expired, by Redis's clock
    refresher.start()
    try:
        await eventually(lambda: views.last.fenced, what="the lapse is reported")
    finally:
        await refresher.stop()
    assert len(views.seen) == 2


async def test_a_failing_callback_is_logged_and_the_view_delivered_again(
    connect: Connect,
) -> None:
    live = LiveSet(connect(), SERVICE, "host-a", ttl_s=2.0)
    await live.join()
    calls: list[LiveView] = []

    async def flaky(view: LiveView) -> None:
        calls.append(view)
        if len(calls) == 1:
            raise RuntimeError("push failed")

    refresher = Refresher(live, lambda: {}, flaky, interval_s=0.05)
    with capture_logs() as logs:
        refresher.start()
        try:
            await eventually(lambda: len(calls) >= 2, what="the view is delivered again")
        finally:
            await refresher.stop()
    assert calls[0] == calls[1]
    assert refresher.view == calls[1]
    assert any(
        e["event"] == "live_set_refresh_failed" and e["log_level"] == "error" for e in logs
    )
