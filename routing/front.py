"""The public port's HTTP protocol: uvicorn's httptools protocol with a passthrough in
front of it for requests another worker holds the session of.

Each request that starts on an idle connection is offered to `Passthrough.start` first.
When its head shows another live worker holds its session (the router's
`passthrough_target`; on a cluster `passthrough_located`, below) and the request is a
plain one, its bytes go to that worker's private socket (on a cluster, perhaps its hop
listener) as they came, with the hop header (hop.py) added, and the reply's bytes
come back as they came, with this server's `date` and `server` headers added; the reply
is parsed only to see where it ends. No ASGI scope, task or message is made for it here;
this worker writes its access line once the reply has ended (SPEC 4.5). The request is
read by `HeadReader` with httptools, the holder's own parser, and what each head read as
is remembered.

Everything else goes to uvicorn's protocol and the router as before, which forwards by
copying what it must (forward.py): a request with no session, or this worker's; a head
or body that did not come in one read, or one that arrives while uvicorn's parser is
inside another request; a body of unknown length; an upgrade
(WebSocket), `expect`, hop-by-hop headers (but `connection: keep-alive` and
`connection: close`, which are left out: the link stays open, and a client that said
close has it in the reply and its connection closed after it) or `forwarded`; a method
other than GET, POST, PUT, PATCH, DELETE and OPTIONS; over `--limit-concurrency`; and one
whose holder's socket does not take it at once. A request whose link fails before the
reply's first byte is given to uvicorn's protocol too, with the bytes it came with, so
the forwarder's retry and its 410 and 503 rules answer it.
The head is read here only to pick the worker; the holder parses it again and decides
by itself (SPEC 4.2: what arrives on a private socket is served there). A request left to
this worker's own router takes along what `find` made of its head (`FOUND_KEY`), so the
router does not read its session from the head a second time.

On a cluster, where a session's holder is known only once Redis answers, a request for
a session not held here waits for the router's lookup (`Router.passthrough_located`), the
connection still read meanwhile (so that a client that leaves ends the wait), and then
goes on as on one host; what the lookup found goes with a request left to the router
(`Found.located`), so that it is not looked up twice. A holder on another host is
reached the same way on a kept-alive TCP link to its hop listener, connected in that
wait if none is kept (`Links.connect`); the request is signed there (hopsign.py), and
its connection never moves.

A connection's first request is not spliced but handed off when it can be (handoff.py):
the connection itself moves to the holder, whose `FrontProtocol` then serves it as if it
had accepted it (`hand_in`), its first request as a forwarded one, and any later request
of it as its own (a session held elsewhere takes the passthrough from there). A handoff
that does not go through at once leaves the request to the passthrough.

A request with `x-forwarded-for` or `x-forwarded-proto` (every request, behind a reverse
proxy) takes the passthrough too: its hop header names the caller uvicorn's own
`ProxyHeadersMiddleware`, with this server's `--forwarded-allow-ips`, makes of that head,
as the copying path's hop header names the caller of the scope the middleware corrected.

It replaces the public server's protocol only where it can: httptools (uvicorn's
default), no TLS (`--ssl-*`) and no HTTP/2, and a process that does not trace (a traced
hop keeps its `tether forward` span, SPEC 9).
"""

from __future__ import annotations

import asyncio
import http
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools
import structlog
import uvicorn
from starlette.types import Message, Scope
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tether.routing.at_once import ran_at_once
from tether.routing.errors import TetherError
from tether.routing.forward import ClaimantGone, ClaimantUnavailable
from tether.routing.handoff import Handoffs
from tether.routing.hop import HOP_HEADER, hop_value, signed_hop_value
from tether.routing.kinds import ANY_KIND_SLOTS, SessionKind
from tether.routing.router import FOUND_KEY, HANDED_KEY, SCOPE_KEY, Router, session_gone
from tether.routing.sources import Found, find
from tether.routing.splice import Link, Links
from tether.routing.types import LATER, WorkerId
from tether.routing.writes import JoinedWrites

log = structlog.get_logger("tether.front")

__all__ = ["MOVING", "HeadReader", "Passthrough", "fits", "front_protocol"]

