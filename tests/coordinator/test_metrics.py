"""tether's metrics as the main process renders them (SPEC 9): from every worker's report,
the checkpointer's phase changes and its own counts; no counter goes backwards when a
worker dies. (The real server: `e2e/test_metrics_e2e.py`.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import eventually
from tether.checkpoint.events import PhaseChange
from tether.coordinator.coordinator import Coordinator, Link
from tether.coordinator.fleet import ChannelFleet
from tether.coordinator.metrics import (
    KEEP_DEAD,
    MULTIPROC_ENV,
    CheckpointMetrics,
    Metrics,
    WorkerReport,
    WorkerTally,
    mark_worker_dead,
)
from tether.routing.errors import TetherError
from tether.routing.router import RouterStats
from tether.routing.types import WorkerId, new_worker_id

SPEC_METRICS = {
    # family name (a counter's without `_total`, as the parser names it): type
    "tether_requests": "counter",
    "tether_forward_seconds": "histogram",
    "tether_sessions": "gauge",
    "tether_claims": "gauge",
    "tether_workers": "gauge",
    "tether_worker_restarts": "counter",
    "tether_checkpoints": "counter",
    "tether_checkpoint_phase_seconds": "histogram",
    "tether_last_checkpoint_bytes": "gauge",
    "tether_last_checkpoint_records": "gauge",
    "tether_last_checkpoint_timestamp_seconds": "gauge",
    "tether_last_restore_timestamp_seconds": "gauge",
    "tether_checkpoint_pause_seconds": "histogram",
    "tether_held_episodes": "gauge",
    "tether_episode_claims": "counter",
}
NOT_BASE_UNITS = {
    "ms", "milliseconds", "us", "microseconds", "ns", "nanoseconds", "minutes", "hours",
    "days", "kb", "kib", "kilobytes", "mb", "mib", "megabytes", "gb", "gigabytes", "percent",
}
LABELS = {"outcome", "worker", "result", "phase", "kind", "le"}
"""Every label tether's metrics may carry: none names a session."""


def naming_problems(families: Iterable[Metric], session_ids: Iterable[str] = ()) -> list[str]:
    """What breaks Prometheus's naming conventions in tether's metrics: the prefix, base
    units, `_total` on counters (and only there), and no session IDs in labels."""
    problems = []
    ids = set(session_ids)
    for family in families:
        name = family.name
        if not name.startswith("tether_"):
            problems.append(f"{name}: not prefixed tether_")
        if set(name.split("_")) & NOT_BASE_UNITS:
            problems.append(f"{name}: not in base units (seconds, bytes)")
        if family.type == "histogram" and not name.endswith(("_seconds", "_bytes")):
            problems.append(f"{name}: a histogram without its base unit")
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_total"):
                problems.append(f"{sample.name}: a counter not ending in _total")
            if family.type != "counter" and sample.name.endswith("_total"):
                problems.append(f"{sample.name}: _total on a {family.type}")
            for label, value in sample.labels.items():
                if label not in LABELS or "session" in label:
                    problems.append(f"{sample.name}: label {label}")
                if value in ids:
                    problems.append(f"{sample.name}: a session ID in label {label}")
    return problems


