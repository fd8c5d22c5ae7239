"""What the end-to-end tests drive: a real `tether serve` process group, an HTTP client
that opens a new connection per request, and the counter app's session flow.

Processes are looked at through `/proc` (a zombie counts as exited: once a main process
is SIGKILLed nobody may reap its workers). Every wait polls a condition with a bound.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import itsdangerous

REPO = Path(__file__).resolve().parent.parent
TOKEN_ENV = "TETHER_CONTROL_TOKEN"
COUNTER_APP = "tether.examples.counter:app"
COUNTER_SECRET = "counter-example-secret"
COOKIE = "session"

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 50.0  # the supervisor itself waits up to 40 s for its workers
GROUP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60.0
CONCURRENCY = 100

# The error codes of SPEC section 6, with their statuses.
SPEC_ERRORS = {
    "unauthorized": 401,
    "invalid_request": 422,
    "invalid_checkpoint_id": 422,
    "body_too_large": 413,
    "session_mismatch": 409,
    "session_conflict": 409,
    "session_closed": 409,
    "seed_rejected": 422,
    "session_lost": 404,
    "session_gone": 410,
    "worker_gone": 410,
    "claimant_unavailable": 503,
    "checkpoint_parked": 503,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "stale_checkpoint": 409,
    "not_ready": 409,
    "commit_failed": 500,
    "deadline_exceeded": 504,
    "not_fresh": 409,
    "workers_missing": 503,
    "no_checkpoint": 404,
    "corrupt_checkpoint": 422,
    "incompatible_state": 422,
    "episode_claimed": 409,
    "stale_attempt": 409,
    "attempt_mismatch": 409,
    "worker_unreported": 503,
    "worker_lost": 503,  # issue 12: a worker exited during the call; retry
    "unsupported_topology": 409,
}

_SERVING = re.compile(r"tether serving (\S+) with (\d+) workers")

T = TypeVar("T")


# Processes ---------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


def alive(pid: int) -> bool:
    """Whether the process still runs (a zombie has exited)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """The running (not zombie) processes of a process group."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry))
    return sorted(members)


def tether_command() -> list[str]:
    """The installed `tether` script next to this interpreter."""
    script = Path(sys.executable).with_name("tether")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from tether.coordinator.cli import main; main()"]


def run_tether(
    *args: str,
    timeout: float = READY_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess[str]:
    """Run `tether ARGS` (from the repo root by default) to completion, for commands that
    should exit; `env` is added to this process's environment."""
    base = tempfile.mkdtemp(prefix="te-", dir="/tmp")
    try:
        return subprocess.run(
            [*tether_command(), *args],
            cwd=cwd,
            env={**os.environ, "XDG_RUNTIME_DIR": base, **(env or {})},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
            check=False,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Server:
    """A running `tether serve` process group and what it tells us: its URL, its token,
    its runtime directory (claims, sockets) and its JSON logs."""

    def __init__(self, proc: subprocess.Popen[bytes], base: Path, token: str) -> None:
        self.proc = proc
        self.base = base
        self.token = token
        self.url = ""
        self.workers = 0
        self.runtime_dir = Path()
        self.stdout_path = base / "stdout"
        self.stderr_path = base / "stderr"
        self._terminated = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.url.split("://", 1)[-1].rpartition(":")
        return host, int(port)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def logs(self) -> list[dict[str, Any]]:
        """Every JSON object logged so far, in order. Objects are read one after another
        whatever the line breaks between them (so that a test about one thing is not
        failed by lines that another test finds interleaved); other text is skipped."""
        decoder = json.JSONDecoder()
        found = []
        for line in self.stderr().splitlines():
            at = line.find("{")
            while at >= 0:
                try:
                    record, end = decoder.raw_decode(line, at)
                except ValueError:
                    break
                if isinstance(record, dict):
                    found.append(record)
                at = line.find("{", end)
        return found

    def claims(self) -> dict[str, str]:
        """Session ID -> claiming worker, from the claim files (worker, newline, session)."""
        directory = self.runtime_dir / "claims"
        found: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(directory):
                if name.endswith(".tmp"):
                    continue
                try:
                    content = (directory / name).read_text(errors="replace")
                except FileNotFoundError:
                    continue
                worker, _, session_id = content.partition("\n")
                found[session_id] = worker
        return found

    def claim_files(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return sorted(os.listdir(self.runtime_dir / "claims"))
        return []

    def sockets(self) -> list[str]:
        """The private sockets in `<runtime>/w`."""
        with contextlib.suppress(FileNotFoundError):
            return sorted(os.listdir(self.runtime_dir / "w"))
        return []

    def group(self) -> list[int]:
        return group_members(self.pid)

    def terminate(self) -> None:
        """SIGTERM the main process (a graceful stop)."""
        self._terminated = True
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the main process only."""
        self.proc.send_signal(signal.SIGKILL)

    async def crash(self) -> None:
        """SIGKILL the whole process group (the main process and its workers), as a crash
        of the machine or the service would; return once every process of it is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        await self.group_gone()

    async def exit_code(self, within: float = STOP_TIMEOUT_S) -> int:
        """The main process's exit code, once it exits."""
        await eventually(
            lambda: self.proc.poll() is not None, within, f"main process {self.pid} exits"
        )
        return self.proc.returncode

    async def group_gone(self, within: float = GROUP_TIMEOUT_S) -> None:
        await eventually(lambda: not self.group(), within, f"process group {self.pid} is empty")

    async def status(self, http: Http) -> dict[str, Any]:
        reply = await http.request(
            "GET", "/_tether/status", headers={"authorization": f"Bearer {self.token}"}
        )
        assert reply.status == 200, reply
        status: dict[str, Any] = reply.json
        return status

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            text = self.stdout_path.read_text(errors="replace")
            match = _SERVING.search(text)
            if match and "control token:" in text:
                self.url, self.workers = match.group(1), int(match.group(2))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tether serve exited with {self.proc.returncode} before serving:\n"
                    f"{text}\n{self.stderr()[-5000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tether serve printed no URL within {timeout} s:\n{self.stderr()[-5000:]}"
                )
            time.sleep(0.05)
        # The runtime directory is the one `tether-*` directory in the XDG_RUNTIME_DIR
        # this server was given (its logs say so too, unless --log-level hides them).
        made = sorted((self.base / "rt").glob("tether-*"))
        if len(made) != 1:
            raise RuntimeError(f"expected one runtime directory, found {made}")
        self.runtime_dir = made[0]

    def shutdown(self) -> list[str]:
        """Stop the group (SIGTERM, then SIGKILL if it must) and remove its files;
        return what was wrong: a main process or workers that would not go, or a runtime
        directory left after a graceful stop."""
        problems = []
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"main process {self.pid} ignored SIGTERM for {STOP_TIMEOUT_S} s;"
                                f" its last lines:\n{self.stderr()[-3000:]}")
                self._kill_group()
                self.proc.wait()
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.group()
        if left:
            problems.append(f"processes left in group {self.pid}: {left}")
            self._kill_group()
        graceful = self._terminated and self.proc.returncode == 0
        if graceful and self.runtime_dir != Path() and self.runtime_dir.exists():
            problems.append(f"runtime directory {self.runtime_dir} left after a graceful stop")
        shutil.rmtree(self.base, ignore_errors=True)
        return problems

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)


