"""tether's own metrics (SPEC 9), rendered by the main process in Prometheus's text format.

Three sources, and no multiprocess files among them:

- every live worker's counters, asked over the channel at each scrape and every
  `REFRESH_S` between scrapes (the `metrics` call): its router's requests by outcome and
  forward histogram (`RouterStats.report`), its sessions and its claims;
- the checkpointer's phase changes (`CheckpointMetrics`, one of its observers);
- the main process's own: the live workers, the supervisor's replacements, the fleet's
  held episode records and its claims of them.

A worker's counters only grow while it lives, so the newest report of each is kept and a
dead worker's last report stays in the totals: no counter goes backwards when a worker
dies (what it counted after the last report, at most `REFRESH_S` ago, is lost with it).

With `--app-metrics`, the app's own metrics from prometheus_client's multiprocess files
are rendered after tether's (`MultiProcessCollector`, read in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector, CollectorRegistry

from tether.checkpoint.events import Change, PhaseChange
from tether.coordinator.channel import ChannelLost
from tether.routing.router import FORWARD_BUCKETS
from tether.routing.types import WorkerId

if TYPE_CHECKING:
    from tether.coordinator.coordinator import Coordinator

log = structlog.get_logger("tether.metrics")

__all__ = ["CONTENT_TYPE_LATEST", "CheckpointMetrics", "Metrics", "WorkerReport", "WorkerTally"]

OUTCOMES = (
    "local", "forwarded", "served_forwarded", "gone", "conflict", "unavailable", "parked",
    "mismatch",
)
"""`tether_requests_total`'s outcomes (docs/observability.md says what each counts)."""
RESULTS = ("committed", "blocked", "failed", "expired", "aborted")
PHASES = ("prepare", "commit", "resume", "restore")
RECORD_KINDS = {"session": "sessions", "episode": "episodes"}
"""`tether_last_checkpoint_records`'s kinds, and the manifest's keys they come from."""
CLAIM_RESULTS = (
    "claimed", "none_held", "stale_attempt", "attempt_mismatch", "episode_claimed", "parked",
)
PHASE_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)
"""Upper bounds, in seconds, of the checkpoint phase and pause histograms (then +Inf)."""

_RESULT_OF: dict[Change, str] = {
    "committed": "committed", "blocked": "blocked", "commit_failed": "failed",
    "restore_failed": "failed", "expired": "expired", "aborted": "aborted",
}
_PHASE_OF: dict[Change, str] = {
    "prepared": "prepare", "blocked": "prepare", "committed": "commit",
    "commit_failed": "commit", "resumed": "resume", "restored": "restore",
    "restore_failed": "restore",
}
SCRAPE_TIMEOUT_S = 2.0
"""How long a scrape waits for each worker; one that does not answer counts its last report."""
REFRESH_S = 5.0
"""How often the main process asks for the workers' counts between scrapes, so a worker
that dies takes at most this long of its counts along, however rarely it is scraped."""
KEEP_DEAD = 64
"""Dead workers whose last reports are kept apart (a late answer may still update one);
older ones are folded into one sum."""