PASSTHROUGH_MAX = 1 << 16
"""The largest request (head and body, in one read) that takes the passthrough."""
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""What the passthrough takes (not HEAD, whose reply has no body, nor CONNECT)."""
_SPACES = b" \t"
_NOT_PASSED = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"expect", HOP_HEADER, b"forwarded",
})
"""Headers that send a request the router's way: hop-by-hop ones, `expect` (uvicorn
answers it), a client's hop header (the router strips it) and `forwarded` (which uvicorn
does not read, and a later version might)."""
_PROXIED = frozenset({b"x-forwarded-for", b"x-forwarded-proto"})
"""The proxy headers uvicorn's `ProxyHeadersMiddleware` reads to correct the caller."""


class HeadReader:
    """Reads requests for one kind of session, as far as the passthrough needs them: the
    parts of an ASGI scope a routing decision reads, keeping of the headers only those
    `sources.find` reads for the kind and those the passthrough's own rules read.

    The request is parsed by httptools, the parser the holder's uvicorn reads it with, so
    the two read it alike: a request it refuses (a header line with no colon, a name with a
    space in it, obsolete line folding) is left to this worker's uvicorn, which answers
    400 as the holder would."""

    def __init__(self, kind: SessionKind | None) -> None:
        self._kind = kind
        slots = kind.header_slots if kind is not None else ANY_KIND_SLOTS
        self._wanted = frozenset({*slots, *_NOT_PASSED, *_PROXIED})
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._begun = 0
        self._complete = False
        self._known: dict[bytes, _Known] = {}
        self._known_bytes = 0

    def on_message_begin(self) -> None:
        self._begun += 1

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self._wanted:
            self._headers.append((name, value))

    def on_message_complete(self) -> None:
        self._complete = True

    def scope(self, data: bytes, root_path: str) -> Scope | None:
        """The scope of the HTTP/1.1 request `data` holds whole (head and body), its
        `headers` those kept here (names lowercased); None for one the parser refuses or
        does not see the end of, and for HTTP/1.0 or a target that is not a path."""
        self._url, self._headers, self._begun, self._complete = b"", [], 0, False
        parser = self._parser
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._parser = httptools.HttpRequestParser(self)
            return None
        if self._begun != 1 or not self._complete:  # a body still coming, or a second
            self._parser = httptools.HttpRequestParser(self)  # request: left to uvicorn
            return None
        version = parser.get_http_version()
        if version != "1.1" or any(name == b"connection" for name, _ in self._headers):
            # It may close its connection, and the parser would refuse the next request.
            self._parser = httptools.HttpRequestParser(self)
        url = self._url
        if version != "1.1" or not url.startswith(b"/") or b"#" in url:
            return None  # (uvicorn drops a fragment: the holder reads another path)
        raw_path, _, query = url.partition(b"?")
        try:
            path = raw_path.decode("ascii")
        except UnicodeDecodeError:
            return None
        return {
            "type": "http",
            "method": parser.get_method().decode("ascii"),
            "path": root_path + (unquote(path) if "%" in path else path),
            "raw_path": raw_path,
            "root_path": root_path,
            "query_string": query,
            "headers": self._headers,
        }

    def read(self, data: bytes, root_path: str) -> _Head | None:
        """The one whole request `data` holds, its head (without its closing blank line)
        as the passthrough sends it on; None for one it does not take (see the module's
        docstring), and for data holding more than one request.

        The scope carries what `find` made of it (`FOUND_KEY`). What a head reads as is
        remembered (a session's requests repeat one head): it depends on the head's bytes
        alone, but for a cookie's signature check, which is made again as often as
        `CookieCodec.read` says; a request whose body is not as long as its head
        declares is parsed whole again. One whose body is as long but that blank lines
        follow, which the parser skips, is not taken: remembered, its length would be
        off by theirs."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = data[:end]
        known = self._known.get(head)
        if (
            known is not None and known.root_path == root_path
            and len(data) - end - 4 == known.length
        ):
            scope = known.scope()
            if known.found.until <= time.monotonic():
                known.found = find(self._kind, scope)
            scope[FOUND_KEY] = known.found.copy()
            return _Head(scope, data[end + 4 :], known.sent, known.proxied, known.closes)
        read = self._read(data, end, root_path)
        if read is None:
            return None
        found = find(self._kind, read.scope)
        if len(read.body) != (found.content_length or 0):
            return None  # blank lines after it, which the parser skips: left to uvicorn
        self._known_bytes += len(head)
        if len(self._known) >= HEADS_REMEMBERED or self._known_bytes > HEAD_BYTES_REMEMBERED:
            self._known.clear()
            self._known_bytes = len(head)
        self._known[head] = _Known(read, root_path, len(read.body), found)
        read.scope[FOUND_KEY] = found.copy()
        return read

    def _read(self, data: bytes, end: int, root_path: str) -> _Head | None:
        scope = self.scope(data, root_path)
        if scope is None or scope["method"] not in _METHODS:
            return None
        head = data[:end]
        line_end = head.find(b"\r\n")
        line = head if line_end < 0 else head[:line_end]
        if line != b"%s %s HTTP/1.1" % (scope["method"].encode("ascii"), self._url):
            return None  # (spaces the parser let pass: the line is sent on as it came)
        said_connection = proxied = closes = False
        for name, value in scope["headers"]:
            if name in _PROXIED:
                proxied = True
            elif name in _NOT_PASSED:
                if name != b"connection":
                    return None
                token = value.strip(_SPACES).lower()
                if token == b"close":  # this worker closes the client's connection
                    closes = True
                elif token != b"keep-alive":  # (what HTTP/1.1 means anyway)
                    return None
                said_connection = True
        if said_connection:
            head = _without_connection(head)
        if root_path:  # the target as uvicorn gives it the router: `--root-path` in front
            method, _, rest = head.partition(b" ")
            head = b"%s %s%s" % (method, root_path.encode("ascii"), rest)
        return _Head(scope, data[end + 4 :], head, proxied, closes)


HEADS_REMEMBERED = 4096
HEAD_BYTES_REMEMBERED = 4 << 20
"""How many request heads, and how many of their bytes, a `HeadReader` remembers the
reading of (4,096 heads of up to 64 KiB would be 256 MiB)."""


class _Known:
    """What a head read as, for its next request: the scope's parts a routing decision
    reads (not changed by it: each request gets a scope of its own), what `find` read of
    them, what is sent on, and its body's length."""

    __slots__ = ("closes", "found", "length", "parts", "proxied", "root_path", "sent")

    def __init__(self, read: _Head, root_path: str, length: int, found: Found) -> None:
        self.parts = {**read.scope, "headers": tuple(read.scope["headers"])}
        self.found = found
        """What `find` read of it, read again once it no longer holds (`Found.until`)."""
        self.sent = read.sent
        self.proxied = read.proxied
        self.closes = read.closes
        self.root_path = root_path
        self.length = length

    def scope(self) -> Scope:
        return dict(self.parts)


