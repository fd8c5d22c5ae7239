"""The several-hosts benchmark (SPEC 11, 12; issue #16): what a hop to another host adds
next to a hop on this host, and what looking up another worker's session on Redis costs.

Run from the repository root (about 45 seconds, 10 of them waiting for the hosts)::

    .venv/bin/python -m e2e.bench.cluster [--rounds 3000] [--warmup 300] [--fresh 1000]
                                          [--lookups 2000] [--no-doc]

It starts one real `redis-server` (`e2e/redis_server.py`, a free port, no persistence)
and two hosts of one service, each a real `tether serve tether.examples.counter:app
--workers 2 --cluster redis://... --service e2e --advertise 127.0.0.N --hop-secret-file F
--host-id hN` process group on its own loopback address (h1 on 127.0.0.2, h2 on
127.0.0.3; `e2e/cluster_harness.py`), waits until each host reaches every worker, seeds
one session on h1 and times `GET /count` for it three ways:

    direct      a connection h1's holder of the session accepted: no hop
    same_host   a connection h1's other worker accepted: passed through to the holder's
                private Unix socket (routing/front.py, SPEC 4.5)
    cross_host  a connection a worker of h2 accepted: passed through over a kept-alive
                TCP link to the holder's hop listener, signed (`x-tether-hop`, SPEC 12;
                copied by the forwarder before the tenth session)

Both forwarded variants first look the session up in Redis (one round trip: the
receiving worker does not hold it), so what they add over `direct` is that lookup plus
the hop; what `cross_host` adds over `same_host` is the hop's difference alone.

First pass, the hop alone: one kept-alive client connection per variant, one request on
each per round in an order that rotates every round (as in `e2e/bench/routing.py`), from
blocking sockets in this process. Each connection's first request names no session, so
that none of them moves (a connection whose first request is for a session of another
worker of its host moves to that worker: routing/handoff.py). The status routes'
`forwarded` counters tell which worker received each connection and check afterwards
that every request went as meant.
Second pass, what a client behind a load balancer with no session affinity sees: every
request on a new TCP connection, alternately to h1 and to h2; a request to h1 is
`direct` or `same_host` depending on the worker that accepted it, found from /proc
(`e2e.harness.Connection.owner`) once it has, before the request is sent (a `same_host`
connection moves to the holder with that request). Its time runs from the request's
first byte to the reply's last: the connect and the accept are not timed.

Then, the hosts up and idle, the lookup of another worker's session (the seeded one, as
its holder claimed it): `RedisClaimStore.claimant` (tether.cluster.claims, on a client
from `tether.cluster.client.redis_client`, as the workers use) on the real
`redis-server`, one call at a time, beside the same client's bare `GET` of the claim's
key, a `GET` written by hand on a blocking socket (the round trip with no client library
around it) and the embedded `FileClaimStore.claimant` (the claim file read of one host),
interleaved, each call timed on its own in this process's event loop (uvloop when
installed, as the workers run).

It prints a table, writes `e2e/bench/results/cluster.json` and rewrites the generated
part of the "Several hosts" section of `docs/benchmarks.md` (not with `--no-doc`). It
exits 1 if the run's own checks fail (a request not routed as meant, a reply not from
the holder, a process left over).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2e.bench import machine, write_generated
from e2e.bench.routing import (
    CLIENT_TIMEOUT_S,
    RawClient,
    cpu_seconds,
    cpu_ticks,
    finish,
    http_request,
    json_reply,
    load_average,
    measure,
    percentile,
    summarize,
)
from e2e.bench.stress import group_cpu
from e2e.cluster_harness import Cluster, Host, write_hop_secret
from e2e.harness import (
    COUNTER_APP,
    REPO,
    Connection,
    CounterSession,
    Server,
    eventually,
    start_server,
    tcp_rows,
)
from e2e.redis_server import REDIS_SERVER, RedisServer
from tether.cluster.claims import RedisClaimStore
from tether.cluster.client import redis_client
from tether.routing.claims import FileClaimStore
from tether.routing.types import SessionId, WorkerId

RESULTS = REPO / "e2e" / "bench" / "results" / "cluster.json"
DOC = REPO / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python -m e2e.bench.cluster"
SECTION = "## Several hosts (issue #16)"

NO_SESSION = http_request("GET", "/health", {})
HOSTS = {"h1": "127.0.0.2", "h2": "127.0.0.3"}
WORKERS = 2
VARIANTS = ("direct", "same_host", "cross_host")
CONNECT_ATTEMPTS = 100  # new connections tried to find one on each of h1's workers
FRESH_WARMUP = 50  # rounds of the new-connection pass not counted
LOOKUP_WARMUP = 200
TARGET_CROSS_OVER_SAME = 1.3  # SPEC 11: a hop to another host ÷ a hop on this host
PACKAGES = ("uvicorn", "starlette", "httptools", "uvloop", "redis", "structlog")
SERVING_WITHIN_S = 30.0


# The client


class HostClient(RawClient):
    """`RawClient` (one kept-alive connection on a blocking socket) to a host's address,
    which is not 127.0.0.1 here."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), CLIENT_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""