class Buckets:
    """A histogram as plain counts: fixed upper bounds, one count per bucket (the last is
    +Inf), not cumulative; rendered cumulative, as Prometheus wants it."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def add(self, counts: Sequence[int], total: float) -> None:
        for index, count in enumerate(counts):
            self.counts[index] += count
        self.total += total

    def cumulative(self) -> list[tuple[str, float]]:
        rendered: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            rendered.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return rendered


# Workers' reports ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReport:
    """One worker's counters at one scrape (its `metrics` answer)."""

    requests: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    forward_buckets: tuple[int, ...] = (0,) * (len(FORWARD_BUCKETS) + 1)
    forward_seconds: float = 0.0
    sessions: int | None = 0
    """None in a refresh's report, which does not count the sessions."""
    claims: int = 0

    @classmethod
    def from_answer(cls, answer: Any) -> WorkerReport | None:
        """The report in a worker's answer, or None if the answer is not one."""
        if not isinstance(answer, dict):
            return None
        requests, buckets = answer.get("requests"), answer.get("forward_buckets")
        seconds = answer.get("forward_seconds")
        if not isinstance(requests, dict) or not isinstance(buckets, list):
            return None
        if len(buckets) != len(FORWARD_BUCKETS) + 1 or not isinstance(seconds, int | float):
            return None
        counts = {outcome: requests.get(outcome, 0) for outcome in OUTCOMES}
        sessions = answer.get("sessions")
        numbers = [*counts.values(), *buckets, answer.get("claims", 0),
                   *([] if sessions is None else [sessions])]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            return None
        return cls(counts, tuple(buckets), float(seconds), sessions, answer.get("claims", 0))

    def newest(self, other: WorkerReport) -> WorkerReport:
        """This report and a later one of the same worker: counters only grow, so the
        larger of each is the newer (two scrapes' answers may cross); gauges from `other`
        (the sessions from this one if `other` did not count them)."""
        return WorkerReport(
            {k: max(v, other.requests.get(k, 0)) for k, v in self.requests.items()},
            tuple(max(a, b) for a, b in zip(self.forward_buckets, other.forward_buckets,
                                            strict=True)),
            max(self.forward_seconds, other.forward_seconds),
            self.sessions if other.sessions is None else other.sessions,
            other.claims,
        )


EMPTY = WorkerReport()


class WorkerTally:
    """Each worker's newest report; a dead worker's last one stays in the totals."""

    def __init__(self) -> None:
        self.live: dict[WorkerId, WorkerReport] = {}
        self._dead: OrderedDict[WorkerId, WorkerReport] = OrderedDict()
        self._folded_requests: Counter[str] = Counter()
        self._folded_forward = Buckets(FORWARD_BUCKETS)

    def update(self, worker: WorkerId, report: WorkerReport, live: bool) -> None:
        """A report from `worker`; `live`: whether it is registered now. A report that
        arrives after its worker left updates that worker's dead contribution."""
        if worker in self._dead:
            self._dead[worker] = self._dead[worker].newest(report)
        elif worker in self.live:
            self.live[worker] = self.live[worker].newest(report)
        elif live:
            self.live[worker] = report

    def worker_left(self, worker: WorkerId) -> None:
        """Keep what `worker` last reported as a dead worker's contribution."""
        if worker in self._dead:
            return
        self._dead[worker] = self.live.pop(worker, EMPTY)
        while len(self._dead) > KEEP_DEAD:
            _, old = self._dead.popitem(last=False)
            self._folded_requests.update(old.requests)
            self._folded_forward.add(old.forward_buckets, old.forward_seconds)

    def _all(self) -> Iterator[WorkerReport]:
        yield from self.live.values()
        yield from self._dead.values()

    def requests(self) -> dict[str, int]:
        """Requests by outcome over every worker this server ran, dead ones included."""
        totals = Counter(self._folded_requests)
        for report in self._all():
            totals.update(report.requests)
        return {outcome: totals[outcome] for outcome in OUTCOMES}

    def forward(self) -> Buckets:
        merged = Buckets(FORWARD_BUCKETS)
        merged.add(self._folded_forward.counts, self._folded_forward.total)
        for report in self._all():
            merged.add(report.forward_buckets, report.forward_seconds)
        return merged


# Checkpoints -----------------------------------------------------------------------


