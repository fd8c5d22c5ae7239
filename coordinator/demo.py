"""`tether demo`: the counter on four workers, with and without tether, on this machine.

It starts the reference counter app twice, under plain `uvicorn --workers 4` and under
`tether serve --workers 4`, drives the same burst of sessions through each with a new
connection for every request, prints a table and exits non-zero unless tether got every
session right.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp

SESSIONS = 1000
STEPS = 5
CONCURRENCY = 200
START_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    label: str
    right: int
    sessions: int
    workers_seen: int
    seconds: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                async with client.get(f"{url}/health") as reply:
                    if reply.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the server did not start in time")


async def _session(
    client: aiohttp.ClientSession, url: str, session_id: str, workers: set[str]
) -> bool:
    """Seed, STEPS increments, verify and close; right if verify reads STEPS."""
    async with client.post(f"{url}/seed_session", json={"session_id": session_id}) as reply:
        if reply.status != 200:
            return False
        cookie = reply.cookies.get("session")
        if cookie is None:
            return False
    headers = {"cookie": f"session={cookie.value}"}
    for _ in range(STEPS):
        async with client.post(f"{url}/increment", headers=headers) as reply:
            if reply.status == 200:
                workers.add((await reply.json())["worker"])
    async with client.post(f"{url}/verify", headers=headers) as reply:
        result = await reply.json() if reply.status == 200 else {}
    async with client.post(
        f"{url}/close_session", json={"session_id": session_id}, headers=headers
    ):
        pass
    return bool(result.get("count") == STEPS and not result.get("masked"))


async def _drive(label: str, url: str, sessions: int) -> Outcome:
    workers: set[str] = set()
    limit = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    started = time.perf_counter()
    jar = aiohttp.DummyCookieJar()
    async with aiohttp.ClientSession(connector=connector, cookie_jar=jar) as client:

        async def one(index: int) -> bool:
            async with limit:
                try:
                    return await _session(client, url, f"{label}-{index}", workers)
                except aiohttp.ClientError:
                    return False

        results = await asyncio.gather(*(one(i) for i in range(sessions)))
    return Outcome(label, sum(results), sessions, len(workers), time.perf_counter() - started)


def _start(command: list[str], cwd: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _run_one(label: str, command: list[str], port: int, cwd: str, sessions: int) -> Outcome:
    proc = _start(command, cwd)
    try:
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(url, proc)
        return await _drive(label, url, sessions)
    finally:
        _stop(proc)


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _demo(sessions: int) -> list[Outcome]:
    root = _project_root()
    workdir = tempfile.mkdtemp(prefix="tether-demo-")
    try:
        plain_port, tether_port = _free_port(), _free_port()
        plain = [sys.executable, "-m", "uvicorn", "examples.counter:app", "--workers", "4",
                 "--port", str(plain_port), "--log-level", "warning", "--no-access-log"]
        tethered = [sys.executable, "-c", "from coordinator.cli import main; main()", "serve",
                    "examples.counter:app", "--workers", "4", "--port", str(tether_port)]
        return [
            await _run_one("uvicorn --workers 4", plain, plain_port, root, sessions),
            await _run_one("tether serve --workers 4", tethered, tether_port, root, sessions),
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    sessions = SESSIONS
    if args and re.fullmatch(r"--sessions=\d+", args[0]):
        sessions = int(args[0].split("=")[1])
    print(f"counter app, {sessions} concurrent sessions: seed, {STEPS} increments, verify, "
          "close; a new connection per request\n")
    outcomes = asyncio.run(_demo(sessions))
    print(f"{'server':<28}{'right':>14}{'workers seen':>15}{'seconds':>10}")
    for o in outcomes:
        print(f"{o.label:<28}{f'{o.right}/{o.sessions}':>14}{o.workers_seen:>15}"
              f"{o.seconds:>10.1f}")
    ok = outcomes[-1].right == outcomes[-1].sessions
    print("\n" + ("tether kept every session on its worker." if ok
                  else "FAILED: tether got sessions wrong."))
    return 0 if ok else 1
