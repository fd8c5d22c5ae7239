"""A real `redis-server` per test (never the machine's), and clients of it that are
closed after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Protocol

import pytest
import redis.asyncio

from e2e.redis_server import RedisServer, redis_server_or_skip
from tether.cluster.client import redis_client


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty `redis-server` on a free loopback port (skipped if not installed)."""
    with redis_server_or_skip() as server:
        yield server


class Connect(Protocol):
    def __call__(self, *, decode: bool = False) -> redis.asyncio.Redis: ...


@pytest.fixture
async def connect(redis_server: RedisServer) -> AsyncIterator[Connect]:
    """Make a client of the test's Redis (one per simulated host), as a host does
    (`redis_client`). All are closed after the test."""
    clients: list[redis.asyncio.Redis] = []

    def make(*, decode: bool = False) -> redis.asyncio.Redis:
        url = redis_server.url + ("?decode_responses=true" if decode else "")
        client = redis_client(url, max_connections=20)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()
