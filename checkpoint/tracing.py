"""The checkpoint protocol's spans (SPEC 9), when this process traces (`routing/tracing.py`).

    tether checkpoint        root: from the prepare that closes admission to its reopening
    ├── tether prepare       each prepare's wait for readiness
    ├── tether commit        the write
    │   └── tether export    one per worker, made by the worker
    └── tether resume        reopening admission
    tether restore           root: from the restore that closes admission to its reopening
    ├── tether install       one per worker, made by the worker
    └── tether resume

The checkpointer opens and closes the spans (`CheckpointSpans`) and tells them what each
phase change moved (`observe`, one of its observers). A worker's spans (`worker_call`)
are children of the span whose context came with the coordinator's call, carried in the
channel's frame (`coordinator/framing.py`), and the checkpoint ID rides along as baggage.
With tracing off every method returns at its first check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from tether.checkpoint.events import PhaseChange
from tether.routing import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["CHECKPOINT_ID", "CheckpointSpans", "worker_call"]

CHECKPOINT_ID = "tether.checkpoint.id"
WORKER_SPANS = frozenset({"export", "install"})
_FAILED = frozenset({"commit_failed", "restore_failed", "expired"})
_ENDS_ROOT = frozenset({"resumed", "expired", "aborted", "restore_failed"})

T = TypeVar("T")


class CheckpointSpans:
    """One checkpointer's spans: a root while admission is closed, a child per phase."""

    def __init__(self) -> None:
        self._root: Span | None = None
        self._root_id: str | None = None

    def closing(self, route: str, checkpoint_id: str) -> None:
        """Admission closes for `checkpoint_id` (a prepare, or a restore): its root starts.
        A root of its own, linked to the caller's span if the call came with one."""
        tracer = tracing.tracer()
        if tracer is None:
            return
        from opentelemetry import trace
        from opentelemetry.context import Context

        self.end()
        caller = trace.get_current_span().get_span_context()
        self._root = tracer.start_span(
            "tether restore" if route == "restore" else "tether checkpoint",
            context=Context(),
            attributes={CHECKPOINT_ID: checkpoint_id},
            links=[trace.Link(caller)] if caller.is_valid else None,
        )
        self._root_id = checkpoint_id

    @contextlib.contextmanager
    def phase(self, name: str, checkpoint_id: str) -> Iterator[None]:
        """The block is the current span `tether NAME`, a child of the checkpoint's root
        (a root itself if admission never closed for it: a restore's dry run)."""
        tracer = tracing.tracer()
        if tracer is None:
            yield
            return
        # Attached first, not passed: the span made current keeps the context's baggage.
        with self._attached(checkpoint_id), tracer.start_as_current_span(
            f"tether {name}", attributes={CHECKPOINT_ID: checkpoint_id}
        ):
            yield

    @contextlib.contextmanager
    def within(self, checkpoint_id: str) -> Iterator[None]:
        """The block runs in the root's context (a restore: the workers' installs are
        its children), or in a `tether restore` span of its own if there is no root."""
        if tracing.tracer() is None:
            yield
            return
        if self._root is None or self._root_id != checkpoint_id:
            with self.phase("restore", checkpoint_id):
                yield
            return
        with self._attached(checkpoint_id):
            yield

    @contextlib.contextmanager
    def reopening(self, checkpoint_id: str, route: str) -> Iterator[None]:
        """Admission reopens: for a resume, the block is the span `tether resume`. (The
        phase change that follows ends the root: `observe`.)"""
        if route == "resume":
            with self.phase("resume", checkpoint_id):
                yield
        else:
            yield

    def observe(self, event: PhaseChange) -> None:
        """An observer: what a phase change moved, on the current span and the root; a
        change that reopens admission (or a failed restore) ends the root."""
        if tracing.tracer() is None:
            return
        from opentelemetry import trace

        attributes = _attributes(event)
        spans = [trace.get_current_span()]
        if self._root is not None and self._root_id == event.checkpoint_id:
            spans.append(self._root)
        for span in spans:
            span.set_attributes(attributes)
            if event.change in _FAILED:
                span.set_status(trace.StatusCode.ERROR, event.code or event.change)
        if event.change in _ENDS_ROOT:
            self.end(event.checkpoint_id)

    def end(self, checkpoint_id: str | None = None) -> None:
        """End the root (of `checkpoint_id`, or whichever is open)."""
        root = self._root
        if root is not None and checkpoint_id in (None, self._root_id):
            self._root, self._root_id = None, None
            root.end()

    @contextlib.contextmanager
    def _attached(self, checkpoint_id: str) -> Iterator[None]:
        """The block runs in the checkpoint's context: its root (if open) as the current
        span, its ID as baggage, nothing of the caller's."""
        from opentelemetry import baggage, trace
        from opentelemetry import context as otel_context

        context = baggage.set_baggage(CHECKPOINT_ID, checkpoint_id, otel_context.Context())
        if self._root is not None and self._root_id == checkpoint_id:
            context = trace.set_span_in_context(self._root, context)
        token = otel_context.attach(context)
        try:
            yield
        finally:
            otel_context.detach(token)


async def worker_call(kind: str, worker: str, call: Awaitable[T]) -> T:
    """One call the coordinator made of this worker: an `export` or an `install` is the
    span `tether export` / `tether install`, a child of the span the call came with."""
    tracer = tracing.tracer()
    if tracer is None or kind not in WORKER_SPANS:
        return await call
    from opentelemetry import baggage

    checkpoint_id = baggage.get_baggage(CHECKPOINT_ID)
    attributes: dict[str, Any] = {"tether.worker": worker}
    if isinstance(checkpoint_id, str):
        attributes[CHECKPOINT_ID] = checkpoint_id
    with tracer.start_as_current_span(f"tether {kind}", attributes=attributes) as span:
        answer = await call
        if isinstance(answer, dict):  # an export: its segment
            span.set_attributes({"tether.records": int(answer.get("records", 0)),
                                 "tether.bytes": int(answer.get("bytes", 0))})
        elif isinstance(answer, int):  # an install: the sessions installed
            span.set_attribute("tether.records", answer)
        return answer


def _attributes(event: PhaseChange) -> dict[str, Any]:
    found: dict[str, Any] = {"tether.outcome": event.change}
    if event.records is not None:
        found["tether.records"] = sum(event.records.values())
        for kind, count in event.records.items():
            found[f"tether.records.{kind}"] = count
    if event.bytes is not None:
        found["tether.bytes"] = event.bytes
    if event.workers is not None:
        found["tether.workers"] = event.workers
    if event.paused_s is not None:
        found["tether.paused_s"] = round(event.paused_s, 6)
    if event.code is not None:
        found["tether.code"] = event.code
    return found
