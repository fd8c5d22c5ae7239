"""The one-process checkpoint suite, end to end at 1 and at 4 workers (issue #4, done
when 1): every "done when" point of issue #3, against real `tether serve` process
groups, each request on a new connection so that requests land on any worker
(SPEC 5, 6, 7, 8).

The in-process tests of tests/checkpoint/ check the same points on one worker; these run
them through the launcher, the coordinator and the channel. The tests play the
controller themselves (control calls over HTTP, CHECKPOINT.json written as the
controller writes it) except where `tether ctl` is the point. Small apps for the points
the reference apps cannot drive live in e2e/apps/ (`gated`: readiness and export driven
through files; `blobs`: the in-process tests' blob app).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.apps.blobs import blob_bytes
from e2e.apps.gated import GATES_ENV
from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    CounterSession,
    Http,
    Reply,
    Server,
    bounded,
    eventually,
    raw_exchange,
    run_tether,
)
from e2e.test_checkpoint_e2e import (
    FAULT_EXIT,
    NAME,
    checkpoint,
    checkpoint_args,
    control,
    controller_writes_checkpoint_json,
    counts_of,
    moved,
    ok,
    publish,
    seeded,
    temp_dirs,
)
from e2e.test_rescale_e2e import status
from tests.checkpoint.test_control import GOOD_BODIES, ID_ROUTES, ROUTES
from tests.checkpoint.test_restore import CORRUPTIONS, forge, write_raw_segment
from tether.checkpoint.segments import file_digest, read_records
from tether.checkpoint.store import CHECKPOINT_NAME, FAULT_ENV, resolve_latest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize("workers", [1, 4], ids=["1_worker", "4_workers"]),
]

EPISODES_APP = "tether.examples.episodes:app"
GATED_APP = "e2e.apps.gated:app"
BLOBS_APP = "e2e.apps.blobs:app"
STEPS = 60
BAD_TOKENS = [None, "Bearer wrong", "Basic {token}", "{token}"]
BAD_IDS = ["latest", "", "-c1", ".c1", "c 1", "c/1", "c1\n", "x" * 129]


# Helpers -------------------------------------------------------------------------------------


def total(answer: dict[str, Any], column: str) -> int:
    """A status column summed over the workers."""
    return sum(int(w[column]) for w in answer["workers"])


def is_error(reply: Reply, status: int, code: str) -> bool:
    return (reply.status, reply.code) == (status, code)


def records_of(root: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every record of a committed checkpoint, read back from its segments on disk."""
    directory = root / manifest["checkpoint_id"] / NAME
    return [r for s in manifest["segments"] for r in read_records(directory / s["file"])]


def logged(server: Server, event: str, checkpoint_id: str) -> list[int]:
    """Where in the server's log lines `event` for `checkpoint_id` appears."""
    return [i for i, r in enumerate(server.logs())
            if r.get("event") == event and r.get("checkpoint_id") == checkpoint_id]


async def fresh(server: Server, http: Http) -> None:
    """The server holds nothing: open, no checkpoint, no sessions, claims or episodes."""
    answer = await status(server, http)
    assert (answer["phase"], answer["checkpoint_id"]) == ("open", None), answer
    assert [(w["sessions"], w["claims"], w["episodes"]) for w in answer["workers"]] == [
        (0, 0, 0)
    ] * server.workers, answer["workers"]
    assert (answer["held_episodes"], server.claims()) == ([], {})
    assert answer["tables"] == {"placed_sessions": 0, "owner_aliases": 0}, answer["tables"]


async def run(
    http: Http, episode_id: str, attempt: int, steps: int = STEPS, step_ms: float = 5
) -> Reply:
    """POST /run of the episodes app, on a new connection."""
    body = {"episode_id": episode_id, "attempt": attempt, "steps": steps, "step_ms": step_ms}
    return await http.request("POST", "/run", json=body)


def held(answer: dict[str, Any]) -> dict[str, int]:
    return {h["episode_id"]: h["attempt_to_send"] for h in answer["held_episodes"]}


async def seeded_on_every_worker(
    server: Server, http: Http, prefix: str
) -> dict[str, CounterSession]:
    """Counter sessions seeded in rounds until every worker holds one (connections go
    to whichever worker accepts them); session `<prefix><round>-<i>` counts i % 4."""
    sessions: dict[str, CounterSession] = {}
    for index in range(20):
        batch = await seeded(http, f"{prefix}{index}", [i % 4 for i in range(8)])
        sessions.update((s.id, s) for s in batch)
        if all(w["sessions"] for w in (await status(server, http))["workers"]):
            return sessions
    raise AssertionError(f"some worker of {server.url} was never given a session")


def count_of(session_id: str) -> int:
    """What `seeded_on_every_worker` counted session `session_id` to."""
    return int(session_id.rsplit("-", 1)[1]) % 4


