"""Every start-up mistake of SPEC 8 ends in one line on stderr that names the problem and
what to do, and a non-zero exit; never a traceback. Each case runs a real `tether serve`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from e2e.harness import run_tether

pytestmark = pytest.mark.e2e


@pytest.fixture
def apps(tmp_path: Path) -> Path:
    """A folder of broken apps, each a module of its own."""
    modules = {
        "raises": "value = 1 / 0\n",
        "needs_dep": "import not_installed_anywhere  # noqa: F401\n",
        "bad_lifespan": """
            from contextlib import asynccontextmanager
            from starlette.applications import Starlette

            @asynccontextmanager
            async def lifespan(app):
                raise RuntimeError("the database is down")
                yield

            app = Starlette(lifespan=lifespan)
            """,
        "mounted": """
            from starlette.applications import Starlette
            from starlette.middleware import Middleware
            from starlette.middleware.sessions import SessionMiddleware
            from starlette.routing import Mount

            sub = Starlette(middleware=[Middleware(SessionMiddleware, secret_key="s")])
            app = Starlette(routes=[Mount("/api", sub)])
            """,
        "raw_asgi": """
            async def app(scope, receive, send):
                pass
            """,
        "own_cookie": """
            from starlette.applications import Starlette
            from starlette.responses import JSONResponse
            from starlette.routing import Route

            async def login(request):
                reply = JSONResponse({})
                reply.set_cookie("sid", "mine")
                return reply

            app = Starlette(routes=[Route("/login", login)])
            """,
        "state_no_kind": """
            from starlette.applications import Starlette
            import tether

            class States:
                def sessions(self): return []
                def holds(self, sid): return False
                def export(self, sid): return None
                async def install(self, sid, state): pass
                async def release(self, sid): pass
                def busy(self, sid): return False

            app = Starlette()
            participant = tether.Participant()
            participant.register_sessions(States())
            tether.declare_participant(app, participant)
            """,
    }
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return tmp_path


def one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The single stderr line of a failed start, checked to name `words`."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    line = lines[0]
    if line.startswith("{"):  # under --log-format json the line is one JSON object
        record = json.loads(line)
        assert (record["event"], record["level"]) == ("startup_failed", "error"), record
        line = record["message"]
    assert line.startswith("tether serve: "), line
    for word in words:
        assert word in line, line
    return line


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_tether("serve", *args, "--port", "0", "--log-format", "json", env=env)


def test_a_missing_module_says_where_it_looked(apps: Path) -> None:
    one_line(serve("nowhere:app", "--app-dir", str(apps)), "'nowhere'", "--app-dir")


def test_a_module_that_raises_at_import_names_the_error_and_line(apps: Path) -> None:
    one_line(serve("raises:app", "--workers", "4", "--app-dir", str(apps)),
             "ZeroDivisionError", "raises.py:1")


def test_a_missing_dependency_is_named(apps: Path) -> None:
    one_line(serve("needs_dep:app", "--app-dir", str(apps)), "not_installed_anywhere")


def test_a_missing_attribute_is_named(apps: Path) -> None:
    one_line(serve("raises_not:app", "--app-dir", str(apps)), "raises_not")
    one_line(serve("mounted:nothing", "--app-dir", str(apps)), "no attribute 'nothing'")


def test_a_failed_lifespan_at_4_workers_is_one_line(apps: Path) -> None:
    one_line(serve("bad_lifespan:app", "--workers", "4", "--app-dir", str(apps)),
             "lifespan", "the database is down")


def test_cookie_preset_without_session_middleware_says_add_it() -> None:
    one_line(serve("e2e.apps.plain:app", "--sessions", "cookie", "--workers", "2"),
             "--sessions cookie", "no Starlette SessionMiddleware")


def test_cookie_preset_with_session_middleware_on_a_sub_app_names_the_mount(
    apps: Path,
) -> None:
    one_line(serve("mounted:app", "--sessions", "cookie", "--app-dir", str(apps)),
             "mounted at '/api'")


def test_cookie_preset_on_a_plain_asgi_app_says_declare_the_kind(apps: Path) -> None:
    one_line(serve("raw_asgi:app", "--sessions", "cookie", "--app-dir", str(apps)),
             "not a Starlette app", "tether.declare")


def test_cookie_preset_on_an_app_with_a_cookie_of_its_own_says_declare_a_kind(
    apps: Path,
) -> None:
    one_line(serve("own_cookie:app", "--sessions", "cookie", "--app-dir", str(apps)),
             "cookie of the app's own", "SessionKind")


def test_session_state_without_a_kind_is_refused(apps: Path) -> None:
    one_line(serve("state_no_kind:app", "--workers", "2", "--app-dir", str(apps)),
             "declares no session kind", "tether.checkpointable")


def test_a_port_in_use_says_pick_another() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_tether("serve", "e2e.apps.echo:app", "--port", str(port))
    one_line(result, f"127.0.0.1:{port}", "--port")


def test_a_metrics_port_in_use_says_pick_another() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_tether("serve", "e2e.apps.echo:app", "--port", "0",
                            "--metrics-port", str(port))
    assert result.returncode == 2
    one_line(result, f"127.0.0.1:{port}", "--metrics-port")


def test_a_port_past_65535_is_one_line_and_leaves_no_runtime_directory(
    tmp_path: Path,
) -> None:
    result = run_tether("serve", "e2e.apps.echo:app", "--port", "70000",
                        "--log-format", "json", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    one_line(result, "--port 70000", "65535")
    assert list(tmp_path.iterdir()) == []  # no runtime directory, no control token


def test_an_env_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    env_file = tmp_path / "bad.env"
    env_file.write_bytes(b"A=\xff\n")
    one_line(serve("e2e.apps.echo:app", "--env-file", str(env_file)), "--env-file", "UTF-8")


def test_a_flag_value_of_the_wrong_type_is_one_line() -> None:
    one_line(run_tether("serve", "e2e.apps.echo:app", "--port", "abc"), "--port", "'abc'",
             "--help")


def test_zero_workers_is_refused() -> None:
    one_line(serve("e2e.apps.echo:app", "--workers", "0"), "--workers")


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.touch(mode=0o600)
    one_line(serve("e2e.apps.echo:app", "--control-token-file", str(token)), "is empty")


def test_an_unreadable_token_file_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.mkdir(mode=0o700)  # unreadable as a file even for root
    one_line(serve("e2e.apps.echo:app", "--control-token-file", str(token)),
             "cannot be read")


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    os.chmod(token, 0o644)
    one_line(serve("e2e.apps.echo:app", "--control-token-file", str(token)),
             "read by others", "chmod 600")


def test_a_token_file_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    one_line(serve("e2e.apps.echo:app", "--control-token-file", str(tmp_path / "no" / "t")),
             "folder does not exist")


def test_a_runtime_directory_that_cannot_be_made_says_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = serve("e2e.apps.echo:app", env={"XDG_RUNTIME_DIR": str(missing)})
    one_line(result, "runtime directory", "XDG_RUNTIME_DIR")


def test_a_bad_flag_variable_is_named() -> None:
    one_line(serve("e2e.apps.echo:app", env={"TETHER_WORKERS": "many"}), "TETHER_WORKERS")


def test_a_missing_env_file_and_app_dir_are_named(tmp_path: Path) -> None:
    one_line(serve("e2e.apps.echo:app", "--env-file", str(tmp_path / "none")), "--env-file")
    one_line(serve("e2e.apps.echo:app", "--app-dir", str(tmp_path / "none")), "--app-dir")


def test_a_bad_certificate_is_one_line(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    one_line(serve("e2e.apps.echo:app", "--ssl-certfile", str(cert), "--ssl-keyfile",
                   str(cert)), "--ssl-certfile")