_CONNECTION_LINE = re.compile(
    rb"\r\nconnection:[ \t]*(?:keep-alive|close)[ \t]*(?=\r\n|$)", re.IGNORECASE
)


def _without_connection(head: bytes) -> bytes:
    """A request head without its `connection: keep-alive` and `connection: close`
    lines: hop-by-hop, so not forwarded (SPEC 4.5), as the copying path leaves them out
    too. The link then stays open whatever the client said of its own connection."""
    return _CONNECTION_LINE.sub(b"", head)


def _signed_target(sent: bytes) -> str:
    """The request target a hop listener's check reads (`hopsign.request_target`) of the
    head `sent` (`method SP target SP HTTP/1.1`, as `HeadReader` takes it, sent on as
    it is): the path, and `?` and the query when there is one."""
    line_end = sent.find(b"\r\n")
    line = sent if line_end < 0 else sent[:line_end]
    target = line[line.index(b" ") + 1 : -len(b" HTTP/1.1")]
    path, _, query = target.partition(b"?")
    return (path + b"?" + query if query else path).decode("latin-1")


class _HeaderLines:
    """uvicorn's default headers (`date`, `server`) as header lines; uvicorn replaces
    their list once a second, and the lines are made again only then."""

    def __init__(self) -> None:
        self._of: list[tuple[bytes, bytes]] | None = None
        self._lines = b""

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        if headers is not self._of:
            self._lines = b"".join(b"%s: %s\r\n" % pair for pair in headers)
            self._of = headers
        return self._lines


_header_lines = _HeaderLines()


class _Head:
    """What the passthrough reads of a request it may take: the scope a routing decision
    reads, the head to send on and the body after it."""

    __slots__ = ("body", "closes", "proxied", "scope", "sent")

    def __init__(
        self, scope: Scope, body: bytes, sent: bytes, proxied: bool, closes: bool
    ) -> None:
        self.scope = scope
        self.body = body
        self.sent = sent
        self.proxied = proxied
        """It names a proxy's caller (`_PROXIED`)."""
        self.closes = closes
        """It said `connection: close` (not sent on): its connection closes after it."""