class RespClient:
    """The least a Redis client can be: `GET` over one blocking socket, RESP written and
    read by hand. The baseline for what a lookup's round trip itself costs."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), CLIENT_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()

    def get(self, key: str) -> bytes | None:
        name = key.encode()
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        data = b""
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis-server closed the connection")
            data += chunk
            end = data.find(b"\r\n")
            if end < 0:
                continue
            if not data.startswith(b"$"):
                raise RuntimeError(f"not a bulk string reply: {data!r}")
            size = int(data[1:end])
            if size < 0:
                return None
            if len(data) >= end + 2 + size + 2:
                return data[end + 2 : end + 2 + size]


class Hosts:
    """The `Serve` that `Cluster` starts hosts with: `start_server`, each server kept so
    that `shutdown` stops them all and reports what was left (as the `serve` fixture)."""

    def __init__(self) -> None:
        self.servers: list[Server] = []

    def __call__(
        self,
        app: str,
        workers: int,
        *extra: str,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
    ) -> Server:
        server = start_server(app, workers, *extra, env=env, cwd=cwd)
        self.servers.append(server)
        return server

    def shutdown(self) -> list[str]:
        return [problem for server in self.servers for problem in server.shutdown()]


@dataclass
class Setup:
    """The two hosts, the seeded session and who is who."""

    cluster: Cluster
    h1: Host
    h2: Host
    owners: dict[str, str]  # worker ID -> host ID
    session_id: SessionId
    holder: str
    cookie: str
    request: bytes  # GET /count with the session's cookie
    refused_after_mesh_s: float  # how long sessions answered 503 once the hosts meshed


async def workers_of(cluster: Cluster, host: Host) -> dict[str, dict[str, Any]]:
    """A host's workers' lines in its status (`forwarded`, `served_forwarded`, `pid`)."""
    status = await host.server.status(cluster.http(host))
    return {worker["id"]: worker for worker in status["workers"]}


async def set_up(cluster: Cluster) -> Setup:
    """Start both hosts, wait until they know each other and serve sessions, and seed the
    session on h1."""
    h1, h2 = (cluster.start(host_id, address, WORKERS) for host_id, address in HOSTS.items())
    owners = await cluster.meshed(dict.fromkeys(HOSTS, WORKERS))
    meshed_at = time.monotonic()
    session = CounterSession(cluster.http(h1), f"bench-{secrets.token_hex(4)}")

    async def seeded() -> bool:
        reply = await session.seed()
        if (reply.status, reply.code) == (503, "cluster_unavailable"):
            return False  # the hosts still refuse sessions (a transient 503, Retry-After)
        if reply.status != 200:
            raise RuntimeError(f"the seed failed: {reply!r}")
        return True

    await eventually(seeded, SERVING_WITHIN_S, "a seed on h1 answers 200", every=0.1)
    if session.cookie is None or session.worker is None:
        raise RuntimeError("the seed set no session cookie")
    if owners.get(session.worker) != "h1":
        raise RuntimeError(f"the session was seeded on {session.worker}, not a worker of h1")

    async def served() -> bool:
        for host in (h1, h2):
            for _ in range(2 * WORKERS):
                reply = await cluster.http(host).request("GET", "/count", cookie=session.cookie)
                if reply.status != 200:
                    return False
        return True

    await eventually(served, SERVING_WITHIN_S, "both hosts serve the session", every=0.1)
    request = http_request("GET", "/count", {"cookie": session.cookie})
    waited = round(time.monotonic() - meshed_at, 2)
    return Setup(
        cluster, h1, h2, owners, SessionId(session.id), session.worker, session.cookie,
        request, waited,
    )


# The kept-alive pass


async def kept_alive(
    setup: Setup, stack: contextlib.ExitStack
) -> tuple[dict[str, RawClient], dict[str, str]]:
    """One connection per variant (closed with `stack`), and the worker that received
    each: h1's holder, h1's other worker, a worker of h2. The status counters tell them
    apart: a connection's request raised the `forwarded` count of the worker that got it,
    unless that worker is the holder."""
    clients: dict[str, RawClient] = {}
    receivers: dict[str, str] = {}

    async def place(host: Host) -> None:
        client = HostClient(*host.server.host_port)
        stack.callback(client.close)
        json_reply(client, NO_SESSION)  # (so that the connection never moves)
        before = await workers_of(setup.cluster, host)
        _, reply = json_reply(client, setup.request)
        after = await workers_of(setup.cluster, host)
        if reply["worker"] != setup.holder:
            raise RuntimeError(f"served by {reply['worker']}, not the holder {setup.holder}")
        senders = [w for w in after if after[w]["forwarded"] > before[w]["forwarded"]]
        name = "cross_host" if host is setup.h2 else "same_host" if senders else "direct"
        if name in clients:
            client.close()
            return
        if name != "direct" and len(senders) != 1:
            raise RuntimeError(f"{name}: expected one forwarding worker, counted {senders}")
        clients[name] = client
        receivers[name] = senders[0] if senders else setup.holder

    await place(setup.h2)
    for _ in range(CONNECT_ATTEMPTS):
        if "direct" in clients and "same_host" in clients:
            return {name: clients[name] for name in VARIANTS}, receivers
        await place(setup.h1)
    raise RuntimeError(f"no connection landed on each of h1's workers in {CONNECT_ATTEMPTS}")


# The new-connection pass


_TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait"}


def tcp_states(address: str) -> dict[str, int]:
    """The loopback TCP connections to or from `host:port` (the holder's hop listener)
    by state, from /proc/net/tcp: how many connections the hops to it opened."""
    found = dict.fromkeys(_TCP_STATES.values(), 0)
    for _, _, state in tcp_rows(address):
        if state in _TCP_STATES:
            found[_TCP_STATES[state]] += 1
    return found


async def fresh(
    setup: Setup, rounds: int, pids: dict[str, int]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Nanoseconds per request, each on a new connection (from its first byte to the
    reply's last, once accepted), to h1 and h2 in turn; an h1 request is `direct` if the
    holder accepted it, else `same_host`. Also how many requests of each variant were
    sent, the warm-up rounds' included."""
    h1_pids = [pids[worker] for worker, host in setup.owners.items() if host == "h1"]
    h2_pids = [pids[worker] for worker, host in setup.owners.items() if host == "h2"]
    holder_pid = pids[setup.holder]
    samples: dict[str, list[int]] = {name: [] for name in VARIANTS}
    sent = dict.fromkeys(VARIANTS, 0)
    headers = {"cookie": setup.cookie}
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for index in range(FRESH_WARMUP + rounds):
            for host in (setup.h1, setup.h2) if index % 2 else (setup.h2, setup.h1):
                connection = await Connection.open(*host.server.host_port)
                try:
                    name = "cross_host"
                    if host is setup.h1:
                        pid = await connection.owner(h1_pids)
                        name = "direct" if pid == holder_pid else "same_host"
                    else:
                        await connection.owner(h2_pids)  # (timed alike: once accepted)
                    started = clock()
                    reply = await connection.request("GET", "/count", headers=headers)
                    elapsed = clock() - started
                    if reply.status != 200 or reply.json["worker"] != setup.holder:
                        raise RuntimeError(f"unexpected reply from {host.host_id}: {reply!r}")
                finally:
                    await connection.close()
                sent[name] += 1
                if index >= FRESH_WARMUP:
                    samples[name].append(elapsed)
    finally:
        gc.enable()
    return samples, sent


# Figures


def ratios(stats: dict[str, dict[str, float]]) -> dict[str, Any]:
    direct, same, cross = (stats[name] for name in VARIANTS)

    def over(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {at: round(a[f"{at}_ms"] / b[f"{at}_ms"], 3) for at in ("median", "p90")}

    def added(of: dict[str, float]) -> dict[str, float]:
        return {at: round(of[f"{at}_ms"] - direct[f"{at}_ms"], 4) for at in ("median", "p90")}

    same_added = added(same)["median"]
    return {
        "cross_over_same": over(cross, same),
        "same_over_direct": over(same, direct),
        "cross_over_direct": over(cross, direct),
        "added_ms": {"same_host": added(same), "cross_host": added(cross)},
        "cross_added_over_same_added_median": (
            round(added(cross)["median"] / same_added, 3) if same_added > 0 else None
        ),
    }


async def _timed(call: Callable[[], Awaitable[Any]], into: list[int]) -> Any:
    started = time.perf_counter_ns()
    value = await call()
    into.append(time.perf_counter_ns() - started)
    return value


def _us(nanoseconds: list[int]) -> dict[str, float]:
    us = sorted(value / 1000 for value in nanoseconds)
    return {
        "median_us": round(statistics.median(us), 2),
        "p90_us": round(percentile(us, 0.90), 2),
        "p99_us": round(percentile(us, 0.99), 2),
        "mean_us": round(statistics.fmean(us), 2),
    }


async def bench_lookups(
    redis_server: RedisServer, service: str, theirs: SessionId, holder: str, count: int
) -> dict[str, Any]:
    """Another worker's session looked up, `count` calls of each kind, interleaved: on
    Redis, the session `holder` claimed through the hosts (so Redis holds it as they wrote
    it); in a claim directory of this process, the same ID claimed for `holder` here."""
    async with contextlib.AsyncExitStack() as stack:
        client = redis_client(redis_server.url)
        stack.push_async_callback(client.aclose)
        raw = RespClient(redis_server.port)
        stack.callback(raw.close)
        directory = tempfile.mkdtemp(prefix="tl-", dir="/tmp")
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        redis_store = RedisClaimStore(client, service)
        file_store = FileClaimStore(directory)
        if await file_store.claim(theirs, WorkerId(holder)) != holder:
            raise RuntimeError("the file claim was not made")
        key = redis_store.keys.claim(theirs)

        async def raw_get() -> bytes | None:
            return raw.get(key)

        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "redis_claimant": lambda: redis_store.claimant(theirs),
            "redis_bare_get": lambda: client.get(key),
            "raw_resp_get": raw_get,
            "file_claimant": lambda: file_store.claimant(theirs),
        }
        samples: dict[str, list[int]] = {name: [] for name in calls}
        wrong = 0
        gc.collect()
        gc.disable()
        try:
            for index in range(LOOKUP_WARMUP + count):
                for name, call in calls.items():
                    into = samples[name] if index >= LOOKUP_WARMUP else []
                    found = await _timed(call, into)
                    if found not in (holder, holder.encode()):
                        wrong += 1
        finally:
            gc.enable()
    return {
        "calls": count,
        "wrong_answers": wrong,
        "loop": type(asyncio.get_running_loop()).__module__,
        **{name: _us(values) for name, values in samples.items()},
    }


# The run


def code_version() -> dict[str, Any]:
    """The commit measured, and the package files that differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return done.stdout if done.returncode == 0 else ""

    # Porcelain lines are `XY path`: X may be a space, so the output is not stripped.
    changed = git("status", "--porcelain", "--", "routing", "coordinator", "cluster", "examples")
    return {
        "commit": git("rev-parse", "HEAD").strip() or None,
        "modified": [line[3:] for line in changed.splitlines() if line],
    }


def redis_version() -> str:
    done = subprocess.run(
        [REDIS_SERVER, "--version"], capture_output=True, text=True, check=False, timeout=10
    )
    return done.stdout.strip()


class CpuMeter:
    """CPU time of chosen processes and of the whole machine between `start` and `stop`:
    per-process seconds, and the share of the CPUs that other work used meanwhile."""

    def __init__(self, pids: dict[str, int], groups: list[int]) -> None:
        self.pids = pids
        self.groups = groups  # every process of ours: the hosts' groups, redis, this one

    def _ours(self) -> float:
        return sum(group_cpu(pgid) for pgid in self.groups) + cpu_seconds(os.getpid())

    def start(self) -> None:
        self._before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._ticks = cpu_ticks()
        self._ours_before = self._ours()

    def stop(self) -> tuple[dict[str, float], float]:
        """Seconds per process, and other work's percent of the CPUs."""
        ticks = cpu_ticks()
        used = {name: cpu_seconds(pid) - self._before[name] for name, pid in self.pids.items()}
        tick = os.sysconf("SC_CLK_TCK")
        busy = (ticks[0] - self._ticks[0]) / tick
        capacity = (ticks[1] - self._ticks[1]) / tick
        ours = self._ours() - self._ours_before
        other = round(100 * max(0.0, busy - ours) / capacity, 1) if capacity else 0.0
        return used, other


async def measure_hosts(
    hosts: Hosts, redis_server: RedisServer, secret: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Both HTTP passes on two hosts started here (stopped by the caller, `hosts`)."""
    cluster = Cluster(hosts, redis_server, secret)
    try:
        setup = await set_up(cluster)
        lines = {**await workers_of(cluster, setup.h1), **await workers_of(cluster, setup.h2)}
        pids = {worker: int(line["pid"]) for worker, line in lines.items()}
        assert redis_server.proc is not None
        groups = [setup.h1.server.pid, setup.h2.server.pid, redis_server.proc.pid]

        with contextlib.ExitStack() as stack:
            clients, receivers = await kept_alive(setup, stack)
            meter = CpuMeter(
                {
                    "holder": pids[setup.holder],
                    "same_host_receiver": pids[receivers["same_host"]],
                    "cross_host_receiver": pids[receivers["cross_host"]],
                    "redis_server": redis_server.proc.pid,
                    "client": os.getpid(),
                },
                groups,
            )
            before = {**await workers_of(cluster, setup.h1), **await workers_of(cluster, setup.h2)}
            meter.start()
            kept_samples = measure(clients, setup.request, args.rounds, args.warmup)
            cpu, kept_other_work = meter.stop()
            after = {**await workers_of(cluster, setup.h1), **await workers_of(cluster, setup.h2)}
        requests = args.rounds + args.warmup

        fresh_before = after
        meter.start()
        record = await cluster.record("h1")
        hop_address = str(record["workers"][setup.holder]) if record else ""
        hop_before = tcp_states(hop_address) if hop_address else None
        fresh_samples, fresh_sent = await fresh(setup, args.fresh, pids)
        hop_after = tcp_states(hop_address) if hop_address else None
        _, fresh_other_work = meter.stop()
        fresh_after = {
            **await workers_of(cluster, setup.h1),
            **await workers_of(cluster, setup.h2),
        }
        # The hosts stay up and idle: the claim is theirs, and so is Redis's state.
        lookups = await bench_lookups(
            redis_server, cluster.service, setup.session_id, setup.holder, args.lookups
        )
    finally:
        await cluster.aclose()

    def delta(of: Mapping[str, Any], since: Mapping[str, Any], worker: str, field: str) -> int:
        return int(of[worker][field] - since[worker][field])

    h1_other = next(w for w, h in setup.owners.items() if h == "h1" and w != setup.holder)
    h2_workers = [w for w, h in setup.owners.items() if h == "h2"]
    checks: dict[str, Any] = {
        "kept_alive": {
            "holder_forwarded": delta(after, before, setup.holder, "forwarded"),
            "holder_served_forwarded": delta(after, before, setup.holder, "served_forwarded"),
            "expected_holder_served_forwarded": 2 * requests,
            "same_host_receiver_forwarded": delta(after, before, receivers["same_host"],
                                                  "forwarded"),
            "cross_host_receiver_forwarded": delta(after, before, receivers["cross_host"],
                                                   "forwarded"),
            "expected_forwarded": requests,
        },
        "fresh": {
            "same_host_sent": fresh_sent["same_host"],
            "h1_other_forwarded": delta(fresh_after, fresh_before, h1_other, "forwarded"),
            "holder_forwarded": delta(fresh_after, fresh_before, setup.holder, "forwarded"),
            "h2_forwarded": sum(
                delta(fresh_after, fresh_before, w, "forwarded") for w in h2_workers
            ),
            "cross_host_sent": fresh_sent["cross_host"],
        },
    }
    kept, new = checks["kept_alive"], checks["fresh"]
    kept["ok"] = (
        kept["holder_forwarded"] == 0
        and kept["holder_served_forwarded"] == 2 * requests
        and kept["same_host_receiver_forwarded"] == requests
        and kept["cross_host_receiver_forwarded"] == requests
    )
    new["ok"] = (
        new["holder_forwarded"] == 0
        and new["h1_other_forwarded"] == fresh_sent["same_host"]
        and new["h2_forwarded"] == fresh_sent["cross_host"] == FRESH_WARMUP + args.fresh
        and all(fresh_samples[name] for name in VARIANTS)
    )
    kept_stats = {name: summarize(kept_samples[name]) for name in VARIANTS}
    fresh_stats = {name: summarize(fresh_samples[name]) for name in VARIANTS}
    per_request = {
        "holder": 3 * requests,  # it serves every variant
        "same_host_receiver": requests,
        "cross_host_receiver": requests,
        "redis_server": 2 * requests,  # one lookup per forwarded request
        "client": 3 * requests,
    }
    return {
        "hosts": {host.host_id: {"address": host.address, "url": host.url}
                  for host in (setup.h1, setup.h2)},
        "holder": setup.holder,
        "receivers": receivers,
        "refused_after_mesh_s": setup.refused_after_mesh_s,
        "kept_alive": {
            "rounds": args.rounds,
            "warmup": args.warmup,
            "variants": kept_stats,
            "ratios": ratios(kept_stats),
            "other_work_cpu_percent": kept_other_work,
            "cpu_us_per_request": {
                name: round(seconds * 1e6 / per_request[name], 1) for name, seconds in cpu.items()
            },
        },
        "fresh": {
            "rounds": args.fresh,
            "warmup": FRESH_WARMUP,
            "counts": {name: len(values) for name, values in fresh_samples.items()},
            "variants": fresh_stats,
            "ratios": ratios(fresh_stats),
            "other_work_cpu_percent": fresh_other_work,
            "holder_hop_listener": hop_address,
            "hop_tcp_states": {"before": hop_before, "after": hop_after},
        },
        "lookups": lookups,
        "checks": checks,
    }


def show_logs(hosts: Hosts) -> None:
    """The hosts' last log lines (on the way out of a failed run, while they exist)."""
    for server in hosts.servers:
        with contextlib.suppress(OSError):
            tail = server.stderr().splitlines()[-15:]
            print(f"--- last lines of {server.url}:", *tail, sep="\n", file=sys.stderr)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start Redis and the hosts, measure, stop every process; the result, for JSON."""
    started = time.monotonic()
    load_before = load_average()
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    directory = Path(tempfile.mkdtemp(prefix="tc-", dir="/tmp"))
    try:
        with RedisServer() as redis_server:
            hosts = Hosts()
            try:
                http = await measure_hosts(
                    hosts, redis_server, write_hop_secret(directory), args
                )
            except BaseException:
                show_logs(hosts)
                raise
            finally:
                problems = hosts.shutdown()
        redis_gone = redis_server.proc is None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    checks = http.pop("checks")
    lookups = http.pop("lookups")
    checks["shutdown_problems"] = problems
    checks["redis_stopped"] = redis_gone
    checks["lookup_wrong_answers"] = lookups["wrong_answers"]
    checks["ok"] = (
        checks["kept_alive"]["ok"]
        and checks["fresh"]["ok"]
        and not problems
        and redis_gone
        and lookups["wrong_answers"] == 0
    )
    headline = http["kept_alive"]["ratios"]["cross_over_same"]["median"]
    return {
        "benchmark": "cluster",
        "command": args.command,
        "timestamp": timestamp,
        "machine": {
            **machine(PACKAGES),
            "redis_server": redis_version(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "code": code_version(),
        "setup": {
            "hosts": f"2 x tether serve {COUNTER_APP} --workers {WORKERS} --cluster "
            "redis://127.0.0.1:PORT/0 --service e2e --advertise 127.0.0.N --hop-secret-file "
            "F --host-id hN --port 0 --log-format json (access log on)",
            "request": "GET /count with the seeded session's cookie",
            "kept_alive": "one kept-alive connection per variant, order rotating each round; "
            "blocking sockets in this process, gc off while measuring",
            "fresh": "a new TCP connection per request, connect to reply, h1 and h2 in turn; "
            "asyncio streams in this process",
        },
        **http,
        "lookups": lookups,
        "target": {
            "cross_over_same_median": headline,
            "at_most": TARGET_CROSS_OVER_SAME,
            "pass": headline <= TARGET_CROSS_OVER_SAME,
        },
        "total_s": round(time.monotonic() - started, 1),
        "checks": checks,
    }


# Reporting


def _variant_rows(stats: dict[str, dict[str, float]], counts: Mapping[str, int]) -> list[str]:
    return [
        f"| {name} | {counts[name]} | {s['median_ms']:.3f} | {s['p90_ms']:.3f} | "
        f"{s['p99_ms']:.3f} | {s['mean_ms']:.3f} |"
        for name, s in stats.items()
    ]


def _ratio_row(label: str, figures: dict[str, Any]) -> str:
    cs, sd, cd = (figures[key] for key in ("cross_over_same", "same_over_direct",
                                            "cross_over_direct"))
    added = figures["added_ms"]
    share = figures["cross_added_over_same_added_median"]
    return (
        f"| {label} | **{cs['median']:.3f}x** / {cs['p90']:.3f}x | {sd['median']:.2f}x / "
        f"{sd['p90']:.2f}x | {cd['median']:.2f}x / {cd['p90']:.2f}x | "
        f"{added['same_host']['median']:+.3f} / {added['cross_host']['median']:+.3f} | "
        f"{'n/a' if share is None else f'{share:.2f}'} |"
    )


def table(result: dict[str, Any]) -> str:
    kept, new, lookups = result["kept_alive"], result["fresh"], result["lookups"]
    header = [
        "| variant | requests | median ms | p90 ms | p99 ms | mean ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines = ["Kept-alive connections (the hop alone):", "", *header]
    lines += _variant_rows(kept["variants"], dict.fromkeys(VARIANTS, kept["rounds"]))
    lines += ["", "A new connection per request (once accepted; the connect not timed):", "",
              *header]
    lines += _variant_rows(new["variants"], new["counts"])
    target = result["target"]
    lines += [
        "",
        "| pass | cross ÷ same host, median / p90 | same host ÷ direct | cross host ÷ direct "
        "| added ms, same / cross (median) | cross's added ÷ same's |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        _ratio_row("kept-alive", kept["ratios"]),
        _ratio_row("new connection", new["ratios"]),
        "",
        f"Target (SPEC 11): cross ÷ same host ≤ {target['at_most']}x (kept-alive median): "
        f"{'pass' if target['pass'] else 'FAIL'} ({target['cross_over_same_median']:.3f}x).",
    ]
    states = new["hop_tcp_states"]
    if states["before"] is not None and states["after"] is not None:
        reused = states["after"]["time_wait"] == 0 and (
            states["before"]["established"] == states["after"]["established"]
        )
        lines += [
            "",
            f"The hops' TCP connections to the holder's listener ({new['holder_hop_listener']}), "
            f"both ends counted: {states['before']['established']} established before the "
            f"new-connection pass, {states['after']['established']} after, "
            f"{states['after']['time_wait']} in TIME_WAIT"
            + (": the hops' connections were reused." if reused else ": some hops reconnected."),
        ]
    cpu = kept["cpu_us_per_request"]
    lines += [
        "",
        "| CPU per request, kept-alive pass (user + system, µs) | same-host receiver "
        "| cross-host receiver | holder (any variant) | redis-server (per lookup) | client |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| | {cpu['same_host_receiver']:.0f} | {cpu['cross_host_receiver']:.0f} | "
        f"{cpu['holder']:.0f} | {cpu['redis_server']:.0f} | {cpu['client']:.0f} |",
        "",
        f"| lookup of another worker's session ({lookups['calls']} calls each, "
        f"{lookups['loop']}) | median µs | p90 µs | p99 µs |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, label in (
        ("redis_claimant", "`RedisClaimStore.claimant` (one round trip to Redis)"),
        ("redis_bare_get", "the same redis-py client's bare `GET` of the key"),
        ("raw_resp_get", "`GET` on a blocking socket, RESP by hand (the round trip)"),
        ("file_claimant", "`FileClaimStore.claimant` (one host's claim file)"),
    ):
        s = lookups[name]
        lines.append(f"| {label} | {s['median_us']:.1f} | {s['p90_us']:.1f} | "
                     f"{s['p99_us']:.1f} |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result's key figures (the JSON kept in the doc)."""
    kept, new, lookups = result["kept_alive"], result["fresh"], result["lookups"]
    return {
        "timestamp": result["timestamp"],
        "commit": (result["code"]["commit"] or "")[:7],
        "other_work_cpu_percent": {"kept_alive": kept["other_work_cpu_percent"],
                                   "fresh": new["other_work_cpu_percent"]},
        "kept_alive_median_ms": {n: s["median_ms"] for n, s in kept["variants"].items()},
        "kept_alive_p90_ms": {n: s["p90_ms"] for n, s in kept["variants"].items()},
        "fresh_median_ms": {n: s["median_ms"] for n, s in new["variants"].items()},
        "fresh_p90_ms": {n: s["p90_ms"] for n, s in new["variants"].items()},
        "cross_over_same": {"kept_alive": kept["ratios"]["cross_over_same"],
                            "fresh": new["ratios"]["cross_over_same"]},
        "lookup_median_us": {
            name: lookups[name]["median_us"]
            for name in ("redis_claimant", "redis_bare_get", "raw_resp_get", "file_claimant")
        },
        "refused_after_mesh_s": result["refused_after_mesh_s"],
        "target_pass": result["target"]["pass"],
        "checks_ok": result["checks"]["ok"],
    }


def _generated_section(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f'  "{key}": {json.dumps(value)}' for key, value in summary(result).items()]
    modified = result["code"]["modified"]
    tree = f" with uncommitted changes to {', '.join(modified)}" if modified else ""
    return "\n".join(
        [
            "<!-- cluster:generated:begin (written by the benchmark; edit outside it) -->",
            f"Latest run: {result['timestamp']}, `{result['command']}`, commit "
            f"{(result['code']['commit'] or 'unknown')[:7]}{tree}, {m['nproc']} CPUs "
            f"({m['cpu_model']}), Python {m['python']}, {m['redis_server'].split(' sha=')[0]}; "
            f"load average {m['load_average_before']} before, {m['load_average_after']} "
            f"after; other processes used {result['kept_alive']['other_work_cpu_percent']}% "
            f"of the CPUs during the kept-alive pass; {result['total_s']} s in all.",
            "",
            table(result),
            "",
            "JSON summary (the full result is in `e2e/bench/results/cluster.json`):",
            "",
            "```json",
            "{\n" + ",\n".join(lines) + "\n}",
            "```",
            "<!-- cluster:generated:end -->",
        ]
    )


def update_doc(result: dict[str, Any], path: Path) -> None:
    """Rewrite the generated part of the section, or add the section at the end."""
    write_generated(path, "cluster", SECTION, _generated_section(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.bench.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3000, help="kept-alive rounds (3000)")
    parser.add_argument("--warmup", type=int, default=300, help="unmeasured rounds first (300)")
    parser.add_argument("--fresh", type=int, default=1000,
                        help="new-connection rounds, one request to each host (1000)")
    parser.add_argument("--lookups", type=int, default=2000, help="lookups of each kind (2000)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON result")
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc to update")
    parser.add_argument("--no-doc", action="store_true", help="leave the doc alone")
    args = parser.parse_args(argv)
    args.command = " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)])
    if args.rounds < 100 or args.warmup < 0 or args.fresh < 100 or args.lookups < 100:
        parser.error("--rounds, --fresh and --lookups must be at least 100, --warmup >= 0")
    if shutil.which(REDIS_SERVER) is None:
        print(f"{REDIS_SERVER} is not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(args))
    else:
        result = uvloop.run(run(args))
    return finish(result, result["kept_alive"]["other_work_cpu_percent"], args.output,
                  None if args.no_doc else args.doc, table, update_doc)


if __name__ == "__main__":
    sys.exit(main())
