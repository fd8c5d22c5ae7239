"""In-process workers on real sockets: each has its own app, a public uvicorn server on
127.0.0.1 port 0 and a private Unix socket; all share one claim directory."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tether.routing.claims import ClaimStore
from tether.routing.front import front_protocol
from tether.routing.kinds import SessionKind, declared_kind
from tether.routing.types import WorkerId
from tether.routing.worker import HopListener, RoutingWorker


@dataclass
class Node:
    """One in-process worker."""

    routing: RoutingWorker
    app: Any
    server: uvicorn.Server
    listener: socket.socket
    url: str

    @property
    def id(self) -> WorkerId:
        return self.routing.id

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, **kwargs)


@dataclass
class Cluster:
    runtime_dir: str
    nodes: list[Node] = field(default_factory=list)

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def set_live(self) -> None:
        live = [node.id for node in self.nodes]
        for node in self.nodes:
            node.routing.tables.set_live(live)

    async def add(
        self,
        app: Any,
        kind: SessionKind | None = None,
        single: bool = False,
        access_log: bool = False,
        root_path: str = "",
        front: bool = False,
        store: ClaimStore | None = None,
        hops: HopListener | None = None,
    ) -> Node:
        """Start a worker; its public server trusts proxy headers from 127.0.0.1 and serves
        under `root_path` (uvicorn's `--root-path`); with `front`, it runs the passthrough
        (routing/front.py) as `tether serve` does. `store` and `hops`: a cluster's claim
        store and hop listener, as a host of one gives its workers."""
        routing = RoutingWorker(
            app,
            kind=kind or declared_kind(app),
            runtime_dir=None if single else self.runtime_dir,
            access_log=access_log,
            store=store,
            hops=hops,
        )
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        config = uvicorn.Config(
            routing.router, lifespan="off", access_log=False, log_config=None, http="httptools",
            interface="asgi3", root_path=root_path, forwarded_allow_ips="127.0.0.1",
        )
        if front:
            assert routing.passthrough is not None
            protocol = config.http = front_protocol(routing.passthrough)

            def handed_in(data: bytes) -> Any:
                handed = protocol(
                    config=config, server_state=server.server_state, app_state={}
                )
                handed.hand_in(data)
                return handed

            routing.accept_handoffs(handed_in)
        await routing.start()
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[listener])
        port = listener.getsockname()[1]
        node = Node(routing, app, server, listener, f"http://127.0.0.1:{port}")
        self.nodes.append(node)
        self.set_live()
        return node

    async def kill(self, node: Node) -> None:
        """Stop a worker as if it died: its claims stay, its sockets go, others learn."""
        await self._stop(node)
        self.nodes.remove(node)
        self.set_live()

    async def _stop(self, node: Node) -> None:
        await node.routing.stop_handoffs()  # (as tether serve's server does)
        await node.server.shutdown(sockets=[node.listener])
        await node.routing.stop()

    async def close(self) -> None:
        for node in self.nodes:
            await self._stop(node)
        self.nodes.clear()


@pytest.fixture
async def cluster(short_tmp: Path) -> AsyncIterator[Cluster]:
    (short_tmp / "w").mkdir(mode=0o700)
    cluster = Cluster(str(short_tmp))
    try:
        yield cluster
    finally:
        await cluster.close()


AppFactory = Callable[[], Any]
