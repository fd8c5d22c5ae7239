"""The `serve` fixture: real `tether serve` process groups, stopped and checked after
each test (nothing of the group may be left)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import pytest

from e2e.harness import REPO, Server, start_server


class Serve(Protocol):
    def __call__(
        self,
        app: str,
        workers: int,
        *extra: str,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
    ) -> Server: ...


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start `tether serve APP --workers N EXTRA...`; at teardown SIGTERM it, SIGKILL the
    group if it must, and fail if any process of the group was left."""
    servers: list[Server] = []

    def start(
        app: str,
        workers: int,
        *extra: str,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
    ) -> Server:
        server = start_server(app, workers, *extra, env=env, cwd=cwd)
        servers.append(server)
        return server

    yield start
    problems = [problem for server in servers for problem in server.shutdown()]
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
def certificate() -> Iterator[tuple[str, str]]:
    """A self-signed key and certificate for localhost, made for this test."""
    with tempfile.TemporaryDirectory(prefix="te-tls-") as directory:
        key, cert = os.path.join(directory, "key.pem"), os.path.join(directory, "cert.pem")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=localhost", "-keyout", key, "-out", cert],
            check=True, capture_output=True,
        )
        yield key, cert
