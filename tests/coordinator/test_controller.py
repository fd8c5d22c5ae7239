"""The controller and `tether ctl` against fake control servers on real sockets.

`FakeServer` is test scaffolding: a Starlette app that answers SPEC 6's control routes
from in-memory phases, served by a real uvicorn on 127.0.0.1 port 0. Its commit writes a
real participant directory with the store (`begin_commit`, `SegmentWriter`, `publish`)
and its restore checks with `load_checkpoint`, so digests and completeness are real.
Every call any fake receives goes into one shared log, in arrival order.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether.checkpoint.segments import SegmentWriter
from tether.checkpoint.store import (
    CHECKPOINT_NAME,
    MANIFEST_NAME,
    begin_commit,
    load_checkpoint,
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
from tether.routing.errors import TetherError
from tether.routing.types import new_worker_id

TOKEN = "s3cret-token"
BOUND = 5.0
ID_PATTERN = re.compile(r"\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{4}")

# The body keys each route accepts (SPEC 6); anything else is refused, as the server's
# strict validation would.
BODY_KEYS = {
    "prepare": {"checkpoint_id", "deadline_s", "lease_s"},
    "commit": {"checkpoint_id", "scope", "deadline_s"},
    "resume": {"checkpoint_id"},
    "renew": {"checkpoint_id", "lease_s"},
    "restore": {"checkpoint_id", "deadline_s", "scope", "dry_run"},
    "abort_restore": {"checkpoint_id"},
    "retire": {"episode_id", "attempt", "deadline_s"},
    "forget": {"episode_ids"},
}

Call = tuple[str, str, dict[str, Any]]


@dataclass
class FakeServer:
    """One tether server's control API, minimally: phases in memory, commits on disk."""

    name: str
    root: Path
    log: list[Call]
    token: str = TOKEN
    reported_root: str | None = None
    block: bool = False
    refuse: dict[str, str] = field(default_factory=dict)
    fail_restore: str | None = None
    prepare_gate: Callable[[], Awaitable[None]] | None = None
    logged: Callable[[], Awaitable[None]] | None = None
    phase: str = "open"
    checkpoint_id: str | None = None
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    saw_checkpoint_json: dict[str, bool] = field(default_factory=dict)
    url: str = ""

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/_tether/{route}", self.handle, methods=["GET", "POST"])])

    async def handle(self, request: Request) -> JSONResponse:
        route = request.path_params["route"]
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return self.error(TetherError("unauthorized"))
        body = await request.json() if request.method == "POST" else {}
        self.log.append((self.name, route, body))
        if self.logged is not None:
            await self.logged()
        try:
            if route != "status" and (
                not isinstance(body, dict) or not set(body) <= BODY_KEYS[route]
            ):
                raise TetherError("invalid_request", f"bad body {body!r}")
            if route in self.refuse:
                raise TetherError(self.refuse[route])  # type: ignore[arg-type]
            answer = await getattr(self, f"do_{route}")(body)
        except TetherError as error:
            return self.error(error)
        return JSONResponse(answer)

    @staticmethod
    def error(error: TetherError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def do_status(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": self.name, "phase": self.phase, "checkpoint_id": self.checkpoint_id,
            "lease_expires_at": None, "expected_workers": 1,
            "workers": [{"id": "w", "pid": 1, "sessions": 2, "claims": 2, "episodes": 0,
                         "forwarded": 0, "served_forwarded": 0}],
            "held_episodes": [], "lost_episodes": [],
            "tables": {"placed_sessions": 0, "owner_aliases": 0},
            "blockers": [], "blockers_total": 0,
            "checkpoint_root": self.reported_root or str(self.root),
        }

    def _active(self, body: dict[str, Any]) -> str:
        cid = validate_checkpoint_id(body["checkpoint_id"])
        if self.checkpoint_id not in (None, cid):
            raise TetherError("checkpoint_conflict")
        return cid

    async def do_prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        self.checkpoint_id = self._active(body)
        self.phase = "preparing"
        if self.prepare_gate is not None:
            await self.prepare_gate()
        if self.block:
            blockers = [{"kind": "episode_running", "worker": "w", "id": "e9", "detail": None}]
            return {"state": "blocked", "blockers": blockers, "blockers_total": 1,
                    "lease_expires_at": time.time() + 300}
        self.phase = "prepared"
        return {"state": "prepared", "blockers": [], "blockers_total": 0,
                "lease_expires_at": time.time() + 300}

    async def do_commit(self, body: dict[str, Any]) -> dict[str, Any]:
        cid = self._active(body)
        if self.phase == "committed":
            return self.manifests[cid]
        if self.phase != "prepared":
            raise TetherError("invalid_phase")
        self.saw_checkpoint_json[f"commit {cid}"] = self.has_checkpoint_json(cid)
        self.manifests[cid] = await asyncio.to_thread(self.write, cid)
        self.phase = "committed"
        return self.manifests[cid]

    def write(self, cid: str) -> dict[str, Any]:
        worker = str(new_worker_id())
        records = [
            {"kind": "session", "id": f"s-{self.name}", "open": True, "owner": worker,
             "state": {"n": 1}},
            {"kind": "episode", "episode_id": f"e-{self.name}", "attempt": 1, "state": [1, 2]},
        ]
        with begin_commit(self.root, cid, self.name) as pending:
            with SegmentWriter(pending.segment_path(worker)) as writer:
                for record in records:
                    writer.add(record)
                info = writer.close()
            return pending.publish({
                "workers": [worker], "owner_aliases": {}, "state_version": None,
                "records": {"sessions": 1, "episodes": 1},
                "segments": [{**info, "worker": worker}],
            })

    def has_checkpoint_json(self, cid: str) -> bool:
        return (self.root / cid / CHECKPOINT_NAME).exists()

    async def do_resume(self, body: dict[str, Any]) -> dict[str, Any]:
        cid = validate_checkpoint_id(body["checkpoint_id"])
        if self.checkpoint_id == cid:
            self.saw_checkpoint_json[f"resume {cid}"] = self.has_checkpoint_json(cid)
            self.phase, self.checkpoint_id = "open", None
        return {"phase": "open"}

    async def do_renew(self, body: dict[str, Any]) -> dict[str, Any]:
        self._active(body)
        return {"lease_expires_at": time.time() + body.get("lease_s", 300)}

    async def do_restore(self, body: dict[str, Any]) -> dict[str, Any]:
        cid = validate_checkpoint_id(body["checkpoint_id"])
        if self.phase != "open":
            raise TetherError("not_fresh")
        loaded = await asyncio.to_thread(load_checkpoint, self.root, cid, self.name)
        if not body.get("dry_run"):
            if self.fail_restore is not None:
                raise TetherError(self.fail_restore)  # type: ignore[arg-type]
            self.phase, self.checkpoint_id = "restored", cid
        return {
            "installed_sessions": loaded.manifest["records"]["sessions"],
            "held_episodes": [{"episode_id": f"e-{self.name}", "attempt_to_send": 2}],
            "placed_sessions": 1, "owner_aliases": 1,
        }

    async def do_abort_restore(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.phase != "restored":
            raise TetherError("invalid_phase")
        self.phase, self.checkpoint_id = "open", None
        return {"phase": "open", "fresh": True}

    async def do_retire(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"retired": [{"episode_id": body["episode_id"], "attempt": body["attempt"],
                             "stopped": 0, "dropped_held": 0}]}

    async def do_forget(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"forgotten": body["episode_ids"]}


@dataclass
class Fleet:
    """Fake servers sharing one checkpoint root and one call log."""

    root: Path
    log: list[Call] = field(default_factory=list)
    running: list[tuple[uvicorn.Server, socket.socket]] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(self, name: str, **options: Any) -> FakeServer:
        fake = FakeServer(name, self.root, self.log, logged=self.notify, **options)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        config = uvicorn.Config(fake.app(), lifespan="off", access_log=False, log_config=None)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[listener])
        self.running.append((server, listener))
        fake.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        return fake

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate` holds after some call, at most BOUND seconds."""
        async with asyncio.timeout(BOUND), self.changed:
            await self.changed.wait_for(predicate)

    def calls(self, *routes: str) -> list[tuple[str, str]]:
        """(server, route) of every call so far, status calls left out unless named."""
        wanted = set(routes) or set(BODY_KEYS)
        return [(name, route) for name, route, _ in self.log if route in wanted]

    def bodies(self, route: str) -> list[dict[str, Any]]:
        return [body for _, r, body in self.log if r == route]

    async def close(self) -> None:
        await asyncio.gather(*(server.shutdown(sockets=[sock]) for server, sock in self.running))
        for _, listener in self.running:
            listener.close()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    root = tmp_path / "ckpt"
    root.mkdir()
    fleet = Fleet(root)
    try:
        yield fleet
    finally:
        await fleet.close()


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def servers(*fakes: FakeServer, named: bool = True) -> list[Server]:
    return [Server(f.name if named else None, f.url, TOKEN) for f in fakes]


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def ctl(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Callable[..., Awaitable[Ran]]:
    """Run `tether ctl ARGS...` in a thread (the fakes serve on this test's loop)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    async def run(*argv: str, token: bool = True) -> Ran:
        capsys.readouterr()
        args = [*(["--token-file", str(token_file)] if token else []), *argv]
        code = await asyncio.to_thread(main, args)
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


def server_flags(*fakes: FakeServer, named: bool = False) -> list[str]:
    flags: list[str] = []
    for fake in fakes:
        flags += ["--server", f"{fake.name}={fake.url}" if named else fake.url]
    return flags


async def checkpoint(fleet: Fleet, *fakes: FakeServer, **kwargs: Any) -> dict[str, Any]:
    async with Controller(servers(*fakes), fleet.root, **kwargs) as controller:
        return await controller.checkpoint(controller_state={"step": 7})


# -- checkpoint -----------------------------------------------------------------------


async def test_checkpoint_writes_checkpoint_json_last_and_resumes_in_reverse_order(
    fleet: Fleet,
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
    async with Controller(servers(a, b, named=False), fleet.root) as controller:
        summary = await controller.checkpoint(scope=["e-a"], controller_state={"step": 7})
    cid = summary["checkpoint_id"]
    assert ID_PATTERN.fullmatch(cid)
    assert fleet.calls() == [
        ("a", "prepare"), ("b", "prepare"), ("a", "commit"), ("b", "commit"),
        ("b", "resume"), ("a", "resume"),
    ]
    assert [body["scope"] for body in fleet.bodies("commit")] == [["e-a"], ["e-a"]]
    for fake in (a, b):
        assert fake.saw_checkpoint_json == {f"commit {cid}": False, f"resume {cid}": True}
        assert fake.phase == "open"
    doc = json.loads((fleet.root / cid / CHECKPOINT_NAME).read_bytes())
    assert doc["participants"] == [
        {"name": f.name, "url": f.url, "manifest_digest": hashlib.sha256(
            (fleet.root / cid / f.name / MANIFEST_NAME).read_bytes()).hexdigest()}
        for f in (a, b)
    ]
    assert doc["scope"] == ["e-a"] and doc["controller_state"] == {"step": 7}
    assert [s["name"] for s in summary["servers"]] == ["a", "b"]
    assert summary["servers"][0]["records"] == {"sessions": 1, "episodes": 1}
    assert summary["servers"][0]["bytes"] > 0
    assert set(summary["timings"]) >= {"prepare_s", "commit_s", "write_s", "resume_s"}
    assert resolve_latest(fleet.root) == cid


async def test_prepared_servers_are_renewed_while_a_later_prepare_waits(fleet: Fleet) -> None:
    async def until_a_renewed_twice() -> None:
        await fleet.wait_until(lambda: fleet.calls("renew").count(("a", "renew")) >= 2)

    a = await fleet.add("a")
    b = await fleet.add("b", prepare_gate=until_a_renewed_twice)
    async with Controller(servers(a, b), fleet.root, renew_interval_s=0.02) as controller:
        await controller.checkpoint(lease_s=42)
    calls = fleet.calls()
    b_prepared = calls.index(("b", "prepare"))
    assert calls[b_prepared + 1 : b_prepared + 3] == [("a", "renew"), ("a", "renew")]
    assert all(body["lease_s"] == 42 for body in fleet.bodies("renew"))
    last_renew = max(i for i, call in enumerate(calls) if call[1] == "renew")
    assert last_renew < calls.index(("b", "resume")), "the renew loop outlived the checkpoint"


async def test_blocked_prepare_resumes_every_prepared_server_including_the_blocked_one(
    fleet: Fleet,
) -> None:
    a, b, c = await fleet.add("a"), await fleet.add("b", block=True), await fleet.add("c")
    async with Controller(servers(a, b, c), fleet.root) as controller:
        with pytest.raises(Blocked) as caught:
            await controller.checkpoint("c1")
    assert caught.value.server == "b" and caught.value.code == "blocked"
    assert caught.value.blockers[0]["kind"] == "episode_running"
    assert fleet.calls() == [("a", "prepare"), ("b", "prepare"), ("b", "resume"), ("a", "resume")]
    assert [f.phase for f in (a, b, c)] == ["open"] * 3
    assert not (fleet.root / "c1" / CHECKPOINT_NAME).exists()


async def test_ctl_blocked_checkpoint_prints_the_blockers_and_exits_3(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b", block=True)
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(fleet.root), "checkpoint")
    assert ran.code == 3
    assert "blocked from b" in ran.err and "episode_running worker=w id=e9" in ran.err
    assert fleet.calls() == [("a", "prepare"), ("b", "prepare"), ("b", "resume"), ("a", "resume")]
    ran = await ctl("--json", *server_flags(a, b), "--checkpoint-root", str(fleet.root),
                    "checkpoint", "--id", "c2")
    assert ran.code == 3
    error = ran.json()["error"]
    assert (error["code"], error["server"], error["blockers_total"]) == ("blocked", "b", 1)


async def test_a_refused_prepare_resumes_the_prepared_ones_but_not_the_refusing_server(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b", refuse={"prepare": "checkpoint_conflict"})
    ran = await ctl("--json", *server_flags(a, b), "--checkpoint-root", str(fleet.root),
                    "checkpoint", "--id", "c1")
    assert ran.code == 4
    assert ran.json()["error"] == {
        "code": "checkpoint_conflict", "detail": "another checkpoint is active, or same ID other "
        "scope", "server": "b", "status": 409,
    }
    assert fleet.calls() == [("a", "prepare"), ("b", "prepare"), ("a", "resume")]


async def test_a_failed_commit_resumes_everyone_and_writes_no_checkpoint_json(
    fleet: Fleet,
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b", refuse={"commit": "commit_failed"})
    async with Controller(servers(a, b), fleet.root) as controller:
        with pytest.raises(ControlError) as caught:
            await controller.checkpoint("c1")
    assert (caught.value.code, caught.value.status, caught.value.server) == (
        "commit_failed", 500, "b")
    assert fleet.calls()[-2:] == [("b", "resume"), ("a", "resume")]
    assert not (fleet.root / "c1" / CHECKPOINT_NAME).exists()
    assert resolve_latest(fleet.root) is None


# -- restore --------------------------------------------------------------------------


async def test_restore_dry_runs_everywhere_then_restores_in_order_and_resumes_in_reverse(
    fleet: Fleet,
) -> None:
    summary = await checkpoint(fleet, await fleet.add("a"), await fleet.add("b"))
    fleet.log.clear()
    a, b = await fleet.add("a"), await fleet.add("b")  # fresh processes after a crash
    async with Controller(servers(a, b, named=False), fleet.root) as controller:
        result = await controller.restore("latest")
    cid = summary["checkpoint_id"]
    assert fleet.calls() == [
        ("a", "restore"), ("b", "restore"), ("a", "restore"), ("b", "restore"),
        ("b", "resume"), ("a", "resume"),
    ]
    assert [body.get("dry_run") for body in fleet.bodies("restore")] == [True, True, None, None]
    assert {body["checkpoint_id"] for _, _, body in fleet.log if body} == {cid}
    assert result["checkpoint_id"] == cid and result["resumed"] is True
    assert result["controller_state"] == {"step": 7}
    assert result["servers"]["a"]["installed_sessions"] == 1
    assert a.phase == b.phase == "open"


async def test_a_failed_restore_aborts_the_restored_servers_in_reverse_order_and_exits_5(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    summary = await checkpoint(fleet, *[await fleet.add(n) for n in "abc"])
    fleet.log.clear()
    a, b = await fleet.add("a"), await fleet.add("b")
    c = await fleet.add("c", fail_restore="corrupt_checkpoint")
    ran = await ctl("--json", *server_flags(a, b, c), "--checkpoint-root", str(fleet.root),
                    "restore", "--id", summary["checkpoint_id"])
    assert ran.code == 5
    error = ran.json()["error"]
    assert (error["code"], error["server"], error["aborted"]) == (
        "corrupt_checkpoint", "c", ["b", "a"])
    assert fleet.calls() == [("a", "restore"), ("b", "restore"), ("c", "restore")] * 2 + [
        ("b", "abort_restore"), ("a", "abort_restore"),
    ]
    assert [f.phase for f in (a, b, c)] == ["open"] * 3


async def test_restore_failure_from_the_python_api_names_the_cause_and_the_aborted(
    fleet: Fleet,
) -> None:
    summary = await checkpoint(fleet, await fleet.add("a"), await fleet.add("b"))
    a, b = await fleet.add("a"), await fleet.add("b", fail_restore="workers_missing")
    async with Controller(servers(a, b), fleet.root) as controller:
        with pytest.raises(RestoreFailed) as caught:
            await controller.restore(summary["checkpoint_id"])
    assert caught.value.aborted == ["a"] and caught.value.cause.code == "workers_missing"
    assert exit_code(caught.value) == 5


async def test_restore_of_a_missing_checkpoint_exits_5_before_anything_is_installed(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(fleet.root),
                    "restore", "--id", "nope")
    assert ran.code == 5 and "no_checkpoint from a" in ran.err
    assert fleet.calls() == [("a", "restore")]
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(fleet.root), "restore")
    assert ran.code == 5 and "no complete checkpoint" in ran.err


async def test_no_resume_leaves_every_server_restored(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    summary = await checkpoint(fleet, await fleet.add("a"), await fleet.add("b"))
    fleet.log.clear()
    a, b = await fleet.add("a"), await fleet.add("b")
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(fleet.root),
                    "restore", "--latest", "--no-resume")
    assert ran.code == 0, ran.err
    assert f"restored {summary['checkpoint_id']}, left restored" in ran.out
    assert "resume" not in {route for _, route in fleet.calls()}
    assert a.phase == b.phase == "restored"


async def test_latest_is_the_newest_complete_checkpoint(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
    older = await checkpoint(fleet, a, b, clock=lambda: 1_800_000_000.0)
    newer = await checkpoint(fleet, a, b, clock=lambda: 1_800_000_100.0)
    assert older["checkpoint_id"] < newer["checkpoint_id"]
    (fleet.root / "zz-incomplete" / "a").mkdir(parents=True)  # no CHECKPOINT.json
    ran = await ctl("--json", "--checkpoint-root", str(fleet.root), "list", token=False)
    assert ran.code == 0
    listed = [(c["id"], c["complete"]) for c in ran.json()["checkpoints"]]
    assert listed == [
        (newer["checkpoint_id"], True), (older["checkpoint_id"], True), ("zz-incomplete", False),
    ]
    fleet.log.clear()
    a2, b2 = await fleet.add("a"), await fleet.add("b")
    ran = await ctl("--json", *server_flags(a2, b2), "--checkpoint-root", str(fleet.root),
                    "restore", "--latest")
    assert ran.code == 0, ran.err
    assert ran.json()["checkpoint_id"] == newer["checkpoint_id"]
    assert {b["checkpoint_id"] for b in fleet.bodies("restore")} == {newer["checkpoint_id"]}


# -- ctl ------------------------------------------------------------------------------


async def test_ctl_checkpoint_with_a_config_file_scope_and_state(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]], tmp_path: Path
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
    (tmp_path / "a.token").write_text(TOKEN)
    config = tmp_path / "tether.toml"
    config.write_text(
        f'checkpoint_root = "{fleet.root.name}"\n'
        f'[[server]]\nname = "a"\nurl = "{a.url}"\ntoken_file = "a.token"\n'
        f'[[server]]\nurl = "{b.url}"\n'
    )
    (tmp_path / "scope.json").write_text('["e-a"]')
    (tmp_path / "state.json").write_text('{"step": 99}')
    ran = await ctl("--json", "--config", str(config), "checkpoint", "--id", "c1",
                    "--scope-file", str(tmp_path / "scope.json"),
                    "--state-file", str(tmp_path / "state.json"))
    assert ran.code == 0, ran.err
    summary = ran.json()
    assert summary["checkpoint_id"] == "c1" and summary["scope"] == ["e-a"]
    assert [s["name"] for s in summary["servers"]] == ["a", "b"]
    doc = json.loads((fleet.root / "c1" / CHECKPOINT_NAME).read_bytes())
    assert doc["controller_state"] == {"step": 99}
    ran = await ctl("--config", str(config), "list", token=False)
    assert ran.code == 0 and re.search(r"^c1 .* complete +a, b$", ran.out, re.MULTILINE)


async def test_ctl_prepare_commit_resume_by_hand_makes_a_complete_checkpoint(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
    common = [*server_flags(a, b), "--checkpoint-root", str(fleet.root)]
    assert (await ctl(*common, "prepare", "--id", "m1")).code == 0
    ran = await ctl(*common, "commit", "--id", "m1")
    assert ran.code == 0 and "committed m1" in ran.out
    assert (await ctl(*common, "commit", "--id", "m1")).code == 0, "commit again is idempotent"
    ran = await ctl(*common, "resume", "--id", "m1")
    assert ran.code == 0 and ran.out.strip() == "resumed b, a"
    assert resolve_latest(fleet.root) == "m1"
    assert fleet.calls() == [
        ("a", "prepare"), ("b", "prepare"), ("a", "commit"), ("b", "commit"),
        ("a", "commit"), ("b", "commit"), ("b", "resume"), ("a", "resume"),
    ]


async def test_ctl_prepare_of_a_blocked_server_exits_3_and_resumes_nothing(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a", block=True), await fleet.add("b")
    ran = await ctl("--json", *server_flags(a, b), "prepare", "--id", "p1", "--deadline", "5")
    assert ran.code == 3
    assert {n: s["state"] for n, s in ran.json()["servers"].items()} == {
        "a": "blocked", "b": "prepared"}
    assert fleet.bodies("prepare")[0] == {"checkpoint_id": "p1", "deadline_s": 5.0}
    assert "resume" not in {route for _, route in fleet.calls()}


async def test_ctl_status_retire_and_forget_reach_every_server(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]]
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
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
    assert fleet.bodies("forget") == [{"episode_ids": ["e1", "e2", "e3"]}] * 2


async def test_a_server_with_another_checkpoint_root_is_refused(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]], tmp_path: Path
) -> None:
    a = await fleet.add("a")
    b = await fleet.add("b", reported_root=str(tmp_path / "elsewhere"))
    async with Controller(servers(a, b), fleet.root) as controller:
        with pytest.raises(ControllerError) as caught:
            await controller.checkpoint("c1")
    assert (caught.value.code, caught.value.server) == ("root_mismatch", "b")
    assert "elsewhere" in str(caught.value.detail)
    ran = await ctl(*server_flags(a, b), "--checkpoint-root", str(fleet.root), "checkpoint")
    assert ran.code == 4 and "root_mismatch from b" in ran.err
    assert fleet.calls() == []


async def test_a_checkpoint_root_reached_through_a_symlink_is_the_same_root(
    fleet: Fleet, tmp_path: Path
) -> None:
    (tmp_path / "link").symlink_to(fleet.root)
    a = await fleet.add("a", reported_root=str(tmp_path / "link"))
    summary = await checkpoint(fleet, a)
    assert resolve_latest(fleet.root) == summary["checkpoint_id"]


async def test_a_configured_name_the_server_does_not_have_is_refused(fleet: Fleet) -> None:
    a = await fleet.add("a")
    async with Controller([Server("x", a.url, TOKEN)], fleet.root) as controller:
        with pytest.raises(ControllerError) as caught:
            await controller.retire("e1", 1)
    assert caught.value.code == "name_mismatch" and "calls itself 'a'" in caught.value.detail


async def test_the_token_comes_from_the_token_file_or_the_environment(
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await fleet.add("a")
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


async def test_an_answer_that_is_not_the_control_api_is_a_bad_answer(fleet: Fleet) -> None:
    a = await fleet.add("a")
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
    ctl: Callable[..., Awaitable[Ran]], tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[server]]\nurl = "http://127.0.0.1:9"\ntoken = "inline"\n')
    ran = await ctl("--config", str(config), "status")
    assert ran.code == 2 and "unknown keys ['token']" in ran.err
    (tmp_path / "scope.json").write_text('{"e1": true}')
    ran = await ctl("--server", "http://127.0.0.1:9", "--checkpoint-root", str(tmp_path),
                    "commit", "--id", "c1", "--scope-file", str(tmp_path / "scope.json"))
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
    fleet: Fleet, ctl: Callable[..., Awaitable[Ran]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await fleet.add("a"), await fleet.add("b")
    common = [*server_flags(a, b), "--checkpoint-root", str(fleet.root), "checkpoint"]
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
