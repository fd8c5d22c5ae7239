"""`tether serve`: the main process (SPEC 3, 8)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass, replace

import structlog

from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.store import resolve_latest, validate_checkpoint_id, validate_participant
from tether.coordinator.apps import AppError, Preset, import_app, resolve_kind
from tether.coordinator.channel import ChannelServer
from tether.coordinator.coordinator import Coordinator
from tether.coordinator.fleet import ChannelFleet
from tether.coordinator.runtime import (
    COORDINATOR_SOCKET,
    RuntimeDirError,
    make_runtime_dir,
    raise_open_file_limit,
    remove_runtime_dir,
    resolve_token,
)
from tether.coordinator.supervisor import Supervisor
from tether.coordinator.worker import CONFIG_ENV, WorkerSettings
from tether.routing.errors import TetherError
from tether.routing.logs import LogFormat, configure_logging

log = structlog.get_logger("tether.serve")

START_TIMEOUT_S = 60.0
RESTORE_DEADLINE_S = 600.0


@dataclass(frozen=True)
class ServeOptions:
    app: str
    workers: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    name: str | None = None
    sessions: Preset | None = None
    checkpoint_root: str | None = None
    control_token_file: str | None = None
    close_window_s: float | None = None
    log_format: LogFormat | None = None
    restore: str | None = None

    def problem(self) -> str | None:
        """Why these options cannot be served, or None."""
        if self.workers < 1:
            return "--workers must be at least 1"
        if self.close_window_s is not None and self.close_window_s <= 0:
            return "--close-window must be positive"
        if self.checkpoint_root is not None and self.name is None:
            return "--name is required with --checkpoint-root"
        if self.name is not None:
            try:
                validate_participant(self.name)
            except ValueError as error:
                return f"--name: {error}"
        if self.restore is not None and self.checkpoint_root is None:
            return "--restore needs --checkpoint-root"
        if self.restore not in (None, "latest"):
            try:
                validate_checkpoint_id(self.restore)
            except TetherError as error:
                return f"--restore: {error.detail}"
        return None


def bind_listener(host: str, port: int) -> socket.socket:
    """The shared listening socket every worker accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(options: ServeOptions) -> int:
    """Run the server until SIGTERM or SIGINT; return the exit code."""
    configure_logging(options.log_format)
    problem = options.problem()
    if problem is not None:
        print(f"tether serve: {problem}", file=sys.stderr)
        return 2
    if options.checkpoint_root is not None:
        os.makedirs(options.checkpoint_root, mode=0o700, exist_ok=True)
    try:
        app = import_app(options.app)
        resolve_kind(app, options.sessions, options.close_window_s)
    except AppError as error:
        print(f"tether serve: {error}", file=sys.stderr)
        return 2
    try:
        runtime_dir = make_runtime_dir()
    except RuntimeDirError as error:
        print(f"tether serve: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(options, runtime_dir))
    finally:
        remove_runtime_dir(runtime_dir)


async def _restore_at_start(options: ServeOptions, coordinator: Coordinator) -> bool:
    """`--restore` on several workers: restore, resume, open admission; False on failure."""
    checkpointer, fleet = coordinator.checkpointer, coordinator.fleet
    if options.restore is None or checkpointer is None or fleet is None:
        return True
    assert options.checkpoint_root is not None
    checkpoint_id = options.restore
    try:
        if checkpoint_id == "latest":
            found = await asyncio.to_thread(resolve_latest, options.checkpoint_root, options.name)
            if found is None:
                log.info("no_checkpoint_yet", restore="latest")
                await fleet.open_admission()
                return True
            checkpoint_id = found
        answer = await checkpointer.call(
            "restore", {"checkpoint_id": checkpoint_id, "deadline_s": RESTORE_DEADLINE_S}
        )
        await checkpointer.call("resume", {"checkpoint_id": checkpoint_id})
    except TetherError as error:
        print(f"tether serve: --restore {checkpoint_id}: {error.code}: {error.detail}",
              file=sys.stderr)
        return False
    await fleet.open_admission()
    log.info("restored", checkpoint_id=checkpoint_id, sessions=answer["installed_sessions"],
             placed=answer["placed_sessions"])
    return True


async def _serve(options: ServeOptions, runtime_dir: str) -> int:
    soft, _ = raise_open_file_limit()
    token, token_path = resolve_token(
        options.control_token_file, options.checkpoint_root, runtime_dir
    )
    try:
        listener = bind_listener(options.host, options.port)
    except OSError as error:
        print(f"tether serve: cannot listen on {options.host}:{options.port}: {error}",
              file=sys.stderr)
        return 2
    host, port = listener.getsockname()[:2]
    coordinator = Coordinator(options.workers, options.name, options.checkpoint_root)
    channels = ChannelServer(
        os.path.join(runtime_dir, COORDINATOR_SOCKET),
        coordinator.handler_for,
        on_channel=coordinator.on_channel,
    )
    if options.workers > 1:
        coordinator.fleet = ChannelFleet(coordinator, runtime_dir)
        coordinator.checkpointer = Checkpointer(
            coordinator.fleet, name=options.name, root=options.checkpoint_root
        )
        coordinator.checkpointer.start()
        # A restore at start-up keeps admission closed until it is done, so old cookies
        # never meet empty state.
        coordinator.fleet.closed = options.restore is not None
    await channels.start()
    stop = asyncio.Event()
    exit_code = 0

    def fail(code: int) -> None:
        nonlocal exit_code
        log.error("worker_failed_to_start", code=code)
        exit_code = 1
        stop.set()

    settings = WorkerSettings(
        app=options.app,
        runtime_dir=runtime_dir,
        workers=options.workers,
        fd=listener.fileno(),
        token=token,
        sessions=options.sessions,
        close_window_s=options.close_window_s,
        log_format=options.log_format,
        name=options.name,
        checkpoint_root=options.checkpoint_root,
        restore=options.restore,
        server_secret=secrets.token_hex(32),
    )
    env = {**os.environ, CONFIG_ENV: settings.to_json()}
    supervisor = Supervisor(
        options.workers,
        env,
        (listener.fileno(),),
        started=lambda: coordinator.ever_registered,
        on_failure=fail,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await supervisor.start()
        ready = asyncio.create_task(coordinator.wait_for_workers(options.workers, START_TIMEOUT_S))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.result() and not await _restore_at_start(options, coordinator):
            exit_code = 1
            stop.set()
        elif ready.done() and ready.result():
            # A replacement worker starts empty; it must not restore the checkpoint again.
            replacements = replace(settings, restore=None)
            supervisor.set_env({**os.environ, CONFIG_ENV: replacements.to_json()})
            where = f"[{host}]" if ":" in host else host
            print(f"tether serving http://{where}:{port} with {options.workers} workers",
                  flush=True)
            print(f"control token: {token_path or 'from $TETHER_CONTROL_TOKEN'}", flush=True)
            log.info("serving", port=port, workers=options.workers, pids=supervisor.pids,
                     open_files=soft, runtime_dir=runtime_dir)
        elif not stop.is_set():
            log.error("workers_did_not_start", registered=len(coordinator.links))
            exit_code = 1
            stop.set()
        await stopped
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)
        log.info("stopping")
    finally:
        coordinator.stopping = True
        if coordinator.checkpointer is not None:
            await coordinator.checkpointer.stop()
        await supervisor.stop()
        await channels.close()
        listener.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return exit_code
