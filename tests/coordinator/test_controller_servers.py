"""The controller and `tether ctl` against real tether servers (SPEC 7).

Each server is the counter app wrapped by `tether.in_process`, which is what plain
`uvicorn tether.examples.counter:app` serves: the router, admission, the control API and
a `Checkpointer`, served by a real uvicorn on 127.0.0.1 port 0, each with its own
participant name on one checkpoint root. Nothing of tether is replaced. What the tests
steer is the app's own state (a session it reports busy, an export or an install that
fails), and what they watch is one ASGI layer in front of each server that logs every
control call it receives, in arrival order across the servers, with whether the call's
CHECKPOINT.json existed when it arrived.

(This replaces tests/coordinator/test_controller.py, whose `FakeServer` answered the
control routes from phases of its own.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.checkpoint.conftest import NoCookies
from tether.checkpoint.inprocess import NAME_ENV, ROOT_ENV, InProcess
from tether.checkpoint.participant import declared_participant
from tether.checkpoint.store import (
    CHECKPOINT_NAME,
    MANIFEST_NAME,
    resolve_latest,
    validate_checkpoint_id,
)
from tether.coordinator.controller import (
    Blocked,
    ControlError,
    Controller,
    ControllerError,
    RestoreFailed,
    Server,
    ServerClient,
    ServerUnreachable,
    new_checkpoint_id,
)
from tether.coordinator.ctl import TOKEN_ENV, exit_code, main
from tether.examples import counter
from tether.routing.errors import TetherError

TOKEN = "s3cret-token"
BOUND = 10.0
ID_PATTERN = re.compile(r"\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{4}")
CONTROL_ROUTES = {"prepare", "commit", "resume", "renew", "restore", "abort_restore",
                  "retire", "forget"}


@dataclass(frozen=True)
class Call:
    """One control call a server received."""

    server: str
    route: str
    body: dict[str, Any]
    checkpoint_json: bool
    """Whether the call's checkpoint had its CHECKPOINT.json when the call arrived."""