class CheckpointMetrics:
    """The checkpointer's phase changes as metrics: an observer (`Checkpointer.observers`)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.results: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.phases = {phase: Buckets(PHASE_BUCKETS) for phase in PHASES}
        self.pause = Buckets(PHASE_BUCKETS)
        self.last_bytes = 0
        self.last_records: dict[str, int] = dict.fromkeys(RECORD_KINDS, 0)
        self.last_checkpoint_at = 0.0
        self.last_restore_at = 0.0

    def __call__(self, event: PhaseChange) -> None:
        result = _RESULT_OF.get(event.change)
        if result is not None:
            self.results[result] += 1
        phase = _PHASE_OF.get(event.change)
        if phase is not None:
            self.phases[phase].observe(event.seconds)
        if event.paused_s is not None:
            self.pause.observe(event.paused_s)
        if event.change == "committed":
            self.last_bytes = event.bytes or 0
            records = event.records or {}
            self.last_records = {kind: int(records.get(key, 0))
                                 for kind, key in RECORD_KINDS.items()}
            self.last_checkpoint_at = self.clock()
        elif event.change == "restored":
            self.last_restore_at = self.clock()


# The app's own metrics (--app-metrics) ----------------------------------------------

APP_METRICS_DIR = "metrics"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def make_app_metrics_dir(runtime_dir: str) -> str:
    """A fresh 0700 directory for the app's multiprocess files, in this run's runtime
    directory (so it goes when the server exits)."""
    path = os.path.join(runtime_dir, APP_METRICS_DIR)
    os.mkdir(path, 0o700)
    return path


def mark_worker_dead(path: str, pid: int) -> None:
    """A worker exited: its live gauges go; its counters stay in the totals."""
    try:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    except OSError as error:
        log.warning("app_metrics_mark_dead_failed", pid=pid, error=str(error))


# Rendering -------------------------------------------------------------------------


class Metrics:
    """Everything the main process renders at `/metrics` and `GET /_tether/metrics`."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        restarts: Callable[[], int] = lambda: 0,
        app_metrics_dir: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`restarts`: how many workers the supervisor replaced; `app_metrics_dir`: the
        app's multiprocess files (`--app-metrics`), or None."""
        self.coordinator = coordinator
        self.restarts = restarts
        self.tally = WorkerTally()
        self.checkpoints = CheckpointMetrics(clock)
        # A private registry: nothing of tether's ever touches prometheus_client's global one.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_TetherCollector(self))
        self._refresher: asyncio.Task[None] | None = None
        self.app_registry: CollectorRegistry | None = None
        if app_metrics_dir is not None:
            self.app_registry = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self.app_registry, path=app_metrics_dir)  # type: ignore[no-untyped-call]

    def start(self, refresh_s: float = REFRESH_S) -> None:
        """Ask for the workers' counts every `refresh_s` between scrapes, until `stop`."""
        self._refresher = asyncio.create_task(self._refresh(refresh_s),
                                              name="tether-metrics-refresh")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None

    def worker_left(self, worker: WorkerId) -> None:
        self.tally.worker_left(worker)

    async def _refresh(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.scrape(counts_only=True)
            except Exception:  # the next refresh or scrape tries again
                log.exception("metrics_refresh_failed")

    async def scrape(self, counts_only: bool = False) -> None:
        """Ask every live worker for its counters and keep each answer; `counts_only`
        (a refresh) spares the workers counting their sessions."""
        links = dict(self.coordinator.links)
        body = {"counts_only": True} if counts_only else None
        answers = await asyncio.gather(
            *(link.channel.request("metrics", body, timeout=SCRAPE_TIMEOUT_S)
              for link in links.values()),
            return_exceptions=True,
        )
        for worker, answer in zip(links, answers, strict=True):
            report = WorkerReport.from_answer(answer)
            if report is not None:
                self.tally.update(worker, report, worker in self.coordinator.links)
            elif not isinstance(answer, ChannelLost | TimeoutError):
                log.warning("metrics_report_failed", worker_id=worker, error=repr(answer))

    async def render(self) -> str:
        """The text a scrape answers: tether's metrics, then the app's (`--app-metrics`)."""
        await self.scrape()
        text = generate_latest(self.registry)
        if self.app_registry is not None:
            text += await asyncio.to_thread(generate_latest, self.app_registry)
        return text.decode()


class _TetherCollector(Collector):
    """SPEC 9's table, read from a `Metrics` at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self.metrics
        coordinator = metrics.coordinator
        tally = metrics.tally
        requests = CounterMetricFamily(
            "tether_requests_total",
            "HTTP requests the workers' routers took, by what each router did with them",
            labels=["outcome"],
        )
        for outcome, count in tally.requests().items():
            requests.add_metric([outcome], count)
        yield requests
        forward = tally.forward()
        yield HistogramMetricFamily(
            "tether_forward_seconds",
            "Time the receiving worker spent on a request it forwarded, reply included",
            buckets=forward.cumulative(), sum_value=forward.total,
        )
        sessions = GaugeMetricFamily(
            "tether_sessions", "Sessions each live worker's app holds", labels=["worker"]
        )
        claims = GaugeMetricFamily(
            "tether_claims", "Session claims each live worker owns", labels=["worker"]
        )
        for worker, report in sorted(tally.live.items()):
            if worker in coordinator.links:
                sessions.add_metric([worker], report.sessions or 0)
                claims.add_metric([worker], report.claims)
        yield sessions
        yield claims
        yield GaugeMetricFamily(
            "tether_workers", "Registered (live) workers", value=len(coordinator.links)
        )
        yield CounterMetricFamily(
            "tether_worker_restarts_total", "Workers the supervisor replaced after they exited",
            value=metrics.restarts(),
        )
        yield from self._checkpoints(metrics.checkpoints)
        fleet = coordinator.fleet
        held = len(fleet.held_episodes()) if fleet is not None else 0
        yield GaugeMetricFamily(
            "tether_held_episodes", "Held episode records no request has claimed yet",
            value=held,
        )
        episode_claims = CounterMetricFamily(
            "tether_episode_claims_total",
            "Requests' claims of held episode records, by result",
            labels=["result"],
        )
        results: Mapping[str, int] = fleet.claim_results if fleet is not None else {}
        for result in CLAIM_RESULTS:
            episode_claims.add_metric([result], results.get(result, 0))
        yield episode_claims

    def _checkpoints(self, checkpoints: CheckpointMetrics) -> Iterator[Metric]:
        totals = CounterMetricFamily(
            "tether_checkpoints_total",
            "Checkpoint protocol outcomes: commits, blocked prepares, failed commits or "
            "restores, expired leases, aborted restores",
            labels=["result"],
        )
        for result, count in checkpoints.results.items():
            totals.add_metric([result], count)
        yield totals
        phases = HistogramMetricFamily(
            "tether_checkpoint_phase_seconds", "How long each checkpoint phase took",
            labels=["phase"],
        )
        for phase, buckets in checkpoints.phases.items():
            phases.add_metric([phase], buckets.cumulative(), buckets.total)
        yield phases
        yield GaugeMetricFamily(
            "tether_last_checkpoint_bytes", "Bytes of segments the last commit wrote",
            value=checkpoints.last_bytes,
        )
        records = GaugeMetricFamily(
            "tether_last_checkpoint_records", "Records the last commit wrote, by kind",
            labels=["kind"],
        )
        for kind, count in checkpoints.last_records.items():
            records.add_metric([kind], count)
        yield records
        yield GaugeMetricFamily(
            "tether_last_checkpoint_timestamp_seconds",
            "When the last commit succeeded (Unix time; 0 before the first)",
            value=checkpoints.last_checkpoint_at,
        )
        yield GaugeMetricFamily(
            "tether_last_restore_timestamp_seconds",
            "When the last restore succeeded (Unix time; 0 before the first)",
            value=checkpoints.last_restore_at,
        )
        yield HistogramMetricFamily(
            "tether_checkpoint_pause_seconds",
            "How long admission stayed closed, from prepare to reopening",
            buckets=checkpoints.pause.cumulative(), sum_value=checkpoints.pause.total,
        )
