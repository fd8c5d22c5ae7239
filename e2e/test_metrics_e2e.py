"""Metrics of a real `tether serve` (SPEC 9): rendered by the main process from every
worker's counters, the same at `GET /_tether/metrics` (with the control token) and at
`--metrics-port`'s `/metrics` (without one), exact for a known workload, and never
going backwards when a worker dies; with `--app-metrics`, the app's own metrics beside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric

from e2e.conftest import Serve
from e2e.harness import (
    COUNTER_APP,
    CounterSession,
    Http,
    Server,
    bounded,
    eventually,
    failed,
    run_episode,
)
from tests.coordinator.test_metrics import naming_problems, parsed, value
from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json

pytestmark = pytest.mark.e2e

NAME = "metered"
SESSIONS = 40
EPISODE_REQUESTS = 9  # seed, 5 increments, count, verify, close
KEPT = 12
KEPT_REQUESTS = 3  # seed, 2 increments
METERED_APP = "e2e.apps.metered:app"


def metrics_url(server: Server) -> str:
    """The `/metrics` URL the server printed (`--metrics-port 0` picks a free port)."""
    for line in server.stdout_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "metrics_serving":
            return str(record["url"])
    raise AssertionError("the server printed no metrics URL")


async def public_metrics(server: Server, http: Http) -> dict[str, Metric]:
    reply = await http.request(
        "GET", "/_tether/metrics", headers={"authorization": f"Bearer {server.token}"}
    )
    assert reply.status == 200, reply
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parsed(reply.raw.decode())


async def port_metrics(server: Server) -> dict[str, Metric]:
    """`/metrics` on `--metrics-port`, with no token."""
    url = metrics_url(server)
    async with aiohttp.ClientSession() as client, client.get(url) as response:
        assert response.status == 200
        return parsed(await response.text())


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def counter_samples(families: dict[str, Metric]) -> dict[tuple[str, tuple[Any, ...]], float]:
    """Every sample that may only grow: counters' and histograms' (buckets, count, sum)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values() if family.type in ("counter", "histogram")
        for sample in family.samples
    }


def went_backwards(before: dict[str, Metric], after: dict[str, Metric]) -> list[str]:
    earlier, later = counter_samples(before), counter_samples(after)
    return [f"{key}: {was} -> {later.get(key)}" for key, was in earlier.items()
            if later.get(key, -1) < was]


