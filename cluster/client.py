"""How a host connects to the cluster's Redis: the one place its client is configured."""

from __future__ import annotations

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

MAX_CONNECTIONS = 64
"""Per process: a burst of lookups waits for a connection rather than failing."""
TIMEOUT_S = 2.0


def redis_client(url: str, *, max_connections: int = MAX_CONNECTIONS) -> redis.asyncio.Redis:
    """A client of the cluster's Redis: a blocking pool, and one retry so a pooled
    connection that Redis closed (a restart) is replaced rather than answered 503; every
    script tether runs is safe to repeat."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=TIMEOUT_S,
        retry=Retry(NoBackoff(), 1),
        socket_timeout=TIMEOUT_S,
        socket_connect_timeout=TIMEOUT_S,
    )
    return redis.asyncio.Redis.from_pool(pool)  # the client owns (closes) the pool
