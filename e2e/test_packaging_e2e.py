"""tether installs as the one import name `tether` (SPEC 2): the wheel holds nothing else,
an app with its own `routing.py`, `checkpoint.py` and `coordinator.py` serves, the
reference apps serve from any directory, the version prints, and the main process never
imports the app.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import tether
from e2e.conftest import Serve
from e2e.harness import REPO, Http, run_tether

pytestmark = pytest.mark.e2e

BUILD_JUNK = (".venv*", ".git", "__pycache__", "*_cache", ".hypothesis", "build",
              "*.egg-info", "results")


def test_the_wheel_holds_only_the_tether_package(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*BUILD_JUNK))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("tether-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith("top_level.txt")))
    tops = {name.split("/", 1)[0] for name in names if ".dist-info/" not in name}
    assert tops == {"tether"}
    assert top_level.split() == [b"tether"]
    for module in ("routing/router.py", "checkpoint/store.py", "coordinator/launcher.py",
                   "examples/counter.py", "__main__.py"):
        assert f"tether/{module}" in names


APP_WITH_ITS_OWN_MODULES = {
    "routing.py": "WHO = 'the app routing'\n",
    "checkpoint.py": "WHO = 'the app checkpoint'\n",
    "coordinator.py": "WHO = 'the app coordinator'\n",
    "app.py": """
        import checkpoint, coordinator, routing
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.sessions import SessionMiddleware
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route
        import tether

        counts: dict[str, int] = {}

        async def seed(request: Request) -> JSONResponse:
            session_id = (await request.json())["session_id"]
            counts[session_id] = 0
            request.session["session_id"] = session_id
            return JSONResponse({"ok": True})

        async def increment(request: Request) -> JSONResponse:
            session_id = request.session["session_id"]
            counts[session_id] += 1
            return JSONResponse({"count": counts[session_id],
                                 "who": [routing.WHO, checkpoint.WHO, coordinator.WHO]})

        app = Starlette(
            routes=[Route("/seed_session", seed, methods=["POST"]),
                    Route("/increment", increment, methods=["POST"])],
            middleware=[Middleware(SessionMiddleware, secret_key="own")],
        )
        tether.declare(app, tether.cookie_kind(app))
        """,
}


async def test_an_app_with_its_own_routing_checkpoint_and_coordinator_serves_at_4_workers(
    serve: Serve, tmp_path: Path
) -> None:
    for name, text in APP_WITH_ITS_OWN_MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    server = serve("app:app", 4, cwd=tmp_path)
    async with Http(server.url) as http:
        for index in range(8):
            seed = await http.request("POST", "/seed_session", json={"session_id": f"s{index}"})
            assert seed.status == 200, seed
            for count in range(1, 4):
                reply = await http.request("POST", "/increment", cookie=seed.cookie())
                assert reply.status == 200, reply
                assert reply.json["count"] == count
        assert reply.json["who"] == ["the app routing", "the app checkpoint",
                                     "the app coordinator"]


async def test_the_counter_serves_from_an_empty_directory(serve: Serve, tmp_path: Path) -> None:
    server = serve("tether.examples.counter:app", 2, cwd=tmp_path)
    async with Http(server.url) as http:
        seed = await http.request("POST", "/seed_session", json={"session_id": "anywhere"})
        assert seed.status == 200, seed
        counts = [(await http.request("POST", "/increment", cookie=seed.cookie())).json["count"]
                  for _ in range(4)]
    assert counts == [1, 2, 3, 4]


def test_tether_and_python_m_tether_print_the_version(tmp_path: Path) -> None:
    by_script = run_tether("--version", cwd=tmp_path)
    by_module = subprocess.run([sys.executable, "-m", "tether", "--version"], cwd=tmp_path,
                               capture_output=True, text=True, check=False)
    for result in (by_script, by_module):
        assert result.returncode == 0, result
        assert result.stdout.strip() == f"tether {tether.__version__}"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_the_main_process_does_not_grow_with_an_app_that_allocates_300_mb(
    serve: Serve, tmp_path: Path
) -> None:
    """Only workers import the app: a model loaded at import costs its memory in each
    worker, never in the main process (uvicorn's main process is ~27 MB)."""
    (tmp_path / "big.py").write_text(textwrap.dedent("""
        from starlette.applications import Starlette
        MODEL = b"w" * (300 * 1024 * 1024)  # written, so resident
        app = Starlette()
        """))
    server = serve("big:app", 2, cwd=tmp_path)
    workers = [pid for pid in server.group() if pid != server.pid]
    assert len(workers) == 2
    assert all(_rss_mib(pid) > 300 for pid in workers), "the app really allocated"
    assert _rss_mib(server.pid) < 120