def start_server(
    app: str,
    workers: int,
    *extra: str,
    env: Mapping[str, str] | None = None,
    timeout: float = READY_TIMEOUT_S,
    cwd: Path = REPO,
) -> Server:
    """Start `tether serve APP --workers N --port 0 --log-format json EXTRA...` in its own
    process group (from `cwd`, the repository by default), its files in a short temp
    dir, and wait until it prints its URL."""
    base = Path(tempfile.mkdtemp(prefix="te-", dir="/tmp"))
    runtime_base = base / "rt"
    runtime_base.mkdir(mode=0o700)
    token = secrets.token_urlsafe(24)
    command = [
        *tether_command(),
        "serve",
        app,
        "--workers",
        str(workers),
        "--port",
        "0",
        "--log-format",
        "json",
        *extra,
    ]
    full_env = {
        **os.environ,
        TOKEN_ENV: token,
        "XDG_RUNTIME_DIR": str(runtime_base),
        **(env or {}),
    }
    with open(base / "stdout", "wb") as out, open(base / "stderr", "ab") as err:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    server = Server(proc, base, token)
    try:
        server._wait_ready(timeout)
    except BaseException:
        server.shutdown()
        raise
    return server


# Waiting ------------------------------------------------------------------------------


async def eventually(
    check: Callable[[], Any], within: float = 5.0, what: str = "", every: float = 0.05
) -> Any:
    """Poll `check` (sync or async) every `every` s until it returns something true; fail
    after `within` s. (Shared by the end-to-end and the in-process tests.)"""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {within} s waiting until {what or check}")
        await asyncio.sleep(every)