class CallLog:
    """ASGI middleware in front of a server: logs each control call it receives (its
    body read whole and handed on unchanged), then lets the server answer it."""

    def __init__(self, app: ASGIApp, name: str, root: Path, cluster: Cluster) -> None:
        self.app = app
        self.name = name
        self.root = root
        self.cluster = cluster

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/_tether/"):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"unparsed": raw.decode(errors="replace")}
        cid = body.get("checkpoint_id") if isinstance(body, dict) else None
        has_json = isinstance(cid, str) and (self.root / cid / CHECKPOINT_NAME).exists()
        await self.cluster.logged(Call(self.name, path.rsplit("/", 1)[1], body, has_json))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class BusySessions:
    """The counter's state, with the sessions the test names reported busy (the app's
    own readiness, as an app with background work reports it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.busy_ids: set[str] = set()

    def sessions(self) -> Iterable[str]:
        return self.inner.sessions()  # type: ignore[no-any-return]

    def holds(self, session_id: str) -> bool:
        return self.inner.holds(session_id)  # type: ignore[no-any-return]

    def export(self, session_id: str) -> Any:
        return self.inner.export(session_id)

    async def install(self, session_id: str, state: Any) -> None:
        await self.inner.install(session_id, state)

    async def release(self, session_id: str) -> None:
        await self.inner.release(session_id)

    def busy(self, session_id: str) -> bool:
        return session_id in self.busy_ids


class FailingExport(BusySessions):
    """An app whose export fails (its own bug): the commit answers 500 commit_failed."""

    def export(self, session_id: str) -> Any:
        raise RuntimeError(f"cannot export {session_id}")


class FailingInstall(BusySessions):
    """An app whose install fails: the restore answers 422 incompatible_state."""

    async def install(self, session_id: str, state: Any) -> None:
        raise RuntimeError(f"cannot install {session_id}")


@dataclass
class Node:
    """One real server: the counter under `tether.in_process`, on a real uvicorn."""

    name: str
    url: str
    root: Path
    state: BusySessions
    inner: InProcess
    server: uvicorn.Server
    listener: socket.socket
    http: httpx.AsyncClient

    async def control(self, route: str, **body: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {TOKEN}"}
        if route == "status":
            return await self.http.get("/_tether/status", headers=headers)
        return await self.http.post(f"/_tether/{route}", json=body, headers=headers)

    async def ok(self, route: str, **body: Any) -> Any:
        reply = await self.control(route, **body)
        assert reply.status_code == 200, (route, reply.text)
        return reply.json()

    async def phase(self) -> str:
        return str((await self.ok("status"))["phase"])

    async def seed(self, session_id: str) -> None:
        reply = await self.http.post("/seed_session", json={"session_id": session_id})
        assert reply.status_code == 200, reply.text

    async def stop(self) -> None:
        await self.http.aclose()
        await self.server.shutdown(sockets=[self.listener])
        self.listener.close()
        await self.inner.checkpointer.stop()


@dataclass
class Cluster:
    """Real servers on one checkpoint root, each named, sharing one call log."""

    root: Path
    log: list[Call] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(
        self,
        name: str,
        *,
        root: Path | None = None,
        state: type[BusySessions] = BusySessions,
        sessions: Iterable[str] | None = None,
    ) -> Node:
        """A fresh server named `name` (a new process, as far as the others can tell)
        writing to `root` (the cluster's by default), holding `sessions` (one, `s-NAME`,
        unless told otherwise)."""
        app = counter.create_app()
        participant = declared_participant(app)
        assert participant is not None
        provider = state(app.state.counters)
        participant.register_sessions(provider)
        where = self.root if root is None else root
        saved = {key: os.environ.get(key) for key in (TOKEN_ENV, ROOT_ENV, NAME_ENV)}
        os.environ.update({TOKEN_ENV: TOKEN, ROOT_ENV: str(where), NAME_ENV: name})
        try:
            inner = InProcess(app)  # reads its settings from the environment, once
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        config = uvicorn.Config(
            CallLog(inner, name, where, self), lifespan="on", access_log=False,
            log_config=None, interface="asgi3",
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[listener])
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        node = Node(name, url, where, provider, inner, server, listener,
                    httpx.AsyncClient(base_url=url, timeout=BOUND, cookies=NoCookies()))
        self.nodes.append(node)
        for session_id in [f"s-{name}"] if sessions is None else sessions:
            await node.seed(session_id)
        return node

    async def logged(self, call: Call) -> None:
        async with self.changed:
            self.log.append(call)
            self.changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate` holds after some call, at most BOUND seconds."""
        async with asyncio.timeout(BOUND), self.changed:
            await self.changed.wait_for(predicate)

    def calls(self, *routes: str) -> list[tuple[str, str]]:
        """(server, route) of every call so far; status calls left out unless named."""
        wanted = set(routes) or CONTROL_ROUTES
        return [(c.server, c.route) for c in self.log if c.route in wanted]

    def bodies(self, route: str) -> list[dict[str, Any]]:
        return [c.body for c in self.log if c.route == route]

    async def crash(self, *nodes: Node) -> None:
        """Stop `nodes` (nothing is handed over: the next servers start fresh)."""
        for node in nodes:
            self.nodes.remove(node)
            await node.stop()

    async def close(self) -> None:
        for node in self.nodes:
            await node.stop()


@pytest.fixture
async def cluster(short_tmp: Path) -> AsyncIterator[Cluster]:
    root = short_tmp / "ckpt"
    root.mkdir()
    started = Cluster(root)
    try:
        yield started
    finally:
        await started.close()


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture(autouse=True)
def _servers_log_nothing() -> Iterator[None]:
    """The servers share this process with `tether ctl`, whose output the tests read:
    their log lines (structlog's default prints them) are dropped."""
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    try:
        yield
    finally:
        structlog.reset_defaults()


def servers(*nodes: Node, named: bool = True) -> list[Server]:
    return [Server(n.name if named else None, n.url, TOKEN) for n in nodes]


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def ctl(
    capsys: pytest.CaptureFixture[str], short_tmp: Path
) -> Callable[..., Awaitable[Ran]]:
    """Run `tether ctl ARGS...` in a thread (the servers serve on this test's loop)."""
    token_file = short_tmp / "token"
    token_file.write_text(TOKEN + "\n")

    async def run(*argv: str, token: bool = True) -> Ran:
        capsys.readouterr()
        args = [*(["--token-file", str(token_file)] if token else []), *argv]
        code = await asyncio.to_thread(main, args)
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


