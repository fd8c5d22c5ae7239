"""What the passthrough reads of a request head (routing/front.py)."""

from __future__ import annotations

from tether.routing.front import head_scope


def test_a_plain_head_gives_method_paths_query_and_lowercased_headers() -> None:
    scope = head_scope(
        b"GET /a%20b/c?x=1&y=2 HTTP/1.1\r\nHost: tether\r\nCookie:  session=abc \r\nX-Y: z",
        "/api",
    )
    assert scope is not None
    assert scope["method"] == "GET"
    assert scope["path"] == "/api/a b/c"
    assert scope["raw_path"] == b"/a%20b/c"
    assert scope["root_path"] == "/api"
    assert scope["query_string"] == b"x=1&y=2"
    assert scope["headers"] == [(b"host", b"tether"), (b"cookie", b"session=abc"), (b"x-y", b"z")]


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
    ):
        assert head_scope(head, "") is None, head
