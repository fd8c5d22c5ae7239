"""`tether serve`: the main process (SPEC 3, 8)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import signal
import socket
import ssl
import stat
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import dotenv
import structlog
from uvicorn.config import create_ssl_context

from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.store import resolve_latest
from tether.coordinator.channel import ChannelServer
from tether.coordinator.coordinator import Coordinator
from tether.coordinator.fleet import ChannelFleet
from tether.coordinator.options import ServeOptions
from tether.coordinator.runtime import (
    COORDINATOR_SOCKET,
    StartupError,
    make_runtime_dir,
    raise_open_file_limit,
    remove_runtime_dir,
    resolve_token,
)
from tether.coordinator.supervisor import Supervisor
from tether.coordinator.worker import CONFIG_ENV, WorkerSettings
from tether.routing import tracing
from tether.routing.errors import TetherError
from tether.routing.kinds import DEFAULT_CLOSE_WINDOW_S
from tether.routing.logs import configure_logging, say

if TYPE_CHECKING:
    from tether.coordinator.cluster import ClusterMember

log = structlog.get_logger("tether.serve")

START_TIMEOUT_S = 60.0
RESTORE_DEADLINE_S = 600.0
STOP_MARGIN_S = 10.0
"""How long after --timeout-graceful-shutdown a worker that has not exited is killed."""

__all__ = ["ServeOptions", "serve"]


def bind_listener(options: ServeOptions) -> socket.socket:
    """The shared listening socket every worker accepts on: TCP, or `--uds` (0666, as
    uvicorn makes it). Raises `StartupError` with the line to print."""
    if options.uds is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = options.uds
    else:
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        where = f"{options.host}:{options.port}"
    try:
        if options.uds is not None:
            if _stale_socket(options.uds):
                os.unlink(options.uds)  # (as uvicorn does: a killed server's leftover)
            sock.bind(options.uds)
            os.chmod(options.uds, 0o666)
        else:
            sock.bind((options.host, options.port))
        sock.listen(options.backlog)
    except (OSError, OverflowError) as error:  # (OverflowError: a port past 65535)
        sock.close()
        in_use = isinstance(error, OSError) and error.errno == errno.EADDRINUSE
        if options.uds is not None:
            fix = ("another server listens there, or a file that is no socket is in the "
                   "way: stop it or remove the file, or pick another --uds"
                   if in_use else "pick another --uds path")
        else:
            fix = ("another process listens there; stop it or pick another --port"
                   if in_use else "pick another address")
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise StartupError(f"cannot listen on {where} ({reason}); {fix}") from None
    sock.set_inheritable(True)
    return sock


def _stale_socket(path: str) -> bool:
    """Whether `path` is a Unix socket nobody listens on any more."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _check_tls(options: ServeOptions) -> None:
    """Build the TLS context once here, so a bad key or certificate is one line."""
    if not options.ssl_certfile:
        return
    try:
        create_ssl_context(
            keyfile=options.ssl_keyfile, certfile=options.ssl_certfile,
            password=options.ssl_keyfile_password, ssl_version=options.ssl_version,
            cert_reqs=options.ssl_cert_reqs, ca_certs=options.ssl_ca_certs,
            ciphers=options.ssl_ciphers,
        )
    except (OSError, ssl.SSLError) as error:
        raise StartupError(
            f"--ssl-certfile/--ssl-keyfile cannot be used ({error}); check both files "
            "and --ssl-keyfile-password"
        ) from None


