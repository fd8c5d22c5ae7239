"""A real `redis-server` for tests, on a free loopback port, in its own process group.

Never the machine's Redis: each `RedisServer` starts its own, with no persistence, so a
`restart` comes back empty (a new run ID), as after a crash or a failover that lost data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest

REDIS_SERVER = "redis-server"
REQUIRE_ENV = "TETHER_REQUIRE_REDIS"
READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 5


def _free_port() -> int:
    """A loopback port nobody listens on now (redis-server cannot bind port 0 and tell)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _bulk_length(reply: bytes) -> int:
    """The whole length of a RESP bulk string whose header `reply` holds."""
    header, _, _ = reply.partition(b"\r\n")
    return len(header) + 2 + int(header[1:]) + 2


def _serving_pid(port: int) -> int | None:
    """The process ID of the Redis that answers on the port once it serves commands (a
    loading Redis answers -LOADING), else None. Asked, so that another Redis that took
    the port meanwhile is not mistaken for ours."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as conn:
            conn.sendall(b"INFO server\r\n")
            reply = b""
            while b"\r\n" not in reply or len(reply) < _bulk_length(reply):
                chunk = conn.recv(65536)
                if not chunk:
                    return None
                reply += chunk
                if not reply.startswith(b"$"):
                    return None  # -LOADING, or not a Redis
    except (OSError, ValueError):
        return None
    for line in reply.decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        if name == "process_id" and value.strip().isdigit():
            return int(value)
    return None


class RedisServer:
    """One `redis-server` process: `with RedisServer() as redis: redis.url`.

    `kill` SIGKILLs it (its clients see connection errors), `restart` starts it again,
    empty, on the same port, `stop` ends it for good and removes its directory."""

    def __init__(self, binary: str = REDIS_SERVER) -> None:
        self.binary = binary
        self.port = 0
        self.directory = Path(tempfile.mkdtemp(prefix="tr-", dir="/tmp"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start on a free port (trying another if one is taken meanwhile)."""
        for _ in range(PORT_ATTEMPTS):
            self.port = _free_port()
            if self._launch():
                return
        raise RuntimeError(f"redis-server did not start:\n{self._log_tail()}")

    def restart(self) -> None:
        """Start again on the same port (killing it first if it still runs): empty, or
        with what a `SAVE` last wrote to its directory."""
        self.kill()
        if not self._launch():
            raise RuntimeError(
                f"redis-server did not restart on port {self.port}:\n{self._log_tail()}"
            )

    def kill(self) -> None:
        """SIGKILL the server's process group and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL if it must) and remove its directory."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused one cannot stop
                self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT_S)
            self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _launch(self) -> bool:
        """Start redis-server on `self.port`; whether it answered PING in time."""
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if _serving_pid(self.port) == self.proc.pid:
                return True
            if self.proc.poll() is not None:
                break  # the port was taken, most likely
            time.sleep(0.02)
        self.kill()
        return False

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return "(no log)"


def redis_server_or_skip() -> RedisServer:
    """A `RedisServer` (not started yet), or skip the test when `redis-server` is not
    installed; with TETHER_REQUIRE_REDIS=1 (CI) a missing `redis-server` fails instead."""
    binary = shutil.which(REDIS_SERVER)
    if binary is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires it")
        pytest.skip(message)
    return RedisServer(binary)