class _ProxyHeaders:
    """uvicorn's `ProxyHeadersMiddleware`, asked which caller it would give the app for a
    request, so that a passed-through request's hop header names the caller a copied
    one's does."""

    def __init__(self, trusted_hosts: list[str] | str) -> None:
        self._seen: Scope | None = None
        self._middleware = ProxyHeadersMiddleware(self._see, trusted_hosts)  # type: ignore[arg-type]

    async def _see(self, scope: Scope, receive: Any, send: Any) -> None:
        self._seen = scope

    def caller(self, scope: Scope) -> Scope | None:
        """`scope` as the middleware passes it on; None if it did not at once (it has
        always done so: it reads only the scope)."""
        self._seen = None
        if ran_at_once(self._middleware(scope, _never, _never)):  # type: ignore[arg-type]
            return self._seen
        return None


async def _never(*_: Any) -> Any:
    raise RuntimeError("the proxy headers middleware is asked only about a scope")


class _Spliced:
    """One request on the passthrough: its link, its bytes (for the copying path, should
    the link fail before it could have been read), and what its access line and
    `tether_forward_seconds` need."""

    __slots__ = (
        "closes", "data", "found", "front", "link", "method", "path", "sent", "session_id",
        "started", "target",
    )

    def __init__(
        self, front: Any, link: Link, data: bytes, scope: Scope, target: WorkerId,
        started: float, closes: bool,
    ) -> None:
        self.front = front
        self.link = link
        self.data = data
        self.closes = closes
        """The client said `connection: close`, which the holder was not sent: the reply
        says it, and the client's connection closes after it (the link stays open)."""
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.session_id: str | None = scope.get(SCOPE_KEY)
        self.found: Found | None = scope.get(FOUND_KEY)
        """What the passthrough read of it, for the copying way should it be sent again."""
        self.target = target
        self.started = started
        self.sent = False

    def reply(self, data: bytes, link: Link) -> None:
        front = self.front
        if not self.sent:
            self.sent = True
            end = data.find(b"\r\n") + 2  # after the status line (uvicorn writes it whole)
            if end > 1:
                lines = _header_lines(front.server_state.default_headers)
                # Said where the final reply's head came whole and first (not after an
                # interim 1xx) and the holder keeps the link; else the close goes unsaid.
                if self.closes and link.keep_alive and data[9:10] != b"1":
                    lines += b"connection: close\r\n"
                data = data[:end] + lines + data[end:]
        front.raw_transport.write(data)
        if link.complete:
            front.spliced(self, link.keep_alive)

    def lost(self, link: Link) -> None:
        self.front.splice_lost(self)


class _Moving:
    """What `Passthrough.start` returns for a connection it is handing to the holder
    (handoff.py), or whose request waits for the claim store to name its session's
    holder: the connection holds its request for the answer (`moved` or `kept`, not read
    meanwhile; `looked_up`, read on)."""


MOVING = _Moving()
LOOKING = _Moving()


