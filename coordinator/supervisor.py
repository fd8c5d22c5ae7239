"""Worker processes: start N, replace any that dies, stop them all gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable

import structlog

log = structlog.get_logger("tether.supervisor")

STOP_TIMEOUT_S = 40.0


class Supervisor:
    """Keeps `count` worker processes running until `stop()`.

    A worker that exits is replaced by a new process (which picks a new worker ID).
    `on_failure` is called if a worker dies before any worker ever registered, which
    means the app cannot start at all; replacing it would only loop.
    """

    def __init__(
        self,
        count: int,
        env: dict[str, str],
        pass_fds: tuple[int, ...],
        started: Callable[[], bool],
        on_failure: Callable[[int], None],
        stop_timeout_s: float = STOP_TIMEOUT_S,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        """`on_exit` is called with the pid of every worker that exits."""
        self.count = count
        self.stop_timeout_s = stop_timeout_s
        self._env = env
        self._pass_fds = pass_fds
        self._started = started
        self._on_failure = on_failure
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._on_exit = on_exit
        self.restarts = 0
        """Workers replaced after they exited (`tether_worker_restarts_total`)."""

    def set_env(self, env: dict[str, str]) -> None:
        """The environment of workers started from now on (replacements)."""
        self._env = env

    @property
    def pids(self) -> list[int]:
        return sorted(self._procs)

    async def start(self) -> None:
        for _ in range(self.count):
            await self._spawn()

    async def _spawn(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from tether.coordinator.worker import main; main()",
            env=self._env,
            pass_fds=self._pass_fds,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self._procs[proc.pid] = proc
        watcher = asyncio.create_task(self._watch(proc), name=f"tether-watch-{proc.pid}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self._procs.pop(proc.pid, None)
        if self._on_exit is not None:
            self._on_exit(proc.pid)
        if self._stopping:
            return
        log.warning("worker_exited", pid=proc.pid, code=code)
        if not self._started():
            self._on_failure(code)
            return
        self.restarts += 1
        await self._spawn()

    async def kill_all(self) -> None:
        """SIGKILL every worker and wait until each exited; each is replaced by a new
        process, as any worker that exits is (a fenced host: nothing is worth finishing)."""
        procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        log.warning("workers_killed", pids=[proc.pid for proc in procs])
        await asyncio.gather(*(proc.wait() for proc in procs))

    async def stop(self) -> None:
        """SIGTERM every worker (in-flight requests finish), SIGKILL any still alive later."""
        self._stopping = True
        procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(proc.wait()) for proc in procs]
        if waits:
            _, late = await asyncio.wait(waits, timeout=self.stop_timeout_s)
            for proc in procs:
                if proc.returncode is None:
                    log.error("worker_killed", pid=proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
            if late:
                await asyncio.wait(late)
        for watcher in list(self._watchers):
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