async def commit_killed_by_the_fault_hook(
    server: Server, http: Http, checkpoint_id: str, workers: int
) -> None:
    """Commit on a server started with the fault hook set, and wait until the process
    that writes the manifest died at the hook: the main process, whatever the worker
    count (its checkpointer runs there; its workers then stop). Then SIGKILL whatever
    is left of the group."""
    try:
        reply = await control(server, http, "commit", checkpoint_id=checkpoint_id)
    except (aiohttp.ClientError, TimeoutError):
        reply = None
    assert reply is None or reply.status != 200, reply
    assert await server.exit_code(within=20) == FAULT_EXIT
    await server.crash()


async def ctl(root: Path, server: Server, *command: str) -> Any:
    """`tether ctl --json ... COMMAND` against `server`; its JSON document."""
    token = server.base / "ctl-token"
    token.write_text(server.token)
    done = await asyncio.to_thread(
        run_tether, "ctl", "--server", server.url, "--checkpoint-root", str(root),
        "--token-file", str(token), "--json", *command,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout)


# 1. The counter through a SIGKILL of the group ------------------------------------------------


async def test_counter_sessions_restore_their_checkpointed_counts_after_a_sigkill(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, workers, *checkpoint_args(root))
    checkpointed = [i % 4 for i in range(200)]
    async with Http(first.url) as http:
        sessions = await seeded(http, "kill", checkpointed)
        manifest = await checkpoint(root, first, http, "c1")
        assert manifest["records"] == {"sessions": 200, "episodes": 0}
        assert len(manifest["segments"]) == workers
        await bounded(s.increment() for s in sessions)
        assert await counts_of(sessions) == [(200, n + 1) for n in checkpointed]
        [late] = await seeded(http, "late", [1])
    await first.crash()

    second = serve(COUNTER_APP, workers, *checkpoint_args(root, "--restore", "latest"))
    assert [r["checkpoint_id"] for r in second.logs() if r.get("event") == "restored"] == ["c1"]
    async with Http(second.url) as http:
        answer = await status(second, http)
        assert (answer["phase"], total(answer, "sessions")) == ("open", 200)
        sessions = moved(sessions, http)
        # Every old cookie reads its checkpointed count: the later increments are gone.
        assert await counts_of(sessions) == [(200, n) for n in checkpointed]
        counted = await bounded(s.increment() for s in sessions)
        assert [(r.status, r.json["count"]) for r in counted] == [
            (200, n + 1) for n in checkpointed
        ]
        # So is the session seeded after the checkpoint.
        [late] = moved([late], http)
        reply = await late.count()
        assert is_error(reply, 404, "session_lost"), reply
        assert await ok(second, http, "resume", checkpoint_id="c1") == {"phase": "open"}


# 2. Episodes: parked by a checkpoint, continued exactly once after a restore ---------------------


