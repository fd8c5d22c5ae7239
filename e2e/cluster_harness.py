"""Several hosts of one service (SPEC 12) on this machine: each a real `tether serve`
process group on its own loopback address (127.0.0.2, 127.0.0.3, ...), all sharing one
real `redis-server` the test started, and what the tests read of them in Redis.

The key names are spelled here from the contract (`tether:{service}:host:{host_id}`,
`tether:{service}:claim:{session_id}`), not imported, so a renamed key fails a test.
"""

from __future__ import annotations

import json
import os
import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from e2e.conftest import Serve
from e2e.harness import COUNTER_APP, Http, Reply, Server, eventually
from e2e.redis_server import RedisServer

SERVICE = "e2e"
TTL_S = 10.0
"""The live set's TTL (SPEC 12's default): a killed host's record is gone by then."""
REFRESH_S = TTL_S / 4
"""How often each host refreshes its record and reads everyone's."""
SECRET_BYTES = 64
MESH_TIMEOUT_S = 30.0


def write_hop_secret(directory: Path, name: str = "hop-secret", *, size: int = SECRET_BYTES,
                     mode: int = 0o600) -> Path:
    """A hop secret file of `size` printable bytes (no newline) with `mode`."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(size)[:size].encode())
    finally:
        os.close(fd)
    os.chmod(path, mode)
    return path


def host_key(host_id: str, service: str = SERVICE) -> str:
    return f"tether:{service}:host:{host_id}"


def trusted_key(service: str = SERVICE) -> str:
    return f"tether:{service}:trusted"


def claim_key(session_id: str, service: str = SERVICE) -> str:
    return f"tether:{service}:claim:{session_id}"


@dataclass
class Host:
    """One host of the service: its `tether serve` group, its ID and its address."""

    host_id: str
    address: str
    server: Server

    @property
    def url(self) -> str:
        return self.server.url


class Spread:
    """Sends each request to a host picked at random among `clients`, on a new
    connection (each `Http` opens one per request): a load balancer with no session
    affinity. Quacks like `Http` for `CounterSession`."""

    def __init__(self, clients: Sequence[Http], rng: random.Random | None = None) -> None:
        self.clients = list(clients)
        self.rng = rng or random.Random()

    async def request(self, method: str, path: str, **kwargs: Any) -> Reply:
        return await self.rng.choice(self.clients).request(method, path, **kwargs)


class Cluster:
    """The hosts of one service, the Redis they share and a client of it (decoding)."""

    def __init__(self, serve: Serve, redis_server: RedisServer, hop_secret: Path,
                 service: str = SERVICE) -> None:
        self.serve = serve
        self.redis_server = redis_server
        self.hop_secret = hop_secret
        self.service = service
        self.hosts: list[Host] = []
        # Retried once: a pooled connection is closed by a Redis the test restarted.
        self.redis = redis.asyncio.Redis.from_url(
            redis_server.url, decode_responses=True, retry=Retry(NoBackoff(), 1),
            retry_on_error=[redis.exceptions.ConnectionError],
        )
        self._clients: dict[str, Http] = {}

    def flags(self, host_id: str, address: str) -> list[str]:
        """The flags that make `tether serve` host `host_id` of this service."""
        return [
            "--host", address,
            "--cluster", self.redis_server.url,
            "--service", self.service,
            "--advertise", address,
            "--hop-secret-file", str(self.hop_secret),
            "--host-id", host_id,
        ]  # fmt: skip

    def start(self, host_id: str, address: str, workers: int = 2, *extra: str,
              app: str = COUNTER_APP) -> Host:
        """Start one host (through the `serve` fixture, so teardown checks its group)."""
        server = self.serve(app, workers, *self.flags(host_id, address), *extra)
        host = Host(host_id, address, server)
        self.hosts.append(host)
        return host

    def http(self, host: Host) -> Http:
        """A client of one host (a new connection per request), closed with the cluster."""
        if host.url not in self._clients:
            self._clients[host.url] = Http(host.url)
        return self._clients[host.url]

    def forget(self, host: Host) -> None:
        """Leave a host that is gone out of `hosts` (a restarted one takes its ID)."""
        self.hosts.remove(host)

    def spread(self, hosts: Sequence[Host] | None = None) -> Spread:
        return Spread([self.http(host) for host in (self.hosts if hosts is None else hosts)])

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.__aexit__()
        self._clients.clear()
        await self.redis.aclose()

    # What Redis holds -----------------------------------------------------------------

    async def record(self, host_id: str) -> dict[str, Any] | None:
        """One host's record (`{"epoch", "host_id", "workers": {worker: "addr:port"}}`)."""
        raw = await self.redis.get(host_key(host_id, self.service))
        return None if raw is None else json.loads(raw)

    async def records(self) -> dict[str, dict[str, Any]]:
        """Every started host's record that exists now, by host ID."""
        found = {}
        for host in self.hosts:
            record = await self.record(host.host_id)
            if record is not None:
                found[host.host_id] = record
        return found

    async def worker_hosts(self) -> dict[str, str]:
        """Worker ID -> host ID, from the records; fails if a worker is listed twice."""
        owners: dict[str, str] = {}
        for host_id, record in (await self.records()).items():
            for worker in record["workers"]:
                assert worker not in owners, f"{worker} is listed by {owners[worker]} and {host_id}"
                owners[worker] = host_id
        return owners

    async def claims(self) -> dict[str, str]:
        """Session ID -> claimant worker ID, for every claim key of the service."""
        prefix = claim_key("", self.service)
        keys = [key async for key in self.redis.scan_iter(match=f"{prefix}*", count=1000)]
        found: dict[str, str] = {}
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            for key, value in zip(batch, await self.redis.mget(batch), strict=True):
                if value is not None:
                    found[key.removeprefix(prefix)] = str(value)
        return found

    # Waiting --------------------------------------------------------------------------

    async def meshed(self, workers_per_host: Mapping[str, int],
                     within: float = MESH_TIMEOUT_S) -> dict[str, str]:
        """Wait until every host's record lists its workers and every host reaches every
        worker of the service (a sessionless `GET /health` with `x-tether-worker: W`
        from each host to each W answers 200), so no host still waits to read another's
        record; returns worker ID -> host ID."""

        async def listed() -> dict[str, str] | None:
            records = await self.records()
            if {h: len(r["workers"]) for h, r in records.items()} != dict(workers_per_host):
                return None
            return await self.worker_hosts()

        owners: dict[str, str] = await eventually(
            listed, within, f"the records list {dict(workers_per_host)} workers", every=0.1
        )
        hosts = [host for host in self.hosts if host.host_id in workers_per_host]

        async def reached() -> bool:
            for host in hosts:
                for worker in owners:
                    reply = await self.http(host).request(
                        "GET", "/health", headers={"x-tether-worker": worker}
                    )
                    if reply.status != 200:
                        return False
            return True

        await eventually(reached, within, "every host reaches every worker", every=0.2)
        await self.trusted(within)
        return owners

    async def trusted(self, within: float = MESH_TIMEOUT_S) -> None:
        """Wait until the hosts trust the claims in Redis: until then a session ID a
        client names that nobody claims answers 503 (a fresh Redis looks like one that
        lost every claim; the hosts wait a TTL out, re-asserting theirs)."""

        async def marked() -> bool:
            return bool(await self.redis.exists(trusted_key(self.service)))

        await eventually(marked, within, "the hosts trust the claims", every=0.2)