def serve(options: ServeOptions) -> int:
    """Run the server until SIGTERM or SIGINT; return the exit code.

    Every start-up mistake ends in one line on stderr that names the problem and what to
    do, and a non-zero exit. The main process never imports the app: its workers do."""
    configure_logging(options.log_format, options.log_level)
    problem = options.problem()
    if problem is not None:
        say(f"tether serve: {problem}", "startup_failed", error=True)
        return 2
    if options.env_file is not None:
        try:
            dotenv.load_dotenv(options.env_file)
        except (OSError, ValueError) as error:  # (UnicodeDecodeError is a ValueError)
            say(f"tether serve: --env-file {options.env_file} cannot be read ({error}); "
                "make it a readable UTF-8 file of NAME=value lines", "startup_failed",
                error=True)
            return 2
    tracing.start()  # after --env-file, which may set OTEL_* too (workers inherit them)
    options = replace(options, app_dir=os.path.abspath(options.app_dir))
    runtime_dir = None
    try:
        if options.checkpoint_root is not None:
            try:
                os.makedirs(options.checkpoint_root, mode=0o700, exist_ok=True)
            except OSError as error:
                raise StartupError(
                    f"--checkpoint-root {options.checkpoint_root!r} cannot be made "
                    f"({error.strerror}); pick a writable folder"
                ) from None
        _check_tls(options)
        hop_secret = _hop_secret(options)
        runtime_dir = make_runtime_dir()
        token, token_path = resolve_token(
            options.control_token_file, options.checkpoint_root, runtime_dir
        )
        metrics_sock = None
        if options.metrics_port is not None:
            from tether.coordinator.metrics_http import bind_metrics  # see _serve

            metrics_sock = bind_metrics(options.metrics_host, options.metrics_port)
        try:
            listener = bind_listener(options)
        except StartupError:
            if metrics_sock is not None:
                metrics_sock.close()
            raise
    except StartupError as error:
        say(f"tether serve: {error}", "startup_failed", error=True)
        if runtime_dir is not None:
            remove_runtime_dir(runtime_dir)
        return 2
    except BaseException:  # (a bug: its traceback, but no runtime dir or token left)
        if runtime_dir is not None:
            remove_runtime_dir(runtime_dir)
        raise
    try:
        with listener, metrics_sock or contextlib.nullcontext():
            return asyncio.run(_serve(
                options, runtime_dir, listener, token, token_path, metrics_sock, hop_secret
            ))
    finally:
        tracing.stop()
        if options.uds is not None:
            with contextlib.suppress(OSError):
                os.unlink(options.uds)
        remove_runtime_dir(runtime_dir)


async def _restore_at_start(options: ServeOptions, coordinator: Coordinator) -> bool:
    """`--restore`: restore, then resume (which opens admission), before the server
    serves; control calls are refused with 503 until then, so nothing reads `open` while
    the app's routes still park. False on failure."""
    checkpointer, fleet = coordinator.checkpointer, coordinator.fleet
    if options.restore is None or checkpointer is None or fleet is None:
        return True
    assert options.checkpoint_root is not None
    checkpoint_id = options.restore
    try:
        if checkpoint_id == "latest":
            found = await asyncio.to_thread(
                resolve_latest, options.checkpoint_root, options.participant
            )
            if found is None:
                log.info("no_checkpoint_yet", restore="latest")
                await fleet.open_admission()
                return True
            checkpoint_id = found
        answer = await checkpointer.run(
            "restore", {"checkpoint_id": checkpoint_id, "deadline_s": RESTORE_DEADLINE_S}
        )
        await checkpointer.run("resume", {"checkpoint_id": checkpoint_id})
    except TetherError as error:
        say(f"tether serve: --restore {checkpoint_id}: {error.code}: {error.detail}",
            "startup_failed", error=True)
        return False
    finally:
        checkpointer.holding = None
    log.info("restored", checkpoint_id=checkpoint_id, sessions=answer["installed_sessions"],
             placed=answer["placed_sessions"])
    return True


def _hop_secret(options: ServeOptions) -> bytes | None:
    """The hop secret of a cluster, read once here so a bad file is one line."""
    if options.cluster is None or options.hop_secret_file is None:
        return None
    from tether.routing.hopsign import HopSecretError, load_hop_secret

    try:
        return load_hop_secret(options.hop_secret_file)
    except HopSecretError as error:
        raise StartupError(f"--hop-secret-file: {error}") from None


