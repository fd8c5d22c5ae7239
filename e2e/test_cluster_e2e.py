"""Several hosts of one service sharing claims through Redis (SPEC 12): each host a real
`tether serve` process group on its own loopback address, one real `redis-server` per
test on a free port (never the machine's), every request on a new connection.

Waiting for the hosts to know each other (`Cluster.meshed`) is part of each set-up: a
host reads the others' records every quarter of the TTL, and until it has read a
newcomer's, that newcomer's sessions answer a transient 503 (not what these tests are
about).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from e2e.cluster_harness import (
    REFRESH_S,
    SERVICE,
    TTL_S,
    Cluster,
    Host,
    claim_key,
    host_key,
    write_hop_secret,
)
from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    CounterSession,
    Reply,
    bounded,
    eventually,
    failed,
    raw_exchange,
    run_episode,
    run_tether,
    tcp_end,
    tcp_rows,
)
from e2e.redis_server import RedisServer, redis_server_or_skip
from e2e.test_passthrough_e2e import across, echoes, get, raw_on, seed, workers
from tether.cluster.client import TIMEOUT_S as REDIS_TIMEOUT_S
from tether.routing.hopsign import WINDOW_S, sign

pytestmark = pytest.mark.e2e

ADDRESSES = {"h1": "127.0.0.2", "h2": "127.0.0.3", "h3": "127.0.0.4"}
WORKERS = 2
CONCURRENCY = 50
SWEEP_MARGIN_S = 5.0
"""A worker sweeps its expired claims every window/20 s (0.1 s for 2 s); the rest is
slack for a loaded 2-core machine."""


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty `redis-server` of this test alone (skipped if not installed,
    failed under TETHER_REQUIRE_REDIS=1)."""
    with redis_server_or_skip() as server:
        yield server


@pytest.fixture
def short_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="tc-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def hop_secret(short_dir: Path) -> Path:
    """The service's hop secret: 64 bytes, mode 0600."""
    return write_hop_secret(short_dir)


@pytest.fixture
def hop_key(hop_secret: Path) -> bytes:
    """The key hops are signed with: the file's content, whitespace stripped."""
    return hop_secret.read_bytes().strip()


@pytest.fixture
async def cluster(
    redis_server: RedisServer, hop_secret: Path, serve: Serve
) -> AsyncIterator[Cluster]:
    """Hosts started through `serve` (stopped and checked after the test, before the
    Redis they use stops)."""
    hosts = Cluster(serve, redis_server, hop_secret)
    try:
        yield hosts
    finally:
        await hosts.aclose()


def start_hosts(cluster: Cluster, *extra: str) -> None:
    for host_id, address in ADDRESSES.items():
        cluster.start(host_id, address, WORKERS, *extra)


def run_id() -> str:
    return os.urandom(4).hex()


# 1. Many sessions over three hosts ----------------------------------------------------

SESSIONS = 1000
SHORT_WINDOW_S = 2.0


@pytest.mark.timeout(180)
async def test_1000_sessions_on_3_hosts_of_2_workers_are_all_right_and_none_split(
    cluster: Cluster,
) -> None:
    start_hosts(cluster, "--close-window", str(SHORT_WINDOW_S))
    owners = await cluster.meshed(dict.fromkeys(ADDRESSES, WORKERS))
    assert len(owners) == len(ADDRESSES) * WORKERS
    spread = cluster.spread()
    run = run_id()

    # A session held open through the run: its claim is in Redis, and stays.
    held = CounterSession(spread, f"held-{run}")  # type: ignore[arg-type]
    assert (await held.seed()).status == 200
    assert held.worker in owners
    assert await cluster.claims() == {held.id: held.worker}

    episodes = await bounded(
        (run_episode(CounterSession(spread, f"m-{run}-{i}")) for i in range(SESSIONS)),  # type: ignore[arg-type]
        limit=CONCURRENCY,
    )

    wrong = failed(episodes)
    assert not wrong, f"{len(wrong)} of {SESSIONS} sessions went wrong, e.g. {wrong[:3]}"
    split = [e for e in episodes if len(e.workers) != 1]
    assert not split, f"sessions served by more than one worker: {split[:3]}"
    strangers = [e for e in episodes if not e.workers <= owners.keys()]
    assert not strangers, f"sessions served by a worker no host lists: {strangers[:3]}"
    by_host = Counter(owners[worker] for e in episodes for worker in e.workers)
    assert sum(by_host.values()) == SESSIONS
    assert set(by_host) == set(ADDRESSES), f"hosts whose workers held no session: {by_host}"

    count = await held.count()
    assert count.status == 200, count
    assert count.json == {"session_id": held.id, "count": 0, "worker": held.worker}
    assert await cluster.redis.get(claim_key(held.id)) == held.worker, "an open claim ended"
    assert (await held.close()).status == 200

    # The claims of the closed sessions end a close window after their last request.
    async def no_claims() -> bool:
        return not await cluster.claims()

    try:
        await eventually(no_claims, SHORT_WINDOW_S + SWEEP_MARGIN_S, "no claim key is left")
    except AssertionError:
        left = await cluster.claims()
        raise AssertionError(
            f"{len(left)} claim keys left, e.g. {list(left.items())[:5]}"
        ) from None
    indexes = [key async for key in cluster.redis.scan_iter(match=f"tether:{SERVICE}:worker:*")]
    sizes = {key: await cluster.redis.scard(key) for key in indexes}
    assert not any(sizes.values()), f"per-worker claim indexes still name sessions: {sizes}"