async def bounded(aws: Iterable[Awaitable[T]], limit: int = CONCURRENCY) -> list[T]:
    """Await all of `aws`, at most `limit` at a time, results in order."""
    semaphore = asyncio.Semaphore(limit)

    async def one(aw: Awaitable[T]) -> T:
        async with semaphore:
            return await aw

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(aw)) for aw in aws]
    return [task.result() for task in tasks]


# HTTP ---------------------------------------------------------------------------------


@dataclass
class Reply:
    """One HTTP reply, read whole."""

    method: str
    path: str
    status: int
    raw: bytes
    headers: Mapping[str, str] = field(repr=False)
    set_cookies: list[str] = field(repr=False)

    @cached_property
    def json(self) -> Any:
        try:
            return json.loads(self.raw)
        except ValueError:
            return None

    @property
    def code(self) -> str | None:
        body = self.json
        return body.get("code") if isinstance(body, dict) else None

    def cookie(self, name: str = COOKIE) -> str | None:
        """The `name=value` pair the reply sets, ready for a `cookie` header."""
        for header in self.set_cookies:
            pair = header.split(";", 1)[0].strip()
            if pair.startswith(f"{name}="):
                return pair
        return None

    def __repr__(self) -> str:
        return f"<{self.method} {self.path}: {self.status} {self.raw[:300]!r}>"


class Http:
    """An HTTP client that opens a new connection for every request and keeps no
    cookies: each session sends its own `cookie` header. `base_url` may be `https://`
    (any certificate is accepted) or `unix:PATH` (a server on `--uds`)."""

    def __init__(self, base_url: str, limit: int = CONCURRENCY) -> None:
        self.base_url = base_url
        self.replies: list[Reply] = []
        connector: aiohttp.BaseConnector
        if base_url.startswith("unix:"):
            connector = aiohttp.UnixConnector(
                base_url.removeprefix("unix:"), force_close=True, limit=limit
            )
            base_url = "http://localhost"
        else:
            connector = aiohttp.TCPConnector(force_close=True, limit=limit, ssl=False)
        self._session = aiohttp.ClientSession(
            base_url,
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )

    async def __aenter__(self) -> Http:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()
        # A connection the server closed first is torn down a loop turn after close();
        # without this turn the test's loop may end first and warn of an open socket.
        await asyncio.sleep(0.01)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        body: bytes | None = None,
        cookie: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        sent = dict(headers or {})
        if cookie is not None:
            sent["cookie"] = cookie
        if body is not None:
            sent.setdefault("content-type", "application/json")
        # aiohttp wants large bodies as a file, so as not to hold up the event loop.
        data = io.BytesIO(body) if body is not None and len(body) > 1 << 20 else body
        async with self._session.request(
            method, path, json=json, data=data, headers=sent
        ) as response:
            raw = await response.read()
            reply = Reply(
                method,
                path,
                response.status,
                raw,
                response.headers,
                response.headers.getall("set-cookie", []),
            )
        self.replies.append(reply)
        return reply

    def misfits(self) -> list[Reply]:
        """Replies so far that are a 5xx, or an error whose code is not the SPEC's with
        the SPEC's status (a route the app lacks may answer a plain 404 or 405)."""
        return [reply for reply in self.replies if _misfit(reply)]

    def off_the_table(self) -> list[Reply]:
        """Replies so far that are an error (4xx or 5xx) whose code is not one of the
        SPEC's table with the table's status: a 503 `checkpoint_parked` is on the table,
        a 500 without a code or a 404 `not_found` is not."""
        return [reply for reply in self.replies if off_the_table(reply)]


def _misfit(reply: Reply) -> bool:
    if reply.status >= 500:
        return True
    if reply.status < 400:
        return False
    if reply.code is None:
        return reply.status not in (404, 405)
    return SPEC_ERRORS.get(reply.code) != reply.status


