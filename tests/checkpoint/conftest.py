"""In-process checkpoint nodes on real sockets.

A *node* is one server of one worker, composed the way plain `uvicorn app:app` serves
an app in-process: a fresh app, its declared participant, a `Checkpointer` over a
`LocalFleet`, and a `RoutingWorker` with the control API and admission, served by a real
uvicorn on 127.0.0.1 port 0. A *crash* stops a node; a *new* node (fresh app, fresh
participant) on the same checkpoint root is what restarts after it.

The test apps here are small apps an app author could write (a blob store, a counter
whose busy flag flips silently, a gate in front of the app); nothing of tether is mocked.
"""

from __future__ import annotations

import asyncio
import functools
import http.cookiejar
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from e2e import harness
from e2e.apps.blobs import blob_app
from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.control import ControlApp
from tether.checkpoint.fleet import LocalFleet
from tether.checkpoint.participant import (
    Participant,
    SessionState,
    declared_participant,
)
from tether.checkpoint.store import read_manifest_digest, resolve_latest, write_checkpoint_json
from tether.examples import counter, episodes
from tether.routing.kinds import declared_kind
from tether.routing.worker import RoutingWorker

TOKEN = "checkpoint-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HOLD_HEADER = "x-test-hold"
GRACE_S = 1
"""How long a stopping node lets requests finish before uvicorn cancels them."""

AppFactory = Callable[[], Any]
FleetFactory = Callable[..., Any]


class NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing: every session sends its own `cookie` header."""

    def __init__(self) -> None:
        super().__init__(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def session_cookie(reply: httpx.Response) -> str:
    """The `session=...` pair a reply sets, ready for a `cookie` header."""
    for header in reply.headers.get_list("set-cookie"):
        pair = header.split(";", 1)[0].strip()
        if pair.startswith("session="):
            return pair
    raise AssertionError(f"no session cookie in {reply.headers!r}")


def assert_error(reply: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The reply is the contract's error `code` with `status`; returns its body."""
    assert (reply.status_code, _code(reply)) == (status, code), reply.text[:500]
    body: dict[str, Any] = reply.json()
    return body


def _code(reply: httpx.Response) -> str | None:
    try:
        body = reply.json()
    except ValueError:
        return None
    return body.get("code") if isinstance(body, dict) else None


eventually = functools.partial(harness.eventually, every=0.01)
"""`e2e.harness.eventually`, polling faster: in process, a check is cheap."""


async def gather_bounded(aws: Iterable[Awaitable[Any]], limit: int = 4) -> list[Any]:
    """Await all of `aws`, at most `limit` at a time; results in order. (Client and
    server share one event loop here: more at once only makes httpx's pool slower.)"""
    semaphore = asyncio.Semaphore(limit)

    async def one(aw: Awaitable[Any]) -> Any:
        async with semaphore:
            return await aw

    return list(await asyncio.gather(*(one(aw) for aw in aws)))