async def _join_cluster(
    options: ServeOptions, coordinator: Coordinator
) -> ClusterMember | None:
    """`--cluster`: join the service's live set before any worker starts. Raises
    `StartupError` for a host ID another live host has, or a Redis nobody answers."""
    if options.cluster is None:
        return None
    from tether.cluster.liveset import DEFAULT_TTL_S, ClusterError
    from tether.coordinator.cluster import ClusterMember, ClusterSettings

    assert options.service is not None
    assert options.advertise is not None
    settings = ClusterSettings(options.cluster, options.service, options.cluster_host_id,
                               options.advertise, options.cluster_ttl_s or DEFAULT_TTL_S)
    member = ClusterMember(
        settings,
        local=coordinator.hop_addresses,
        changed=coordinator.broadcast_live,
        close_window_s=options.close_window_s or DEFAULT_CLOSE_WINDOW_S,
        restart_workers=coordinator.restart_workers,
        reassert_claims=coordinator.reassert_claims,
    )
    try:
        epoch = await member.join()
    except (ClusterError, TetherError) as error:
        await member.stop()
        if isinstance(error, TetherError):
            raise StartupError(f"--cluster {options.cluster}: {error.detail}; start Redis "
                               "there or point --cluster at a running one") from None
        raise StartupError(f"--cluster {options.cluster}: {error}") from None
    log.info("cluster_joined", service=settings.service, host_id=settings.host_id,
             epoch=epoch)
    return member


def _url(options: ServeOptions, listener: socket.socket) -> str:
    if options.uds is not None:
        return f"unix:{options.uds}"
    host, port = listener.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    return f"{options.scheme}://{where}:{port}"


