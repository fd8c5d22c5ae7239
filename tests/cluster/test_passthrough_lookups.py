"""The passthrough (routing/front.py) on a cluster's claim store: a request whose holder
only Redis can name waits for the lookup, then for a link to the holder's host. Real
workers on real sockets, a real `redis-server`; the other host is an address."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from tests.cluster.conftest import Connect
from tests.cluster.test_redis_claims import SERVICE, trusting
from tests.routing.apps import session_app
from tests.routing.conftest import Cluster
from tests.routing.test_forward import BOUND
from tether.cluster.claims import RedisClaimStore
from tether.routing.kinds import declared_kind
from tether.routing.types import SessionId, new_worker_id
from tether.routing.worker import HopListener

CONNECT_TIMEOUT_S = 1.0


async def test_a_passed_through_request_to_a_host_that_never_answers_is_503_in_one_connect_timeout(
    short_tmp: Path, connect: Connect
) -> None:
    """Redis names a worker of another host whose hop listener takes no connection (its
    accept queue full, as a blackholed host: the kernel drops the SYN). The passthrough's
    link times out once, and the router answers `claimant_unavailable` from what the
    passthrough found, without asking Redis or connecting a second time (which would
    take another timeout); the app never runs."""
    (short_tmp / "w").mkdir(mode=0o700)
    cluster = Cluster(str(short_tmp))
    store = await trusting(RedisClaimStore(connect(), SERVICE))
    app = session_app()
    kind = declared_kind(app)
    assert kind is not None and kind.cookie is not None
    elsewhere = new_worker_id()
    await store.claim(SessionId("far"), elsewhere)
    cookie = kind.cookie.encode({kind.cookie_key: "far"})
    with socket.socket() as full, socket.socket() as queued:
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # one connection waits to be accepted; none ever is
        queued.connect(full.getsockname())
        try:
            node = await cluster.add(
                app, front=True, store=store, hops=HopListener("127.0.0.1", b"s" * 32)
            )
            assert node.routing.forwarder is not None
            node.routing.forwarder.connect_timeout = CONNECT_TIMEOUT_S
            node.routing.tables.set_live(
                [node.id, elsewhere], {elsewhere: f"tcp://127.0.0.1:{full.getsockname()[1]}"},
                dead=[],
            )
            started = time.monotonic()
            async with httpx.AsyncClient(
                base_url=node.url, timeout=BOUND, cookies={kind.cookie.name: cookie}
            ) as client:
                reply = await client.get("/touch")
            waited = time.monotonic() - started
            stats = node.routing.router.stats
        finally:
            await cluster.close()

    assert reply.status_code == 503, reply.text
    assert reply.json()["code"] == "claimant_unavailable"
    assert "cannot connect" in reply.json()["detail"]
    assert CONNECT_TIMEOUT_S - 0.1 < waited < 2 * CONNECT_TIMEOUT_S, waited
    assert stats.passed_through == 0 and stats.forwarded == 0 and stats.local == 0
    assert stats.refused["unavailable"] == 1