def off_the_table(reply: Reply) -> bool:
    """An error reply whose code and status are not a row of the SPEC's table."""
    return reply.status >= 400 and (
        reply.code is None or SPEC_ERRORS.get(reply.code) != reply.status
    )


async def raw_exchange(
    host: str,
    port: int,
    head: bytes,
    body: AsyncIterator[bytes] | None = None,
    within: float = REQUEST_TIMEOUT_S,
) -> tuple[int, dict[str, str], bytes]:
    """Send a hand-written request head (and stream `body` while the reply is read);
    return the reply's status, headers and body. The reply may come before the body ends."""
    reader, writer = await asyncio.open_connection(host, port)

    async def pump(chunks: AsyncIterator[bytes]) -> None:
        with contextlib.suppress(ConnectionError):
            async for chunk in chunks:
                writer.write(chunk)
                await writer.drain()

    pumping = None
    try:
        writer.write(head)
        if body is not None:
            pumping = asyncio.create_task(pump(body))
        async with asyncio.timeout(within):
            raw_head = await reader.readuntil(b"\r\n\r\n")
            status_line, *lines = raw_head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            payload = await reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, payload
    finally:
        if pumping is not None:
            pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)
        writer.transport.abort()  # drop whatever body is still queued
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


class Connection:
    """One kept-alive HTTP/1.1 connection: every request on it reaches the worker that
    accepted it. `owner` finds that worker's process from /proc (the kernel's TCP table
    names the accepted socket's inode, and one worker holds a descriptor for it), so a
    test can tell, pick or kill the worker a call lands on."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.server_port: int = writer.get_extra_info("peername")[1]
        self.local_port: int = writer.get_extra_info("sockname")[1]

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def owner(self, pids: Iterable[int], within: float = 10.0) -> int:
        """The pid, among `pids`, of the worker that accepted this connection (once one
        has: until then the connection waits in the listening socket's queue)."""
        candidates = list(pids)

        def find() -> int | None:
            return _holder(candidates, _accepted_inodes(self.server_port, self.local_port))

        pid: int = await eventually(
            find, within, f"one of {candidates} accepts the connection from {self.local_port}",
            every=0.01,
        )
        return pid

    def send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        partial: bool = False,
    ) -> bytes:
        """Write one request; with `partial`, everything but the body's last byte (which
        `finish` sends), so that the handler waits for its body. Returns what is unsent."""
        payload = b"" if json is None else _json_bytes(json)
        lines = [f"{method} {path} HTTP/1.1", "host: tether", f"content-length: {len(payload)}"]
        if json is not None:
            lines.append("content-type: application/json")
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload
        held = raw[-1:] if partial and payload else b""
        self._writer.write(raw[: len(raw) - len(held)])
        return held

    def finish(self, rest: bytes) -> None:
        """Send what `send(partial=True)` kept back."""
        self._writer.write(rest)

    async def reply(self, method: str = "", path: str = "",
                    within: float = REQUEST_TIMEOUT_S) -> Reply:
        """Read one reply (raises `asyncio.IncompleteReadError` or `ConnectionError` if
        the worker went away first)."""
        async with asyncio.timeout(within):
            raw_head = await self._reader.readuntil(b"\r\n\r\n")
            status_line, *lines = raw_head.decode("latin-1").split("\r\n")
            headers: dict[str, str] = {}
            cookies: list[str] = []
            for line in lines:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                    if name.strip().lower() == "set-cookie":
                        cookies.append(value.strip())
            payload = await self._reader.readexactly(int(headers.get("content-length", "0")))
        return Reply(method, path, int(status_line.split()[1]), payload, headers, cookies)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        within: float = REQUEST_TIMEOUT_S,
    ) -> Reply:
        self.send(method, path, json=json, headers=headers)
        return await self.reply(method, path, within)

    async def close(self) -> None:
        self._writer.transport.abort()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


def tcp_rows(address: str) -> list[tuple[str, str, str]]:
    """The IPv4 TCP sockets of this machine with `address` (`host:port`) at either end,
    from /proc/net/tcp: (local end, remote end, state) as the table writes them (an end
    as `tcp_end` makes it; a state in hex, "01" established)."""
    end = tcp_end(address)
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if end in (fields[1], fields[2]):
            rows.append((fields[1], fields[2], fields[3]))
    return rows


