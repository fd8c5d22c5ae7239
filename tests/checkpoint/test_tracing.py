"""The checkpoint protocol's spans, on an in-process node (SPEC 9): one trace per
checkpoint and per restore, a child per phase, the worker's own span under them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tests.checkpoint.conftest import Nodes, eventually
from tether.routing import tracing


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This process traces into memory (never through the global provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: ReadableSpan) -> int:
    return span.get_span_context().span_id


def trace_id(span: ReadableSpan) -> int:
    return span.get_span_context().trace_id


async def test_checkpoint_is_one_trace_with_a_span_per_phase_and_the_export_under_commit(
    spans: InMemorySpanExporter, nodes: Nodes
) -> None:
    node = await nodes.start()
    for n in range(3):
        await node.seed(f"s-{n}")
    manifest = await node.checkpoint("c1")

    found = by_name(spans)
    [root] = found["tether checkpoint"]
    [prepare], [commit], [resume] = (found[f"tether {p}"] for p in ("prepare", "commit", "resume"))
    [export] = found["tether export"]
    assert root.parent is None
    assert {trace_id(s) for s in (root, prepare, commit, resume, export)} == {trace_id(root)}
    assert [parent_of(s) for s in (prepare, commit, resume)] == [span_id(root)] * 3
    assert parent_of(export) == span_id(commit)
    assert root.end_time is not None and resume.end_time is not None
    assert root.end_time >= resume.end_time  # the root lasts while admission is closed

    segment_bytes = sum(segment["bytes"] for segment in manifest["segments"])
    moved = {"tether.records": 3, "tether.records.sessions": 3, "tether.records.episodes": 0,
             "tether.bytes": segment_bytes, "tether.workers": 1}
    assert dict(commit.attributes or {}) == {
        "tether.checkpoint.id": "c1", "tether.outcome": "committed", **moved}
    root_attributes = dict(root.attributes or {})
    assert root_attributes.pop("tether.paused_s") > 0
    assert root_attributes == {"tether.checkpoint.id": "c1", "tether.outcome": "resumed", **moved}
    assert (prepare.attributes or {})["tether.outcome"] == "prepared"
    assert dict(export.attributes or {}) == {
        "tether.worker": manifest["workers"][0], "tether.checkpoint.id": "c1",
        "tether.records": 3, "tether.bytes": segment_bytes,
    }
    assert all(s.status.status_code is not StatusCode.ERROR for s in spans.get_finished_spans())


async def test_restore_is_one_trace_with_the_install_and_the_resume_under_it(
    spans: InMemorySpanExporter, nodes: Nodes
) -> None:
    first = await nodes.start()
    for n in range(2):
        await first.seed(f"r-{n}")
    await first.checkpoint("c2")
    await first.stop()
    spans.clear()

    fresh = await nodes.start()
    await fresh.restore_latest()
    found = by_name(spans)
    [root] = found["tether restore"]
    [install] = found["tether install"]
    [resume] = found["tether resume"]
    assert root.parent is None
    assert parent_of(install) == parent_of(resume) == span_id(root)
    assert (install.attributes or {})["tether.records"] == 2
    assert (install.attributes or {})["tether.checkpoint.id"] == "c2"
    attributes = root.attributes or {}
    assert (attributes["tether.outcome"], attributes["tether.records"]) == ("resumed", 2)
    assert attributes["tether.workers"] == 1


async def test_dry_run_restore_is_a_root_of_its_own_that_installs_nothing(
    spans: InMemorySpanExporter, nodes: Nodes
) -> None:
    first = await nodes.start()
    await first.seed("d-0")
    await first.checkpoint("c3")
    await first.stop()
    spans.clear()

    fresh = await nodes.start()
    await fresh.restore("c3", dry_run=True)
    [root] = spans.get_finished_spans()
    assert (root.name, root.parent) == ("tether restore", None)


async def test_expired_lease_ends_the_checkpoints_root_as_an_error(
    spans: InMemorySpanExporter, nodes: Nodes
) -> None:
    node = await nodes.start()
    await node.prepared("c4", lease_s=0.2, deadline_s=0.1)
    await eventually(lambda: by_name(spans).get("tether checkpoint"), 5.0, "the root ends")
    [root] = by_name(spans)["tether checkpoint"]
    assert (root.attributes or {})["tether.outcome"] == "expired"
    assert root.status.status_code is StatusCode.ERROR
    assert sorted(by_name(spans)) == ["tether checkpoint", "tether prepare"]


async def test_without_tracing_a_checkpoint_makes_no_span_and_still_commits(
    nodes: Nodes,
) -> None:
    node = await nodes.start()
    await node.seed("plain")
    manifest = await node.checkpoint("c5")
    assert manifest["records"]["sessions"] == 1
    assert tracing.tracer() is None
    assert node.checkpointer.spans._root is None
