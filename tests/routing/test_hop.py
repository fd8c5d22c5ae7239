"""A forwarded request keeps its caller: real workers, real sockets, the hop header."""

from __future__ import annotations

from typing import Any

import httpx

from tests.routing.apps import session_app
from tests.routing.conftest import Cluster, Node
from tether.routing.forward import HOP_BY_HOP
from tether.routing.hop import HOP_HEADER, hop_value, take_hop
from tether.routing.types import SessionId

HOP = HOP_HEADER.decode()


async def seeded(node: Node, session_id: str) -> httpx.Cookies:
    async with node.client() as client:
        reply = await client.post("/seed_session", json={"session_id": session_id})
    assert reply.status_code == 200, reply.text
    return reply.cookies


async def whoami(node: Node, cookies: httpx.Cookies, **headers: str) -> tuple[Any, list[Any]]:
    """What the handler saw, and the (host, port) this client connected from."""
    async with node.client(cookies=cookies) as client:
        reply = await client.get("/whoami", headers=headers)
        caller = reply.extensions["network_stream"].get_extra_info("client_addr")
    assert reply.status_code == 200, reply.text
    return reply.json(), list(caller)


async def test_forwarded_request_keeps_the_callers_address(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    cookies = await seeded(a, "caller")

    direct, direct_caller = await whoami(a, cookies)
    forwarded, forwarded_caller = await whoami(b, cookies)

    assert b.routing.router.stats.forwarded == 1
    assert forwarded["worker"] == direct["worker"] == a.id
    assert direct["client"] == direct_caller
    assert forwarded["client"] == forwarded_caller  # not None, not the private socket
    assert forwarded["server"] == list(b.listener.getsockname())  # where the caller connected
    for key in ("scheme", "root_path", "path", "raw_path"):
        assert forwarded[key] == direct[key], key
    assert forwarded["url_for"] == f"{b.url}/whoami"
    assert HOP not in forwarded["headers"]
    assert forwarded["headers"] == [h for h in direct["headers"] if h.encode() not in HOP_BY_HOP]


async def test_forwarded_request_behind_a_tls_proxy_keeps_https_and_the_proxied_client(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    cookies = await seeded(a, "proxied")
    proxy = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.7"}

    direct, _ = await whoami(a, cookies, **proxy)
    forwarded, _ = await whoami(b, cookies, **proxy)

    assert forwarded["worker"] == a.id
    for seen in (direct, forwarded):
        assert seen["scheme"] == "https"
        assert seen["client"] == ["203.0.113.7", 0]
        assert seen["url_for"].startswith("https://")
    assert forwarded["url_for"] == f"https://{b.url.removeprefix('http://')}/whoami"


async def test_forwarded_request_under_a_root_path_sees_the_path_uvicorn_gives_it(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app(), root_path="/api")
    b = await cluster.add(session_app(), root_path="/api")
    # The seed route matches below the root path, so it claims before its handler runs
    # (its handler never reads the session).
    cookies = await seeded(a, "rooted")
    assert b.routing.claims is not None
    assert await b.routing.claims.lookup(SessionId("rooted")) == a.id

    direct, _ = await whoami(a, cookies)
    forwarded, _ = await whoami(b, cookies)

    assert forwarded["worker"] == a.id
    assert direct["root_path"] == forwarded["root_path"] == "/api"
    assert direct["path"] == forwarded["path"] == "/api/whoami"
    assert direct["raw_path"] == forwarded["raw_path"] == "/api/whoami"
    assert forwarded["url_for"] == f"{b.url}/api/whoami"


async def test_a_hop_header_a_client_sends_is_stripped_and_ignored(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    cookies = await seeded(a, "forger")
    forged = {HOP: "https 198.51.100.66 1 evil.example 1 /evil"}

    direct, direct_caller = await whoami(a, cookies, **forged)
    forwarded, forwarded_caller = await whoami(b, cookies, **forged)

    assert forwarded["worker"] == direct["worker"] == a.id
    assert direct["client"] == direct_caller
    assert forwarded["client"] == forwarded_caller
    for seen in (direct, forwarded):
        assert seen["scheme"] == "http"
        assert seen["root_path"] == ""
        assert HOP not in seen["headers"]


def test_hop_value_round_trips_unusual_callers() -> None:
    callers: list[dict[str, Any]] = [
        {"client": ("::1", 5), "server": ("/run/app.sock", None), "root_path": "/a b%c"},
        {"client": None, "server": None, "root_path": "", "scheme": "https"},
        {"client": ("h\u00e9st tab\t", 0), "server": ("127.0.0.1", 80), "root_path": "/x"},
    ]
    for caller in callers:
        sent = {"scheme": "http", **caller, "headers": [(b"host", b"h")]}
        scope: dict[str, Any] = {"headers": [(b"host", b"h"), (HOP_HEADER, hop_value(sent))]}
        take_hop(scope)
        assert scope == sent

