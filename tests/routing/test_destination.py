"""The routing decision on a cluster (SPEC 12): a claimant this host has not seen in any
host's record yet is 503, never 410; one known dead is 410."""

from __future__ import annotations

from tests.routing.apps import session_app
from tests.routing.conftest import Cluster
from tether.routing.types import SessionId, new_worker_id


async def test_a_claimant_not_yet_known_is_503_and_one_known_dead_is_410(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "elsewhere"})
    assert a.routing.claims is not None
    newcomer = new_worker_id()  # a worker of another host whose record a has not read
    await a.routing.claims.drop(SessionId("elsewhere"))
    assert await a.routing.claims.store.claim(SessionId("elsewhere"), newcomer) == newcomer
    tables = a.routing.tables
    tables.set_live(tables.live, {}, dead=[])
    async with a.client(cookies=seeded.cookies) as ca:
        unknown = await ca.get("/touch")
        assert unknown.status_code == 503, unknown.text
        assert unknown.json()["code"] == "claimant_unavailable"
        assert unknown.headers["retry-after"] == "1"
        tables.set_live(tables.live, {}, dead=[newcomer])
        gone = await ca.get("/touch")
        assert gone.status_code == 410, gone.text
        assert gone.json()["code"] == "session_gone"
