"""Worker processes: start N, replace any that dies, stop them all gracefully."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
from collections.abc import Callable

import structlog

log = structlog.get_logger("tether.supervisor")

STOP_TIMEOUT_S = 40.0
START_TIMEOUT_S = 60.0
"""How long a replacement may take to register before it counts as hung and is killed."""
QUICK_EXIT_S = 10.0
"""A worker that exits sooner than this after it started failed to start: each one in a
row waits twice as long before its replacement (from `RESPAWN_DELAYS_S`' first to its
last), so an app that cannot start now is not respawned in a tight loop."""
RESPAWN_DELAYS_S = (0.5, 30.0)
WORKER_COMMAND = ("-c", "from tether.coordinator.worker import main; main()")


class Supervisor:
    """Keeps `count` worker processes running until `stop()`.

    A worker that exits is replaced by a new process (which picks a new worker ID), after
    a delay that doubles with each one in a row that failed to start (`QUICK_EXIT_S`); a
    replacement that has not registered (`registered`) within `start_timeout_s` is killed
    and replaced in turn. `on_failure` is called if a worker dies before any worker ever
    registered, which means the app cannot start at all; replacing it would only loop.
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
        registered: Callable[[int], bool] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        respawn_delays_s: tuple[float, float] = RESPAWN_DELAYS_S,
        command: tuple[str, ...] = WORKER_COMMAND,
    ) -> None:
        """`on_exit` is called with the pid of every worker that exits; `registered`
        says whether the worker of a pid registered (None: replacements are not timed)."""
        self.count = count
        self.stop_timeout_s = stop_timeout_s
        self.start_timeout_s = start_timeout_s
        self.respawn_delays_s = respawn_delays_s
        self._registered = registered
        self._command = command
        self._born: dict[int, float] = {}
        self._failed_in_a_row = 0
        self.delays: collections.deque[float] = collections.deque(maxlen=64)
        """The delay before each of the latest replacements, in order (0: at once)."""
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

    async def _spawn(self, replacement: bool = False) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *self._command,
            env=self._env,
            pass_fds=self._pass_fds,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self._procs[proc.pid] = proc
        self._born[proc.pid] = asyncio.get_running_loop().time()
        watcher = asyncio.create_task(
            self._watch(proc, replacement), name=f"tether-watch-{proc.pid}"
        )
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, proc: asyncio.subprocess.Process, replacement: bool) -> None:
        if replacement and self._registered is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.start_timeout_s):
                    await proc.wait()
            if proc.returncode is None and not self._registered(proc.pid):
                log.error("worker_start_timeout", pid=proc.pid, seconds=self.start_timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        code = await proc.wait()
        self._procs.pop(proc.pid, None)
        lived = asyncio.get_running_loop().time() - self._born.pop(proc.pid)
        if self._on_exit is not None:
            self._on_exit(proc.pid)
        if self._stopping:
            return
        log.warning("worker_exited", pid=proc.pid, code=code)
        if not self._started():
            self._on_failure(code)
            return
        self.restarts += 1
        self._failed_in_a_row = self._failed_in_a_row + 1 if lived < QUICK_EXIT_S else 0
        delay = 0.0
        if self._failed_in_a_row:
            first, last = self.respawn_delays_s
            delay = min(first * 2 ** (self._failed_in_a_row - 1), last)
            log.warning("worker_restart_delayed", seconds=delay,
                        failed_in_a_row=self._failed_in_a_row)
        self.delays.append(delay)
        await asyncio.sleep(delay)
        await self._spawn(replacement=True)

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