@dataclass
class Node:
    """One in-process server of one worker."""

    app: Any
    participant: Participant
    checkpointer: Checkpointer
    routing: RoutingWorker
    server: uvicorn.Server
    listener: socket.socket
    url: str
    name: str
    root: Path
    http: httpx.AsyncClient
    stopped: bool = False

    async def control(self, route: str, token: str | None = TOKEN, **body: Any) -> httpx.Response:
        """One control call: `status` is a GET, every other route a POST of `body`."""
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        if route == "status":
            return await self.http.get("/_tether/status", headers=headers)
        return await self.http.post(f"/_tether/{route}", json=body, headers=headers)

    async def ok(self, route: str, **body: Any) -> Any:
        """A control call that must answer 200; its JSON."""
        reply = await self.control(route, **body)
        assert reply.status_code == 200, (route, body, reply.status_code, reply.text[:500])
        return reply.json()

    async def status(self) -> dict[str, Any]:
        status: dict[str, Any] = await self.ok("status")
        return status

    async def prepared(self, checkpoint_id: str, **options: Any) -> dict[str, Any]:
        answer: dict[str, Any] = await self.ok(
            "prepare", checkpoint_id=checkpoint_id, **{"deadline_s": 10, **options}
        )
        assert answer["state"] == "prepared", answer
        return answer

    async def checkpoint(self, checkpoint_id: str, scope: list[str] | None = None) -> Any:
        """prepare → commit → CHECKPOINT.json (as the controller writes it) → resume;
        returns the manifest."""
        await self.prepared(checkpoint_id)
        manifest = await self.ok("commit", checkpoint_id=checkpoint_id, scope=scope)
        self.publish(checkpoint_id, scope)
        await self.ok("resume", checkpoint_id=checkpoint_id)
        return manifest

    def publish(self, checkpoint_id: str, scope: list[str] | None = None) -> dict[str, Any]:
        """Write CHECKPOINT.json for this node's committed participant (the controller's job)."""
        digest = read_manifest_digest(self.root, checkpoint_id, self.name)
        entry = {"name": self.name, "url": self.url, "manifest_digest": digest}
        return write_checkpoint_json(self.root, checkpoint_id, [entry], scope, None)  # type: ignore[list-item]

    async def restore(self, checkpoint_id: str, **options: Any) -> dict[str, Any]:
        answer: dict[str, Any] = await self.ok("restore", checkpoint_id=checkpoint_id, **options)
        return answer

    async def restore_latest(self) -> dict[str, Any]:
        """What `--restore latest` does: resolve, restore, resume."""
        latest = resolve_latest(self.root, self.name)
        assert latest is not None, "no complete checkpoint"
        answer = await self.restore(latest)
        await self.ok("resume", checkpoint_id=latest)
        return answer

    async def seed(self, session_id: str, **extra: Any) -> str:
        """Seed a session; the cookie that names it."""
        reply = await self.http.post("/seed_session", json={"session_id": session_id, **extra})
        assert reply.status_code == 200, reply.text
        return session_cookie(reply)

    async def get(self, path: str, cookie: str | None = None, **kwargs: Any) -> httpx.Response:
        return await self.http.get(path, headers=_cookie_header(cookie), **kwargs)

    async def post(self, path: str, cookie: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {**_cookie_header(cookie), **kwargs.pop("headers", {})}
        return await self.http.post(path, headers=headers, **kwargs)

    async def stop(self) -> None:
        """Stop serving (a crash, as far as the next node can tell: nothing is handed over)."""
        if self.stopped:
            return
        self.stopped = True
        await self.http.aclose()
        await self.server.shutdown(sockets=[self.listener])
        await self.routing.stop()
        assert await stop_promptly(self.checkpointer), "Checkpointer.stop() hung"


async def stop_promptly(checkpointer: Checkpointer, within: float = 5.0) -> bool:
    """`checkpointer.stop()`; False if it did not return within `within` s (it is then
    stopped anyway, by cancelling its lease timer again, so nothing is left running)."""
    stopping = asyncio.ensure_future(checkpointer.stop())
    done, _ = await asyncio.wait({stopping}, timeout=within)
    if not done:
        timer = checkpointer._timer
        while not stopping.done():
            if timer is not None:
                timer.cancel()
            await asyncio.wait({stopping}, timeout=0.1)
    await stopping
    return bool(done)


def _cookie_header(cookie: str | None) -> dict[str, str]:
    return {} if cookie is None else {"cookie": cookie}


@dataclass
class Nodes:
    """Starts nodes on one checkpoint root; stops them all at teardown."""

    base: Path
    root: Path
    started: list[Node] = field(default_factory=list)

    async def start(
        self,
        factory: AppFactory = counter.create_app,
        *,
        name: str | None = None,
        fleet: FleetFactory = LocalFleet,
        wrap: Callable[[ASGIApp], ASGIApp] | None = None,
        claims: bool = False,
        setup: Callable[[Any], None] | None = None,
    ) -> Node:
        """A node serving a fresh `factory()` app; `wrap` puts a test middleware between
        the router and the app, `claims` gives it a claim store (a runtime directory),
        `setup` adjusts the fresh app before it serves."""
        app = factory()
        if setup is not None:
            setup(app)
        participant = declared_participant(app)
        assert participant is not None, "the app declares no participant"
        name = name or _default_name(factory)
        checkpointer: Checkpointer | None = None

        async def backend(route: str, body: dict[str, Any]) -> Any:
            assert checkpointer is not None
            return await checkpointer.call(route, body)

        runtime_dir = None
        if claims:
            runtime = self.base / f"rt{len(self.started)}"
            runtime.mkdir(mode=0o700)
            runtime_dir = str(runtime)
        routing = RoutingWorker(
            wrap(app) if wrap is not None else app,
            kind=declared_kind(app),
            runtime_dir=runtime_dir,
            control=ControlApp(TOKEN, backend),
            admission=participant,
            access_log=False,
        )
        participant.worker = routing.id
        checkpointer = Checkpointer(
            fleet(participant, None, routing.is_open, routing.stats), name=name, root=str(self.root)
        )
        checkpointer.start()
        await routing.start()
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
        # without it every reply written in two parts waits ~40 ms for a delayed ACK.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        config = uvicorn.Config(
            routing.router,
            lifespan="off",
            access_log=False,
            log_config=None,
            http="httptools",
            interface="asgi3",
            timeout_graceful_shutdown=GRACE_S,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[listener])
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = httpx.AsyncClient(
            base_url=url,
            cookies=NoCookies(),
            timeout=httpx.Timeout(30.0),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=100),
        )
        node = Node(
            app, participant, checkpointer, routing, server, listener, url, name, self.root, client
        )
        self.started.append(node)
        return node

    async def close(self) -> None:
        for node in self.started:
            await node.stop()