async def test_episodes_park_at_a_checkpoint_and_continue_exactly_once_after_a_restore(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    ids = [f"ep-{i:02d}" for i in range(20)]
    first = serve(EPISODES_APP, workers, *checkpoint_args(root))
    async with Http(first.url) as http:
        old = {w["id"] for w in (await status(first, http))["workers"]}
        runs = [asyncio.ensure_future(run(http, e, 1, step_ms=25)) for e in ids]
        try:

            async def running() -> bool:
                ended = [r.result() for r in runs if r.done()]
                assert not ended, f"runs ended before the checkpoint: {ended[:3]}"
                return total(await status(first, http), "episodes") == len(ids)

            await eventually(running, 20, "every run has started")
            prepared = await ok(first, http, "prepare", checkpoint_id="c1", deadline_s=10)
            assert prepared["state"] == "prepared", prepared
            reply = await run(http, "new", 1)
            assert is_error(reply, 503, "checkpoint_parked"), reply
            manifest = await ok(first, http, "commit", checkpoint_id="c1")
            # Prepared while none had finished: every run was parked at a boundary.
            assert manifest["records"] == {"sessions": 0, "episodes": len(ids)}
            assert not any(r.done() for r in runs)
            assert total(await status(first, http), "episodes") == len(ids)
            records = records_of(root, manifest)
            steps = {r["episode_id"]: r["state"]["step"] for r in records}
            assert sorted(steps) == ids
            assert {r["attempt"] for r in records} == {1}
            assert all(0 < step < STEPS for step in steps.values()), steps
            publish(root, first, "c1")
            await ok(first, http, "resume", checkpoint_id="c1")
            finished = await asyncio.wait_for(asyncio.gather(*runs), 30)
        finally:
            for task in runs:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    # Each original run went on after the resume and finished.
    assert [(r.status, r.json["steps_done"], r.json["resumed_from"]) for r in finished] == [
        (200, STEPS, 0)
    ] * len(ids), finished[:3]
    await first.crash()

    second = serve(EPISODES_APP, workers, *checkpoint_args(root, "--restore", "latest"))
    async with Http(second.url) as http:
        live = {w["id"] for w in (await status(second, http))["workers"]}
        assert held(await status(second, http)) == dict.fromkeys(ids, 2)
        stale = await bounded(run(http, e, 1) for e in ids)
        assert all(is_error(r, 409, "stale_attempt") for r in stale), stale[:3]
        ahead = await bounded(run(http, e, 3) for e in ids)
        assert all(is_error(r, 409, "attempt_mismatch") for r in ahead), ahead[:3]
        assert {r.json["detail"]["expected"] for r in ahead} == {2}

        def continued(reply: Reply, episode_id: str) -> str:
            """The worker that continued `episode_id` from its checkpointed step."""
            body, start = reply.json, steps[episode_id]
            assert reply.status == 200, reply
            assert (body["attempt"], body["resumed_from"], body["steps_done"]) == (
                2, start, STEPS
            ), body
            assert set(body["workers"][:start]) <= old, body
            [worker] = set(body["workers"][start:])
            assert worker in live
            return str(worker)

        # Attempt 2 claims its record; a second, concurrent attempt 2 is refused.
        first_id = ids[0]
        claimer = asyncio.ensure_future(run(http, first_id, 2, step_ms=20))
        try:

            async def claimed(episode_id: str) -> bool:
                return episode_id not in held(await status(second, http))

            await eventually(lambda: claimed(first_id), 10, f"{first_id} is claimed")
            twice = await run(http, first_id, 2)
            assert not claimer.done(), "the first attempt 2 ended before the second came"
            long = await asyncio.wait_for(claimer, 30)
        finally:
            claimer.cancel()
            await asyncio.gather(claimer, return_exceptions=True)
        assert is_error(twice, 409, "episode_claimed"), twice
        assert twice.json["detail"]["worker"] == continued(long, first_id)

        # A claimed request whose client leaves before its first boundary hands the
        # record back, and a retry continues it.
        gone_id = ids[1]
        body = json.dumps({"episode_id": gone_id, "attempt": 2, "steps": STEPS,
                           "step_ms": 1000}).encode()
        head = (f"POST /run HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body
        leaving = asyncio.ensure_future(raw_exchange(*second.host_port, head))
        try:
            await eventually(lambda: claimed(gone_id), 10, f"{gone_id} is claimed")
        finally:
            leaving.cancel()  # closes the connection
            await asyncio.gather(leaving, return_exceptions=True)

        async def handed_back() -> bool:
            return held(await status(second, http)).get(gone_id) == 2

        await eventually(handed_back, 10, f"{gone_id} is held again for attempt 2")
        continued(await run(http, gone_id, 2), gone_id)

        rest = await bounded(run(http, e, 2) for e in ids[2:])
        for reply, episode_id in zip(rest, ids[2:], strict=True):
            continued(reply, episode_id)
        after = await status(second, http)
        assert (after["held_episodes"], after["lost_episodes"]) == ([], [])


# 3. Admission while a checkpoint is open ------------------------------------------------------


async def test_an_open_checkpoint_parks_new_work_serves_health_and_holds_session_requests(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    server = serve(COUNTER_APP, workers, *checkpoint_args(root))
    async with Http(server.url) as http:
        [old] = await seeded(http, "old", [1])
        before = await status(server, http)
        claim_files = server.claim_files()
        prepared = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10)
        assert prepared["state"] == "prepared", prepared

        seeds = await bounded(
            http.request("POST", "/seed_session", json={"session_id": f"new-{i}"})
            for i in range(8)
        )
        minted = await http.request("POST", "/increment")  # the router would mint an ID
        for reply in [*seeds, minted]:
            assert is_error(reply, 503, "checkpoint_parked"), reply
            assert reply.headers["retry-after"] == "1"
            assert reply.cookie() is None
        # Parked before any claim was made.
        assert server.claim_files() == claim_files
        assert not [s for s in server.claims() if s.startswith("new-")]
        during = await status(server, http)
        assert (total(during, "claims"), total(during, "sessions")) == (
            total(before, "claims"), 1
        )
        for cookie in (None, old.cookie):
            reply = await http.request("GET", "/health", cookie=cookie)
            assert (reply.status, reply.json) == (200, {"ok": True}), reply

        waiting = asyncio.ensure_future(old.increment())
        try:
            done, _ = await asyncio.wait({waiting}, timeout=0.5)
            assert not done, f"a request of a held session went through: {waiting.result()}"
            # Waiting at admission does not count against readiness, and does not get in.
            again = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10)
            assert (again["state"], again["blockers"]) == ("prepared", [])
            manifest = await ok(server, http, "commit", checkpoint_id="c1")
            assert [(r["id"], r["state"]) for r in records_of(root, manifest)] == [(old.id, 1)]
            assert not waiting.done()
            await ok(server, http, "resume", checkpoint_id="c1")
            reply = await asyncio.wait_for(waiting, 10)
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        assert (reply.status, reply.json["count"]) == (200, 2), reply
        reply = await http.request("POST", "/seed_session", json={"session_id": "new-0"})
        assert reply.status == 200, reply


# 4. Readiness ----------------------------------------------------------------------------------


async def test_a_busy_session_blocks_prepare_until_it_is_done_even_when_nothing_tells(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    server = serve(GATED_APP, workers, *checkpoint_args(tmp_path / "ckpt"),
                   env={GATES_ENV: str(gates)})
    async with Http(server.url) as http:
        [busy, quiet] = await seeded(http, "busy", [0, 0])
        holding = asyncio.ensure_future(
            http.request("POST", "/hold", cookie=busy.cookie)
        )
        try:
            await eventually((gates / f"holding-{busy.id}").exists, 10, "the request runs")
            started = time.monotonic()
            answer = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=0.3)
            assert time.monotonic() - started >= 0.3, "blocked before its deadline"
            assert (answer["state"], answer["blockers_total"]) == ("blocked", 1), answer
            [blocker] = answer["blockers"]
            assert (blocker["kind"], blocker["worker"], blocker["id"]) == (
                "session_busy", busy.worker, busy.id
            ), blocker
            during = await status(server, http)
            assert (during["phase"], during["checkpoint_id"]) == ("preparing", "c1")
            assert during["blockers_total"] == 1
            # Blocked stays closed: new work is parked, and commit is not allowed yet.
            reply = await http.request("POST", "/seed_session", json={"session_id": "x"})
            assert is_error(reply, 503, "checkpoint_parked"), reply
            reply = await control(server, http, "commit", checkpoint_id="c1")
            assert is_error(reply, 409, "invalid_phase"), reply
        finally:
            (gates / f"release-{busy.id}").touch()
            [held_reply] = await asyncio.gather(holding, return_exceptions=True)
        assert isinstance(held_reply, Reply), held_reply
        assert (held_reply.status, held_reply.json["count"]) == (200, 1), held_reply
        again = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10)
        assert (again["state"], again["blockers"], again["blockers_total"]) == (
            "prepared", [], 0
        )
        await ok(server, http, "resume", checkpoint_id="c1")

        # The app's busy flag flips with no notification to tether: the poll notices.
        (gates / f"busy-{quiet.id}").touch()
        prepare = asyncio.ensure_future(
            ok(server, http, "prepare", checkpoint_id="c2", deadline_s=30)
        )
        try:

            async def blocked() -> list[Any]:
                found: list[Any] = (await status(server, http))["blockers"]
                return found

            [blocker] = await eventually(blocked, 10, "status lists the busy session")
            assert (blocker["kind"], blocker["worker"], blocker["id"]) == (
                "session_busy", quiet.worker, quiet.id
            ), blocker
            assert not prepare.done()
            (gates / f"busy-{quiet.id}").unlink()
            answer = await asyncio.wait_for(prepare, 5)  # far before its 30 s deadline
        finally:
            prepare.cancel()
            await asyncio.gather(prepare, return_exceptions=True)
        assert answer["state"] == "prepared", answer
        await ok(server, http, "resume", checkpoint_id="c2")