async def _serve(
    options: ServeOptions,
    runtime_dir: str,
    listener: socket.socket,
    token: str,
    token_path: str | None,
    metrics_sock: socket.socket | None = None,
    hop_secret: bytes | None = None,
) -> int:
    # Imported here, not at the top: every worker imports this package, and
    # prometheus_client (and aiohttp's server) stay out of the workers.
    from tether.coordinator.metrics import (
        MULTIPROC_ENV,
        Metrics,
        make_app_metrics_dir,
        mark_worker_dead,
    )
    from tether.coordinator.metrics_http import MetricsServer, metrics_url

    soft, _ = raise_open_file_limit()
    workers = options.worker_count
    coordinator = Coordinator(workers, options.participant, options.checkpoint_root)
    channels = ChannelServer(
        os.path.join(runtime_dir, COORDINATOR_SOCKET),
        coordinator.handler_for,
        on_channel=coordinator.on_channel,
    )
    # The checkpointer runs here whatever the worker count: one place for the phase,
    # the remembered IDs and the retire marks, which outlive any worker.
    coordinator.fleet = ChannelFleet(coordinator, runtime_dir)
    coordinator.checkpointer = Checkpointer(
        coordinator.fleet, name=options.participant, root=options.checkpoint_root
    )
    coordinator.checkpointer.start()
    # A restore at start-up keeps admission closed until it is done, so old cookies
    # never meet empty state.
    coordinator.fleet.closed = options.restore is not None
    if options.restore is not None:
        coordinator.checkpointer.holding = f"restoring {options.restore} at start; retry shortly"
    await channels.start()
    stop = asyncio.Event()
    exit_code = 0
    reported: list[str] = []

    def startup_failed(problem: str) -> None:
        """A worker reported why it cannot start: before any worker ever started, the
        app cannot start at all, so that is the server's one line."""
        nonlocal exit_code
        if coordinator.ever_registered:
            log.error("worker_failed_to_start", problem=problem)
            return
        if not reported:
            reported.append(problem)
            say(f"tether serve: {problem}", "startup_failed", error=True)
        exit_code = 1
        stop.set()

    def exited_early(code: int) -> None:
        nonlocal exit_code
        if not reported:
            reported.append(f"exit {code}")
            say(f"tether serve: a worker exited with code {code} before it started; its "
                "output above says why", "startup_failed", error=True)
        exit_code = 1
        stop.set()

    coordinator.on_startup_failed = startup_failed
    settings = WorkerSettings(
        app=options.app,
        runtime_dir=runtime_dir,
        workers=workers,
        fd=listener.fileno(),
        token=token,
        sessions=options.sessions,
        close_window_s=options.close_window_s,
        log_format=options.log_format,
        name=options.participant,
        checkpoint_root=options.checkpoint_root,
        restore=options.restore,
        app_dir=options.app_dir,
        factory=options.factory,
        lifespan=options.lifespan,
        log_level=options.log_level,
        access_log=options.access_log,
        uvicorn=options.uvicorn_config(),
        server_secret=secrets.token_hex(32),
        cluster=None if options.cluster is None or hop_secret is None else {
            "url": options.cluster,
            "service": str(options.service),
            "advertise": str(options.advertise),
            "hop_secret": hop_secret.hex(),
        },
    )
    # --app-metrics: the app's prometheus_client writes its multiprocess files in a fresh
    # directory of this run; a worker that exits is marked dead there (SPEC 9).
    app_metrics = make_app_metrics_dir(runtime_dir) if options.app_metrics else None
    worker_env = {MULTIPROC_ENV: app_metrics} if app_metrics is not None else {}
    env = {**os.environ, **worker_env, CONFIG_ENV: settings.to_json()}
    supervisor = Supervisor(
        workers,
        env,
        (listener.fileno(),),
        started=lambda: coordinator.ever_registered,
        on_failure=exited_early,
        stop_timeout_s=options.timeout_graceful_shutdown + STOP_MARGIN_S,
        on_exit=None if app_metrics is None else partial(mark_worker_dead, app_metrics),
        registered=lambda pid: any(link.pid == pid for link in coordinator.links.values()),
        start_timeout_s=START_TIMEOUT_S,
    )
    coordinator.kill_workers = supervisor.kill_all
    metrics = Metrics(
        coordinator, restarts=lambda: supervisor.restarts, app_metrics_dir=app_metrics
    )
    coordinator.metrics = metrics
    coordinator.checkpointer.observers.append(metrics.checkpoints)
    metrics_server = None if metrics_sock is None else MetricsServer(metrics, metrics_sock)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            coordinator.cluster = await _join_cluster(options, coordinator)
        except StartupError as error:
            say(f"tether serve: {error}", "startup_failed", error=True)
            return 2
        metrics.start()
        if metrics_server is not None:
            await metrics_server.start()
        await supervisor.start()
        ready = asyncio.create_task(coordinator.wait_for_workers(workers, START_TIMEOUT_S))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.result() and not await _restore_at_start(options, coordinator):
            exit_code = 1
            stop.set()
        elif ready.done() and ready.result():
            # A replacement worker starts empty; it must not restore the checkpoint again.
            replacements = replace(settings, restore=None)
            supervisor.set_env({**os.environ, **worker_env, CONFIG_ENV: replacements.to_json()})
            url, token_from = _url(options, listener), token_path or "$TETHER_CONTROL_TOKEN"
            if metrics_sock is not None:
                say(f"tether metrics: {metrics_url(metrics_sock)}", "metrics_serving",
                    url=metrics_url(metrics_sock))
            say(f"tether serving {url} with {workers} workers", "tether_serving", url=url,
                workers=workers)
            say(f"control token: {token_from}", "control_token", path=token_path)
            port = None if options.uds is not None else listener.getsockname()[1]
            log.info("serving", url=_url(options, listener), port=port, workers=workers,
                     pids=supervisor.pids, open_files=soft, runtime_dir=runtime_dir)
        elif not stop.is_set():
            say(f"tether serve: {len(coordinator.links)} of {workers} workers started "
                f"within {START_TIMEOUT_S:.0f} s; see their output above",
                "startup_failed", error=True)
            exit_code = 1
            stop.set()
        await stopped
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)
        if reported:
            log.debug("stopping")
        else:
            log.info("stopping")
    finally:
        coordinator.stopping = True
        await metrics.stop()
        if coordinator.checkpointer is not None:
            await coordinator.checkpointer.stop()
        await supervisor.stop()
        if coordinator.cluster is not None:
            await coordinator.cluster.stop()
        if metrics_server is not None:
            await metrics_server.close()
        await channels.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return exit_code