def _default_name(factory: AppFactory) -> str:
    if factory is episodes.create_app:
        return "episodes"
    if factory is blob_app:
        return "blobs"
    return "counter"


@pytest.fixture
async def nodes(short_tmp: Path) -> AsyncIterator[Nodes]:
    root = short_tmp / "ckpt"
    started = Nodes(short_tmp, root)
    try:
        yield started
    finally:
        await started.close()


# Test apps and test middleware ---------------------------------------------------------


class Gate:
    """ASGI middleware between the router and the app: a request with `x-test-hold: 1`
    waits (in progress, already admitted) until the test opens the gate."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.open = asyncio.Event()
        self.waiting = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (HOLD_HEADER.encode(), b"1") in scope["headers"]:
            self.waiting += 1
            try:
                await self.open.wait()
            finally:
                self.waiting -= 1
        await self.app(scope, receive, send)


class SilentlyBusy:
    """An app's session state whose busy flag flips with no notification to tether
    (the counter's state, plus a set of busy IDs the test edits)."""

    def __init__(self, inner: SessionState) -> None:
        self.inner = inner
        self.busy_ids: set[str] = set()

    def sessions(self) -> Iterable[str]:
        return self.inner.sessions()

    def holds(self, session_id: str) -> bool:
        return self.inner.holds(session_id)

    def export(self, session_id: str) -> Any:
        return self.inner.export(session_id)

    async def install(self, session_id: str, state: Any) -> None:
        await self.inner.install(session_id, state)

    async def release(self, session_id: str) -> None:
        await self.inner.release(session_id)

    def busy(self, session_id: str) -> bool:
        return session_id in self.busy_ids


def silently_busy(app: Any) -> None:
    """`setup` for a counter node: register `SilentlyBusy` over its counters."""
    participant = declared_participant(app)
    assert participant is not None
    provider = SilentlyBusy(app.state.counters)
    participant.register_sessions(provider)
    app.state.busy = provider
