"""What the passthrough reads of a request head (routing/front.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httptools
import pytest

import tether.routing.front as front_module
from tether.routing.front import HeadReader, _ProxyHeaders
from tether.routing.hopsign import request_target
from tether.routing.kinds import CookieCodec, SessionKind
from tether.routing.router import FOUND_KEY


def read_head(head: bytes, root_path: str) -> Any:
    """The passthrough's reading of a request of `head` (no closing blank line)."""
    return HeadReader(None).read(head + b"\r\n\r\n", root_path)


def head_scope(head: bytes, root_path: str) -> Any:
    return HeadReader(None).scope(head + b"\r\n\r\n", root_path)


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
    # Values as httptools gives them, and so the holder's uvicorn: leading blanks gone.
    assert scope["headers"] == [(b"cookie", b"session=abc "), (b"x-forwarded-for", b"10.0.0.1")]


def test_a_kinds_own_headers_are_read_in_their_order_and_others_are_not() -> None:
    scope = HeadReader(SessionKind(header="x-session")).scope(
        b"GET / HTTP/1.1\r\nX-Session: a\r\nx-other: b\r\nx-tether-session-token: t\r\n"
        b"x-session: c\r\nx-tether-close-follows: 1\r\n\r\n",
        "",
    )
    assert scope is not None
    assert scope["headers"] == [
        (b"x-session", b"a"), (b"x-tether-session-token", b"t"), (b"x-session", b"c"),
        (b"x-tether-close-follows", b"1"),
    ]
    assert HeadReader(None).scope(b"GET / HTTP/1.1\r\nX-Session: a\r\n\r\n", "") == {
        **scope, "headers": []
    }


def test_heads_the_passthrough_does_not_read_give_none() -> None:
    for head in (
        b"GET / HTTP/1.0\r\nhost: t",  # keep-alive rules of its own
        b"GET / HTTP/2\r\nhost: t",
        b"GET http://example.com/ HTTP/1.1\r\nhost: t",  # absolute form
        b"OPTIONS * HTTP/1.1\r\nhost: t",
        b"GET / HTTP/1.1\r\nhost: t\r\n folded",  # obsolete line folding
        b"GET / HTTP/1.1\r\nhost: t\r\n\tfolded",
        b"GET / HTTP/1.1\r\nno colon here",
        b"GET / HTTP/1.1\r\nbad name : x",
        b"GET /\xff HTTP/1.1\r\nhost: t",
        b"GET / HTTP/1.1\r\nhost: t\nx: y",  # a bare line feed
        b"GET / HTTP/1.1\r\nhost: t\rx: y",  # a bare carriage return
        b"GET / HTTP/1.1\r\ncookie: a\n\r\nx: y",
    ):
        assert head_scope(head, "") is None, head


def test_a_fragment_or_a_request_line_of_extra_spaces_is_left_to_uvicorn() -> None:
    """uvicorn drops a fragment (the holder would read another path or query than the
    passthrough), and the request line is sent on as it came (so a hop's signature, and
    a root path put in front, need it as `method SP target SP HTTP/1.1`)."""
    for head in (
        b"GET /s/abc#x HTTP/1.1\r\nhost: t",
        b"GET /a?session=abc#x HTTP/1.1\r\nhost: t",
        b"GET  /a HTTP/1.1\r\nhost: t",
        b"GET /a  HTTP/1.1\r\nhost: t",
    ):
        assert read_head(head, "") is None, head
    assert read_head(b"GET /a?b HTTP/1.1\r\nhost: t", "") is not None


@pytest.mark.parametrize("target", [
    b"/a", b"/a?", b"/a?b=1&c=%2F", b"/a?b?c", b"/a%20b/%E2%82%AC", b"//x", b"/",
])
@pytest.mark.parametrize("root_path", ["", "/api"])
def test_the_target_a_hop_signs_is_what_the_listeners_uvicorn_reads_of_the_line_sent(
    target: bytes, root_path: str
) -> None:
    read = read_head(b"GET %s HTTP/1.1\r\nhost: t" % target, root_path)
    sent_target = read.sent.split(b"\r\n")[0].split(b" ")[1]
    url = httptools.parse_url(sent_target)  # as uvicorn's httptools protocol parses it
    scope = {"raw_path": url.path, "query_string": url.query or b"", "path": ""}
    assert front_module._signed_target(read.sent) == request_target(scope)
    assert sent_target == root_path.encode() + target


def test_a_head_sent_on_loses_connection_keep_alive_and_gains_the_root_path() -> None:
    read = read_head(
        b"GET /count HTTP/1.1\r\nhost: t\r\nConnection: Keep-Alive\r\ncookie: s=1", "/api"
    )
    assert read is not None
    assert read.sent == b"GET /api/count HTTP/1.1\r\nhost: t\r\ncookie: s=1"
    assert read.body == b""
    assert read.scope["path"] == "/api/count"


def test_a_head_loses_connection_close_but_says_it_closes_and_its_body_is_read_whole() -> None:
    head = b"POST /x HTTP/1.1\r\nconnection: close\r\ncontent-length: 12"
    read = HeadReader(None).read(head + b"\r\n\r\n" + b"twelve bytes", "")
    assert read is not None and read.body == b"twelve bytes"
    assert (read.sent, read.closes) == (b"POST /x HTTP/1.1\r\ncontent-length: 12", True)
    assert read_head(head, "") is None, "its body is still coming"