def tcp_end(address: str) -> str:
    """`host:port` (IPv4) as /proc/net/tcp writes a socket's end."""
    host, _, port = address.rpartition(":")
    return f"{socket.inet_aton(host)[::-1].hex().upper()}:{int(port):04X}"


def _accepted_inodes(server_port: int, client_port: int) -> set[int]:
    """Inodes of the accepted sockets of one TCP connection (server side), from the
    kernel's tables; a connection not yet accepted has inode 0 and is left out."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], int(fields[9])
                if (inode and int(local.rsplit(":", 1)[1], 16) == server_port
                        and int(remote.rsplit(":", 1)[1], 16) == client_port):
                    found.add(inode)
    return found


def _holder(pids: Iterable[int], inodes: set[int]) -> int | None:
    """The process among `pids` with a descriptor for one of the socket `inodes`."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    if not wanted:
        return None
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                        return pid
    return None


# The counter app ---------------------------------------------------------------------


class _SignedAt(itsdangerous.TimestampSigner):
    def __init__(self, secret: str, at: int) -> None:
        super().__init__(secret)
        self.at = at

    def get_timestamp(self) -> int:
        return self.at


def session_cookie(
    session: Mapping[str, Any], secret: str = COUNTER_SECRET, at: int | None = None
) -> str:
    """A `session=...` cookie pair as Starlette's SessionMiddleware writes it, signed at
    `at` (Unix seconds; now by default)."""
    signer = itsdangerous.TimestampSigner(secret) if at is None else _SignedAt(secret, at)
    data = base64.b64encode(json.dumps(dict(session)).encode("utf-8"))
    return f"{COOKIE}={signer.sign(data).decode('utf-8')}"


class CounterSession:
    """One session of the counter app: its ID, the cookie it was given, its worker."""

    def __init__(self, http: Http, session_id: str) -> None:
        self.http = http
        self.id = session_id
        self.cookie: str | None = None
        self.worker: str | None = None

    async def seed(self, cookie: str | None = None) -> Reply:
        reply = await self.http.request(
            "POST", "/seed_session", json={"session_id": self.id}, cookie=cookie
        )
        if reply.status == 200:
            self.cookie = reply.cookie() or self.cookie
            self.worker = reply.json["worker"]
        return reply

    async def increment(self) -> Reply:
        return await self.http.request("POST", "/increment", cookie=self.cookie)

    async def count(self) -> Reply:
        return await self.http.request("GET", "/count", cookie=self.cookie)

    async def verify(self, close_follows: bool = False) -> Reply:
        headers = {"x-tether-close-follows": "1"} if close_follows else {}
        return await self.http.request("POST", "/verify", cookie=self.cookie, headers=headers)

    async def close(self, with_cookie: bool = True) -> Reply:
        return await self.http.request(
            "POST",
            "/close_session",
            json={"session_id": self.id},
            cookie=self.cookie if with_cookie else None,
        )


@dataclass
class Episode:
    """What one session's full run saw: the workers that answered and what went wrong."""

    session_id: str
    workers: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


async def run_episode(session: CounterSession, increments: int = 5) -> Episode:
    """seed, `increments` x increment, count, verify, close: each on a new connection."""
    episode = Episode(session.id)

    def expect(reply: Reply, ok: Callable[[Any], bool]) -> bool:
        good = reply.status == 200 and ok(reply.json)
        if not good:
            episode.problems.append(repr(reply))
        elif isinstance(reply.json, dict) and "worker" in reply.json:
            episode.workers.add(reply.json["worker"])
        return good

    if not expect(await session.seed(), lambda b: b["session_id"] == session.id):
        return episode
    if session.cookie is None:
        episode.problems.append("the seed set no session cookie")
        return episode
    for n in range(1, increments + 1):
        expect(
            await session.increment(),
            lambda b, n=n: b["count"] == n and b["worker"] == session.worker,  # type: ignore[misc]
        )
    expect(await session.count(), lambda b: b["count"] == increments)
    expect(
        await session.verify(),
        lambda b: b == {"session_id": session.id, "count": increments},
    )
    expect(await session.close(), lambda b: b["closed"] is True)
    return episode


def failed(episodes: Iterable[Episode]) -> list[Episode]:
    return [episode for episode in episodes if episode.problems]
