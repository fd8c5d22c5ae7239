"""`tether demo`: the whole story on this machine, with the reference apps.

1. The counter at 4 workers under plain `uvicorn --workers 4`, then under
   `tether serve --workers 4`: 1,000 concurrent sessions, a new connection per request.
2. A checkpoint, SIGKILL of the whole process group, and a restore onto 2 workers:
   every counter continues from its checkpointed value through its old cookie.
3. A rescale to 3 workers (checkpoint, stop, restore) and the same check.
   After each restore every worker holds restored sessions, the counts within one of
   each other (SPEC 5.7), and every worker answers some of them.
4. The episodes app: runs parked by a checkpoint, SIGKILL, restore onto 3 workers;
   each run continues exactly once, a duplicate gets 409 `episode_claimed`.

It prints a short table and exits non-zero if anything is wrong.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from tether.coordinator.controller import Controller, Server

STEPS = 5
CONCURRENCY = 200
START_TIMEOUT_S = 60.0
EPISODES = 20
EPISODE_STEPS = 40
STEP_MS = 25


@dataclass
class Row:
    label: str
    right: int
    total: int
    workers_seen: int
    seconds: float
    held: list[int] | None = None
    """Sessions each worker holds (status `workers[].sessions`), where it is shown."""
    spread: bool = False
    """Whether `held` must cover every worker within one and every worker answer."""

    @property
    def ok(self) -> bool:
        if self.right != self.total:
            return False
        if not self.spread:
            return True
        held = self.held or [0]
        return min(held) > 0 and max(held) - min(held) <= 1 and self.workers_seen == len(held)

    @property
    def held_text(self) -> str:
        return "/".join(str(n) for n in sorted(self.held, reverse=True)) if self.held else "-"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Process:
    """A server process in its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, command: list[str], port: int, env: dict[str, str]) -> Process:
        proc = await asyncio.create_subprocess_exec(
            *command, cwd=_root(), env=env, start_new_session=True,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        server = cls(proc, url)
        await server._wait_ready(env.get("TETHER_CONTROL_TOKEN"))
        return server

    async def _wait_ready(self, token: str | None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        path = "/_tether/status" if token else "/health"
        headers = {"authorization": f"Bearer {token}"} if token else {}
        async with aiohttp.ClientSession() as client:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}")
                try:
                    async with client.get(self.url + path, headers=headers) as reply:
                        if reply.status == 200:
                            body = await reply.json()
                            if not token or len(body["workers"]) == body["expected_workers"]:
                                return
                except (aiohttp.ClientError, KeyError):
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError("the server did not start in time")

    async def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would."""
        if self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 40)
            except TimeoutError:
                await self.kill()


def _client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True, limit=0),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def _each(count: int, work: Callable[[int], Awaitable[bool]]) -> int:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(index: int) -> bool:
        async with limit:
            try:
                return await work(index)
            except aiohttp.ClientError:
                return False

    return sum(await asyncio.gather(*(one(i) for i in range(count))))


async def _seed_and_count(url: str, sessions: int, cookies: dict[int, str],
                          workers: set[str]) -> int:
    """Seed each session and increment it STEPS times; right if it then reads STEPS."""
    async with _client() as client:

        async def work(index: int) -> bool:
            async with client.post(f"{url}/seed_session",
                                   json={"session_id": f"demo-{index}"}) as reply:
                cookie = reply.cookies.get("session")
                if reply.status != 200 or cookie is None:
                    return False
            cookies[index] = f"session={cookie.value}"
            count = 0
            for _ in range(STEPS):
                async with client.post(f"{url}/increment",
                                       headers={"cookie": cookies[index]}) as reply:
                    if reply.status == 200:
                        body = await reply.json()
                        workers.add(body["worker"])
                        count = body["count"]
            return bool(count == STEPS)

        return await _each(sessions, work)


async def _check_counts(url: str, cookies: dict[int, str], expected: int,
                        workers: set[str]) -> int:
    """Each old cookie reads `expected`, then counts on to expected+1."""
    async with _client() as client:

        async def work(index: int) -> bool:
            headers = {"cookie": cookies[index]}
            async with client.get(f"{url}/count", headers=headers) as reply:
                if reply.status != 200 or (await reply.json())["count"] != expected:
                    return False
            async with client.post(f"{url}/increment", headers=headers) as reply:
                body = await reply.json() if reply.status == 200 else {}
                workers.add(str(body.get("worker")))
                return bool(body.get("count") == expected + 1)

        return await _each(len(cookies), work)


async def _held(url: str, token: str, total: int) -> list[int]:
    """Sessions each worker holds (the control API's status), once they add up to `total`
    (a restore at start-up may still be installing) or the start-up bound has passed."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as client:
        while True:
            async with client.get(f"{url}/_tether/status",
                                  headers={"authorization": f"Bearer {token}"}) as reply:
                body = await reply.json()
            held = [int(worker["sessions"]) for worker in body["workers"]]
            if sum(held) >= total or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.1)


async def _checkpoint(url: str, token: str, root: str, name: str) -> None:
    async with Controller([Server(name, url, token)], root) as controller:
        await controller.checkpoint()


async def _counter_story(sessions: int, env: dict[str, str], root: str) -> list[Row]:
    rows: list[Row] = []
    token = env["TETHER_CONTROL_TOKEN"]
    python = [sys.executable, "-c", "from tether.coordinator.cli import main; main()"]

    def serve(workers: int, port: int, restore: bool) -> list[str]:
        command = [*python, "serve", "tether.examples.counter:app", "--workers", str(workers),
                   "--port", str(port), "--name", "counter", "--checkpoint-root", root]
        return command + (["--restore", "latest"] if restore else [])

    port = _free_port()
    plain = await Process.start(
        [sys.executable, "-m", "uvicorn", "tether.examples.counter:app", "--workers", "4",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        port, {k: v for k, v in env.items() if k != "TETHER_CONTROL_TOKEN"},
    )
    started, workers, ignored = time.perf_counter(), set[str](), dict[int, str]()
    try:
        right = await _seed_and_count(plain.url, sessions, ignored, workers)
    finally:
        await plain.stop()
    rows.append(Row("uvicorn --workers 4", right, sessions, len(workers),
                    time.perf_counter() - started))

    port, cookies, workers = _free_port(), dict[int, str](), set[str]()
    started = time.perf_counter()
    server = await Process.start(serve(4, port, False), port, env)
    right = await _seed_and_count(server.url, sessions, cookies, workers)
    held = await _held(server.url, token, right)
    await _checkpoint(server.url, token, root, "counter")
    await server.kill()
    rows.append(Row("tether, 4 workers", right, sessions, len(workers),
                    time.perf_counter() - started, held))

    expected = STEPS
    for count, label in ((2, "SIGKILL, restore onto 2"), (3, "rescale to 3")):
        started, workers = time.perf_counter(), set[str]()
        server = await Process.start(serve(count, port, True), port, env)
        try:
            held = await _held(server.url, token, len(cookies))  # as restored
            right = await _check_counts(server.url, cookies, expected, workers)
            await _checkpoint(server.url, token, root, "counter")
        finally:
            await (server.kill() if count == 2 else server.stop())
        rows.append(Row(label, right, len(cookies), len(workers),
                        time.perf_counter() - started, held, spread=True))
        expected += 1
    return rows


async def _episode_story(env: dict[str, str], root: str) -> Row:
    token = env["TETHER_CONTROL_TOKEN"]
    python = [sys.executable, "-c", "from tether.coordinator.cli import main; main()"]
    port = _free_port()

    def serve(workers: int, restore: bool) -> list[str]:
        command = [*python, "serve", "tether.examples.episodes:app", "--workers", str(workers),
                   "--port", str(port), "--name", "episodes", "--checkpoint-root", root]
        return command + (["--restore", "latest"] if restore else [])

    started = time.perf_counter()
    server = await Process.start(serve(2, False), port, env)

    async def run(client: aiohttp.ClientSession, episode: int, attempt: int) -> Any:
        body = {"episode_id": f"ep-{episode}", "attempt": attempt,
                "steps": EPISODE_STEPS, "step_ms": STEP_MS}
        async with client.post(f"{server.url}/run", json=body) as reply:
            return reply.status, await reply.json()

    async with _client() as client:
        runs = [asyncio.create_task(run(client, i, 1)) for i in range(EPISODES)]
        await asyncio.sleep(EPISODE_STEPS * STEP_MS / 3000)  # let them get going
        await _checkpoint(server.url, token, root, "episodes")
        await server.kill()
        await asyncio.gather(*runs, return_exceptions=True)
    server = await Process.start(serve(3, True), port, env)
    workers: set[str] = set()
    try:
        async with _client() as client:

            async def continue_once(index: int) -> bool:
                first, second = await asyncio.gather(run(client, index, 2),
                                                     run(client, index, 2))
                answers = sorted([first, second], key=lambda pair: pair[0])
                (ok_status, done), (lost_status, lost) = answers
                workers.update(done.get("workers", []))
                return bool(ok_status == 200 and done["resumed_from"] > 0
                            and done["steps_done"] == EPISODE_STEPS
                            and lost_status == 409 and lost["code"] == "episode_claimed")

            right = await _each(EPISODES, continue_once)
    finally:
        await server.stop()
    return Row("episodes, restore onto 3", right, EPISODES, len(workers),
               time.perf_counter() - started)


async def _demo(sessions: int) -> list[Row]:
    root = tempfile.mkdtemp(prefix="tether-demo-")
    env = {**os.environ, "TETHER_CONTROL_TOKEN": secrets.token_urlsafe(16)}
    try:
        rows = await _counter_story(sessions, env, root)
        rows.append(await _episode_story(env, root))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    sessions = 1000
    for arg in args:
        if arg.startswith("--sessions="):
            sessions = int(arg.split("=", 1)[1])
    print(f"counter: {sessions} concurrent sessions, seed and {STEPS} increments each, "
          "a new connection per request\n")
    rows = asyncio.run(_demo(sessions))
    print(f"{'step':<28}{'right':>12}{'workers seen':>15}{'sessions per worker':>22}"
          f"{'seconds':>10}")
    for row in rows:
        wrong = "" if row.ok or row is rows[0] else "  <- wrong"
        print(f"{row.label:<28}{f'{row.right}/{row.total}':>12}{row.workers_seen:>15}"
              f"{row.held_text:>22}{row.seconds:>10.1f}{wrong}")
    ok = all(row.ok for row in rows[1:])
    print("\n" + ("every session and episode continued exactly where it was checkpointed, "
                  "and each restore spread the sessions over every worker."
                  if ok else "FAILED: see the rows above."))
    return 0 if ok else 1