def test_heads_the_passthrough_leaves_to_the_router_read_as_none() -> None:
    for head in (
        b"HEAD / HTTP/1.1\r\nhost: t",
        b"get / HTTP/1.1\r\nhost: t",
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


def test_keep_alive_and_close_lines_all_go_and_the_close_is_kept_in_mind() -> None:
    read = read_head(
        b"GET / HTTP/1.1\r\nconnection: keep-alive\r\nConnection:\tKEEP-ALIVE \r\n"
        b"Connection: Close\r\nhost: t",
        "",
    )
    assert read is not None
    assert (read.sent, read.closes) == (b"GET / HTTP/1.1\r\nhost: t", True)
    kept = read_head(b"GET / HTTP/1.1\r\nconnection: keep-alive\r\nhost: t", "")
    assert kept is not None and not kept.closes


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


def test_a_reader_reads_again_after_a_refused_partial_or_doubled_request() -> None:
    reader = HeadReader(None)
    good = b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n"
    for bad in (
        b"GET / HTTP/1.1\r\nbad name : x\r\n\r\n",
        b"POST / HTTP/1.1\r\ncontent-length: 5\r\n\r\nab",  # its body is still coming
        good + good,  # pipelined
        good + good[:10],
        b"GET / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",  # no keep-alive: the parser takes nothing after it
    ):
        assert reader.read(bad, "") is None, bad
        read = reader.read(good, "")
        assert read is not None, bad
        assert (read.scope["path"], read.sent) == ("/a", good[:-4])


def test_a_head_read_again_reads_the_same_and_its_body_must_still_be_whole() -> None:
    reader = HeadReader(None)
    head = b"POST /x?y=1 HTTP/1.1\r\nconnection: keep-alive\r\ncookie: s=1\r\ncontent-length: 3"
    first = reader.read(head + b"\r\n\r\nabc", "/r")
    again = reader.read(head + b"\r\n\r\nxyz", "/r")
    assert first is not None and again is not None
    assert again.scope is not first.scope, "a scope of its own"
    assert (again.scope["path"], list(again.scope["headers"]), again.sent, again.body) == (
        first.scope["path"], first.scope["headers"], first.sent, b"xyz"
    )
    assert reader.read(head + b"\r\n\r\nab", "/r") is None, "a body still coming"
    assert reader.read(head + b"\r\n\r\nabc" + b"GET / HTTP/1.1\r\n\r\n", "/r") is None
    other = reader.read(head + b"\r\n\r\nabc", "")
    assert other is not None and other.scope["path"] == "/x", "another root path"


def test_a_request_that_closes_its_connection_is_read_and_so_is_the_next() -> None:
    reader = HeadReader(None)
    closing = reader.read(b"GET /c HTTP/1.1\r\nconnection: close\r\n\r\n", "")
    assert closing is not None and (closing.sent, closing.closes) == (b"GET /c HTTP/1.1", True)
    again = reader.read(b"GET /c HTTP/1.1\r\nconnection: close\r\n\r\n", "")
    assert again is not None and again.closes, "a remembered head closes too"
    after = reader.read(b"GET /d HTTP/1.1\r\nhost: t\r\n\r\n", "")
    assert after is not None and after.scope["path"] == "/d" and not after.closes


def test_a_remembered_heads_cookie_is_checked_again_and_stops_naming_it_once_expired() -> None:
    kind = SessionKind(cookie=CookieCodec(secret="s3cret", max_age=1))
    assert kind.cookie is not None
    reader = HeadReader(kind)
    value = kind.cookie.encode({"session_id": "abc"})
    data = f"GET /x HTTP/1.1\r\ncookie: session={value}\r\n\r\n".encode()
    first, again = reader.read(data, ""), reader.read(data, "")
    assert first is not None and again is not None
    assert first.scope[FOUND_KEY].session_id == again.scope[FOUND_KEY].session_id == "abc"
    assert again.scope[FOUND_KEY] is not first.scope[FOUND_KEY], "a reading of its own"
    time.sleep(2.1)  # past the cookie's max_age (whole seconds)
    late = reader.read(data, "")
    assert late is not None and late.scope[FOUND_KEY].session_id is None


def test_a_reader_remembers_at_most_its_byte_budget_of_heads() -> None:
    reader = HeadReader(None)
    filler = b"x" * 60_000
    for index in range(200):  # 12 MB of distinct heads
        data = b"GET /%d HTTP/1.1\r\nx-big: %s\r\n\r\n" % (index, filler)
        assert reader.read(data, "") is not None
        assert sum(len(head) for head in reader._known) <= front_module.HEAD_BYTES_REMEMBERED


@pytest.mark.parametrize("with_cookie", [False, True])
def test_a_head_whose_id_the_apps_own_reader_gives_is_read_by_it_every_time(
    with_cookie: bool,
) -> None:
    """Never remembered, a cookie's reading beside it included."""
    calls: list[str] = []

    def reader_of(value: str) -> str:
        calls.append(value)
        return f"id-{len(calls)}"  # (an app's reader may answer differently each time)

    codec = CookieCodec(secret="s3cret")
    reader = HeadReader(SessionKind(header="x-session", header_reader=reader_of, cookie=codec))
    cookie = f"cookie: session={codec.encode({'session_id': 'c'})}\r\n" if with_cookie else ""
    data = f"GET / HTTP/1.1\r\nx-session: v\r\n{cookie}\r\n".encode()
    first, again = reader.read(data, ""), reader.read(data, "")
    assert first is not None and again is not None
    assert (first.scope[FOUND_KEY].session_id, again.scope[FOUND_KEY].session_id) == (
        "id-1", "id-2"
    )
