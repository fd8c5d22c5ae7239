"""A worker that registers while a restore installs (issue #5, done when 6): it is
welcomed with the restore's tables, so it routes old cookies from its first request.

The in-process `tether serve` of test_claim_race (real coordinator, channel and uvicorn
workers) serving the counter; the loop's executor holds the install's record reads back
until the newcomer has registered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.checkpoint.conftest import eventually
from tests.coordinator.test_claim_race import (
    AUTH,
    BOUND,
    NAME,
    TOKEN,
    HeldReads,
    Server,
    Worker,
    _start_worker,
    start_server,
)
from tether.checkpoint import participant as participant_module
from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json
from tether.coordinator.worker import WorkerSettings

APP = "tether.examples.counter:app"
SESSIONS = 20


async def count(worker: Worker, cookie: str) -> Any:
    worker.http.cookies.clear()  # only the cookie given
    reply = await worker.http.get("/count", headers={"cookie": cookie})
    return reply.status_code, reply.json()


async def test_a_worker_registering_during_the_install_routes_old_cookies_at_once(
    short_tmp: Path,
) -> None:
    root = short_tmp / "ckpt"
    servers: list[Server] = []
    extra: list[Worker] = []
    installs = HeldReads(participant_module._read_paused)  # the runner shuts it down
    asyncio.get_running_loop().set_default_executor(installs)
    try:
        first = await start_server(short_tmp, root, "r1", APP)
        servers.append(first)
        a = first.workers[0]
        cookies = {}
        for number in range(SESSIONS):
            sid = f"s{number:02d}"
            a.http.cookies.clear()  # a new session, not the last one's
            reply = await a.http.post("/seed_session", json={"session_id": sid})
            cookies[sid] = reply.headers["set-cookie"].split(";")[0]
            for _ in range(number):
                a.http.cookies.clear()
                await a.http.post("/increment", headers={"cookie": cookies[sid]})
        assert (await a.ok("prepare", checkpoint_id="c1", deadline_s=BOUND))["state"] == (
            "prepared"
        )
        await a.ok("commit", checkpoint_id="c1")
        digest = read_manifest_digest(root, "c1", NAME)
        entry = {"name": NAME, "url": a.url, "manifest_digest": digest}
        write_checkpoint_json(root, "c1", [entry], None, None)  # type: ignore[list-item]
        await a.ok("resume", checkpoint_id="c1")
        await first.stop()

        second = await start_server(short_tmp, root, "r2", APP)
        servers.append(second)
        holder = second.workers[0]
        restoring = asyncio.create_task(
            holder.http.post("/_tether/restore", json={"checkpoint_id": "c1",
                                                       "deadline_s": BOUND}, headers=AUTH)
        )
        await eventually(
            installs.requested.is_set, BOUND, "a worker reads its placed records"
        )
        settings = WorkerSettings(app=APP, runtime_dir=str(second.runtime_dir), workers=2,
                                  fd=-1, token=TOKEN, name=NAME, checkpoint_root=str(root))
        newcomer = await _start_worker(settings)  # registers while the install is held
        extra.append(newcomer)
        assert not restoring.done()
        installs.release.set()
        reply = await restoring
        assert reply.status_code == 200, reply.text
        await holder.ok("resume", checkpoint_id="c1")

        # Every old cookie's first request since the restore lands on the newcomer.
        for number, (sid, cookie) in enumerate(cookies.items()):
            status, body = await count(newcomer, cookie)
            assert (status, body.get("count")) == (200, number), (sid, status, body)
            assert body["worker"] != newcomer.id
    finally:
        installs.release.set()
        for worker in extra:
            await worker.stop()
        for server in servers:
            await server.stop()