class Passthrough:
    """Decides which requests take the passthrough (or move their connection), and starts
    them on it."""

    def __init__(
        self,
        router: Router,
        path_of: Callable[[WorkerId], str],
        handoff_of: Callable[[str], str] | None = None,
    ) -> None:
        """`path_of`: a worker's private socket; `handoff_of`: its handoff socket (None:
        connections are never handed off)."""
        self.router = router
        self.path_of = path_of
        self._paths: dict[WorkerId, str] = {}
        self.links = Links()
        self.handoffs = None if handoff_of is None else Handoffs(handoff_of)
        self.heads = HeadReader(router.kind)
        self.closed = False
        self._lookups: set[asyncio.Task[None]] = set()

    def start(
        self, front: Any, data: bytes, first: bool = False
    ) -> _Spliced | _Moving | Found | None:
        """Send the request `data` holds whole to its session's holder, if it may take
        the passthrough (or, as the connection's `first` request, hand the connection to
        it: MOVING, and `front` is told how that ended). Otherwise nothing is sent: a
        request its holder's worker serves here gives what its head says of its
        session, for the router (`FOUND_KEY`); any other gives None. LOOKING: only the
        claim store can name the holder (a cluster's), and `front.looked_up` is told
        what came of the request once it has (its task is `front.looking`)."""
        started = time.perf_counter()
        if len(data) > PASSTHROUGH_MAX:
            return None
        read = self.heads.read(data, front.root_path)
        if read is None:
            return None
        limit = front.limit_concurrency
        if limit is not None and (len(front.connections) >= limit or len(front.tasks) >= limit):
            return None  # uvicorn's protocol answers it 503
        router = self.router
        scope = read.scope
        target = router.passthrough_target(scope)
        if target is None:
            found: Found | None = scope.get(FOUND_KEY)
            return found
        if target is LATER:
            if self.closed:
                return None
            task = asyncio.get_running_loop().create_task(
                self._look_up(front, data, read, first, started), name="tether-passthrough"
            )
            self._lookups.add(task)
            task.add_done_callback(lambda task: self._looked(task, front, read, started))
            front.looking = task
            return LOOKING
        return self._send(front, data, read, target, first, started)

    async def _look_up(
        self, front: Any, data: bytes, read: _Head, first: bool, started: float
    ) -> None:
        """Wait for the claim store to name the request's holder (and, for a worker of
        another host with no link kept to it, for a link to connect), then send the
        request on as `start` would have; `front` is told what came of it (cancelled by
        the client leaving, or by `close`: see `_looked`)."""
        sent: _Spliced | _Moving | None = None
        found: Found = read.scope[FOUND_KEY]
        remote = None
        try:
            target = await self.router.passthrough_located(read.scope)
            if target is not None:
                address = self.router.tables.addresses.get(target)
                if address is not None:
                    remote = await self._remote(address, target, read, found)
                    if remote is None:
                        target = None
            if front.raw_transport.is_closing():
                if remote is not None:
                    self.links.put(remote[0])
                front.looking = None
                return
            if target is not None:
                # Bytes read meanwhile are this worker's: the connection no longer moves.
                sent = self._send(front, data, read, target, first and not front.read_on,
                                  started, remote)
        except Exception:  # (as in `start`): the router's way answers it
            log.exception("passthrough_failed")
            if remote is not None and sent is None:
                remote[0].close()
        front.looking = None
        front.looked_up(sent, found, started)

    def _looked(self, task: asyncio.Task[None], front: Any, read: _Head, started: float) -> None:
        """A lookup's task ended. One `close` cancelled, begun or not, leaves its request
        to `front` to answer (503: nothing serves it now); one the client's leaving
        cancelled has nothing to answer on (the connection no longer waits for it)."""
        self._lookups.discard(task)
        if task.cancelled() and front.looking is task:
            front.looking = None
            if self.closed:
                front.looked_up(None, read.scope[FOUND_KEY], started)
            else:  # (the loop itself is torn down: nothing serves it)
                front.raw_transport.abort()

    async def _remote(
        self, address: str, target: WorkerId, read: _Head, found: Found
    ) -> tuple[Link, str] | None:
        """A link to another host's hop listener for `read` (a kept one, else a new
        one), and the request's signature for it (hopsign.py). None leaves the request to
        the router: one this worker cannot sign (it has no hop secret), one to a worker
        found dead while
        its link connected (the router answers 410), or one whose link did not connect
        (the error then goes into `found.located`, which the router answers as its
        forwarder would have, without trying to connect again)."""
        forwarder = self.router.forwarder
        signer = None if forwarder is None else forwarder.signer
        if forwarder is None or signer is None:
            return None
        link = self.links.idle(address)
        try:
            if link is None:
                async with asyncio.timeout(forwarder.connect_timeout):
                    link = await self.links.connect(address)
        except ClaimantGone:
            return None
        except (ClaimantUnavailable, TimeoutError) as error:
            reason = str(error) if isinstance(error, ClaimantUnavailable) else (
                f"cannot connect to {address}: {error!r}"
            )
            located = found.located
            if located is not None:
                found.located = (located[0], TetherError("claimant_unavailable", reason))
            return None
        return link, signer(read.scope["method"], _signed_target(read.sent), target)

    def _send(
        self, front: Any, data: bytes, read: _Head, target: WorkerId, first: bool,
        started: float, remote: tuple[Link, str] | None = None,
    ) -> _Spliced | _Moving | None:
        """`start`'s sending, once the holder is known: a move, the request spliced, or
        None if neither could begin at once. `remote`: the link to the hop listener of
        `target`, a worker of another host, and the request's signature (`_remote`); its
        connection never moves."""
        router = self.router
        scope = read.scope
        if remote is None and first and self.handoffs is not None and self.handoffs.send(
            target, front.raw_transport.get_extra_info("socket").fileno(), data, front
        ):
            router.stats.forwarded += 1
            router.stats.handed_off += 1
            front.moving_found = scope[FOUND_KEY]  # (for the copying way, if refused)
            return MOVING
        hop = front.hop_value(scope if read.proxied else None)
        if hop is None:
            if remote is not None:
                self.links.put(remote[0])
            return None
        link: Link | None
        if remote is not None:
            link, signature = remote
            hop = signed_hop_value(signature, hop)
        else:
            path = self._paths.get(target)
            if path is None:
                path = self._paths[target] = self.path_of(target)
            link = self.links.get(path)
            if link is None:
                return None
        request = b"%s\r\n%s: %s\r\n\r\n%s" % (read.sent, HOP_HEADER, hop, read.body)
        spliced = _Spliced(front, link, data, scope, target, started, read.closes)
        if not link.send(request, spliced):
            return None
        router.stats.forwarded += 1
        router.stats.passed_through += 1
        return spliced

    def finished(self, spliced: _Spliced, status: int, kept: bool) -> None:
        """A request whose reply ended (or was cut, `status` 0): time it, log it, and
        keep its link if it may be reused."""
        router = self.router
        elapsed = time.perf_counter() - spliced.started
        router.stats.observe_forward(elapsed)
        link = spliced.link
        if kept and not link.closed and not link.unsent:
            link.resume()  # (paused while the client was slow to read)
            self.links.put(link)
        else:
            link.close()
        if router.access_log:
            router.log_request(spliced.method, spliced.path, status, spliced.session_id, elapsed)

    def kept(self) -> None:
        """A move its holder did not take: the copying path serves it, and counts it."""
        self.router.stats.forwarded -= 1
        self.router.stats.handed_off -= 1

    def retry(self, spliced: _Spliced) -> bool:
        """Whether a request whose link failed before its reply began may be sent again
        (the copying path then takes it, and counts it): only if the link was a kept-alive
        one that answered nothing, which the holder closed before reading it (SPEC 4.5)."""
        link = spliced.link
        link.close()
        if not link.reused or link.got_bytes:
            return False
        self.router.stats.forwarded -= 1
        self.router.stats.passed_through -= 1
        return True

    def refusal(self, spliced: _Spliced, default_headers: list[tuple[bytes, bytes]]) -> bytes:
        """The reply to a request whose link failed with it unanswered, as the copying
        path would answer it: 410 if its holder is known dead now, else 503."""
        router = self.router
        if router.tables.is_live(spliced.target):
            error = TetherError(
                "claimant_unavailable", f"the claimant {spliced.target} closed the connection"
            )
        else:
            error = session_gone(spliced.session_id)  # type: ignore[arg-type]
        return encode_reply(router.refusal(error), default_headers)

    def stopping(
        self, data: bytes, found: Found | None, since: float, front: Any
    ) -> bytes:
        """The reply to the request `data` holds, which waited since `since` and which
        this worker can no longer serve (it has stopped): 503, its access line written."""
        router = self.router
        error = TetherError("claimant_unavailable", f"the worker {router.worker} stopped")
        reply = encode_reply(router.refusal(error), front.server_state.default_headers)
        if router.access_log:
            method, _, rest = data.partition(b" ")
            target, _, _ = rest.partition(b" ")
            path = unquote(target.partition(b"?")[0].decode("latin-1"))
            router.log_request(
                method.decode("latin-1"), front.root_path + path, 503,
                None if found is None else found.session_id, time.perf_counter() - since,
            )
        return reply

    def close(self) -> None:
        """Once the public server's connections are closed: stop the lookups still
        waiting, close the links, then the handoff channels (a move still unanswered is
        answered 503 from here)."""
        self.closed = True
        for task in self._lookups:
            task.cancel()
        self.links.close()
        if self.handoffs is not None:
            self.handoffs.close()


