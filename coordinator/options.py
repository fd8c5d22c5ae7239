"""What `tether serve` is told: its options, each also a `TETHER_<FLAG>` variable, and the
uvicorn flags it takes with uvicorn's meaning (SPEC 8).

One table, `FLAGS`, names every flag once; the CLI parser, the environment variables and
`tether.run(...)`'s keyword arguments all come from it, and `ServeOptions` holds the result.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tether.checkpoint.store import validate_checkpoint_id, validate_participant
from tether.coordinator.apps import Preset
from tether.routing.errors import TetherError
from tether.routing.logs import LOG_LEVELS, LogFormat

Lifespan = Literal["auto", "on", "off"]
ENV_PREFIX = "TETHER_"
DEFAULT_GRACEFUL_S = 30
"""How long a stopping worker lets in-flight requests run (uvicorn's own default waits forever)."""


@dataclass(frozen=True)
class ServeOptions:
    """Everything `tether serve` was asked for; field names are uvicorn.run's where it has one."""

    app: str
    workers: int | None = None
    """None: `$WEB_CONCURRENCY`, else 1 (as uvicorn)."""
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    name: str | None = None
    sessions: Preset | None = None
    checkpoint_root: str | None = None
    control_token_file: str | None = None
    close_window_s: float | None = None
    log_format: LogFormat | None = None
    restore: str | None = None
    metrics_port: int | None = None
    """Serve `/metrics` from the main process on this port, without a token; None: off."""
    metrics_host: str = "127.0.0.1"
    app_metrics: bool = False
    """The app's own prometheus_client metrics in multiprocess mode, served beside tether's."""
    cluster: str | None = None
    """Several hosts (SPEC 12): the Redis URL that holds their claims and live set."""
    service: str | None = None
    advertise: str | None = None
    """The address other hosts reach this one's hop listeners at."""
    hop_secret_file: str | None = None
    host_id: str | None = None
    """None: `$POD_NAME` if set, else the hostname."""
    cluster_ttl_s: float | None = None
    """The TTL of this host's record in the live set; None: 10 s."""
    # uvicorn's flags, with uvicorn's meaning
    app_dir: str = "."
    factory: bool = False
    env_file: str | None = None
    lifespan: Lifespan = "auto"
    log_level: str | None = None
    access_log: bool = True
    root_path: str = ""
    proxy_headers: bool = True
    forwarded_allow_ips: str | None = None
    timeout_keep_alive: int = 5
    timeout_graceful_shutdown: int = DEFAULT_GRACEFUL_S
    limit_concurrency: int | None = None
    backlog: int = 2048
    http: Literal["auto", "h11", "httptools"] = "httptools"
    ws: Literal["auto", "none", "websockets", "wsproto"] = "auto"
    ws_ping_interval: float | None = 20.0
    ws_ping_timeout: float | None = 20.0
    """None (from `tether.run`, as `uvicorn.run` takes it): no pings, or no timeout."""
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    h11_max_incomplete_event_size: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    server_header: bool = True
    date_header: bool = True
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile_password: str | None = None
    ssl_version: int = int(ssl.PROTOCOL_TLS_SERVER)
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    ssl_ca_certs: str | None = None
    ssl_ciphers: str = "TLSv1"

    @property
    def worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        value = os.environ.get("WEB_CONCURRENCY", "")
        return int(value) if value.isdigit() else 1

    @property
    def cluster_host_id(self) -> str:
        return self.host_id or os.environ.get("POD_NAME") or socket.gethostname()

    @property
    def participant(self) -> str | None:
        """The name of this server's records in checkpoints: `--name`, else on a cluster
        `<service>@<host_id>` (SPEC 12), else None."""
        if self.name is not None or self.cluster is None or self.service is None:
            return self.name
        return f"{self.service}@{self.cluster_host_id}"

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def problem(self) -> str | None:
        """Why these options cannot be served, and what to do, or None."""
        if self.worker_count < 1:
            return "--workers must be at least 1"
        if self.close_window_s is not None and self.close_window_s <= 0:
            return "--close-window must be a positive number of seconds"
        if self.checkpoint_root is not None and self.participant is None:
            return "--name is required with --checkpoint-root: it names this server's records"
        if self.name is not None:
            try:
                validate_participant(self.name)
            except ValueError as error:
                return f"--name: {error}"
        if self.restore is not None and self.checkpoint_root is None:
            return "--restore needs --checkpoint-root, where the checkpoint is read from"
        if self.restore not in (None, "latest"):
            try:
                validate_checkpoint_id(self.restore)
            except TetherError as error:
                return f"--restore: {error.detail}"
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            return "--metrics-port must be a port number (0 picks a free one)"
        if self.uds is None and not 0 <= self.port <= 65535:
            return f"--port {self.port} is not a port number: pick one from 0 to 65535"
        if self.log_level is not None and self.log_level not in LOG_LEVELS:
            return f"--log-level must be one of {', '.join(LOG_LEVELS)}"
        if not os.path.isdir(self.app_dir):
            return f"--app-dir {self.app_dir!r} is not a directory"
        if self.env_file is not None and not os.path.isfile(self.env_file):
            return f"--env-file {self.env_file!r} does not exist"
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            return "--ssl-keyfile and --ssl-certfile go together: give both"
        cluster_problem = self._cluster_problem()
        if cluster_problem is not None:
            return cluster_problem
        for limit, flag in ((self.timeout_graceful_shutdown, "--timeout-graceful-shutdown"),
                            (self.timeout_keep_alive, "--timeout-keep-alive")):
            if limit < 0:
                return f"{flag} must not be negative"
        for seconds, flag in ((self.ws_ping_interval, "--ws-ping-interval"),
                              (self.ws_ping_timeout, "--ws-ping-timeout")):
            if seconds is not None and not seconds > 0:
                return f"{flag} must be a positive number of seconds"
        return None

    def _cluster_problem(self) -> str | None:
        given = [flag for flag, value in (
            ("--service", self.service), ("--advertise", self.advertise),
            ("--hop-secret-file", self.hop_secret_file), ("--host-id", self.host_id),
            ("--cluster-ttl", self.cluster_ttl_s),
        ) if value is not None]
        if self.cluster is None:
            if given:
                return f"{given[0]} needs --cluster redis://HOST:PORT/DB (several hosts)"
            return None
        if not self.cluster.startswith(("redis://", "rediss://", "unix://")):
            return "--cluster must be a Redis URL: redis://HOST:PORT/DB"
        for flag, value in (("--service", self.service), ("--advertise", self.advertise),
                            ("--hop-secret-file", self.hop_secret_file)):
            if value is None:
                return f"--cluster needs {flag} too (docs/cluster.md)"
        from tether.cluster.keys import name_problem  # only a cluster imports it

        for flag, value in (("--service", self.service), ("--host-id", self.cluster_host_id)):
            problem = name_problem(value)
            if problem is not None:
                return f"{flag}: {problem}"
        if self.uds is not None:
            return "--cluster serves on --host and --port; drop --uds"
        if self.cluster_ttl_s is not None and not 5.0 <= self.cluster_ttl_s <= 3600.0:
            return "--cluster-ttl must be 5 to 3600 seconds"
        return None

    def uvicorn_config(self) -> dict[str, Any]:
        """The keyword arguments of each worker's public `uvicorn.Config` (JSON-safe)."""
        return {
            "root_path": self.root_path,
            "proxy_headers": self.proxy_headers,
            "forwarded_allow_ips": self.forwarded_allow_ips,
            "timeout_keep_alive": self.timeout_keep_alive,
            "timeout_graceful_shutdown": self.timeout_graceful_shutdown,
            "limit_concurrency": self.limit_concurrency,
            "backlog": self.backlog,
            "http": self.http,
            "ws": self.ws,
            "ws_ping_interval": self.ws_ping_interval,
            "ws_ping_timeout": self.ws_ping_timeout,
            "loop": self.loop,
            "h11_max_incomplete_event_size": self.h11_max_incomplete_event_size,
            "headers": [list(pair) for pair in self.headers],
            "server_header": self.server_header,
            "date_header": self.date_header,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile_password": self.ssl_keyfile_password,
            "ssl_version": self.ssl_version,
            "ssl_cert_reqs": self.ssl_cert_reqs,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_ciphers": self.ssl_ciphers,
        }


class OptionError(ValueError):
    """A flag or a `TETHER_<FLAG>` variable holds a value `tether serve` cannot use."""


def _header(value: str) -> tuple[str, str]:
    name, sep, text = value.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME:VALUE")
    return name.strip(), text.strip()


def _boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not true or false")


@dataclass(frozen=True)
class Flag:
    """One `tether serve` flag: its name, what argparse needs, and where it goes."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    dest: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    """A `--x` / `--no-x` pair."""
    many: bool = False
    """Repeatable; its variable holds one value a line."""
    metavar: str | None = None

    @property
    def field(self) -> str:
        return self.dest or self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.replace("-", "_").upper()


FLAGS: tuple[Flag, ...] = (
    Flag("workers", "worker processes (default $WEB_CONCURRENCY, else 1)", int),
    Flag("host", "bind to this address (default 127.0.0.1)"),
    Flag("port", "bind to this port; 0 picks a free one (default 8000)", int),
    Flag("uds", "bind to this Unix domain socket instead of host and port", metavar="PATH"),
    Flag("name", "the participant's name in checkpoints"),
    Flag("sessions", "a preset for an app that declares no session kind",
         choices=("cookie", "mcp")),
    Flag("checkpoint-root", "where checkpoints are written", metavar="DIR"),
    Flag("control-token-file", "the control token: read, or created 0600 if missing",
         metavar="F"),
    Flag("close-window", "seconds a session that is not open keeps its claim (default 300)",
         float, dest="close_window_s", metavar="S"),
    Flag("log-format", "console on a terminal, JSON otherwise", choices=("console", "json")),
    Flag("restore", "restore this checkpoint, then resume, before serving",
         metavar="ID|latest"),
    Flag("metrics-port", "serve /metrics from the main process on this port, without a "
         "token; 0 picks a free one (default off)", int, metavar="P"),
    Flag("metrics-host", "the address --metrics-port binds to (default 127.0.0.1)",
         metavar="H"),
    Flag("app-metrics", "the app's own prometheus_client metrics in multiprocess mode, "
         "served beside tether's (default off)", switch=True),
    Flag("cluster", "several hosts: the Redis that holds their claims and live set",
         metavar="redis://HOST:PORT/DB"),
    Flag("service", "with --cluster: the service's name, shared by all its hosts"),
    Flag("advertise", "with --cluster: the address other hosts reach this one at",
         metavar="ADDR"),
    Flag("hop-secret-file", "with --cluster: the secret that signs hops between hosts "
         "(0600, at least 32 bytes)", metavar="F"),
    Flag("host-id", "with --cluster: this host's ID, unique and stable in the service "
         "(default $POD_NAME, else the hostname)", metavar="ID"),
    Flag("cluster-ttl", "with --cluster: seconds this host's record lives unless refreshed "
         "(default 10; a host fences itself after 0.8 of it without Redis)", float,
         dest="cluster_ttl_s", metavar="S"),
    Flag("app-dir", "look for APP's module in this directory (default .)"),
    Flag("factory", "APP names a function that returns the app", switch=True),
    Flag("env-file", "load environment variables from this file before starting workers"),
    Flag("lifespan", "the app's lifespan events (default auto)", choices=("auto", "on", "off")),
    Flag("log-level", "the log level (default info)", choices=tuple(LOG_LEVELS)),
    Flag("access-log", "one log line per request (default on)", switch=True),
    Flag("root-path", "the ASGI root_path, for an app mounted below a prefix by a proxy"),
    Flag("proxy-headers", "trust X-Forwarded-Proto and -For from --forwarded-allow-ips "
         "(default on)", switch=True),
    Flag("forwarded-allow-ips", "addresses whose proxy headers are trusted "
         "(default $FORWARDED_ALLOW_IPS, else 127.0.0.1,::1)"),
    Flag("timeout-keep-alive", "seconds an idle kept-alive connection stays open (default 5)",
         int),
    Flag("timeout-graceful-shutdown", "seconds in-flight requests may run after SIGTERM "
         f"(default {DEFAULT_GRACEFUL_S})", int),
    Flag("limit-concurrency", "per worker, answer 503 above this many connections and tasks",
         int),
    Flag("backlog", "the listening socket's backlog (default 2048)", int),
    Flag("http", "the HTTP protocol implementation (default httptools)",
         choices=("auto", "h11", "httptools")),
    Flag("ws", "the WebSocket protocol implementation (default auto)",
         choices=("auto", "none", "websockets", "wsproto")),
    Flag("ws-ping-interval", "seconds between WebSocket pings, to clients and to the "
         "workers a WebSocket is relayed to (default 20)", float),
    Flag("ws-ping-timeout", "seconds a WebSocket ping may go unanswered before the "
         "connection is dropped (default 20)", float),
    Flag("loop", "the event loop (default auto)", choices=("auto", "asyncio", "uvloop")),
    Flag("h11-max-incomplete-event-size", "h11's limit on a request head, in bytes", int),
    Flag("header", "add this header to every reply; repeatable", _header, dest="headers",
         many=True, metavar="NAME:VALUE"),
    Flag("server-header", "send a server header (default on)", switch=True),
    Flag("date-header", "send a date header (default on)", switch=True),
    Flag("ssl-keyfile", "the TLS key file"),
    Flag("ssl-certfile", "the TLS certificate file"),
    Flag("ssl-keyfile-password", "the TLS key file's password"),
    Flag("ssl-version", "the TLS protocol version (see the ssl module)", int),
    Flag("ssl-cert-reqs", "whether a client certificate is required (see the ssl module)",
         int),
    Flag("ssl-ca-certs", "the CA certificates file"),
    Flag("ssl-ciphers", "the TLS ciphers (default TLSv1)"),
)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of `FLAGS` on the `serve` parser; defaults stay None so the
    environment and `ServeOptions` fill them in."""
    for flag in FLAGS:
        option = f"--{flag.name}"
        if flag.switch:
            parser.add_argument(option, dest=flag.field, action=argparse.BooleanOptionalAction,
                                default=None, help=flag.help)
        elif flag.many:
            parser.add_argument(option, dest=flag.field, action="append", type=flag.type,
                                default=None, help=flag.help, metavar=flag.metavar)
        else:
            parser.add_argument(option, dest=flag.field, type=flag.type, choices=flag.choices,
                                default=None, help=flag.help, metavar=flag.metavar)


def _from_env(flag: Flag, text: str) -> Any:
    try:
        if flag.switch:
            return _boolean(text)
        convert = flag.type
        if flag.many:
            return [convert(line) for line in text.splitlines() if line.strip()]
        value = convert(text)
    except (argparse.ArgumentTypeError, ValueError) as error:
        raise OptionError(f"{flag.env}={text!r}: {error}") from None
    if flag.choices is not None and value not in flag.choices:
        raise OptionError(f"{flag.env}={text!r} must be one of {', '.join(flag.choices)}")
    return value


def options_from(app: str, given: Mapping[str, Any],
                 env: Mapping[str, str] | None = None) -> ServeOptions:
    """`ServeOptions` from parsed flags (None where not given), then `TETHER_<FLAG>`
    variables, then the defaults."""
    environ = os.environ if env is None else env
    chosen: dict[str, Any] = {}
    for flag in FLAGS:
        value = given.get(flag.field)
        if value is None and flag.env in environ:
            value = _from_env(flag, environ[flag.env])
        if value is not None:
            chosen[flag.field] = value
    return ServeOptions(app=app, **chosen)

