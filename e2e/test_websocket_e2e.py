"""WebSockets end to end (SPEC 4.8): `tether serve e2e.apps.wscounter:app --workers 4` in
real processes, sessions seeded over HTTP (a new connection per request) and then counted
over a WebSocket with their cookie, against the same app under plain `uvicorn --workers 4`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Close

from e2e.conftest import Serve
from e2e.harness import REPO, Http, Server, alive, bounded, eventually, session_cookie

pytestmark = pytest.mark.e2e

APP = "e2e.apps.wscounter:app"
SECRET = "wscounter-secret"
SESSIONS = 100
INCREMENTS = 5
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
OPEN_TIMEOUT_S = 30.0


def ws_base(url: str) -> str:
    return url.replace("http://", "ws://", 1)


@dataclass
class Outcome:
    """One session: seeded on `seeded_on`, then what its WebSocket answered."""

    session_id: str
    seeded_on: str = ""
    replies: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None

    @property
    def right(self) -> bool:
        return (
            self.problem is None
            and [r["count"] for r in self.replies] == list(range(1, INCREMENTS + 1))
            and all(r["worker"] == self.seeded_on for r in self.replies)
        )


async def seed(http: Http, session_id: str) -> tuple[str, str]:
    """Seed over HTTP; return the session's cookie and the worker that holds it."""
    reply = await http.request("POST", "/seed_session", json={"session_id": session_id})
    assert reply.status == 200, reply
    cookie = reply.cookie()
    assert cookie is not None, reply
    return cookie, reply.json["worker"]


async def count_over_websocket(base: str, http: Http, session_id: str) -> Outcome:
    """Seed the session over HTTP, then count it INCREMENTS times over one WebSocket."""
    outcome = Outcome(session_id)
    cookie, outcome.seeded_on = await seed(http, session_id)
    try:
        async with connect(f"{ws_base(base)}/ws", additional_headers={"cookie": cookie},
                           open_timeout=OPEN_TIMEOUT_S) as ws:
            for _ in range(INCREMENTS):
                await ws.send("inc")
                outcome.replies.append(json.loads(await ws.recv()))
    except InvalidStatus as refused:
        outcome.problem = f"{refused.response.status_code} {refused.response.body[:200]!r}"
    except (OSError, ConnectionClosed) as error:
        outcome.problem = repr(error)
    return outcome


async def run_sessions(url: str, sessions: int = SESSIONS) -> list[Outcome]:
    async with Http(url) as http:
        return await bounded(
            [count_over_websocket(url, http, f"ws-{index}") for index in range(sessions)],
            limit=25,
        )


async def status(server: Server) -> dict[str, Any]:
    async with Http(server.url) as http:
        return await server.status(http)


async def forwarded(server: Server) -> int:
    """How many requests and WebSockets the server's workers have forwarded so far."""
    return sum(worker["forwarded"] for worker in (await status(server))["workers"])


async def control(server: Server, call: str, **body: Any) -> dict[str, Any]:
    async with Http(server.url) as http:
        reply = await http.request(
            "POST", f"/_tether/{call}", json=body,
            headers={"authorization": f"Bearer {server.token}"},
        )
    assert reply.status == 200, reply
    answer: dict[str, Any] = reply.json
    return answer


