"""The routing rule on real in-process workers sharing one claim directory."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from e2e.harness import eventually
from tests.routing.apps import header_app, session_app
from tests.routing.conftest import Cluster
from tests.routing.test_hop import seeded
from tether.routing.kinds import SessionKind
from tether.routing.router import worker_of
from tether.routing.types import SessionId


def claim_files(cluster: Cluster) -> list[str]:
    return [n for n in os.listdir(Path(cluster.runtime_dir) / "claims") if not n.endswith(".tmp")]


async def test_seed_on_one_worker_is_served_by_it_from_another(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca, b.client() as cb:
        seeded = await ca.post("/seed_session", json={"session_id": "s-1"})
        assert seeded.status_code == 200
        cb.cookies = seeded.cookies
        touched = await cb.get("/touch")
    assert touched.json() == {"session_id": "s-1", "n": 1, "worker": a.id}
    assert a.routing.router.stats.forwarded == 0
    assert b.routing.router.stats.forwarded == 1
    assert a.routing.router.stats.served_forwarded == 1


async def test_seed_whose_handler_never_reads_the_session_still_claims_it(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "quiet"})
    assert "session" in seeded.cookies  # the cookie names the body's ID
    assert b.routing.claims is not None
    assert await b.routing.claims.lookup(SessionId("quiet")) == a.id


async def test_request_that_never_touches_the_session_gets_no_cookie_and_no_claim(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    await cluster.add(session_app())
    async with a.client() as client:
        bare = await client.get("/health")
        seeded = await client.post("/seed_session", json={"session_id": "s-2"})
        before = claim_files(cluster)
        with_cookie = await client.get("/health")
    assert "set-cookie" not in bare.headers
    assert "set-cookie" not in with_cookie.headers
    assert seeded.status_code == 200
    assert claim_files(cluster) == before
    assert len(before) == 1


async def test_implicit_session_is_claimed_before_its_reply_and_works_through_every_worker(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    c = await cluster.add(session_app())
    async with a.client() as ca:
        first = await ca.get("/touch")
        assert len(claim_files(cluster)) == 1  # claimed by the time the reply arrived
        session_id = first.json()["session_id"]
        assert "session" in first.cookies
    for node in (b, c, a):
        async with node.client(cookies=first.cookies) as client:
            reply = await client.get("/touch")
        assert reply.json()["worker"] == a.id
        assert reply.json()["session_id"] == session_id
    assert a.app.state.values[session_id] == 4
    assert b.app.state.values == {} and c.app.state.values == {}


async def test_session_written_by_the_handler_keeps_the_routed_id(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "w-1"})
    async with b.client(cookies=seeded.cookies) as cb:
        written = await cb.post("/write")
        assert written.json() == {"session_id": "w-1"}
        assert "session" in written.cookies  # the claimant's own Set-Cookie came back
        touched = await cb.get("/touch")
    assert touched.json()["worker"] == a.id


async def test_cookie_whose_claim_ended_is_claimed_again_by_the_worker_that_uses_it(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(close_window_s=0.2))
    b = await cluster.add(session_app(close_window_s=0.2))
    async with a.client() as ca:
        touched = await ca.get("/touch")
    session_id = SessionId(touched.json()["session_id"])
    assert b.routing.claims is not None
    for _ in range(200):  # the sweep releases it a window later, with no request arriving
        if await b.routing.claims.lookup(session_id) is None:
            break
        await asyncio.sleep(0.02)
    assert await b.routing.claims.lookup(session_id) is None
    async with b.client(cookies=touched.cookies) as cb:
        again = await cb.get("/touch")
    assert again.json()["worker"] == b.id
    assert a.routing.claims is not None
    assert await a.routing.claims.lookup(session_id) == b.id


async def test_post_handler_claim_that_loses_a_race_answers_409_and_keeps_no_state(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "race"})
        assert a.routing.claims is not None
        await a.routing.claims.drop(SessionId("race"))  # as if its window had passed
        async with b.client(cookies=seeded.cookies) as cb:
            pending = asyncio.create_task(cb.get("/touch", params={"gate": "g"}))
            await asyncio.wait_for(b.app.state.entered.setdefault("g", asyncio.Event()).wait(), 5)
            assert b.app.state.values == {"race": 1}  # the handler made state on b
            assert await a.routing.claims.claim(SessionId("race")) == a.id  # a claims it meanwhile
            b.app.state.gates.setdefault("g", asyncio.Event()).set()
            lost = await pending
    assert lost.status_code == 409
    assert lost.json()["code"] == "session_conflict"
    assert "set-cookie" not in lost.headers
    assert b.app.state.values == {}  # released on the losing worker


async def test_a_reply_begun_after_the_hosts_lease_lapsed_is_503_not_sent(
    cluster: Cluster,
) -> None:
    """On a cluster a host whose lease lapses may no longer prove it holds its sessions
    (another host may take them over). The lease is checked as a request arrives; a
    handler that outlasts it (a slow call, the host paused mid-handler) has its reply
    refused at its start: 503 `cluster_unavailable`, as the requests after it are."""
    a = await cluster.add(session_app())
    claims = a.routing.claims
    assert claims is not None
    cookies = await seeded(a, "leased")
    claims.lease_until = time.monotonic() + 60  # as the host's coordinator sets it
    async with a.client(cookies=cookies) as client:
        pending = asyncio.create_task(client.get("/touch", params={"gate": "g"}))
        await asyncio.wait_for(a.app.state.entered.setdefault("g", asyncio.Event()).wait(), 5)
        claims.lease_until = time.monotonic() - 1  # Redis stopped answering meanwhile
        a.app.state.gates.setdefault("g", asyncio.Event()).set()
        refused = await pending
        after = await client.get("/touch")

    assert refused.status_code == 503, refused.text
    assert refused.json()["code"] == "cluster_unavailable"
    assert "lease" in refused.json()["detail"]
    assert a.app.state.values == {"leased": 1}  # the handler ran; its reply went unsent
    assert (after.status_code, after.json()["code"]) == (503, "cluster_unavailable")


def failing_writer_app() -> Any:
    """`session_app` with a route whose handler writes the session, then fails."""
    app = session_app()

    async def fail_writing(request: Request) -> JSONResponse:
        request.session["note"] = "tried"
        return JSONResponse({"worker": worker_of(request.scope)}, status_code=422)

    app.router.routes.append(Route("/fail_writing", fail_writing, methods=["POST"]))
    return app


async def test_a_failed_reply_setting_the_apps_own_cookie_keeps_its_minted_claim(
    cluster: Cluster,
) -> None:
    """A request with no session whose handler writes the session and fails: Starlette's
    `SessionMiddleware` sets the cookie naming the ID the router minted all the same, so
    the claim stays; the next request, landing on another worker, reaches this one (it
    was claimed there beside what this handler made)."""
    a = await cluster.add(failing_writer_app())
    b = await cluster.add(failing_writer_app())
    async with a.client() as on_a:
        failed = await on_a.post("/fail_writing")
    assert failed.status_code == 422 and "set-cookie" in failed.headers
    async with b.client(cookies=failed.cookies) as on_b:
        again = await on_b.get("/touch")

    assert again.status_code == 200, again.text
    assert again.json()["worker"] == a.id


async def test_seed_naming_another_session_than_its_cookie_is_409(cluster: Cluster) -> None:
    single = await cluster.add(session_app(), single=True)
    a = await cluster.add(session_app())
    for node in (single, a):
        async with node.client() as client:
            seeded = await client.post("/seed_session", json={"session_id": "one"})
            assert seeded.status_code == 200
            for route in ("/seed_session", "/close_session"):
                other = await client.post(route, json={"session_id": "two"})
                assert other.status_code == 409, route
                assert other.json()["code"] == "session_mismatch"


async def test_seed_and_close_of_one_id_on_two_workers_at_once_never_split(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    ids = [f"pair-{i}" for i in range(200)]
    async with a.client() as ca, b.client() as cb:

        async def pair(session_id: str) -> tuple[int, int]:
            seed, close = await asyncio.gather(
                ca.post("/seed_session", json={"session_id": session_id}),
                cb.post("/close_session", json={"session_id": session_id}),
            )
            return seed.status_code, close.status_code

        results = await asyncio.gather(*(pair(s) for s in ids))
    assert a.routing.claims is not None and b.routing.claims is not None
    for session_id, (seed, close) in zip(ids, results, strict=True):
        owner = await a.routing.claims.lookup(SessionId(session_id))
        assert owner in (a.id, b.id)
        assert seed in (200, 409) and close in (200, 409)
        assert 200 in (seed, close)
    mine_a = {s for s in ids if a.routing.claims.mine(SessionId(s))}
    mine_b = {s for s in ids if b.routing.claims.mine(SessionId(s))}
    assert mine_a.isdisjoint(mine_b) and mine_a | mine_b == set(ids)


async def test_forwarded_request_for_a_released_claim_is_served_there_never_forwarded_again(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "moved"})
    assert a.routing.claims is not None and b.routing.claims is not None
    # b holds no claim; a forwarded request that reaches b is served there as unclaimed.
    transport = httpx.AsyncHTTPTransport(uds=b.routing.socket_path(b.id))
    cookie = {"cookie": f"session={seeded.cookies['session']}"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://worker", headers=cookie
    ) as private:
        served = await private.get("/touch")
        assert served.status_code == 409  # a still claims it: refused, not forwarded
        assert served.json()["code"] == "session_conflict"
        await a.routing.claims.drop(SessionId("moved"))
        served = await private.get("/touch")
    assert served.status_code == 200
    assert served.json()["worker"] == b.id
    assert b.routing.claims.mine(SessionId("moved"))
    assert b.routing.router.stats.forwarded == 0


async def test_x_tether_worker_reaches_the_named_worker_unless_a_session_is_named(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        named = await ca.get("/health", headers={"x-tether-worker": b.id})
        assert named.json() == {"worker": b.id}
        seeded = await ca.post("/seed_session", json={"session_id": "here"})
        ca.cookies = seeded.cookies
        ignored = await ca.get("/touch", headers={"x-tether-worker": b.id})
        assert ignored.json()["worker"] == a.id
    async with a.client() as fresh:
        gone = await fresh.get("/health", headers={"x-tether-worker": "f" * 32})
        assert gone.status_code == 410 and gone.json()["code"] == "worker_gone"


async def test_request_for_an_exited_workers_session_gets_410(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "orphan"})
    await cluster.kill(a)
    async with b.client(cookies=seeded.cookies) as cb:
        gone = await cb.get("/touch")
        close = await cb.post("/close_session", json={"session_id": "orphan"})
    assert gone.status_code == 410 and gone.json()["code"] == "session_gone"
    assert close.status_code == 410
    assert b.app.state.values == {}


async def test_claimant_whose_socket_refuses_is_treated_as_gone(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "refused"})
    await a.routing.stop()  # its socket is gone while b still thinks it is live
    async with b.client(cookies=seeded.cookies) as cb:
        gone = await cb.get("/touch")
    assert gone.status_code == 410


async def test_declared_header_and_query_kinds_route_by_them(cluster: Cluster) -> None:
    header_kind = SessionKind(header="x-episode", token_header=None, starts=("POST /start",))
    query_kind = SessionKind(query_param="sid", token_header=None, starts=("POST /start",))
    for kind in (header_kind, query_kind):
        a = await cluster.add(header_app(kind))
        b = await cluster.add(header_app(kind))
        by_header = kind.header is not None
        headers = {"x-episode": "ep-h"} if by_header else {}
        params = {} if by_header else {"sid": "ep-q"}
        async with a.client() as ca, b.client() as cb:
            started = await ca.post("/start", headers=headers, params=params)
            assert started.status_code == 200, started.text
            assert started.json()["worker"] == a.id
            for _ in range(3):
                where = await cb.get("/where", headers=headers, params=params)
                assert where.json()["worker"] == a.id
        await cluster.kill(a)
        await cluster.kill(b)


def session_cookies(reply: httpx.Response) -> list[str]:
    """The `session=` values a reply sets."""
    return [
        header.split(";", 1)[0].removeprefix("session=")
        for header in reply.headers.get_list("set-cookie")
        if header.startswith("session=")
    ]


async def test_login_that_rotates_the_session_id_keeps_the_session_on_its_holder(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(close_window_s=0.3))
    b = await cluster.add(session_app(close_window_s=0.3))
    c = await cluster.add(session_app(close_window_s=0.3))
    assert a.routing.claims is not None and c.routing.claims is not None
    old = SessionId("before-login")
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": old})
        ca.cookies = seeded.cookies
        assert (await ca.get("/touch")).json()["n"] == 1
    async with b.client(cookies=seeded.cookies) as cb:
        login = await cb.post("/login")  # forwarded to a, which rotates the ID
    assert login.status_code == 200, login.text
    new = SessionId(login.json()["new"])
    assert login.json()["worker"] == a.id
    (value,) = session_cookies(login)  # the app's own cookie, and no second one
    kind = a.routing.router.kind
    assert kind is not None and kind.cookie is not None
    assert (kind.cookie.decode(value) or {})["session_id"] == new
    assert await c.routing.claims.lookup(new) == a.id  # claimed before the reply left a

    for count, node in enumerate((b, c, a, b), start=2):
        async with node.client(cookies=login.cookies) as client:
            touched = await client.get("/touch")
        assert touched.json() == {"session_id": new, "n": count, "worker": a.id}
    assert a.routing.claims.lifetimes.is_open(new)  # a seeded session stays open renamed
    assert not a.routing.claims.lifetimes.is_open(old)
    # The old ID ends as a closed session: its claim goes one window later; the new stays.
    async def old_released() -> bool:
        return await c.routing.claims.lookup(old) is None  # type: ignore[union-attr]

    await eventually(old_released, 10, "the old claim ends")
    assert await c.routing.claims.lookup(new) == a.id


async def test_rotating_a_minted_id_claims_only_the_new_one(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with b.client() as cb:
        login = await cb.post("/login", params={"to": "fresh-login"})  # no cookie: minted
    assert login.status_code == 200, login.text
    assert len(session_cookies(login)) == 1
    assert len(claim_files(cluster)) == 1  # the minted ID, never named, was not claimed
    assert a.routing.claims is not None
    assert await a.routing.claims.lookup(SessionId("fresh-login")) == b.id
    async with a.client(cookies=login.cookies) as ca:
        touched = await ca.get("/touch")
    assert touched.json() == {"session_id": "fresh-login", "n": 1, "worker": b.id}


async def test_rotation_to_an_id_another_worker_holds_answers_409_and_releases_it(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        assert (await ca.post("/seed_session", json={"session_id": "taken"})).status_code == 200
    async with b.client() as cb:
        seeded = await cb.post("/seed_session", json={"session_id": "mine"})
        cb.cookies = seeded.cookies
        assert (await cb.get("/touch")).json()["n"] == 1
        lost = await cb.post("/login", params={"to": "taken"})
    assert lost.status_code == 409
    assert lost.json()["code"] == "session_conflict"
    assert "set-cookie" not in lost.headers  # the client keeps its old cookie
    assert "taken" not in b.app.state.values  # the handler's state for it was released
    assert a.routing.claims is not None and b.routing.claims is not None
    assert await b.routing.claims.lookup(SessionId("taken")) == a.id
    assert await a.routing.claims.lookup(SessionId("mine")) == b.id
    assert b.routing.claims.lifetimes.is_open(SessionId("mine"))