def server_flags(*nodes: Node, named: bool = False) -> list[str]:
    flags: list[str] = []
    for node in nodes:
        flags += ["--server", f"{node.name}={node.url}" if named else node.url]
    return flags


async def checkpoint(cluster: Cluster, *nodes: Node, **kwargs: Any) -> dict[str, Any]:
    async with Controller(servers(*nodes), cluster.root, **kwargs) as controller:
        summary: dict[str, Any] = await controller.checkpoint(controller_state={"step": 7})
    return summary


async def phases(*nodes: Node) -> list[str]:
    return [await node.phase() for node in nodes]


# -- checkpoint -----------------------------------------------------------------------


async def test_checkpoint_writes_checkpoint_json_last_and_resumes_in_reverse_order(
    cluster: Cluster,
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    async with Controller(servers(a, b, named=False), cluster.root) as controller:
        summary = await controller.checkpoint(scope=["e-a"], controller_state={"step": 7})
    cid = summary["checkpoint_id"]
    assert ID_PATTERN.fullmatch(cid)
    assert cluster.calls() == [
        ("a", "prepare"), ("b", "prepare"), ("a", "commit"), ("b", "commit"),
        ("b", "resume"), ("a", "resume"),
    ]
    assert [body["scope"] for body in cluster.bodies("commit")] == [["e-a"], ["e-a"]]
    seen = {(c.server, c.route): c.checkpoint_json for c in cluster.log
            if c.route in ("commit", "resume")}
    assert seen == {("a", "commit"): False, ("b", "commit"): False,
                    ("a", "resume"): True, ("b", "resume"): True}
    assert await phases(a, b) == ["open", "open"]
    doc = json.loads((cluster.root / cid / CHECKPOINT_NAME).read_bytes())
    assert doc["participants"] == [
        {"name": n.name, "url": n.url, "manifest_digest": hashlib.sha256(
            (cluster.root / cid / n.name / MANIFEST_NAME).read_bytes()).hexdigest()}
        for n in (a, b)
    ]
    assert doc["scope"] == ["e-a"] and doc["controller_state"] == {"step": 7}
    assert [s["name"] for s in summary["servers"]] == ["a", "b"]
    assert summary["servers"][0]["records"] == {"sessions": 1, "episodes": 0}
    assert summary["servers"][0]["bytes"] > 0
    assert set(summary["timings"]) >= {"prepare_s", "commit_s", "write_s", "resume_s"}
    assert resolve_latest(cluster.root) == cid


async def test_prepared_servers_are_renewed_while_a_later_prepare_waits(
    cluster: Cluster,
) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b")
    b.state.busy_ids.add("s-b")

    async def until_a_renewed_twice() -> None:
        await cluster.wait_until(lambda: cluster.calls("renew").count(("a", "renew")) >= 2)
        b.state.busy_ids.clear()  # b's own work ends: its prepare becomes ready

    freeing = asyncio.ensure_future(until_a_renewed_twice())
    async with Controller(servers(a, b), cluster.root, renew_interval_s=0.05) as controller:
        await controller.checkpoint(lease_s=42, deadline_s=BOUND)
    await freeing
    calls = cluster.calls()
    b_prepared = calls.index(("b", "prepare"))
    assert calls[b_prepared + 1 : b_prepared + 3] == [("a", "renew"), ("a", "renew")]
    assert all(body["lease_s"] == 42 for body in cluster.bodies("renew"))
    last_renew = max(i for i, call in enumerate(calls) if call[1] == "renew")
    assert last_renew < calls.index(("b", "resume")), "the renew loop outlived the checkpoint"


async def test_blocked_prepare_resumes_every_prepared_server_including_the_blocked_one(
    cluster: Cluster,
) -> None:
    a, b, c = await cluster.add("a"), await cluster.add("b"), await cluster.add("c")
    b.state.busy_ids.add("s-b")
    async with Controller(servers(a, b, c), cluster.root) as controller:
        with pytest.raises(Blocked) as caught:
            await controller.checkpoint("c1", deadline_s=0.3)
    assert caught.value.server == "b" and caught.value.code == "blocked"
    assert [(x["kind"], x["id"]) for x in caught.value.blockers] == [("session_busy", "s-b")]
    assert cluster.calls() == [
        ("a", "prepare"), ("b", "prepare"), ("b", "resume"), ("a", "resume")]
    assert await phases(a, b, c) == ["open"] * 3
    assert not (cluster.root / "c1" / CHECKPOINT_NAME).exists()


async def test_ctl_blocked_checkpoint_prints_the_blockers_and_exits_3(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    b.state.busy_ids.add("s-b")
    common = [*server_flags(a, b), "--checkpoint-root", str(cluster.root), "checkpoint",
              "--deadline", "0.3"]
    ran = await ctl(*common)
    assert ran.code == 3
    assert "blocked from b" in ran.err and "session_busy" in ran.err and "id=s-b" in ran.err
    assert cluster.calls() == [
        ("a", "prepare"), ("b", "prepare"), ("b", "resume"), ("a", "resume")]
    ran = await ctl("--json", *common, "--id", "c2")
    assert ran.code == 3
    error = ran.json()["error"]
    assert (error["code"], error["server"], error["blockers_total"]) == ("blocked", "b", 1)
    assert await phases(a, b) == ["open", "open"]


async def test_a_refused_prepare_resumes_the_prepared_ones_but_not_the_refusing_server(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    await b.ok("prepare", checkpoint_id="other", deadline_s=5)  # another controller's
    cluster.log.clear()
    ran = await ctl("--json", *server_flags(a, b), "--checkpoint-root", str(cluster.root),
                    "checkpoint", "--id", "c1")
    assert ran.code == 4
    error = ran.json()["error"]
    assert (error["code"], error["server"], error["status"]) == ("checkpoint_conflict", "b", 409)
    assert cluster.calls() == [("a", "prepare"), ("b", "prepare"), ("a", "resume")]
    status = await b.ok("status")
    assert (status["phase"], status["checkpoint_id"]) == ("prepared", "other")
    assert await a.phase() == "open"


async def test_a_failed_commit_resumes_everyone_and_writes_no_checkpoint_json(
    cluster: Cluster,
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b", state=FailingExport)
    async with Controller(servers(a, b), cluster.root) as controller:
        with pytest.raises(ControlError) as caught:
            await controller.checkpoint("c1")
    assert (caught.value.code, caught.value.status, caught.value.server) == (
        "commit_failed", 500, "b")
    assert cluster.calls()[-2:] == [("b", "resume"), ("a", "resume")]
    assert not (cluster.root / "c1" / CHECKPOINT_NAME).exists()
    assert resolve_latest(cluster.root) is None
    assert await phases(a, b) == ["open", "open"]


# -- restore --------------------------------------------------------------------------


async def test_restore_dry_runs_everywhere_then_restores_in_order_and_resumes_in_reverse(
    cluster: Cluster,
) -> None:
    first = [await cluster.add("a"), await cluster.add("b")]
    summary = await checkpoint(cluster, *first)
    await cluster.crash(*first)
    cluster.log.clear()
    a, b = await cluster.add("a", sessions=()), await cluster.add("b", sessions=())
    async with Controller(servers(a, b, named=False), cluster.root) as controller:
        result = await controller.restore("latest")
    cid = summary["checkpoint_id"]
    assert cluster.calls() == [
        ("a", "restore"), ("b", "restore"), ("a", "restore"), ("b", "restore"),
        ("b", "resume"), ("a", "resume"),
    ]
    assert [body.get("dry_run") for body in cluster.bodies("restore")] == [True, True, None, None]
    assert {c.body["checkpoint_id"] for c in cluster.log if c.route != "status"} == {cid}
    assert result["checkpoint_id"] == cid and result["resumed"] is True
    assert result["controller_state"] == {"step": 7}
    assert result["servers"]["a"]["installed_sessions"] == 1
    assert await phases(a, b) == ["open", "open"]
    assert set(a.state.sessions()) == {"s-a"} and set(b.state.sessions()) == {"s-b"}


async def test_a_failed_restore_aborts_the_restored_servers_in_reverse_order_and_exits_5(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    first = [await cluster.add(n) for n in "abc"]
    summary = await checkpoint(cluster, *first)
    await cluster.crash(*first)
    cluster.log.clear()
    a, b = await cluster.add("a", sessions=()), await cluster.add("b", sessions=())
    c = await cluster.add("c", state=FailingInstall, sessions=())
    ran = await ctl("--json", *server_flags(a, b, c), "--checkpoint-root", str(cluster.root),
                    "restore", "--id", summary["checkpoint_id"])
    assert ran.code == 5
    error = ran.json()["error"]
    assert (error["code"], error["server"], error["aborted"]) == (
        "incompatible_state", "c", ["b", "a"])
    assert cluster.calls() == [("a", "restore"), ("b", "restore"), ("c", "restore")] * 2 + [
        ("b", "abort_restore"), ("a", "abort_restore"),
    ]
    assert await phases(a, b, c) == ["open"] * 3
    assert [set(n.state.sessions()) for n in (a, b, c)] == [set(), set(), set()]


async def test_restore_failure_from_the_python_api_names_the_cause_and_the_aborted(
    cluster: Cluster,
) -> None:
    first = [await cluster.add("a"), await cluster.add("b")]
    summary = await checkpoint(cluster, *first)
    await cluster.crash(*first)
    a = await cluster.add("a", sessions=())
    b = await cluster.add("b", state=FailingInstall, sessions=())
    async with Controller(servers(a, b), cluster.root) as controller:
        with pytest.raises(RestoreFailed) as caught:
            await controller.restore(summary["checkpoint_id"])
    assert caught.value.aborted == ["a"] and caught.value.cause.code == "incompatible_state"
    assert exit_code(caught.value) == 5


async def test_restore_of_a_missing_checkpoint_exits_5_before_anything_is_installed(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a", sessions=()), await cluster.add("b", sessions=())
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(cluster.root),
                    "restore", "--id", "nope")
    assert ran.code == 5 and "no_checkpoint from a" in ran.err
    assert cluster.calls() == [("a", "restore")]
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(cluster.root), "restore")
    assert ran.code == 5 and "no complete checkpoint" in ran.err


async def test_no_resume_leaves_every_server_restored(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    first = [await cluster.add("a"), await cluster.add("b")]
    summary = await checkpoint(cluster, *first)
    await cluster.crash(*first)
    cluster.log.clear()
    a, b = await cluster.add("a", sessions=()), await cluster.add("b", sessions=())
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(cluster.root),
                    "restore", "--latest", "--no-resume")
    assert ran.code == 0, ran.err
    assert f"restored {summary['checkpoint_id']}, left restored" in ran.out
    assert "resume" not in {route for _, route in cluster.calls()}
    assert await phases(a, b) == ["restored", "restored"]


async def test_latest_is_the_newest_complete_checkpoint(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    older = await checkpoint(cluster, a, b, clock=lambda: 1_800_000_000.0)
    newer = await checkpoint(cluster, a, b, clock=lambda: 1_800_000_100.0)
    assert older["checkpoint_id"] < newer["checkpoint_id"]
    (cluster.root / "zz-incomplete" / "a").mkdir(parents=True)  # no CHECKPOINT.json
    ran = await ctl("--json", "--checkpoint-root", str(cluster.root), "list", token=False)
    assert ran.code == 0
    listed = [(c["id"], c["complete"]) for c in ran.json()["checkpoints"]]
    assert listed == [
        (newer["checkpoint_id"], True), (older["checkpoint_id"], True), ("zz-incomplete", False),
    ]
    await cluster.crash(a, b)
    cluster.log.clear()
    a2, b2 = await cluster.add("a", sessions=()), await cluster.add("b", sessions=())
    ran = await ctl("--json", *server_flags(a2, b2), "--checkpoint-root", str(cluster.root),
                    "restore", "--latest")
    assert ran.code == 0, ran.err
    assert ran.json()["checkpoint_id"] == newer["checkpoint_id"]
    assert {b["checkpoint_id"] for b in cluster.bodies("restore")} == {newer["checkpoint_id"]}


# -- ctl ------------------------------------------------------------------------------


async def test_ctl_checkpoint_with_a_config_file_scope_and_state(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]], short_tmp: Path
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    (short_tmp / "a.token").write_text(TOKEN)
    config = short_tmp / "tether.toml"
    config.write_text(
        f'checkpoint_root = "{cluster.root.name}"\n'
        f'[[server]]\nname = "a"\nurl = "{a.url}"\ntoken_file = "a.token"\n'
        f'[[server]]\nurl = "{b.url}"\n'
    )
    (short_tmp / "scope.json").write_text('["e-a"]')
    (short_tmp / "state.json").write_text('{"step": 99}')
    ran = await ctl("--json", "--config", str(config), "checkpoint", "--id", "c1",
                    "--scope-file", str(short_tmp / "scope.json"),
                    "--state-file", str(short_tmp / "state.json"))
    assert ran.code == 0, ran.err
    summary = ran.json()
    assert summary["checkpoint_id"] == "c1" and summary["scope"] == ["e-a"]
    assert [s["name"] for s in summary["servers"]] == ["a", "b"]
    assert [body["scope"] for body in cluster.bodies("commit")] == [["e-a"], ["e-a"]]
    doc = json.loads((cluster.root / "c1" / CHECKPOINT_NAME).read_bytes())
    assert doc["controller_state"] == {"step": 99}
    ran = await ctl("--config", str(config), "list", token=False)
    assert ran.code == 0 and re.search(r"^c1 .* complete +a, b$", ran.out, re.MULTILINE)


async def test_ctl_prepare_commit_resume_by_hand_makes_a_complete_checkpoint(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    common = [*server_flags(a, b), "--checkpoint-root", str(cluster.root)]
    assert (await ctl(*common, "prepare", "--id", "m1")).code == 0
    assert await phases(a, b) == ["prepared", "prepared"]
    ran = await ctl(*common, "commit", "--id", "m1")
    assert ran.code == 0 and "committed m1" in ran.out
    assert (await ctl(*common, "commit", "--id", "m1")).code == 0, "commit again is idempotent"
    ran = await ctl(*common, "resume", "--id", "m1")
    assert ran.code == 0 and ran.out.strip() == "resumed b, a"
    assert resolve_latest(cluster.root) == "m1"
    assert cluster.calls() == [
        ("a", "prepare"), ("b", "prepare"), ("a", "commit"), ("b", "commit"),
        ("a", "commit"), ("b", "commit"), ("b", "resume"), ("a", "resume"),
    ]
    assert await phases(a, b) == ["open", "open"]


async def test_ctl_prepare_of_a_blocked_server_exits_3_and_resumes_nothing(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    a.state.busy_ids.add("s-a")
    ran = await ctl("--json", *server_flags(a, b), "prepare", "--id", "p1", "--deadline", "0.3")
    assert ran.code == 3
    assert {n: s["state"] for n, s in ran.json()["servers"].items()} == {
        "a": "blocked", "b": "prepared"}
    assert cluster.bodies("prepare")[0] == {"checkpoint_id": "p1", "deadline_s": 0.3}
    assert "resume" not in {route for _, route in cluster.calls()}
    assert await phases(a, b) == ["preparing", "prepared"]


async def test_ctl_status_retire_and_forget_reach_every_server(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await cluster.add("a", sessions=["s1", "s2"]), await cluster.add("b")
    ran = await ctl("--json", *server_flags(a, b), "status")
    assert ran.code == 0 and list(ran.json()["servers"]) == ["a", "b"]
    ran = await ctl(*server_flags(a, b), "status")
    assert ran.out.startswith("a: open, 1/1 workers, 2 sessions")
    ran = await ctl("--json", *server_flags(a, b), "retire", "--id", "e1", "--attempt", "2")
    assert ran.code == 0
    assert ran.json()["servers"]["b"]["retired"][0] == {
        "episode_id": "e1", "attempt": 2, "stopped": 0, "dropped_held": 0}
    ran = await ctl(*server_flags(a, b), "forget", "--id", "e1", "e2", "--id", "e3")
    assert ran.code == 0
    assert cluster.bodies("forget") == [{"episode_ids": ["e1", "e2", "e3"]}] * 2
    assert cluster.calls("retire", "forget") == [
        ("a", "retire"), ("b", "retire"), ("a", "forget"), ("b", "forget")]


async def test_a_server_with_another_checkpoint_root_is_refused(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]], short_tmp: Path
) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b", root=short_tmp / "elsewhere")
    async with Controller(servers(a, b), cluster.root) as controller:
        with pytest.raises(ControllerError) as caught:
            await controller.checkpoint("c1")
    assert (caught.value.code, caught.value.server) == ("root_mismatch", "b")
    assert "elsewhere" in str(caught.value.detail)
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(cluster.root), "checkpoint")
    assert ran.code == 4 and "root_mismatch from b" in ran.err
    assert cluster.calls() == []


async def test_a_checkpoint_root_reached_through_a_symlink_is_the_same_root(
    cluster: Cluster, short_tmp: Path
) -> None:
    (short_tmp / "link").symlink_to(cluster.root)
    a = await cluster.add("a", root=short_tmp / "link")
    summary = await checkpoint(cluster, a)
    assert resolve_latest(cluster.root) == summary["checkpoint_id"]


async def test_a_configured_name_the_server_does_not_have_is_refused(cluster: Cluster) -> None:
    a = await cluster.add("a")
    async with Controller([Server("x", a.url, TOKEN)], cluster.root) as controller:
        with pytest.raises(ControllerError) as caught:
            await controller.retire("e1", 1)
    assert caught.value.code == "name_mismatch" and "calls itself 'a'" in caught.value.detail
    assert cluster.calls() == []


async def test_the_token_comes_from_the_token_file_or_the_environment(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await cluster.add("a")
    assert (await ctl(*server_flags(a), "status")).code == 0
    ran = await ctl(*server_flags(a), "status", token=False)
    assert ran.code == 2 and TOKEN_ENV in ran.err
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert (await ctl(*server_flags(a), "status", token=False)).code == 0
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    ran = await ctl("--json", *server_flags(a), "status", token=False)
    assert ran.code == 1 and ran.json()["error"]["code"] == "unauthorized"


async def test_an_unreachable_server_is_a_clear_error(
    ctl: Callable[..., Awaitable[Ran]],
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with ServerClient(Server("gone", url, TOKEN)) as client:
        with pytest.raises(ServerUnreachable) as caught:
            await client.status()
    assert caught.value.code == "server_unreachable" and url in caught.value.detail
    ran = await ctl("--json", "--server", url, "status")
    assert ran.code == 1 and ran.json()["error"]["code"] == "server_unreachable"


async def test_an_answer_that_is_not_the_control_api_is_a_bad_answer(cluster: Cluster) -> None:
    a = await cluster.add("a")
    async with ServerClient(Server("a", a.url + "/not-tether", TOKEN)) as client:
        with pytest.raises(ControllerError) as caught:
            await client.status()
    assert (caught.value.code, caught.value.status) == ("bad_answer", 404)


@pytest.mark.parametrize(
    "argv",
    [
        ["restore", "--id", "x", "--latest"],
        ["retire", "--id", "e1"],
        ["retire", "--id", "e1", "--attempt", "one"],
        ["checkpoint", "--deadline", "-1"],
        ["forget"],
        ["frobnicate"],
    ],
)
async def test_ctl_argument_errors_exit_2(
    argv: list[str], ctl: Callable[..., Awaitable[Ran]]
) -> None:
    with pytest.raises(SystemExit) as caught:
        await ctl("--server", "http://127.0.0.1:9", *argv)
    assert caught.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status"], "no servers"),
        (["--server", "ftp://x", "status"], "not an http"),
        (["--server", "http://127.0.0.1:9", "checkpoint"], "needs the checkpoint root"),
        (["--server", "http://127.0.0.1:9", "--checkpoint-root", "r", "checkpoint",
          "--id", "latest"], "bad checkpoint ID"),
        (["--server", "http://127.0.0.1:9", "--checkpoint-root", "r", "checkpoint",
          "--scope-file", "/nonexistent"], "cannot read the scope file"),
        (["--config", "/nonexistent.toml", "status"], "cannot read the config"),
    ],
)
async def test_ctl_usage_errors_exit_2_with_a_message(
    argv: list[str], message: str, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    ran = await ctl(*argv)
    assert ran.code == 2 and message in ran.err and ran.out == ""
    ran = await ctl("--json", *argv)
    assert ran.code == 2 and ran.json()["error"]["code"] == "usage"


async def test_a_config_with_unknown_keys_or_a_bad_scope_file_is_refused(
    ctl: Callable[..., Awaitable[Ran]], short_tmp: Path
) -> None:
    config = short_tmp / "c.toml"
    config.write_text('[[server]]\nurl = "http://127.0.0.1:9"\ntoken = "inline"\n')
    ran = await ctl("--config", str(config), "status")
    assert ran.code == 2 and "unknown keys ['token']" in ran.err
    (short_tmp / "scope.json").write_text('{"e1": true}')
    ran = await ctl("--server", "http://127.0.0.1:9", "--checkpoint-root", str(short_tmp),
                    "commit", "--id", "c1", "--scope-file", str(short_tmp / "scope.json"))
    assert ran.code == 2 and "JSON list of episode IDs" in ran.err


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (Blocked("a", {"blockers": [], "blockers_total": 0}), 3),
        (ControlError("checkpoint_conflict", server="a", status=409), 4),
        (ControlError("invalid_phase", server="a", status=409), 4),
        (ControlError("stale_checkpoint", server="a", status=409), 4),
        (ControlError("not_ready", server="a", status=409), 4),
        (ControlError("not_fresh", server="a", status=409), 4),
        (ControlError("episode_claimed", server="a", status=409), 4),
        (ControlError("stale_attempt", server="a", status=409), 4),
        (ControlError("attempt_mismatch", server="a", status=409), 4),
        (ControlError("some_future_conflict", server="a", status=409), 4),
        (ControlError("no_checkpoint", server="a", status=404), 5),
        (ControlError("corrupt_checkpoint", server="a", status=422), 5),
        (ControlError("incompatible_state", server="a", status=422), 5),
        (TetherError("stale_checkpoint"), 4),
        (ControlError("commit_failed", server="a", status=500), 1),
        (ControlError("unauthorized", server="a", status=401), 1),
        (ControlError("worker_unreported", server="a", status=503), 1),
        (ServerUnreachable("down", server="a"), 1),
        (TetherError("invalid_checkpoint_id"), 2),
        (ValueError("anything else"), 1),
    ],
)
def test_exit_codes(error: BaseException, code: int) -> None:
    assert exit_code(error) == code


def test_new_checkpoint_ids_sort_by_time_and_are_valid() -> None:
    first = new_checkpoint_id(lambda: 1_800_000_000.0)
    second = new_checkpoint_id(lambda: 1_800_000_000.5)
    assert ID_PATTERN.fullmatch(first) and first.startswith("20270115T080000.000000Z-")
    assert first < second and validate_checkpoint_id(second) == second


async def test_progress_lines_appear_only_on_a_terminal(
    cluster: Cluster, ctl: Callable[..., Awaitable[Ran]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await cluster.add("a"), await cluster.add("b")
    common = [*server_flags(a, b), "--checkpoint-root", str(cluster.root), "checkpoint"]
    ran = await ctl(*common, "--id", "quiet")
    assert ran.code == 0 and "..." not in ran.out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    ran = await ctl(*common, "--id", "loud")
    assert ran.code == 0
    assert ran.out.splitlines()[:4] == [
        "... prepare a", "... prepare b", "... commit a", "... commit b"]
    assert re.search(r"^checkpoint loud in [0-9.]+ s$", ran.out, re.MULTILINE)
    ran = await ctl("--json", *common, "--id", "json")
    assert ran.json()["checkpoint_id"] == "json", "--json prints no progress, even on a tty"