# 2. A host killed ---------------------------------------------------------------------

KILL_WINDOW_S = 10.0
"""Long enough to check every dead session's 410 before its claims are swept."""
KILLED_SESSIONS = 300


@pytest.mark.timeout(180)
async def test_a_sigkilled_hosts_sessions_answer_410_elsewhere_and_others_stay_right(
    cluster: Cluster,
) -> None:
    start_hosts(cluster, "--close-window", str(KILL_WINDOW_S))
    owners = await cluster.meshed(dict.fromkeys(ADDRESSES, WORKERS))
    run = run_id()
    spread = cluster.spread()
    sessions = [CounterSession(spread, f"k-{run}-{i}") for i in range(KILLED_SESSIONS)]  # type: ignore[arg-type]
    seeds = await bounded((s.seed() for s in sessions), limit=CONCURRENCY)
    assert all(r.status == 200 for r in seeds), [r for r in seeds if r.status != 200][:5]
    firsts = await bounded((s.increment() for s in sessions), limit=CONCURRENCY)
    assert all(r.status == 200 and r.json["count"] == 1 for r in firsts), [
        r for r in firsts if r.status != 200 or r.json["count"] != 1
    ][:5]

    by_host: dict[str, list[CounterSession]] = defaultdict(list)
    for session in sessions:
        by_host[owners[str(session.worker)]].append(session)
    assert set(by_host) == set(ADDRESSES), {h: len(s) for h, s in by_host.items()}
    victim, *live = cluster.hosts[1], cluster.hosts[0], cluster.hosts[2]
    doomed = by_host[victim.host_id]
    survivors = [s for s in sessions if owners[str(s.worker)] != victim.host_id]
    dead_workers = {w for w, h in owners.items() if h == victim.host_id}
    assert await cluster.claims() == {s.id: s.worker for s in sessions}

    os.killpg(victim.server.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    await victim.server.group_gone()

    # Once its record has expired, every other host answers 410 for its sessions.
    async def record_gone() -> bool:
        return await cluster.redis.exists(host_key(victim.host_id)) == 0

    await eventually(record_gone, TTL_S + SWEEP_MARGIN_S, "the killed host's record expires")
    probes = list({s.worker: s for s in doomed}.values())  # one session per dead worker

    async def gone_everywhere() -> bool:
        for host in live:
            for session in probes:
                reply = await cluster.http(host).request(
                    "POST", "/increment", cookie=session.cookie
                )
                if (reply.status, reply.code) != (410, "session_gone"):
                    return False
        return True

    await eventually(gone_everywhere, 2 * REFRESH_S + SWEEP_MARGIN_S,
                     "every live host answers 410 for the killed host's sessions", every=0.2)
    gone = await bounded(
        (
            request
            for session in doomed
            for host in live
            for request in (
                session_on(cluster, host, session, "POST", "/increment"),
                session_on(cluster, host, session, "GET", "/count"),
                session_on(cluster, host, session, "POST", "/verify"),
                session_on(cluster, host, session, "POST", "/close_session", body=True),
                session_on(cluster, host, session, "POST", "/close_session", body=True,
                           cookie=False),
            )
        ),
        limit=CONCURRENCY,
    )
    wrong = [r for r in gone if (r.status, r.code) != (410, "session_gone")]
    assert not wrong, f"{len(wrong)} of {len(gone)} requests were not 410: {wrong[:5]}"

    # Every other session goes on, through the hosts that are left.
    survivors = [rebind(s, cluster.spread(live)) for s in survivors]
    seconds = await bounded((s.increment() for s in survivors), limit=CONCURRENCY)
    wrong = [r for r in seconds if r.status != 200 or r.json["count"] != 2]
    assert not wrong, f"{len(wrong)} of {len(survivors)} live sessions miscounted: {wrong[:5]}"
    counts = await bounded((s.count() for s in survivors), limit=CONCURRENCY)
    wrong = [
        (s.id, r) for s, r in zip(survivors, counts, strict=True)
        if r.status != 200 or r.json != {"session_id": s.id, "count": 2, "worker": s.worker}
    ]
    assert not wrong, f"{len(wrong)} of {len(survivors)} live sessions miscounted: {wrong[:5]}"

    # A close window after they were seen dead, the dead workers' claims are swept; the
    # live sessions' claims stay.
    async def swept() -> bool:
        return not dead_workers & set((await cluster.claims()).values())

    deadline = killed_at + TTL_S + REFRESH_S + KILL_WINDOW_S + REFRESH_S + SWEEP_MARGIN_S
    try:
        await eventually(swept, max(deadline - time.monotonic(), 1.0),
                         "no claim key names a dead worker")
    except AssertionError:
        left = {s: w for s, w in (await cluster.claims()).items() if w in dead_workers}
        raise AssertionError(f"{len(left)} claims of dead workers left, e.g. "
                             f"{list(left.items())[:3]}") from None
    assert await cluster.claims() == {s.id: s.worker for s in survivors}


def session_on(
    cluster: Cluster, host: Host, session: CounterSession, method: str, path: str,
    *, body: bool = False, cookie: bool = True,
) -> Any:
    """One request of `session` sent to `host` (a coroutine)."""
    return cluster.http(host).request(
        method,
        path,
        json={"session_id": session.id} if body else None,
        cookie=session.cookie if cookie else None,
    )


def rebind(session: CounterSession, client: Any) -> CounterSession:
    """The same session (ID, cookie, worker) sent through another client."""
    moved = CounterSession(client, session.id)
    moved.cookie, moved.worker = session.cookie, session.worker
    return moved


# 3. Forged hops -----------------------------------------------------------------------

CALLER = "http 127.0.0.1 40000 127.0.0.2 8000 "
"""The six caller fields a forwarder puts after the signature (an empty root path)."""


async def test_hops_without_a_valid_signature_are_refused_401_and_nothing_is_served(
    cluster: Cluster, hop_key: bytes
) -> None:
    host = cluster.start("h1", ADDRESSES["h1"], WORKERS)
    await cluster.meshed({"h1": WORKERS})
    http = cluster.http(host)
    session = CounterSession(http, f"hop-{run_id()}")
    assert (await session.seed()).status == 200
    assert session.worker is not None and session.cookie is not None
    record = await cluster.record("h1")
    assert record is not None
    worker = session.worker
    (other,) = set(record["workers"]) - {worker}
    hop_host, _, hop_port = record["workers"][worker].rpartition(":")
    assert hop_host == ADDRESSES["h1"], record
    secret = hop_key

    async def increment_by_hop(hop: str | None) -> tuple[int, Any]:
        lines = [
            "POST /increment HTTP/1.1",
            f"host: {hop_host}:{hop_port}",
            f"cookie: {session.cookie}",
            "content-length: 0",
        ]
        if hop is not None:
            lines.append(f"x-tether-hop: {hop}")  # last, where a forwarder puts it
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        status, _, body = await raw_exchange(hop_host, int(hop_port), head, within=10)
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    async def count() -> int:
        reply = await session.count()
        assert reply.status == 200, reply
        value: int = reply.json["count"]
        return value

    now = time.time()
    refused = {
        "no hop header": None,
        "caller fields but no signature": CALLER,
        "a signature made with another secret": sign(
            b"not-the-services-hop-secret-" * 3, "POST", "/increment", worker
        ),
        "a signature for another path": sign(secret, "GET", "/count", worker),
        f"a signature older than {WINDOW_S:g} s": sign(
            secret, "POST", "/increment", worker, now=now - WINDOW_S - 15
        ),
        "a signature for another worker": sign(secret, "POST", "/increment", other),
    }
    answers = {}
    for what, signature in refused.items():
        value = signature if signature is None or signature == CALLER else f"{signature} {CALLER}"
        answers[what] = await increment_by_hop(value)
    wrong = {what: a for what, a in answers.items() if not _hop_unauthorized(a)}
    assert not wrong, f"hops served or refused otherwise than 401 hop_unauthorized: {wrong}"
    assert await count() == 0, "a refused hop reached the app"

    valid = f"{sign(secret, 'POST', '/increment', worker)} {CALLER}"
    status, body = await increment_by_hop(valid)
    assert status == 200, body
    assert body == {"session_id": session.id, "count": 1, "worker": worker}

    replayed = await increment_by_hop(valid)
    assert _hop_unauthorized(replayed), f"a replayed hop: {replayed}"
    assert await count() == 1, "a replayed hop reached the app"


def _hop_unauthorized(answer: tuple[int, Any]) -> bool:
    status, body = answer
    return status == 401 and isinstance(body, dict) and body.get("code") == "hop_unauthorized"


# 4. Start-up mistakes -----------------------------------------------------------------


def one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The single stderr line of a failed start (one JSON object under --log-format
    json, event `startup_failed`), checked to name `words`."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    record = json.loads(lines[0])
    assert (record["event"], record["level"]) == ("startup_failed", "error"), record
    line: str = record["message"]
    assert line.startswith("tether serve: "), line
    for word in words:
        assert word in line, line
    return line


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_args(*args: str) -> list[str]:
    return ["serve", COUNTER_APP, "--workers", str(WORKERS), "--port", "0",
            "--log-format", "json", *args]


Mistake = Callable[[str, Path], tuple[list[str], tuple[str, ...]]]
"""Given the live Redis URL and a short directory: the flags, and words the line names."""


def _service_alone(url: str, directory: Path) -> tuple[list[str], tuple[str, ...]]:
    return ["--service", SERVICE], ("--service", "--cluster")


def _no_hop_secret(url: str, directory: Path) -> tuple[list[str], tuple[str, ...]]:
    flags = ["--cluster", url, "--service", SERVICE, "--advertise", "127.0.0.2",
             "--host", "127.0.0.2", "--host-id", "h1"]
    return flags, ("--cluster", "--hop-secret-file")


def _secret_open_to_others(url: str, directory: Path) -> tuple[list[str], tuple[str, ...]]:
    secret = write_hop_secret(directory, "open", mode=0o644)
    flags = ["--cluster", url, "--service", SERVICE, "--advertise", "127.0.0.2",
             "--host", "127.0.0.2", "--host-id", "h1", "--hop-secret-file", str(secret)]
    return flags, ("--hop-secret-file", str(secret), "chmod 600")


def _secret_too_short(url: str, directory: Path) -> tuple[list[str], tuple[str, ...]]:
    secret = write_hop_secret(directory, "short", size=31)
    flags = ["--cluster", url, "--service", SERVICE, "--advertise", "127.0.0.2",
             "--host", "127.0.0.2", "--host-id", "h1", "--hop-secret-file", str(secret)]
    return flags, ("--hop-secret-file", str(secret), "32")


def _no_redis(url: str, directory: Path) -> tuple[list[str], tuple[str, ...]]:
    secret = write_hop_secret(directory)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    flags = ["--cluster", nowhere, "--service", SERVICE, "--advertise", "127.0.0.2",
             "--host", "127.0.0.2", "--host-id", "h1", "--hop-secret-file", str(secret)]
    return flags, ("--cluster", nowhere, "start Redis there")


MISTAKES: dict[str, Mistake] = {
    "service-without-cluster": _service_alone,
    "cluster-without-hop-secret-file": _no_hop_secret,
    "hop-secret-file-0644": _secret_open_to_others,
    "hop-secret-file-under-32-bytes": _secret_too_short,
    "cluster-where-no-redis-listens": _no_redis,
}


@pytest.mark.parametrize("mistake", list(MISTAKES.values()), ids=list(MISTAKES))
def test_cluster_start_up_mistakes_are_one_line(
    mistake: Mistake, redis_server: RedisServer, short_dir: Path
) -> None:
    flags, words = mistake(redis_server.url, short_dir)
    one_line(run_tether(*serve_args(*flags)), *words)
    # Refused before joining: nothing of the host is left in the service's Redis.
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.keys("*") == []


async def test_a_second_host_with_a_live_hosts_id_is_refused_in_one_line(
    cluster: Cluster,
) -> None:
    first = cluster.start("h1", ADDRESSES["h1"], WORKERS)
    await cluster.meshed({"h1": WORKERS})
    before = await cluster.record("h1")
    assert before is not None

    result = await asyncio.to_thread(
        run_tether, *serve_args(*cluster.flags("h1", ADDRESSES["h2"]))
    )
    one_line(result, "'h1'", "--host-id")

    # The live host keeps its record, its incarnation and its sessions.
    assert await cluster.record("h1") == before
    session = CounterSession(cluster.http(first), f"dup-{run_id()}")
    seeded: Reply = await session.seed()
    assert seeded.status == 200, seeded
    assert session.worker in before["workers"]
    assert await cluster.redis.get(claim_key(session.id)) == session.worker


# 5. A host paused past its TTL ---------------------------------------------------------

PAUSE_WINDOW_S = 2.0


@pytest.mark.timeout(150)
async def test_a_host_paused_past_its_ttl_never_serves_a_session_another_host_took(
    cluster: Cluster,
) -> None:
    paused = cluster.start("h1", ADDRESSES["h1"], 1, "--close-window", str(PAUSE_WINDOW_S))
    taker = cluster.start("h2", ADDRESSES["h2"], 1, "--close-window", str(PAUSE_WINDOW_S))
    await cluster.meshed({"h1": 1, "h2": 1})
    first_epoch = (await cluster.record("h1") or {})["epoch"]
    session = CounterSession(cluster.http(paused), f"pause-{run_id()}")
    assert (await session.seed()).status == 200
    for _ in range(3):
        assert (await session.increment()).status == 200
    old_worker, old_cookie = session.worker, session.cookie

    os.killpg(paused.server.pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        # A request the other host forwards to the paused one waits, until the other
        # host sees the paused one dead: then it ends with 410, not at the pause's end.
        waiting = await cluster.http(taker).request("GET", "/count", cookie=old_cookie)
        assert (waiting.status, waiting.code) == (410, "session_gone"), waiting
        assert time.monotonic() - paused_at < TTL_S + 2 * REFRESH_S + SWEEP_MARGIN_S

        # Its record expired; the other host sweeps the claim a window later, and then
        # the session's ID is free: the other host takes it, new.
        async def record_gone() -> bool:
            return await cluster.redis.exists(host_key("h1")) == 0

        await eventually(record_gone, TTL_S + SWEEP_MARGIN_S, "the paused host's record expires")
        retaken = CounterSession(cluster.http(taker), session.id)

        async def taken() -> bool:
            return (await retaken.seed()).status == 200

        await eventually(taken, 2 * REFRESH_S + PAUSE_WINDOW_S + SWEEP_MARGIN_S,
                         "the other host takes the session once its claim is swept", every=0.2)
        assert retaken.worker != old_worker
        assert (await retaken.increment()).json["count"] == 1
    finally:
        os.killpg(paused.server.pid, signal.SIGCONT)

    # Resumed, the paused host refuses the session (it cannot prove it holds it) until
    # it has restarted its workers; then it forwards to the host that took it.
    replies: list[Reply] = []
    stale = []
    until = time.monotonic() + REFRESH_S * 2
    while time.monotonic() < until:
        for cookie in (old_cookie, retaken.cookie):
            reply = await cluster.http(paused).request("GET", "/count", cookie=cookie)
            replies.append(reply)
            if reply.status == 200 and reply.json.get("worker") != retaken.worker:
                stale.append(reply)
    assert not stale, f"the resumed host served its old copy of the session: {stale[:3]}"
    wrong = [r for r in replies if r.status != 200 and (r.status, r.code) != (
        503, "cluster_unavailable")]
    assert not wrong, f"neither the new holder's answer nor 503: {wrong[:3]}"
    assert all(r.headers.get("retry-after") for r in replies if r.status == 503)

    async def rejoined() -> dict[str, Any] | None:
        record = await cluster.record("h1")
        ok = record is not None and record["epoch"] > first_epoch and len(record["workers"]) == 1
        return record if ok else None

    record = await eventually(rejoined, TTL_S, "the paused host joins under a new epoch")
    assert old_worker not in record["workers"], "the paused host kept its fenced worker"
    await cluster.meshed({"h1": 1, "h2": 1})
    reply = await cluster.http(paused).request("GET", "/count", cookie=retaken.cookie)
    assert reply.status == 200 and reply.json == {
        "session_id": session.id, "count": 1, "worker": retaken.worker
    }, reply
    events = [r.get("event") for r in paused.server.logs()]
    assert "cluster_fenced" in events and "workers_killed" in events


# 6. Losing Redis ------------------------------------------------------------------------


@pytest.mark.timeout(150)
async def test_redis_killed_then_restarted_empty_loses_no_session_and_splits_none(
    cluster: Cluster,
) -> None:
    hosts = [cluster.start(h, ADDRESSES[h], 1) for h in ("h1", "h2")]
    await cluster.meshed({"h1": 1, "h2": 1})
    run = run_id()
    sessions = {
        host.host_id: [CounterSession(cluster.http(host), f"r-{run}-{host.host_id}-{i}")
                       for i in range(10)]
        for host in hosts
    }
    everyone = [s for held in sessions.values() for s in held]
    seeded = await bounded((s.seed() for s in everyone), limit=CONCURRENCY)
    assert all(r.status == 200 for r in seeded), seeded
    counts = dict.fromkeys((s.id for s in everyone), 0)

    cluster.redis_server.kill()
    # Each host's own sessions are served (one worker each holds them all); a session
    # of the other host needs a lookup, which is 503 with Retry-After.
    for host in hosts:
        for session in sessions[host.host_id]:
            reply = await session.increment()
            assert reply.status == 200, reply
            counts[session.id] += 1
    other = {"h1": hosts[1], "h2": hosts[0]}
    for host_id, held in sessions.items():
        reply = await cluster.http(other[host_id]).request(
            "POST", "/increment", cookie=held[0].cookie
        )
        assert (reply.status, reply.code) == (503, "cluster_unavailable"), reply
        assert reply.headers.get("retry-after"), reply

    cluster.redis_server.restart()  # empty, well within the hosts' lease
    # Until every host has re-asserted its claims, a session nobody claims is refused,
    # never taken for a new one: then every session is reachable from every host.
    stale: list[Reply] = []

    async def reachable_everywhere() -> bool:
        for host_id, held in sessions.items():
            for session in held:
                reply = await cluster.http(other[host_id]).request(
                    "GET", "/count", cookie=session.cookie
                )
                if reply.status == 200 and reply.json != {
                    "session_id": session.id, "count": counts[session.id],
                    "worker": session.worker,
                }:
                    stale.append(reply)
                if reply.status != 200:
                    # Redis answers again, but without its claims (re-asserted, not yet
                    # trusted) or without the other host's record (not yet written).
                    assert reply.status == 503 and reply.code in (
                        "cluster_unavailable", "claimant_unavailable"), reply
                    return False
        return True

    await eventually(reachable_everywhere, TTL_S + 4 * REFRESH_S + SWEEP_MARGIN_S,
                     "every session is reachable from every host again", every=0.5)
    assert not stale, f"a session answered from another copy: {stale[:3]}"
    for session in everyone:
        reply = await session.increment()
        assert reply.status == 200 and reply.json["worker"] == session.worker, reply
    assert await cluster.claims() == {s.id: s.worker for s in everyone}


# 7. Checkpoints across hosts ------------------------------------------------------------


@pytest.mark.timeout(240)
async def test_two_hosts_checkpointed_by_ctl_and_both_killed_restore_every_session(
    cluster: Cluster, short_dir: Path
) -> None:
    root = short_dir / "ckpt"
    root.mkdir(mode=0o700)
    flags = ("--checkpoint-root", str(root))
    first = [cluster.start(h, ADDRESSES[h], WORKERS, *flags) for h in ("h1", "h2")]
    await cluster.meshed({"h1": WORKERS, "h2": WORKERS})
    run = run_id()
    spread = cluster.spread(first)
    sessions = [CounterSession(spread, f"ck-{run}-{i}") for i in range(40)]  # type: ignore[arg-type]
    seeds = await bounded((s.seed() for s in sessions), limit=CONCURRENCY)
    assert all(r.status == 200 for r in seeds), seeds
    counts = {s.id: i % 4 for i, s in enumerate(sessions)}
    for session in sessions:
        for _ in range(counts[session.id]):
            assert (await session.increment()).status == 200

    config = short_dir / "ctl.toml"
    servers = []
    for host in first:
        token = short_dir / f"{host.host_id}-token"
        token.write_text(host.server.token)
        token.chmod(0o600)
        servers.append(f'[[server]]\nname = "e2e@{host.host_id}"\nurl = "{host.url}"\n'
                       f'token_file = "{token}"\n')
    config.write_text("\n".join(servers))
    done = await asyncio.to_thread(
        run_tether, "ctl", "--config", str(config), "--checkpoint-root", str(root), "--json",
        "checkpoint", "--id", "c1",
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    written = json.loads((root / "c1" / "CHECKPOINT.json").read_text())
    assert sorted(p["name"] for p in written["participants"]) == ["e2e@h1", "e2e@h2"]
    for session in sessions:  # after the checkpoint: lost with the hosts
        assert (await session.increment()).status == 200
    late = CounterSession(spread, f"ck-{run}-late")  # type: ignore[arg-type]
    assert (await late.seed()).status == 200

    for host in first:
        os.killpg(host.server.pid, signal.SIGKILL)
    for host in first:
        await host.server.group_gone()
        cluster.forget(host)

    async def records_gone() -> bool:
        return not await cluster.redis.exists(host_key("h1"), host_key("h2"))

    await eventually(records_gone, TTL_S + SWEEP_MARGIN_S, "the killed hosts' records expire")
    second = [cluster.start(h, ADDRESSES[h], WORKERS, *flags, "--restore", "latest")
              for h in ("h1", "h2")]
    owners = await cluster.meshed({"h1": WORKERS, "h2": WORKERS})
    for host in second:
        restored = [r for r in host.server.logs() if r.get("event") == "restored"]
        assert [r["checkpoint_id"] for r in restored] == ["c1"], host.host_id

    # The session seeded after the checkpoint is gone: its claim names a worker no host
    # saw die, and every host finds it dead among the claimants (410, never 503).
    for host in second:
        reply = await cluster.http(host).request("GET", "/count", cookie=late.cookie)
        assert (reply.status, reply.code) == (410, "session_gone"), (host.host_id, reply)

    # Every session, asked of either host, reads its checkpointed count, from one worker
    # of the new incarnations whose claim Redis holds.
    again = [rebind(s, cluster.spread(second)) for s in sessions]
    seen: dict[str, set[str]] = defaultdict(set)
    for session in again:
        for host in second:
            reply = await cluster.http(host).request("GET", "/count", cookie=session.cookie)
            assert reply.status == 200, (host.host_id, reply)
            assert reply.json["count"] == counts[session.id], reply
            seen[session.id].add(reply.json["worker"])
    assert all(len(workers) == 1 for workers in seen.values()), seen
    claims = await cluster.claims()
    for session in again:
        (worker,) = seen[session.id]
        assert worker in owners and claims[session.id] == worker, (session.id, worker)
        reply = await session.increment()
        assert reply.status == 200 and reply.json["count"] == counts[session.id] + 1, reply


# 9. The passthrough on a cluster --------------------------------------------------------
#
# A cluster's claims are in Redis, so the passthrough (routing/front.py) waits for the
# lookup, holding the request unread, before it moves the connection or splices the
# request; what it found travels with a request it leaves to the router.

ECHO = "e2e.apps.echo:app"


async def one_host(cluster: Cluster, *extra: str) -> Host:
    host = cluster.start("h1", ADDRESSES["h1"], WORKERS, *extra, app=ECHO)
    await cluster.meshed({"h1": WORKERS})
    return host


async def gets(redis_server: RedisServer) -> int:
    """How many `GET`s Redis has answered so far (`INFO commandstats`)."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        stats = await asyncio.to_thread(client.info, "commandstats")
    finally:
        client.close()
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


async def test_on_a_cluster_a_connections_first_request_moves_it_to_its_sessions_holder(
    cluster: Cluster,
) -> None:
    host = await one_host(cluster)
    cookie, holder, other, raw = await across(host.server, f"moved-{run_id()}", stay=False)
    before = await workers(host.server)
    try:
        seen = await echoes(raw, cookie, 4)
    finally:
        await raw.close()
    assert {s["worker"] for s in seen} == {holder}
    after = await workers(host.server)
    assert after[other]["handed_off"] - before[other]["handed_off"] == 1
    assert after[other]["forwarded"] - before[other]["forwarded"] == 1
    assert after[holder]["served_forwarded"] - before[holder]["served_forwarded"] == 1


async def test_on_a_cluster_requests_of_another_workers_session_pass_through_one_lookup_each(
    cluster: Cluster, redis_server: RedisServer,
) -> None:
    host = await one_host(cluster)
    cookie, holder, other, raw = await across(host.server, f"through-{run_id()}")
    before, lookups = await workers(host.server), await gets(redis_server)
    try:
        seen = await echoes(raw, cookie, 10)
    finally:
        await raw.close()
    lookups = await gets(redis_server) - lookups
    assert {s["worker"] for s in seen} == {holder}
    after = await workers(host.server)
    assert after[other]["passed_through"] - before[other]["passed_through"] == 10
    assert after[holder]["served_forwarded"] - before[holder]["served_forwarded"] == 10
    # One lookup a request (two would be 20); the hosts' own refreshes add a few `GET`s.
    assert 10 <= lookups < 20, lookups


ESTABLISHED, CLOSE_WAIT = "01", "08"


def links_to(address: str, state: str = ESTABLISHED) -> set[int]:
    """The local ports of the TCP connections to `address` (`host:port`, IPv4) from this
    machine in `state` (`/proc/net/tcp`): each one link or pooled connection."""
    end = tcp_end(address)
    return {
        int(local.rsplit(":", 1)[1], 16)
        for local, remote, found in tcp_rows(address)
        if remote == end and found == state
    }


async def two_hosts(cluster: Cluster) -> tuple[Host, Host, str, str, str]:
    """Two hosts of the echo app; a session seeded on the first: the hosts, its cookie,
    its holder and that worker's hop listener (`host:port`)."""
    h1 = cluster.start("h1", ADDRESSES["h1"], WORKERS, app=ECHO)
    h2 = cluster.start("h2", ADDRESSES["h2"], WORKERS, app=ECHO)
    owners = await cluster.meshed({"h1": WORKERS, "h2": WORKERS})
    cookie, holder = await seed(h1.server, f"far-{run_id()}")
    assert owners[holder] == "h1"
    record = await cluster.record("h1")
    assert record is not None
    return h1, h2, cookie, holder, record["workers"][holder]


async def test_on_a_cluster_requests_of_another_hosts_session_pass_through_on_one_kept_link(
    cluster: Cluster, redis_server: RedisServer,
) -> None:
    """The passthrough reaches a worker of another host on its hop listener, each request
    signed (its query too) and looked up once, on one TCP link kept alive from one
    request to the next; a target with a fragment (which the listener's uvicorn drops)
    goes the copying way and is answered as well."""
    h1, h2, cookie, holder, hop = await two_hosts(cluster)
    lines = await workers(h2.server)
    receiver = next(iter(lines))
    raw = await raw_on(h2.server, lines, receiver)
    before, held, lookups = lines, await workers(h1.server), await gets(redis_server)
    pooled, links = links_to(hop), set()
    try:
        for _ in range(10):
            (seen,) = await echoes(raw, cookie, 1)
            assert seen["worker"] == holder, seen
            links |= links_to(hop) - pooled
        lookups = await gets(redis_server) - lookups
        raw.write(get("/echo?a=1&b=%2F&c", cookie))
        status, _, seen = await raw.reply()
        assert (status, seen["worker"]) == (200, holder), seen
        raw.write(get("/echo#part", cookie))
        status, _, seen = await raw.reply()
        assert (status, seen["worker"], seen["path"]) == (200, holder, "/echo"), seen
    finally:
        await raw.close()
    after = (await workers(h2.server))[receiver]
    assert after["passed_through"] - before[receiver]["passed_through"] == 11
    assert after["forwarded"] - before[receiver]["forwarded"] == 12
    served = (await workers(h1.server))[holder]["served_forwarded"]
    assert served - held[holder]["served_forwarded"] == 12
    assert len(links) == 1, f"{len(links)} new links for 10 requests: {links}"
    assert 10 <= lookups < 20, f"{lookups} lookups for 10 requests (refreshes add a few)"


async def test_on_a_cluster_requests_that_say_connection_close_still_keep_the_link(
    cluster: Cluster,
) -> None:
    """A client's `connection: close` closes the client's connection after the reply,
    which says so, but is not sent on: the TCP link to the other host stays open for
    the next connection's request, instead of a new TCP connection a request."""
    _, h2, cookie, holder, hop = await two_hosts(cluster)
    lines = await workers(h2.server)
    receiver = next(iter(lines))
    pooled, links = links_to(hop), set()
    closing = get("/echo", cookie).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    for _ in range(4):
        raw = await raw_on(h2.server, lines, receiver)
        try:
            raw.write(closing)
            status, headers, seen = await raw.reply()
            assert (status, seen["worker"]) == (200, holder), seen
            assert ("connection", "close") in headers, headers
            assert await asyncio.wait_for(raw.reader.read(), 10) == b"", "left open"
        finally:
            await raw.close()
        links |= links_to(hop) - pooled
    # (0: each request's link closed with it; more than 1: a new link a request)
    assert len(links) == 1, f"{len(links)} links left open by 4 requests: {links}"


async def test_on_a_cluster_a_session_of_a_killed_host_answers_503_before_its_record_expires(
    cluster: Cluster,
) -> None:
    """A host killed while still listed: its hop listener refuses the passthrough's new
    link, and the request is answered 503 `claimant_unavailable` from that refusal, the
    router not trying to connect again (it forwards nothing)."""
    h1, h2, cookie, holder, hop = await two_hosts(cluster)
    lines = await workers(h2.server)
    receiver = next(iter(lines))
    raw = await raw_on(h2.server, lines, receiver)
    try:
        seen = await echoes(raw, cookie, 2)  # a link to the holder is kept
        assert {s["worker"] for s in seen} == {holder}
        before = (await workers(h2.server))[receiver]
        os.killpg(h1.server.pid, signal.SIGKILL)
        await h1.server.group_gone()
        # The kept link's end read: no connection to the listener waits to be closed.
        await eventually(lambda: not links_to(hop, CLOSE_WAIT), 10, "the links are closed")
        raw.write(get("/echo", cookie))
        status, headers, body = await raw.reply()
    finally:
        await raw.close()
    assert (status, body["code"]) == (503, "claimant_unavailable"), body
    assert "refused the connection" in body["detail"], body
    assert any(name == "retry-after" for name, _ in headers), headers
    after = (await workers(h2.server))[receiver]
    assert after["forwarded"] == before["forwarded"], "the router tried it again"
    assert await cluster.record("h1") is not None, "the record expired: not the case tested"


async def test_on_a_cluster_a_request_whose_lookup_waits_on_a_paused_redis_is_answered_503(
    cluster: Cluster, redis_server: RedisServer,
) -> None:
    """Redis stops answering while the passthrough waits on it: the request is refused
    503 `cluster_unavailable` once the client's timeout ends the wait (and not asked of
    Redis twice, which would double the wait); once Redis answers again, so does the
    connection's next request."""
    host = await one_host(cluster)
    cookie, holder, _, raw = await across(host.server, f"paused-{run_id()}")
    try:
        redis_server.pause()
        try:
            started = time.monotonic()
            raw.write(get("/echo", cookie))
            status, _, body = await raw.reply()
            waited = time.monotonic() - started
        finally:
            redis_server.resume()
        assert status == 503, body
        assert body["code"] == "cluster_unavailable", body
        # One lookup waits out the client's timeout twice (it retries once); asked twice,
        # Redis would keep the request twice as long.
        one_lookup = 2 * REDIS_TIMEOUT_S
        assert waited < 1.5 * one_lookup, f"{waited:.1f} s: Redis was asked twice"
        # Its access line counts the wait (it began when the passthrough took it).
        refused = await eventually(
            lambda: [r for r in host.server.logs()
                     if r.get("event") == "request" and r.get("status") == 503],
            10, "the refusal's access line")
        assert refused[0]["ms"] >= 0.9 * one_lookup * 1000, refused

        async def answered() -> bool:
            raw.write(get("/echo", cookie))
            status, _, seen = await raw.reply()
            return status == 200 and seen["worker"] == holder

        await eventually(answered, 15, "the connection is served again")
    finally:
        await raw.close()


async def test_on_a_cluster_a_client_that_leaves_while_its_lookup_waits_is_never_served(
    cluster: Cluster, redis_server: RedisServer,
) -> None:
    """The connection is read while its request waits for Redis, so a client that leaves
    then ends the wait: the request goes nowhere once Redis answers again."""
    host = await one_host(cluster)
    cookie, holder, other, raw = await across(host.server, f"left-{run_id()}")
    before = await workers(host.server)
    redis_server.pause()
    try:
        raw.write(get("/echo", cookie))
        await asyncio.sleep(0.3)  # the lookup waits on Redis
        await raw.close()
        await asyncio.sleep(0.3)
    finally:
        redis_server.resume()
    await asyncio.sleep(REDIS_TIMEOUT_S)  # (what a lookup left running would have taken)
    lines = await workers(host.server)
    assert lines[other]["forwarded"] == before[other]["forwarded"], "it was sent on"
    assert lines[holder]["served_forwarded"] == before[holder]["served_forwarded"]
    raw = await raw_on(host.server, lines, other)
    try:
        seen = await echoes(raw, cookie, 2)
    finally:
        await raw.close()
    assert {s["worker"] for s in seen} == {holder}
    errors = [r for r in host.server.logs() if r.get("level") in ("error", "critical")]
    assert not errors, errors


async def test_on_a_cluster_a_request_whose_lookup_waits_when_the_server_stops_is_answered(
    cluster: Cluster, redis_server: RedisServer,
) -> None:
    """A SIGTERM while a request waits for a paused Redis, past the graceful timeout: the
    wait is given up and the request answered 503, not dropped unanswered, and logged."""
    host = await one_host(cluster, "--timeout-graceful-shutdown", "1")
    cookie, _, _, raw = await across(host.server, f"stopping-{run_id()}")
    redis_server.pause()
    try:
        raw.write(get("/echo", cookie))
        await asyncio.sleep(0.3)  # the lookup waits on Redis
        host.server.terminate()
        status, _, body = await raw.reply()
    finally:
        redis_server.resume()
        await raw.close()
    assert status == 503, body
    assert body["code"] in ("claimant_unavailable", "cluster_unavailable"), body
    assert await host.server.exit_code() == 0
    # Logged once, by the worker that received it, as every request is (SPEC 4.5).
    refused = [r for r in host.server.logs()
               if r.get("event") == "request" and r.get("status") == 503]
    assert [(r["method"], r["path"]) for r in refused] == [("GET", "/echo")], refused