def encode_reply(messages: list[Message], default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP/1.1 reply from ASGI messages whose start names its content-length."""
    start, *bodies = messages
    status: int = start["status"]
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())]
    lines += [b"%s: %s\r\n" % pair for pair in (*default_headers, *start["headers"])]
    return b"".join([*lines, b"\r\n", *(m.get("body", b"") for m in bodies)])


def fits(config: uvicorn.Config) -> bool:
    """Whether the public server's settings let `front_protocol` replace its protocol:
    httptools, chosen or by `auto`, and no TLS or HTTP/2."""
    if config.is_ssl or getattr(config, "http2", False):
        return False
    if config.http == "httptools":
        return True
    if config.http != "auto":
        return False
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol is HttpToolsProtocol


def front_protocol(passthrough: Passthrough) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol that offers each request that starts on an idle
    connection, between two messages, to `passthrough` first."""

    class FrontProtocol(HttpToolsProtocol):
        proxy_headers: _ProxyHeaders | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._spliced: _Spliced | None = None
            self._in_message = False
            """uvicorn's parser is inside a request (a head or body it has not all of)."""
            self._held: list[bytes] = []
            self._held_size = 0
            self._paused = False
            self._hop: bytes | None = None
            self._closing = False
            self._first = True
            """No request has started on this connection yet."""
            self._handed_in: bytes | None = None
            self._mark_handed = False
            self._found: Found | None = None
            """What the passthrough read of the request uvicorn's parser is given next."""
            self._moving: bytes | None = None
            """The request of this connection while it is being moved (handoff.py), or
            while the claim store is asked who holds its session."""
            self.looking: asyncio.Task[None] | None = None
            """The lookup of `_moving`'s holder, while it runs (`Passthrough.start`); the
            connection is read meanwhile, so that a client that leaves cancels it."""
            self._moving_since = 0.0
            """When `_moving` began to wait (for its access line, should it be refused)."""
            self.moving_found: Found | None = None
            """What the passthrough read of a request whose connection it is moving
            (and what the lookup found, on a cluster), for the copying way and the
            access line should the move be refused."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.raw_transport = transport
            """The client's own transport: a spliced reply's bytes come in pieces worth
            writing at once."""
            super().connection_made(JoinedWrites(transport, self.loop))
            data, self._handed_in = self._handed_in, None
            if data is not None:  # served here, as forwarded requests are (SPEC 4.2)
                self._mark_handed = True
                super().data_received(data)

        def hand_in(self, data: bytes) -> None:
            """Serve a connection another worker accepted and handed here (handoff.py),
            whose first request `data` holds."""
            self._handed_in = data
            self._first = False  # (a connection moves once)

        def hop_value(self, proxied: Scope | None = None) -> bytes | None:
            """The hop header's value (hop.py) for this connection's caller, or for the
            caller a request whose head named a proxy's (`proxied`, its scope) has, as
            `--proxy-headers` corrects it; None if that is not known at once."""
            if proxied is not None and self.config.proxy_headers:
                proxy_headers = FrontProtocol.proxy_headers
                if proxy_headers is None:  # (one server's config per process)
                    proxy_headers = FrontProtocol.proxy_headers = _ProxyHeaders(
                        self.config.forwarded_allow_ips
                    )
                caller = proxy_headers.caller({
                    "type": "http", "client": self.client, "scheme": self.scheme,
                    "headers": proxied["headers"],
                })
                if caller is None:
                    return None
                return hop_value({**caller, "server": self.server, "root_path": self.root_path})
            if self._hop is None:
                self._hop = hop_value({
                    "client": self.client, "server": self.server,
                    "scheme": self.scheme, "root_path": self.root_path,
                })
            return self._hop

        def on_message_begin(self) -> None:
            self._in_message = True
            super().on_message_begin()
            if self._mark_handed:
                self._mark_handed = False
                self.scope[HANDED_KEY] = True  # type: ignore[literal-required]
            if self._found is not None:
                self.scope[FOUND_KEY] = self._found  # type: ignore[literal-required]
                self._found = None

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_message = False

        def data_received(self, data: bytes) -> None:
            first, self._first = self._first, False
            if self._spliced is not None or self._moving is not None:
                self._held.append(data)  # pipelined behind the spliced request
                self._held_size += len(data)
                if self._held_size > PASSTHROUGH_MAX:
                    self.transport.pause_reading()
                    self._paused = True
                return
            cycle = self.cycle
            if (
                not self._in_message
                and (cycle is None or cycle.response_complete)
                and not self.pipeline
                and not self.flow.write_paused
            ):
                try:
                    spliced = passthrough.start(self, data, first)
                except Exception:  # (out of file descriptors, say): uvicorn's way answers
                    log.exception("passthrough_failed")
                    spliced = None
                if isinstance(spliced, Found):
                    self._parse(data, spliced)
                    return
                if isinstance(spliced, _Moving):
                    self._moving = data
                    self._moving_since = time.perf_counter()
                    if spliced is MOVING:
                        self.raw_transport.pause_reading()  # (the holder may read it already)
                    self._unset_keepalive_if_required()  # (the wait is no idle time)
                    return
                if spliced is not None:
                    self._unset_keepalive_if_required()
                    self._spliced = spliced
                    return
            super().data_received(data)

        def _parse(self, data: bytes, found: Found | None) -> None:
            """Give `data` to uvicorn's parser, the router taking `found` (what the
            passthrough read of it) along with the request whose message begins first."""
            self._found = found  # (its message begins within this call)
            try:
                super().data_received(data)
            finally:
                self._found = None

        def moved(self) -> None:
            """The holder took this connection (handoff.py)."""
            self.moving_found = None
            if self._moving is not None:
                self._moving = None
                self.raw_transport.abort()  # our descriptor only: the holder has its own

        def kept(self) -> None:
            """The holder did not take this connection: its request is served from here,
            the copying way (its 410 and 503 rules answer it if the holder is gone)."""
            found, self.moving_found = self.moving_found, None
            if self._moving is not None:
                passthrough.kept()
                self._serve_held(found)

        @property
        def read_on(self) -> bool:
            """Bytes of a later request came while this connection's request waited."""
            return bool(self._held)

        def looked_up(
            self, sent: _Spliced | _Moving | None, found: Found, started: float
        ) -> None:
            """The claim store was asked, since `started`, who holds the session of the
            request this connection waits with: the request was spliced, or its
            connection is moving, or (None) it is served from here, the router going by
            what the passthrough read of it (`found`, the holder included)."""
            found.since = started
            if isinstance(sent, _Spliced):
                self._moving = None
                self._spliced = sent
            elif sent is None:
                self._serve_held(found)
            else:  # moving: it waits on, not read, for `moved` or `kept`
                self.raw_transport.pause_reading()
                self.moving_found = found

        def _serve_held(self, found: Found | None) -> None:
            """Serve the request this connection waited with (`_moving`) the way of a
            request the passthrough does not take."""
            data, self._moving = self._moving, None
            if data is None or self.raw_transport.is_closing():  # (nothing to answer on)
                return
            if passthrough.closed:  # this worker has stopped serving: nothing serves it
                since = self._moving_since if found is None or found.since is None else (
                    found.since
                )
                self.raw_transport.write(passthrough.stopping(data, found, since, self))
                self.raw_transport.close()
                return
            self.raw_transport.resume_reading()
            self._parse(data + self._take_held(), found)
            if self._closing:
                super().shutdown()

        def spliced(self, spliced: _Spliced, keep_alive: bool) -> None:
            """The spliced request's reply is complete; `keep_alive`: the holder keeps the
            link open."""
            self._spliced = None
            passthrough.finished(spliced, spliced.link.status, keep_alive)
            self._next(keep_alive and not spliced.closes)

        def _next(self, keep_alive: bool) -> None:
            """After a reply this protocol wrote: close, or wait for the next request."""
            self.server_state.total_requests += 1
            if not keep_alive or self._closing:
                self.transport.close()
                return
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            if self._held:
                self.data_received(self._take_held())

        def _take_held(self) -> bytes:
            held, self._held, self._held_size = b"".join(self._held), [], 0
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            return held

        def splice_lost(self, spliced: _Spliced) -> None:
            """The link failed. After the reply began, the client connection is cut (as
            forward.py does); before, the request is sent again the copying way if it
            cannot have been read, else answered 410 or 503 as copying would."""
            self._spliced = None
            if spliced.sent:
                passthrough.finished(spliced, 0, False)
                self.transport.abort()
                return
            if passthrough.retry(spliced):
                if spliced.found is not None:
                    spliced.found.since = spliced.started
                    spliced.found.resent = True
                self._parse(spliced.data + self._take_held(), spliced.found)
                if self._closing:
                    super().shutdown()
                return
            headers = self.server_state.default_headers
            if spliced.closes:  # (as uvicorn answers a request that said close)
                headers = [*headers, (b"connection", b"close")]
            reply = passthrough.refusal(spliced, headers)
            passthrough.finished(spliced, int(reply[9:12]), False)
            self.transport.write(reply)
            self._next(not spliced.closes)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.looking is not None:
                self.looking.cancel()
                self.looking = None
            spliced, self._spliced = self._spliced, None
            if spliced is not None:
                passthrough.finished(spliced, 0, False)  # closes the link: the holder sees it
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self._spliced is not None or self._moving is not None:
                self._closing = True  # closes once the reply is out (or the move is)
                return
            super().shutdown()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._spliced is not None:
                self._spliced.link.pause()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._spliced is not None:
                self._spliced.link.resume()

    return FrontProtocol
