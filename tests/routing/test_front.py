"""What the passthrough reads of a request head (routing/front.py)."""

from __future__ import annotations

import asyncio

import pytest

from tether.routing.front import HeadReader, _ProxyHeaders
from tether.routing.kinds import SessionKind

read_head = HeadReader(None).read
head_scope = HeadReader(None).scope


def test_a_plain_head_gives_method_paths_query_and_the_headers_routing_reads() -> None:
    scope = head_scope(
        b"GET /a%20b/c?x=1&y=2 HTTP/1.1\r\nHost: tether\r\nCookie:  session=abc \r\nX-Y: z"
        b"\r\nX-Forwarded-For: 10.0.0.1",
        "/api",
    )
    assert scope is not None
    assert scope["method"] == "GET"
    assert scope["path"] == "/api/a b/c"
    assert scope["raw_path"] == b"/a%20b/c"
    assert scope["root_path"] == "/api"
    assert scope["query_string"] == b"x=1&y=2"
    assert scope["headers"] == [(b"cookie", b"session=abc"), (b"x-forwarded-for", b"10.0.0.1")]


def test_a_kinds_own_headers_are_read_in_their_order_and_others_are_not() -> None:
    scope = HeadReader(SessionKind(header="x-session")).scope(
        b"GET / HTTP/1.1\r\nX-Session: a\r\nx-other: b\r\nx-tether-session-token: t\r\n"
        b"x-session: c\r\nx-tether-close-follows: 1",
        "",
    )
    assert scope is not None
    assert scope["headers"] == [
        (b"x-session", b"a"), (b"x-tether-session-token", b"t"), (b"x-session", b"c"),
        (b"x-tether-close-follows", b"1"),
    ]
    assert HeadReader(None).scope(b"GET / HTTP/1.1\r\nX-Session: a", "") == {
        **scope, "headers": []
    }


def test_heads_the_passthrough_does_not_read_give_none() -> None:
    for head in (
        b"GET / HTTP/1.0\r\nhost: t",  # keep-alive rules of its own
        b"GET / HTTP/2\r\nhost: t",
        b"GET http://example.com/ HTTP/1.1\r\nhost: t",  # absolute form
        b"OPTIONS * HTTP/1.1\r\nhost: t",
        b"GET / HTTP/1.1\r\nhost: t\r\n folded",  # obsolete line folding
        b"GET / HTTP/1.1\r\nno colon here",
        b"GET / HTTP/1.1\r\nbad name : x",
        b"GET /\xff HTTP/1.1\r\nhost: t",
        b"GET  / HTTP/1.1\r\nhost: t",
        b"GET / HTTP/1.1\r\nhost: t\nx: y",  # a bare line feed
        b"get / HTTP/1.1\r\nhost: t",
    ):
        assert head_scope(head, "") is None, head


def test_a_head_sent_on_loses_connection_keep_alive_and_gains_the_root_path() -> None:
    read = read_head(
        b"GET /count HTTP/1.1\r\nhost: t\r\nConnection: Keep-Alive\r\ncookie: s=1", "/api"
    )
    assert read is not None
    assert read.sent == b"GET /api/count HTTP/1.1\r\nhost: t\r\ncookie: s=1"
    assert read.length == -1
    assert read.scope["path"] == "/api/count"


def test_a_head_keeps_connection_close_and_reads_its_body_length() -> None:
    head = b"POST /x HTTP/1.1\r\nconnection: close\r\ncontent-length: 12"
    read = read_head(head, "")
    assert read is not None and read.sent == head and read.length == 12


def test_heads_the_passthrough_leaves_to_the_router_read_as_none() -> None:
    for head in (
        b"HEAD / HTTP/1.1\r\nhost: t",
        b"GET / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket",
        b"GET / HTTP/1.1\r\nconnection: keep-alive, x-private",
        b"POST / HTTP/1.1\r\ntransfer-encoding: chunked",
        b"POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 1",
        b"POST / HTTP/1.1\r\ncontent-length: -1",
        b"POST / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 1",
        b"GET / HTTP/1.1\r\nforwarded: for=10.0.0.1",
        b"GET / HTTP/1.1\r\nx-tether-hop: http 1.2.3.4 1 h 1 ",
    ):
        assert read_head(head, "") is None, head


def test_keep_alive_lines_all_go_and_a_close_line_stays() -> None:
    read = read_head(
        b"GET / HTTP/1.1\r\nconnection: keep-alive\r\nConnection:\tKEEP-ALIVE \r\n"
        b"connection: close\r\nhost: t",
        "",
    )
    assert read is not None
    assert read.sent == b"GET / HTTP/1.1\r\nconnection: close\r\nhost: t"


def test_a_head_naming_a_proxys_caller_is_read_and_marked_proxied() -> None:
    for name in (b"X-Forwarded-For: 203.0.113.7", b"x-forwarded-proto: https"):
        read = read_head(b"GET / HTTP/1.1\r\nhost: t\r\n" + name, "")
        assert read is not None and read.proxied, name
        assert read.sent.endswith(name), "sent on unchanged"
    plain = read_head(b"GET / HTTP/1.1\r\nhost: t", "")
    assert plain is not None and not plain.proxied


@pytest.mark.parametrize(
    ("trusted", "client", "expected"),
    [
        ("127.0.0.1", "127.0.0.1", (("203.0.113.7", 0), "https")),
        ("127.0.0.1", "10.1.1.1", (("10.1.1.1", 5000), "http")),  # not a trusted proxy
        ("*", "10.1.1.1", (("203.0.113.7", 0), "https")),
        (["10.0.0.1", "127.0.0.1"], "127.0.0.1", (("203.0.113.7", 0), "https")),
    ],
)
def test_a_proxied_caller_is_the_one_uvicorns_middleware_gives_the_app(
    trusted: str | list[str], client: str, expected: tuple[tuple[str, int], str]
) -> None:
    caller = _ProxyHeaders(trusted).caller({
        "type": "http", "client": (client, 5000), "scheme": "http",
        "headers": [(b"x-forwarded-for", b"203.0.113.7"), (b"x-forwarded-proto", b"https")],
    })
    assert caller is not None
    assert (caller["client"], caller["scheme"]) == expected


def test_a_proxy_middleware_that_would_wait_tells_no_caller_and_is_closed() -> None:
    # (uvicorn's never waits; one that did must leave the request to the copying path)
    proxy = _ProxyHeaders("127.0.0.1")
    finished = []

    async def waits(scope: object, receive: object, send: object) -> None:
        try:
            await asyncio.sleep(0)
        finally:
            finished.append(True)

    proxy._middleware = waits  # type: ignore[assignment]
    assert proxy.caller({"type": "http", "client": ("127.0.0.1", 1), "headers": []}) is None
    assert finished == [True], "the waiting step was closed, not left pending"