@contextlib.contextmanager
def plain_uvicorn(app: str, workers: int) -> Iterator[str]:
    """`uvicorn APP --workers N` on a socket bound here (port 0), in its own process
    group; yields its URL."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="te-uv-") as logs, listener:
        err = Path(logs) / "stderr"
        with err.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", app, "--workers", str(workers),
                 "--fd", str(listener.fileno()), "--no-access-log"],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(listener.fileno(),),
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while err.read_text().count("Application startup complete") < workers:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"uvicorn did not start:\n{err.read_text()[-3000:]}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


async def relayed_websocket(
    server: Server, cookie: str, path: str = "/ws", attempts: int = 40
) -> ClientConnection:
    """A WebSocket of the session that landed on a worker other than its holder (told
    by the status counters: nothing else runs on the server meanwhile)."""
    for _ in range(attempts):
        before = await forwarded(server)
        ws = await connect(f"{ws_base(server.url)}{path}", additional_headers={"cookie": cookie},
                           open_timeout=OPEN_TIMEOUT_S, max_size=None)
        if await forwarded(server) > before:
            return ws
        await ws.close()
    raise AssertionError(f"no WebSocket landed off its holder in {attempts} tries")


# The tests


async def test_100_sessions_seeded_over_http_each_count_right_over_a_websocket(
    serve: Serve,
) -> None:
    server = serve(APP, 4)
    outcomes = await run_sessions(server.url)
    wrong = [o for o in outcomes if not o.right]
    assert not wrong, wrong[:5]
    assert len({o.seeded_on for o in outcomes}) == 4  # every worker holds some
    # Most landed off their holder (3 in 4 at random) and were relayed to it.
    assert await forwarded(server) >= SESSIONS // 4


async def test_the_same_app_under_plain_uvicorn_loses_websocket_sessions() -> None:
    """The control: plain uvicorn passes each WebSocket to the worker that accepted it,
    which holds the session about one time in four; on a loaded machine the kernel may
    hand most connections to one worker (a CI run saw 58 of 100 right), so the control
    asks only that a clear share is lost, each refused by a worker without it."""
    with plain_uvicorn(APP, 4) as url:
        outcomes = await run_sessions(url)
    right = sum(o.right for o in outcomes)
    assert right <= SESSIONS * 9 // 10, right
    refused = [o for o in outcomes if o.problem and o.problem.startswith("404")]
    assert len(refused) >= SESSIONS // 10  # the workers without the session said so


async def test_close_codes_and_reasons_pass_through_a_relay_both_ways(serve: Serve) -> None:
    server = serve(APP, 4)
    async with Http(server.url) as http:
        cookie, holder = await seed(http, "closes")
        ws = await relayed_websocket(server, cookie)
        async with ws:
            await ws.send("inc")
            assert json.loads(await ws.recv()) == {"count": 1, "worker": holder}
            await ws.send("close:4000:the app says goodbye")
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.protocol.close_rcvd == Close(4000, "the app says goodbye")

        ws = await relayed_websocket(server, cookie)
        async with ws:
            await ws.send("inc")
            assert json.loads(await ws.recv())["count"] == 2
            await ws.close(4001, "the client says goodbye")

        async def app_saw_it() -> Any:
            reply = await http.request("GET", "/last_close", cookie=cookie)
            return reply.json["close"]

        seen = await eventually(app_saw_it, 10, "the app records the client's close")
        assert seen == {"code": 4001, "reason": "the client says goodbye"}


async def test_a_sigkilled_holder_closes_its_relayed_websockets_and_refuses_new_ones_with_410(
    serve: Serve,
) -> None:
    server = serve(APP, 4)
    async with Http(server.url) as http:
        cookie, holder = await seed(http, "doomed")
        pid = {w["id"]: w["pid"] for w in (await server.status(http))["workers"]}[holder]
        ws = await relayed_websocket(server, cookie)
        async with ws:
            await ws.send("inc")
            assert json.loads(await ws.recv())["worker"] == holder
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            closed = ws.protocol.close_rcvd
            assert closed is not None and closed.code == 1011, closed
        await eventually(lambda: not alive(pid), 10, f"worker {pid} exits")

        async def refused() -> Any:
            try:
                async with connect(f"{ws_base(server.url)}/ws",
                                   additional_headers={"cookie": cookie},
                                   open_timeout=OPEN_TIMEOUT_S):
                    return None
            except InvalidStatus as error:
                # 503 claimant_unavailable while the dead worker is still being noticed
                return error.response if error.response.status_code == 410 else None

        response = await eventually(refused, 20, "the handshake is refused with 410")
        assert json.loads(response.body)["code"] == "session_gone"
        # Every worker says so, the replacement included, whichever a handshake lands on.
        for _ in range(12):
            assert await refused() is not None


async def test_a_relayed_websocket_whose_holder_stops_answering_pings_is_closed_1011(
    serve: Serve,
) -> None:
    """The holder is stopped (SIGSTOP: no reset, no close, as a hung host): the worker
    that relays the WebSocket pings it (`--ws-ping-*`), gets no answer, and closes the
    client with 1011 instead of leaving it open forever."""
    server = serve(APP, 2, "--ws-ping-interval", "0.5", "--ws-ping-timeout", "1")
    async with Http(server.url) as http:
        cookie, holder = await seed(http, "hung")
        pid = {w["id"]: w["pid"] for w in (await server.status(http))["workers"]}[holder]
    ws = await relayed_websocket(server, cookie)
    try:
        await ws.send("inc")
        assert json.loads(await ws.recv())["worker"] == holder
        await asyncio.sleep(3)  # several pings, answered: the relay stays
        await ws.send("inc")
        assert json.loads(await ws.recv()) == {"count": 2, "worker": holder}
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(ConnectionClosed):
            async with asyncio.timeout(15):
                await ws.recv()
        closed = ws.protocol.close_rcvd
        assert closed is not None, "the client's WebSocket was dropped, not closed"
        assert (closed.code, closed.reason) == (1011, "the session's worker stopped answering")
        assert time.monotonic() - stopped_at < 10
    finally:
        os.kill(pid, signal.SIGCONT)
        await ws.close()


async def test_a_prepare_with_100_open_websockets_answers_prepared_at_once(
    serve: Serve, tmp_path: Path
) -> None:
    server = serve(APP, 4, "--checkpoint-root", str(tmp_path), "--name", "ws")
    sockets: list[ClientConnection] = []
    try:
        async with Http(server.url) as http:
            cookies = [(await seed(http, f"open-{index}"))[0] for index in range(100)]
        for cookie in cookies:
            ws = await connect(f"{ws_base(server.url)}/ws", additional_headers={"cookie": cookie},
                               open_timeout=OPEN_TIMEOUT_S)
            sockets.append(ws)
            await ws.send("inc")
            assert json.loads(await ws.recv())["count"] == 1
        started = time.monotonic()
        prepared = await control(server, "prepare", checkpoint_id="ws-1", deadline_s=30)
        elapsed = time.monotonic() - started
        assert prepared["state"] == "prepared", prepared
        assert elapsed < 10, elapsed  # not held to its 30 s deadline by the WebSockets
        await control(server, "resume", checkpoint_id="ws-1")
        for ws in sockets:  # and they keep working
            await ws.send("inc")
            assert json.loads(await ws.recv())["count"] == 2
    finally:
        for ws in sockets:
            await ws.close()


async def test_handshakes_with_bad_ids_count_as_no_id_and_crash_nothing(serve: Serve) -> None:
    server = serve(APP, 4)
    host, port = server.host_port
    bad_cookies = [
        session_cookie({"session_id": "x" * 257}, SECRET),  # oversize, validly signed
        session_cookie({"session_id": "tab\there"}, SECRET),  # not printable ASCII
        session_cookie({"session_id": 42}, SECRET),  # not a string
        session_cookie({"session_id": "forged"}, "another-secret"),  # bad signature
        "session=" + "A" * 5000,  # garbage
    ]
    for cookie in bad_cookies:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{ws_base(server.url)}/ws?session_id=q",
                               additional_headers={"cookie": cookie,
                                                   "x-tether-session-token": "not.a.token"},
                               open_timeout=OPEN_TIMEOUT_S):
                pass
        # No ID: served where it landed, by an app that holds no such session.
        assert refused.value.response.status_code == 404, cookie
        assert json.loads(refused.value.response.body)["code"] == "session_lost"
    for header in (b"cookie: session=\x01\x02", b"cookie: \xff\xfe=\xff",
                   b"x-tether-session-token: " + b"t" * 8000):
        status_line = await raw_handshake(host, port, header)
        assert status_line.split()[1] in (b"404", b"400"), (header, status_line)
    logged = [line for line in server.logs() if line.get("event") == "websocket"]
    assert logged and all(line["session_id"] is None for line in logged)
    assert all(not name.endswith(".tmp") for name in server.claim_files())
    assert server.claims() == {}
    outcomes = await run_sessions(server.url, 8)  # and the server still serves sessions
    assert all(o.right for o in outcomes), outcomes


async def raw_handshake(host: str, port: int, header: bytes) -> bytes:
    """A handshake with one hand-written header line; returns the reply's status line."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"GET /ws HTTP/1.1\r\nhost: t\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            + header + b"\r\n\r\n"
        )
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