# 5. The lease ----------------------------------------------------------------------------------


async def test_a_prepare_left_alone_resumes_by_itself_when_its_lease_runs_out(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    server = serve(COUNTER_APP, workers, *checkpoint_args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        [session] = await seeded(http, "lease", [0])
        called = time.time()
        answer = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=0.2,
                          lease_s=0.3)
        assert answer["state"] == "prepared", answer
        assert answer["lease_expires_at"] == pytest.approx(called + 0.5, abs=0.5)
        # No control call from here on: only the server's own lease timer reopens
        # admission and lets the waiting request in.
        waiting = asyncio.ensure_future(session.increment())
        try:
            reply = await asyncio.wait_for(waiting, 10)
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        assert time.time() >= answer["lease_expires_at"] - 0.05
        assert (reply.status, reply.json["count"]) == (200, 1), reply
        await eventually(lambda: logged(server, "lease_expired", "c1"), 5, "the expiry is logged")
        after = await status(server, http)
        assert (after["phase"], after["checkpoint_id"]) == ("open", None)
        reply = await http.request("POST", "/seed_session", json={"session_id": "later"})
        assert reply.status == 200, reply
        for route in ("commit", "prepare", "renew"):
            reply = await control(server, http, route, checkpoint_id="c1")
            assert is_error(reply, 409, "stale_checkpoint"), reply
        assert await ok(server, http, "resume", checkpoint_id="c1") == {"phase": "open"}


class Pinned:
    """One kept-alive connection to a server: every request on it reaches the worker
    that accepted it (the harness's clients open a new connection per request)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def __aenter__(self) -> Pinned:
        self._streams = await asyncio.open_connection(*self.server.host_port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._streams is not None
        writer = self._streams[1]
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    async def request(self, method: str, path: str, body: Any = None) -> Reply:
        """One request (a control call if `path` is one), read whole."""
        assert self._streams is not None
        reader, writer = self._streams
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", "host: tether", f"content-length: {len(data)}",
                "content-type: application/json",
                f"authorization: Bearer {self.server.token}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines if line)
        raw = await reader.readexactly(int(headers["content-length"]))
        return Reply(method, path, int(status_line.split()[1]), raw, headers, [])


async def test_a_lease_that_falls_inside_a_slow_commit_fires_only_after_it(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root, gates = tmp_path / "ckpt", tmp_path / "gates"
    gates.mkdir()
    server = serve(GATED_APP, workers, *checkpoint_args(root), env={GATES_ENV: str(gates)})
    async with Http(server.url) as http:
        await seeded_on_every_worker(server, http, "slow")
        async with Pinned(server) as pinned:
            # The export is slow on every worker but the one that relays the commit, so
            # that its answer could come back while the others export; with one worker,
            # on that one.
            relay = (await pinned.request("GET", "/whoami")).json["worker"]
            listed = (await status(server, http))["workers"]
            others = [w["id"] for w in listed if w["id"] != relay]
            (gates / "slow-export").write_text("\n".join(others or [relay]))
            answer = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=0.2,
                              lease_s=0.2)
            assert answer["state"] == "prepared", answer
            sent = time.time()
            body = {"checkpoint_id": "c1", "deadline_s": 0.2}
            commit = asyncio.ensure_future(pinned.request("POST", "/_tether/commit", body))
            try:
                await eventually((gates / "exporting").exists, 10, "the export runs")
                # The commit's lease: its call time + its 0.2 s deadline + the 0.2 s lease.
                await eventually(lambda: time.time() > sent + 1.0, 5, "the lease is past")
                assert not commit.done(), f"the commit answered during the export: {commit}"
                assert not logged(server, "lease_expired", "c1"), "expired during the commit"
            finally:
                (gates / "export-open").touch()
                [reply] = await asyncio.gather(commit, return_exceptions=True)
        assert isinstance(reply, Reply) and is_error(reply, 504, "deadline_exceeded"), reply

        async def expired() -> bool:
            return bool(logged(server, "lease_expired", "c1"))

        await eventually(expired, 10, "the lease expires once the commit ended")
        [finished] = logged(server, "checkpoint_commit_failed", "c1")
        assert logged(server, "lease_expired", "c1")[0] > finished
        assert (await status(server, http))["phase"] == "open"
        assert temp_dirs(root, "c1") == []
        assert not (root / "c1" / NAME).exists()
        reply = await control(server, http, "prepare", checkpoint_id="c1")
        assert is_error(reply, 409, "stale_checkpoint"), reply


# 6. Retries and wrong calls -------------------------------------------------------------------


async def test_control_calls_are_safe_to_retry_and_wrong_ones_are_refused_with_their_code(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    server = serve(COUNTER_APP, workers, *checkpoint_args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        await seeded(http, "retry", [1])

        async def call(route: str, body: dict[str, Any], authorization: str | None) -> Reply:
            headers = {} if authorization is None else {"authorization": authorization}
            if route == "status":
                return await http.request("GET", "/_tether/status", headers=headers)
            return await http.request("POST", f"/_tether/{route}", json=body, headers=headers)

        for bad in BAD_TOKENS:
            authorization = None if bad is None else bad.format(token=server.token)
            for route in ROUTES:
                reply = await call(route, GOOD_BODIES[route], authorization)
                assert is_error(reply, 401, "unauthorized"), (bad, reply)
                assert reply.headers["www-authenticate"] == "Bearer"
        # 401 comes before body validation.
        reply = await call("prepare", {"checkpoint_id": "latest", "x": 1}, None)
        assert is_error(reply, 401, "unauthorized"), reply
        for route in ROUTES[1:]:
            reply = await control(server, http, route, **GOOD_BODIES[route], surprise=1)
            assert is_error(reply, 422, "invalid_request"), reply
        # None of that did anything.
        assert (await status(server, http))["phase"] == "open"
        for route in ("commit", "renew", "abort_restore"):
            reply = await control(server, http, route, checkpoint_id="c1")
            assert is_error(reply, 409, "invalid_phase"), reply

        first = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10)
        again = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10)
        assert (first["state"], again["state"]) == ("prepared", "prepared")
        assert again["lease_expires_at"] >= first["lease_expires_at"]
        for bad_id in BAD_IDS:  # 422 comes before conflicts and phases
            for route in ID_ROUTES:
                reply = await control(server, http, route, checkpoint_id=bad_id)
                assert is_error(reply, 422, "invalid_checkpoint_id"), (bad_id, reply)
        for route in ("prepare", "commit", "resume", "renew", "abort_restore", "restore"):
            reply = await control(server, http, route, checkpoint_id="c2")
            assert is_error(reply, 409, "checkpoint_conflict"), reply
        reply = await control(server, http, "restore", checkpoint_id="c1")
        assert is_error(reply, 409, "invalid_phase"), reply
        assert (await status(server, http))["checkpoint_id"] == "c1"

        both = await asyncio.gather(
            ok(server, http, "commit", checkpoint_id="c1"),
            ok(server, http, "commit", checkpoint_id="c1"),
        )
        assert both[0] == both[1]
        assert await ok(server, http, "commit", checkpoint_id="c1") == both[0]
        assert both[0]["records"] == {"sessions": 1, "episodes": 0}
        reply = await control(server, http, "prepare", checkpoint_id="c1")
        assert is_error(reply, 409, "invalid_phase"), reply
        for _ in range(2):
            assert await ok(server, http, "resume", checkpoint_id="c1") == {"phase": "open"}

        # Delayed calls of a resumed ID, and of an ID resumed before it was ever prepared.
        for route in ("prepare", "commit", "renew"):
            reply = await control(server, http, route, checkpoint_id="c1")
            assert is_error(reply, 409, "stale_checkpoint"), reply
        assert await ok(server, http, "resume", checkpoint_id="never-seen") == {"phase": "open"}
        reply = await control(server, http, "prepare", checkpoint_id="never-seen")
        assert is_error(reply, 409, "stale_checkpoint"), reply
        prepared = await ok(server, http, "prepare", checkpoint_id="c2", deadline_s=10)
        assert prepared["state"] == "prepared"
        reply = await control(server, http, "prepare", checkpoint_id="c1")
        assert is_error(reply, 409, "stale_checkpoint"), reply  # stale before conflict
        assert (await status(server, http))["checkpoint_id"] == "c2"
        await ok(server, http, "resume", checkpoint_id="c2")


# 7. Restore: only on a fresh server, all or nothing -------------------------------------------


def duplicated_session() -> dict[str, Any]:
    """`forge` edits that add to the first segment a copy of a session record of another
    segment (of its own with one worker), under the first segment's owner, the manifest
    telling the truth about the segment and the counts."""
    info: dict[str, Any] = {}

    def segment(path: Path) -> None:
        records = list(read_records(path))
        others = sorted(p for p in path.parent.glob("segment-*") if p != path)
        donor = list(read_records(others[0])) if others else records
        twice = {**donor[0], "owner": records[0]["owner"]}
        write_raw_segment(path, [*records, twice])
        digest, size = file_digest(path)
        info.update(bytes=size, records=len(records) + 1, digest=digest)

    def manifest(doc: dict[str, Any]) -> None:
        doc["segments"][0].update(info)
        doc["records"]["sessions"] += 1

    return {"segment": segment, "manifest": manifest}


async def test_restore_is_all_or_nothing_and_only_on_a_fresh_server(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    first = serve(COUNTER_APP, workers, *checkpoint_args(root))
    async with Http(first.url) as http:
        sessions = await seeded_on_every_worker(first, http, "fresh")
        manifest = await checkpoint(root, first, http, "good")
        # A server that already served a session is not fresh.
        for dry_run in (False, True):
            reply = await control(first, http, "restore", checkpoint_id="good", dry_run=dry_run)
            assert is_error(reply, 409, "not_fresh"), reply
    await first.crash()
    assert len(manifest["segments"]) == workers
    assert all(s["records"] for s in manifest["segments"])

    # With 4 workers, one of the 4 segments is corrupt (the first).
    # The in-process duplicate rewrites the segment's counts as if it were the only one.
    corruptions = {**CORRUPTIONS, "duplicate-session": duplicated_session()}
    for name, edits in corruptions.items():
        forge(root, f"bad-{name}", **edits)

    server = serve(COUNTER_APP, workers, *checkpoint_args(root))
    async with Http(server.url) as http:
        for name in corruptions:
            for dry_run in (False, True):
                reply = await control(server, http, "restore", checkpoint_id=f"bad-{name}",
                                      dry_run=dry_run)
                assert is_error(reply, 422, "corrupt_checkpoint"), (name, reply)
        await fresh(server, http)

        # (No request of an old cookie while the server should stay fresh: with several
        # workers its handler's reading the session claims the ID, SPEC 4.3.)
        answer = await ok(server, http, "restore", checkpoint_id="good", dry_run=True)
        assert answer["installed_sessions"] == len(sessions)
        await fresh(server, http)

        answer = await ok(server, http, "restore", checkpoint_id="good")
        assert answer["installed_sessions"] == len(sessions)
        assert (await status(server, http))["phase"] == "restored"
        for dry_run in (False, True):
            reply = await control(server, http, "restore", checkpoint_id="good", dry_run=dry_run)
            assert is_error(reply, 409, "not_fresh"), reply
        for _ in range(2):
            reply = await control(server, http, "abort_restore", checkpoint_id="good")
            assert (reply.status, reply.json) == (200, {"phase": "open", "fresh": True}), reply
        await fresh(server, http)

        answer = await ok(server, http, "restore", checkpoint_id="good")
        assert answer["installed_sessions"] == len(sessions)
        await ok(server, http, "resume", checkpoint_id="good")
        ours = moved(list(sessions.values()), http)
        assert await counts_of(ours) == [(200, count_of(s.id)) for s in ours]
        reply = await control(server, http, "restore", checkpoint_id="good")
        assert is_error(reply, 409, "not_fresh"), reply


# 8. Crash windows of a commit -----------------------------------------------------------------


async def test_only_a_checkpoint_that_outlived_every_crash_window_is_restorable(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    # c1: complete (killed after both its manifest and CHECKPOINT.json were in place).
    # c4: committed, then the controller dies while it writes CHECKPOINT.json.
    first = serve(COUNTER_APP, workers, *checkpoint_args(root))
    async with Http(first.url) as http:
        sessions = await seeded(http, "window", [1, 2, 3])
        await checkpoint(root, first, http, "c1")
        prepared = await ok(first, http, "prepare", checkpoint_id="c4", deadline_s=10)
        assert prepared["state"] == "prepared", prepared
        await ok(first, http, "commit", checkpoint_id="c4")
        fault = "before_checkpoint_rename"
        assert controller_writes_checkpoint_json(root, first, "c4", fault) == FAULT_EXIT
        await ok(first, http, "resume", checkpoint_id="c4")
        await bounded(s.increment() for s in sessions)
    await first.crash()
    assert (root / "c4" / NAME).exists() and not (root / "c4" / CHECKPOINT_NAME).exists()

    # c2: killed after the segments, before the manifest.
    faulty = serve(COUNTER_APP, workers, *checkpoint_args(root),
                   env={FAULT_ENV: "after_segments"})
    async with Http(faulty.url) as http:
        await seeded(http, "segments", [1, 1, 1, 1])
        prepared = await ok(faulty, http, "prepare", checkpoint_id="c2", deadline_s=10)
        assert prepared["state"] == "prepared", prepared
        await commit_killed_by_the_fault_hook(faulty, http, "c2", workers)
    assert not (root / "c2" / NAME).exists()
    [temp] = temp_dirs(root, "c2")
    assert len(list((root / "c2" / temp).glob("segment-*"))) == workers

    # c3: killed after the manifest (the participant directory is published), before
    # CHECKPOINT.json.
    faulty = serve(COUNTER_APP, workers, *checkpoint_args(root),
                   env={FAULT_ENV: "after_manifest"})
    async with Http(faulty.url) as http:
        await seeded(http, "manifest", [1])
        prepared = await ok(faulty, http, "prepare", checkpoint_id="c3", deadline_s=10)
        assert prepared["state"] == "prepared", prepared
        await commit_killed_by_the_fault_hook(faulty, http, "c3", workers)
    assert (root / "c3" / NAME / "MANIFEST.json").exists()
    assert not (root / "c3" / CHECKPOINT_NAME).exists()

    # Only c1 is restorable, though the others are newer; `latest` skips them.
    assert resolve_latest(root, NAME) == "c1"
    server = serve(COUNTER_APP, workers, *checkpoint_args(root))
    async with Http(server.url) as http:
        for checkpoint_id in ("c2", "c3", "c4"):
            reply = await control(server, http, "restore", checkpoint_id=checkpoint_id)
            assert is_error(reply, 404, "no_checkpoint"), reply
        await fresh(server, http)
        # A published ID cannot be committed again, even by a server that never saw it.
        for route in ("prepare", "commit"):
            reply = await control(server, http, route, checkpoint_id="c3")
            assert is_error(reply, 409, "stale_checkpoint"), reply
        answer = await ok(server, http, "restore", checkpoint_id="c1")
        assert answer["installed_sessions"] == 3
        await ok(server, http, "resume", checkpoint_id="c1")
        assert await counts_of(moved(sessions, http)) == [(200, 1), (200, 2), (200, 3)]


# 9. Retire and forget -------------------------------------------------------------------------


async def test_retire_stops_an_attempt_everywhere_until_forget_and_not_during_a_checkpoint(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    server = serve(EPISODES_APP, workers, *checkpoint_args(tmp_path / "ckpt"))
    async with Http(server.url) as http:
        running = asyncio.ensure_future(run(http, "ep", 2, step_ms=200))
        try:

            async def started() -> bool:
                return total(await status(server, http), "episodes") == 1

            await eventually(started, 10, "attempt 2 runs")
            answer = await ok(server, http, "retire", episode_id="ep", attempt=2)
            assert answer == {
                "retired": [{"episode_id": "ep", "attempt": 2, "stopped": 1, "dropped_held": 0}]
            }
            # It answers once the attempt has stopped and its state is freed.
            assert total(await status(server, http), "episodes") == 0
            reply = await asyncio.wait_for(running, 10)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        assert is_error(reply, 409, "stale_attempt"), reply

        # On whichever worker they land, the retired attempt and older ones are refused.
        for attempt in [1, 2] * workers:
            reply = await run(http, "ep", attempt, steps=1)
            assert is_error(reply, 409, "stale_attempt"), reply
        assert (await run(http, "ep", 3, steps=1)).status == 200
        assert (await run(http, "other", 1, steps=1)).status == 200
        answer = await ok(server, http, "forget", episode_ids=["ep", "never-retired"])
        assert answer == {"forgotten": ["ep"]}
        for _ in range(workers):
            reply = await run(http, "ep", 2, steps=1)
            assert reply.status == 200, reply

        prepared = await ok(server, http, "prepare", checkpoint_id="c1", deadline_s=10)
        assert prepared["state"] == "prepared", prepared
        for then in ("commit", "resume"):  # refused while prepared, then while committed
            reply = await control(server, http, "retire", episode_id="ep", attempt=1)
            assert is_error(reply, 409, "invalid_phase"), reply
            await ok(server, http, then, checkpoint_id="c1")
        answer = await ok(server, http, "retire", episode_id="ep", attempt=1)
        assert [r["attempt"] for r in answer["retired"]] == [1]


# 10. A large record, `tether ctl list` and `latest`, the controller's state -------------------


async def test_a_32_mib_record_and_the_controller_state_round_trip_through_the_newest(
    serve: Serve, tmp_path: Path, workers: int
) -> None:
    root = tmp_path / "ckpt"
    size = 32 * 1024 * 1024
    first = serve(BLOBS_APP, workers, *checkpoint_args(root))
    # IDs sorted the other way round from their age: `latest` goes by created_at.
    ids = ["zz-first", "mm-second", "aa-third"]
    cookies: dict[str, tuple[str, int]] = {}
    async with Http(first.url) as http:

        async def seed(session_id: str, length: int) -> None:
            reply = await http.request(
                "POST", "/seed_session", json={"session_id": session_id, "size": length}
            )
            assert reply.status == 200 and reply.cookie() is not None, reply
            cookies[session_id] = (str(reply.cookie()), length)

        await seed("big", size)
        await seed("small", 3)
        for index, checkpoint_id in enumerate(ids):
            state = tmp_path / f"state-{index}.json"
            state.write_text(json.dumps({"step": index, "of": checkpoint_id}))
            summary = await ctl(root, first, "checkpoint", "--id", checkpoint_id,
                                "--state-file", str(state))
            assert summary["checkpoint_id"] == checkpoint_id
            await seed(f"later-{index}", index + 1)  # in the next checkpoints only
    listed = await ctl(root, first, "list")
    await first.crash()

    assert [(c["id"], c["complete"]) for c in listed["checkpoints"]] == [
        (checkpoint_id, True) for checkpoint_id in reversed(ids)
    ]
    assert resolve_latest(root, NAME) == "aa-third"
    for index, checkpoint_id in enumerate(ids):
        written = json.loads((root / checkpoint_id / CHECKPOINT_NAME).read_text())
        assert written["controller_state"] == {"step": index, "of": checkpoint_id}
    manifest = json.loads((root / "aa-third" / NAME / "MANIFEST.json").read_text())
    assert manifest["records"] == {"sessions": 4, "episodes": 0}
    assert len(manifest["segments"]) == workers
    assert size < max(s["bytes"] for s in manifest["segments"]) < size + 4096

    second = serve(BLOBS_APP, workers, *checkpoint_args(root, "--restore", "latest"))
    restored = [r for r in second.logs() if r.get("event") == "restored"]
    assert [(r["checkpoint_id"], r["sessions"]) for r in restored] == [("aa-third", 4)]
    async with Http(second.url) as http:
        for session_id, (cookie, length) in cookies.items():
            reply = await http.request("GET", "/blob", cookie=cookie)
            if session_id == "later-2":  # seeded after the last checkpoint
                assert is_error(reply, 404, "session_lost"), reply
                continue
            expected = hashlib.sha256(blob_bytes(session_id, length)).hexdigest()
            assert (reply.status, reply.json) == (
                200, {"sha256": expected, "bytes": length}
            ), (session_id, reply)