async def test_a_known_workload_is_counted_exactly_on_both_endpoints(
    serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    server = serve(COUNTER_APP, 4, "--metrics-port", "0", "--name", NAME,
                   "--checkpoint-root", str(root))
    async with Http(server.url) as http:
        episodes = await bounded(
            run_episode(CounterSession(http, f"ep-{i:03d}")) for i in range(SESSIONS)
        )
        assert not failed(episodes)
        kept = [CounterSession(http, f"kept-{i:03d}") for i in range(KEPT)]
        for session in kept:
            assert (await session.seed()).status == 200
            for _ in range(KEPT_REQUESTS - 1):
                assert (await session.increment()).status == 200
        for headers in ({}, {"authorization": "Bearer not-the-token"}):
            refused = await http.request("GET", "/_tether/metrics", headers=headers)
            assert (refused.status, refused.code) == (401, "unauthorized")
        status = await server.status(http)
        public = await public_metrics(server, http)
        private = await port_metrics(server)

        requests = SESSIONS * EPISODE_REQUESTS + KEPT * KEPT_REQUESTS
        forwarded = sum(w["forwarded"] for w in status["workers"])
        assert forwarded == sum(w["served_forwarded"] for w in status["workers"]) > 0
        ids = [f"ep-{i:03d}" for i in range(SESSIONS)] + [s.id for s in kept]
        for families in (public, private):
            assert value(families, "tether_requests_total", outcome="forwarded") == forwarded
            assert value(families, "tether_requests_total",
                         outcome="served_forwarded") == forwarded
            assert value(families, "tether_requests_total",
                         outcome="local") == requests - forwarded
            for outcome in ("gone", "conflict", "unavailable", "parked", "mismatch"):
                assert value(families, "tether_requests_total", outcome=outcome) == 0
            # A request whose connection moved to its holder is not timed here: its reply
            # never passes the worker that received it (docs/observability.md).
            handed_off = sum(w["handed_off"] for w in status["workers"])
            assert value(families, "tether_forward_seconds_count") == forwarded - handed_off
            assert value(families, "tether_workers") == 4
            for worker in status["workers"]:
                assert value(families, "tether_sessions", worker=worker["id"]) == worker[
                    "sessions"]
                assert value(families, "tether_claims", worker=worker["id"]) == worker["claims"]
            assert sum(s.value for s in families["tether_sessions"].samples) == KEPT
            assert value(families, "tether_worker_restarts_total") == 0
            assert naming_problems(families.values(), session_ids=ids) == []
        assert counter_samples(public) == counter_samples(private)

        auth = {"authorization": f"Bearer {server.token}"}
        answers = {}
        for route in ("prepare", "commit", "resume"):
            reply = await http.request("POST", f"/_tether/{route}", headers=auth,
                                       json={"checkpoint_id": "m1"})
            assert reply.status == 200, reply
            answers[route] = reply.json
            if route == "commit":  # what the controller writes once every server committed
                entry: Any = {"name": NAME, "url": server.url,
                              "manifest_digest": read_manifest_digest(root, "m1", NAME)}
                write_checkpoint_json(root, "m1", [entry], None, None)
        checkpointed = await port_metrics(server)
    manifest = answers["commit"]
    assert value(checkpointed, "tether_checkpoints_total", result="committed") == 1
    for result in ("blocked", "failed", "expired", "aborted"):
        assert value(checkpointed, "tether_checkpoints_total", result=result) == 0
    assert value(checkpointed, "tether_last_checkpoint_records", kind="session") == KEPT
    assert value(checkpointed, "tether_last_checkpoint_records", kind="episode") == 0
    assert value(checkpointed, "tether_last_checkpoint_bytes") == sum(
        segment["bytes"] for segment in manifest["segments"])
    assert abs(value(checkpointed, "tether_last_checkpoint_timestamp_seconds")
               - time.time()) < 120
    for phase in ("prepare", "commit", "resume"):
        assert value(checkpointed, "tether_checkpoint_phase_seconds_count", phase=phase) == 1
    assert value(checkpointed, "tether_checkpoint_phase_seconds_count", phase="restore") == 0
    assert value(checkpointed, "tether_checkpoint_pause_seconds_count") == 1
    assert value(checkpointed, "tether_last_restore_timestamp_seconds") == 0
    assert value(checkpointed, "tether_held_episodes") == 0
    # Control calls are not requests of the app: the counts did not move.
    for name in ("tether_requests", "tether_forward_seconds"):
        assert counter_samples({name: checkpointed[name]}) == counter_samples(
            {name: public[name]})
    server.terminate()
    assert await server.exit_code() == 0

    restored = serve(COUNTER_APP, 2, "--metrics-port", "0", "--name", NAME,
                     "--checkpoint-root", str(root), "--restore", "m1")
    async with Http(restored.url) as http:
        for session in kept:
            session.http = http
            reply = await session.count()
            assert (reply.status, reply.json["count"]) == (200, KEPT_REQUESTS - 1)
        after = await public_metrics(restored, http)
    assert value(after, "tether_checkpoint_phase_seconds_count", phase="restore") == 1
    assert abs(value(after, "tether_last_restore_timestamp_seconds") - time.time()) < 120
    assert value(after, "tether_workers") == 2
    assert sum(s.value for s in after["tether_sessions"].samples) == KEPT
    assert (value(after, "tether_requests_total", outcome="local")
            + value(after, "tether_requests_total", outcome="forwarded")) == KEPT


class Traffic:
    """Counter sessions run one after another on new connections until stopped; a
    worker's death fails some of them, which is what it must do."""

    def __init__(self, http: Http) -> None:
        self.http = http
        self.done = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await run_episode(CounterSession(self.http, f"t-{self.done:04d}"), 2)
            self.done += 1

    async def ran(self, more: int) -> None:
        target = self.done + more
        await eventually(lambda: self.done >= target, 60, f"{more} more sessions run")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def replaced(server: Server, http: Http, pid: int) -> Callable[[], Any]:
    async def check() -> bool:
        # Only rows that answered: one for a worker leaving during the call has no pid.
        status = await server.status(http)
        pids = [w["pid"] for w in status["workers"] if isinstance(w.get("pid"), int)]
        return len(pids) == 4 and pid not in pids

    return check


async def killed(server: Server, http: Http) -> str:
    """SIGKILL the worker holding the most sessions; wait for its replacement; its ID."""
    status = await server.status(http)
    victim = max(status["workers"], key=lambda w: (w["sessions"], w["id"]))
    os.kill(victim["pid"], signal.SIGKILL)
    await eventually(await replaced(server, http, victim["pid"]), 30,
                     f"worker {victim['pid']} is replaced")
    return str(victim["id"])


async def test_a_worker_killed_mid_run_makes_no_counter_go_backwards(serve: Serve) -> None:
    server = serve(COUNTER_APP, 4, "--metrics-port", "0")
    async with Http(server.url) as http:
        traffic = Traffic(http)
        traffic.start()
        try:
            await traffic.ran(20)
            before = await port_metrics(server)
            dead = await killed(server, http)
            await traffic.ran(10)
            during = await port_metrics(server)
        finally:
            await traffic.stop()
        assert went_backwards(before, during) == []
        assert value(during, "tether_worker_restarts_total") == 1
        assert dead not in {s.labels["worker"] for s in during["tether_sessions"].samples}
        # With no traffic, a death changes no count at all: the dead worker's last report
        # stays, all of it, in the totals.
        quiet = await port_metrics(server)
        await killed(server, http)
        after = await port_metrics(server)
    assert went_backwards(during, quiet) == []
    for outcome in ("local", "forwarded", "served_forwarded"):
        assert value(after, "tether_requests_total", outcome=outcome) == value(
            quiet, "tether_requests_total", outcome=outcome) > 0
    assert value(after, "tether_forward_seconds_count") == value(
        quiet, "tether_forward_seconds_count")
    assert value(after, "tether_worker_restarts_total") == 2


async def test_app_metrics_are_summed_over_workers_and_a_dead_workers_stay(
    serve: Serve,
) -> None:
    server = serve(METERED_APP, 4, "--app-metrics", "--metrics-port", "0")
    async with Http(server.url) as http:
        replies = await bounded(http.request("POST", "/hit") for _ in range(40))
        assert all(reply.status == 200 for reply in replies)
        directory = Path(replies[0].json["multiproc_dir"])
        assert directory.parent == server.runtime_dir
        assert mode_of(directory) == 0o700
        for families in (await public_metrics(server, http), await port_metrics(server)):
            assert value(families, "app_hits_total") == 40
            assert value(families, "app_workers_alive") == 4
            assert value(families, "tether_requests_total", outcome="local") == 40
        hits = {reply.json["pid"] for reply in replies}
        victim = sorted(hits)[0]
        os.kill(victim, signal.SIGKILL)
        await eventually(await replaced(server, http, victim), 30, f"worker {victim} replaced")
        for families in (await public_metrics(server, http), await port_metrics(server)):
            assert value(families, "app_hits_total") == 40  # the dead worker's hits stay
            assert value(families, "app_workers_alive") == 4  # its live gauge went
            assert value(families, "tether_requests_total", outcome="local") == 40
        replies = await bounded(http.request("POST", "/hit") for _ in range(10))
        assert all(reply.status == 200 for reply in replies)
        assert value(await port_metrics(server), "app_hits_total") == 50
