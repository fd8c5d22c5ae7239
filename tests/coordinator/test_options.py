"""`tether serve`'s options: one table of flags, each also a `TETHER_<FLAG>` variable,
uvicorn's names and defaults, `WEB_CONCURRENCY` as the worker count (SPEC 8)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from pathlib import Path

import pytest
from starlette.applications import Starlette

import tether
from tether.coordinator.launcher import bind_listener
from tether.coordinator.options import (
    FLAGS,
    OptionError,
    ServeOptions,
    add_serve_flags,
    options_from,
)
from tether.coordinator.runtime import StartupError


def parsed(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    parser.add_argument("app")
    add_serve_flags(parser)
    return vars(parser.parse_args(["main:app", *argv]))


def test_every_flag_is_a_serve_option() -> None:
    fields = {f.name for f in dataclasses.fields(ServeOptions)}
    assert {flag.field for flag in FLAGS} <= fields


@pytest.mark.parametrize(
    "flag",
    ["--uds", "--root-path", "--proxy-headers", "--no-proxy-headers", "--forwarded-allow-ips",
     "--timeout-keep-alive", "--timeout-graceful-shutdown", "--limit-concurrency",
     "--backlog", "--ssl-keyfile", "--ssl-certfile", "--ssl-keyfile-password",
     "--ssl-version", "--ssl-cert-reqs", "--ssl-ca-certs", "--ssl-ciphers", "--log-level",
     "--access-log", "--no-access-log", "--factory", "--app-dir", "--env-file", "--lifespan",
     "--h11-max-incomplete-event-size", "--header", "--server-header", "--no-server-header",
     "--date-header", "--no-date-header", "--ws-ping-interval", "--ws-ping-timeout"],
)
def test_uvicorns_flags_are_accepted(flag: str) -> None:
    option = next(a for a in _actions() if flag in a.option_strings)
    assert option is not None


def _actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return list(parser._actions)


def test_flags_become_options_with_uvicorns_meaning() -> None:
    options = options_from("main:app", parsed(
        "--root-path", "/api", "--no-proxy-headers", "--header", "x-a: 1", "--header", "x-b:2",
        "--timeout-graceful-shutdown", "7", "--no-access-log", "--ws-ping-interval", "2.5",
        "--ws-ping-timeout", "4",
    ))
    config = options.uvicorn_config()
    assert config["root_path"] == "/api"
    assert config["proxy_headers"] is False
    assert config["headers"] == [["x-a", "1"], ["x-b", "2"]]
    assert config["timeout_graceful_shutdown"] == 7
    assert (config["ws_ping_interval"], config["ws_ping_timeout"]) == (2.5, 4.0)
    assert options.access_log is False


def test_a_tether_variable_stands_for_its_flag() -> None:
    env = {"TETHER_PORT": "9001", "TETHER_PROXY_HEADERS": "false",
           "TETHER_HEADER": "x-a: 1\nx-b: 2", "TETHER_CLOSE_WINDOW": "5",
           "TETHER_LOG_LEVEL": "warning"}
    options = options_from("main:app", parsed(), env)
    assert options.port == 9001
    assert options.proxy_headers is False
    assert options.headers == [("x-a", "1"), ("x-b", "2")]
    assert options.close_window_s == 5.0
    assert options.log_level == "warning"


def test_a_flag_wins_over_its_variable() -> None:
    options = options_from("main:app", parsed("--port", "7000"), {"TETHER_PORT": "9001"})
    assert options.port == 7000


@pytest.mark.parametrize(
    ("name", "value"),
    [("TETHER_PORT", "eighty"), ("TETHER_ACCESS_LOG", "maybe"), ("TETHER_LIFESPAN", "sometimes"),
     ("TETHER_HEADER", "no-colon")],
)
def test_a_bad_variable_is_an_option_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(OptionError, match=name):
        options_from("main:app", parsed(), {name: value})


def test_metrics_are_off_by_default_and_flags_or_variables_turn_them_on() -> None:
    off = options_from("main:app", parsed(), {})
    assert (off.metrics_port, off.metrics_host, off.app_metrics) == (None, "127.0.0.1", False)
    flags = options_from("main:app", parsed(
        "--metrics-port", "9100", "--metrics-host", "0.0.0.0", "--app-metrics",
    ), {})
    assert (flags.metrics_port, flags.metrics_host, flags.app_metrics) == (9100, "0.0.0.0", True)
    env = {"TETHER_METRICS_PORT": "9101", "TETHER_METRICS_HOST": "::1",
           "TETHER_APP_METRICS": "true"}
    variables = options_from("main:app", parsed(), env)
    assert (variables.metrics_port, variables.metrics_host, variables.app_metrics) == (
        9101, "::1", True)
    # tether.run takes them as keyword arguments: they are ServeOptions fields.
    assert ServeOptions("main:app", metrics_port=9102, app_metrics=True).metrics_port == 9102


def test_web_concurrency_is_the_default_worker_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEB_CONCURRENCY", "3")
    assert ServeOptions("main:app").worker_count == 3
    assert ServeOptions("main:app", workers=2).worker_count == 2
    monkeypatch.delenv("WEB_CONCURRENCY")
    assert ServeOptions("main:app").worker_count == 1


def test_websocket_pings_turn_off_with_none_as_under_uvicorn_run() -> None:
    options = ServeOptions("main:app", ws_ping_interval=None, ws_ping_timeout=None)
    assert options.problem() is None
    config = options.uvicorn_config()
    assert (config["ws_ping_interval"], config["ws_ping_timeout"]) == (None, None)


def test_the_graceful_shutdown_default_is_30_s() -> None:
    assert ServeOptions("main:app").timeout_graceful_shutdown == 30


@pytest.mark.parametrize(
    ("options", "named"),
    [(ServeOptions("a:b", workers=0), "--workers"),
     (ServeOptions("a:b", checkpoint_root="/tmp/x"), "--name"),
     (ServeOptions("a:b", ssl_certfile="c.pem"), "--ssl-keyfile"),
     (ServeOptions("a:b", app_dir="/no/such/dir"), "--app-dir"),
     (ServeOptions("a:b", log_level="loud"), "--log-level"),
     (ServeOptions("a:b", metrics_port=70000), "--metrics-port"),
     (ServeOptions("a:b", ws_ping_interval=0), "--ws-ping-interval"),
     (ServeOptions("a:b", ws_ping_timeout=-1), "--ws-ping-timeout")],
)
def test_problems_name_the_flag(options: ServeOptions, named: str) -> None:
    problem = options.problem()
    assert problem is not None and named in problem


def test_tether_run_needs_an_import_string() -> None:
    with pytest.raises(TypeError, match="import string"):
        tether.run(Starlette())  # type: ignore[arg-type]


def test_tether_run_refuses_an_unknown_option() -> None:
    with pytest.raises(TypeError):
        tether.run("main:app", no_such_option=1)


def test_checkpointable_declares_the_kind_and_the_participant_together() -> None:
    from tether.checkpoint import declared_participant
    from tether.routing.kinds import declared_kind

    app = Starlette()
    kind = tether.SessionKind(header="x-session")

    class States:
        def sessions(self) -> list[str]:
            return []

    participant = tether.checkpointable(app, sessions=kind, state=States(),  # type: ignore[arg-type]
                                        state_version="v1")
    assert declared_kind(app) is kind
    assert declared_participant(app) is participant
    assert participant.provider is not None
    assert participant.state_version == "v1"


CLUSTER = ("--cluster", "redis://127.0.0.1:6379/0", "--service", "svc", "--advertise",
           "127.0.0.2", "--hop-secret-file", "/dev/null", "--host-id", "h1")


def test_a_cluster_hosts_participant_is_service_at_host_id_unless_named() -> None:
    assert options_from("main:app", parsed(*CLUSTER), env={}).participant == "svc@h1"
    named = options_from("main:app", parsed(*CLUSTER, "--name", "mine"), env={})
    assert named.participant == "mine"
    alone = options_from("main:app", parsed("--checkpoint-root", "/tmp/x"), env={})
    assert alone.participant is None
    assert alone.problem() is not None and "--name" in alone.problem()  # type: ignore[operator]
    clustered = options_from("main:app", parsed(*CLUSTER, "--checkpoint-root", "/tmp/x"), env={})
    assert clustered.problem() is None


@pytest.mark.parametrize(("value", "problem"), [
    ("30", None), ("5", None), ("4.9", "--cluster-ttl must be 5 to 3600 seconds"),
    ("7200", "--cluster-ttl must be 5 to 3600 seconds"),
])
def test_the_cluster_ttl_is_a_flag_and_a_variable(value: str, problem: str | None) -> None:
    by_flag = options_from("main:app", parsed(*CLUSTER, "--cluster-ttl", value), env={})
    by_env = options_from("main:app", parsed(*CLUSTER), env={"TETHER_CLUSTER_TTL": value})
    assert by_flag.cluster_ttl_s == by_env.cluster_ttl_s == float(value)
    assert by_flag.problem() == by_env.problem() == problem
    alone = options_from("main:app", parsed("--cluster-ttl", value), env={})
    assert alone.problem() == "--cluster-ttl needs --cluster redis://HOST:PORT/DB (several hosts)"


def test_a_uds_socket_a_killed_server_left_is_taken_over_and_a_live_one_is_not(
    short_tmp: Path,
) -> None:
    """A server SIGKILLed on `--uds` leaves its socket file: the next one on that path
    takes it over, as uvicorn does, since nothing listens there; a path where a server
    does listen, or a file that is no socket, is one line saying so."""
    stale = str(short_tmp / "stale.sock")
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(stale)  # bound, closed, never listening: what a killed server leaves
    with bind_listener(ServeOptions("main:app", uds=stale)) as taken:
        assert taken.getsockname() == stale
    live = str(short_tmp / "live.sock")
    plain = short_tmp / "plain"
    plain.write_text("not a socket")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(live)
        listening.listen()
        for path in (live, str(plain)):
            with pytest.raises(StartupError, match="another server listens there"):
                bind_listener(ServeOptions("main:app", uds=path))