def parsed(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Metric], sample: str, **labels: str) -> float:
    """One sample's value, by its sample name and labels."""
    family = families[_family_of(sample, families)]
    found = [s.value for s in family.samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, (sample, labels, family.samples)
    return found[0]


def _family_of(sample: str, families: dict[str, Metric]) -> str:
    for suffix in ("_total", "_bucket", "_count", "_sum", ""):
        name = sample.removesuffix(suffix) if suffix else sample
        if name in families:
            return name
    raise KeyError(sample)


class Answering:
    """A worker's channel that answers the `metrics` call with whatever it is given."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.bodies: list[Any] = []

    async def request(self, kind: str, body: Any, **options: Any) -> Any:
        assert kind == "metrics"
        self.bodies.append(body)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def report(local: int = 0, forwarded: int = 0, sessions: int = 0, claims: int = 0,
           forwards: Iterable[float] = ()) -> dict[str, Any]:
    """A worker's `metrics` answer, as `RoutingWorker.metrics` makes it."""
    stats = RouterStats(local=local, forwarded=forwarded)
    for seconds in forwards:
        stats.observe_forward(seconds)
    return {"id": "w", "pid": 1, "claims": claims, "sessions": sessions, "episodes": 0,
            **stats.report()}


def server(tmp_path: Path, answers: dict[WorkerId, Any]) -> Metrics:
    coordinator = Coordinator(expected_workers=len(answers))
    coordinator.fleet = ChannelFleet(coordinator, str(tmp_path))
    for n, (worker, answer) in enumerate(answers.items()):
        coordinator.links[worker] = Link(worker, 1000 + n, Answering(answer))  # type: ignore[arg-type]
    return Metrics(coordinator, restarts=lambda: 3)


def workers(count: int) -> list[WorkerId]:
    return sorted(WorkerId(new_worker_id()) for _ in range(count))


async def test_every_metric_of_the_spec_is_rendered_with_prometheus_names(
    tmp_path: Path,
) -> None:
    a, b = workers(2)
    metrics = server(tmp_path, {a: report(local=2), b: report(forwarded=1, forwards=[0.002])})
    text = await metrics.render()
    families = parsed(text)
    assert {name: f.type for name, f in families.items()} == SPEC_METRICS
    assert naming_problems(families.values()) == []


def test_the_naming_check_finds_what_breaks_the_conventions() -> None:
    bad = parsed(
        "# TYPE app_hits_total counter\napp_hits_total 1\n"
        "# TYPE tether_pause_ms gauge\ntether_pause_ms 3\n"
        "# TYPE tether_open_total gauge\ntether_open_total 1\n"
        "# TYPE tether_touched gauge\ntether_touched{session=\"s-1\"} 1\n"
        "# TYPE tether_seen gauge\ntether_seen{worker=\"s-2\"} 1\n"
    )
    problems = naming_problems(bad.values(), session_ids=["s-2"])
    assert [problem.split(":")[0] for problem in problems] == [
        "app_hits", "tether_pause_ms", "tether_open_total", "tether_touched", "tether_seen",
    ], problems


async def test_workers_counts_are_summed_and_their_gauges_kept_apart(tmp_path: Path) -> None:
    a, b = workers(2)
    metrics = server(tmp_path, {
        a: report(local=5, sessions=4, claims=3),
        b: report(local=1, forwarded=2, forwards=[0.0001, 20.0]),
    })
    families = parsed(await metrics.render())
    assert value(families, "tether_requests_total", outcome="local") == 6
    assert value(families, "tether_requests_total", outcome="forwarded") == 2
    assert value(families, "tether_requests_total", outcome="gone") == 0
    assert value(families, "tether_forward_seconds_count") == 2
    assert value(families, "tether_forward_seconds_bucket", le="0.0005") == 1
    assert value(families, "tether_forward_seconds_bucket", le="10.0") == 1
    assert value(families, "tether_forward_seconds_bucket", le="+Inf") == 2
    assert value(families, "tether_forward_seconds_sum") == pytest.approx(20.0001)
    assert value(families, "tether_sessions", worker=a) == 4
    assert value(families, "tether_claims", worker=a) == 3
    assert value(families, "tether_sessions", worker=b) == 0
    assert value(families, "tether_workers") == 2
    assert value(families, "tether_worker_restarts_total") == 3


async def test_a_dead_workers_counts_stay_and_its_gauges_go(tmp_path: Path) -> None:
    a, b = workers(2)
    metrics = server(tmp_path, {a: report(local=5, sessions=4), b: report(local=1)})
    await metrics.render()
    del metrics.coordinator.links[a]  # what the coordinator does when a's channel closes
    metrics.worker_left(a)
    families = parsed(await metrics.render())
    assert value(families, "tether_requests_total", outcome="local") == 6
    assert [s.labels["worker"] for s in families["tether_sessions"].samples] == [b]
    assert value(families, "tether_workers") == 1


async def test_a_worker_that_does_not_answer_counts_its_last_report(tmp_path: Path) -> None:
    a, b = workers(2)
    metrics = server(tmp_path, {a: report(local=5), b: report(local=1)})
    await metrics.render()
    metrics.coordinator.links[a].channel.answer = TimeoutError()  # type: ignore[attr-defined]
    metrics.coordinator.links[b].channel.answer = TetherError("internal_error")  # type: ignore[attr-defined]
    families = parsed(await metrics.render())
    assert value(families, "tether_requests_total", outcome="local") == 6


async def test_counts_refreshed_between_scrapes_stay_when_their_worker_dies_unscraped(
    tmp_path: Path,
) -> None:
    a, b = workers(2)
    metrics = server(tmp_path, {a: report(local=5), b: report(local=1)})
    metrics.start(refresh_s=0.01)
    try:
        await eventually(lambda: metrics.tally.requests()["local"] == 6, 5, "a refresh")
    finally:
        await metrics.stop()
    assert metrics.coordinator.links[a].channel.bodies[0] == {"counts_only": True}  # type: ignore[attr-defined]
    del metrics.coordinator.links[a]
    metrics.worker_left(a)
    families = parsed(await metrics.render())
    assert value(families, "tether_requests_total", outcome="local") == 6


async def test_a_refresh_that_does_not_count_sessions_keeps_the_last_count(
    tmp_path: Path,
) -> None:
    [a] = workers(1)
    metrics = server(tmp_path, {a: report(local=1, sessions=7)})
    await metrics.render()
    channel = metrics.coordinator.links[a].channel
    channel.answer = {**report(local=2), "sessions": None}  # type: ignore[attr-defined]
    await metrics.scrape(counts_only=True)
    channel.answer = TimeoutError()  # type: ignore[attr-defined]
    families = parsed(await metrics.render())
    assert value(families, "tether_sessions", worker=a) == 7
    assert value(families, "tether_requests_total", outcome="local") == 2


def test_a_report_that_arrives_after_its_worker_left_counts_once() -> None:
    tally = WorkerTally()
    [a] = workers(1)
    tally.update(a, WorkerReport.from_answer(report(local=2)), live=True)  # type: ignore[arg-type]
    tally.worker_left(a)
    late = WorkerReport.from_answer(report(local=3))
    assert late is not None
    tally.update(a, late, live=False)  # a scrape's answer, read after a's channel closed
    assert tally.requests()["local"] == 3
    assert tally.live == {}


def test_a_report_of_a_worker_never_registered_counts_nothing() -> None:
    tally = WorkerTally()
    [a] = workers(1)
    tally.update(a, WorkerReport.from_answer(report(local=2)), live=False)  # type: ignore[arg-type]
    assert tally.requests()["local"] == 0


def test_answers_of_two_scrapes_that_cross_never_lower_a_count() -> None:
    tally = WorkerTally()
    [a] = workers(1)
    newer, older = (WorkerReport.from_answer(report(local=n, forwards=[0.1] * n))
                    for n in (5, 3))
    assert newer is not None and older is not None
    tally.update(a, newer, live=True)
    tally.update(a, older, live=True)
    assert tally.requests()["local"] == 5
    assert sum(tally.forward().counts) == 5


def test_dead_workers_beyond_those_kept_apart_fold_into_one_sum() -> None:
    tally = WorkerTally()
    dead = workers(KEEP_DEAD + 5)
    for worker in dead:
        tally.update(worker, WorkerReport.from_answer(report(local=1, forwards=[1.0])),  # type: ignore[arg-type]
                     live=True)
        tally.worker_left(worker)
    assert tally.requests()["local"] == KEEP_DEAD + 5
    assert sum(tally.forward().counts) == KEEP_DEAD + 5
    assert tally.forward().total == KEEP_DEAD + 5


@pytest.mark.parametrize("answer", [
    None, "text", {"requests": {}}, {"requests": {"local": "1"}, "forward_buckets": [],
                                     "forward_seconds": 0.0},
    {**report(), "forward_buckets": [0]},
])
def test_an_answer_that_is_not_a_report_is_refused(answer: Any) -> None:
    assert WorkerReport.from_answer(answer) is None


def test_phase_changes_become_results_phase_times_pauses_and_last_gauges() -> None:
    checkpoints = CheckpointMetrics(clock=lambda: 1_700_000_000.0)
    for event in (
        PhaseChange("prepared", "c1", 0.02),
        PhaseChange("committed", "c1", 0.5, records={"sessions": 7, "episodes": 2},
                    bytes=4096, workers=4),
        PhaseChange("resumed", "c1", 0.001, paused_s=0.6),
        PhaseChange("blocked", "c2", 60.0, code="1 blockers"),
        PhaseChange("expired", "c2", 0.001, paused_s=300.0),
        PhaseChange("commit_failed", "c3", 0.1, code="deadline_exceeded"),
        PhaseChange("restore_failed", "c4", 0.1, code="no_checkpoint"),
        PhaseChange("restored", "c1", 1.5, records={"sessions": 7, "episodes": 2}),
        PhaseChange("aborted", "c1", 0.01, paused_s=2.0),
    ):
        checkpoints(event)
    assert checkpoints.results == {"committed": 1, "blocked": 1, "failed": 2, "expired": 1,
                                   "aborted": 1}
    counts = {phase: sum(b.counts) for phase, b in checkpoints.phases.items()}
    assert counts == {"prepare": 2, "commit": 2, "resume": 1, "restore": 2}
    assert sum(checkpoints.pause.counts) == 3 and checkpoints.pause.total == 302.6
    assert checkpoints.last_bytes == 4096
    assert checkpoints.last_records == {"session": 7, "episode": 2}
    assert checkpoints.last_checkpoint_at == checkpoints.last_restore_at == 1_700_000_000.0


ENTRY = ["episode", "e", None, 1, 0, 10]


def test_each_claim_of_a_held_record_counts_under_its_result(tmp_path: Path) -> None:
    fleet = ChannelFleet(Coordinator(expected_workers=2), str(tmp_path))
    fleet.hand_back({"episode_id": "e", "attempt": 1, "path": str(tmp_path / "s"),
                     "entry": ENTRY})
    a, b = workers(2)
    assert fleet.claim(a, "e", 2) is not None
    assert fleet.claim(a, "fresh", 1) is None
    for attempt in (2, 1, 5):  # claimed already, older than held, beyond the next
        with pytest.raises(TetherError):
            fleet.claim(b, "e", attempt)
    fleet.closed = True
    with pytest.raises(TetherError):
        fleet.claim(b, "e", 2)
    assert dict(fleet.claim_results) == {"claimed": 1, "none_held": 1, "episode_claimed": 1,
                                         "stale_attempt": 1, "attempt_mismatch": 1,
                                         "parked": 1}


def test_a_dead_workers_live_gauges_go_and_its_counters_stay(tmp_path: Path) -> None:
    for name in ("gauge_livesum_41.db", "gauge_liveall_41.db", "counter_41.db",
                 "gauge_livesum_42.db"):
        (tmp_path / name).write_bytes(b"")
    mark_worker_dead(str(tmp_path), 41)
    assert sorted(os.listdir(tmp_path)) == ["counter_41.db", "gauge_livesum_42.db"]


def count_hits_in(directory: Path, processes: int) -> None:
    """`processes` processes in multiprocess mode, as workers, each counting 2 hits."""
    script = "from prometheus_client import Counter; Counter('app_hits', 'hits').inc(2)"
    for _ in range(processes):
        subprocess.run([sys.executable, "-c", script], check=True,
                       env={**os.environ, MULTIPROC_ENV: str(directory)})


async def test_the_apps_multiprocess_metrics_follow_tethers(tmp_path: Path) -> None:
    count_hits_in(tmp_path, 2)
    coordinator = Coordinator(expected_workers=1)
    metrics = Metrics(coordinator, app_metrics_dir=str(tmp_path))
    text = await metrics.render()
    families = parsed(text)
    assert value(families, "app_hits_total") == 4
    assert text.index("tether_requests_total") < text.index("app_hits_total")


def test_a_worker_process_never_imports_prometheus_client() -> None:
    """Workers count with plain integers; only the main process renders (SPEC 9)."""
    script = ("import sys, tether.coordinator.worker; "
              "sys.exit('prometheus_client' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", script], check=False).returncode == 0
