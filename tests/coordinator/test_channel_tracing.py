"""A span's context crosses the coordinator channel in the request's frame (SPEC 9)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.coordinator.test_channel import Harness
from tether.coordinator.framing import (
    FrameError,
    Notification,
    Request,
    encode_frame,
    parse_message,
)
from tether.routing import tracing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def tracer() -> Iterator[trace.Tracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracing.use(provider)
    found = tracing.tracer()
    assert found is not None
    try:
        yield found
    finally:
        tracing.use(None)
        provider.shutdown()


class Seen:
    """A handler that records the span context (and baggage) each call ran in."""

    def __init__(self) -> None:
        self.contexts: list[tuple[trace.SpanContext, object]] = []

    async def __call__(self, kind: str, body: Any) -> Any:
        self.contexts.append(
            (trace.get_current_span().get_span_context(), baggage.get_baggage("k"))
        )
        return body


def test_request_frame_carries_a_trace_only_when_it_has_one() -> None:
    plain = Request(1, "export", {"path": "x"})
    traced = Request(2, "export", {"path": "x"}, {"traceparent": TRACEPARENT})
    assert plain.to_wire() == {"id": 1, "kind": "export", "body": {"path": "x"}}
    assert parse_message(traced.to_wire()) == traced
    assert parse_message(plain.to_wire()) == plain


@pytest.mark.parametrize(
    "wire",
    [
        {"id": 3, "kind": "export", "body": None, "trace": {"traceparent": 1}},
        {"id": 3, "kind": "export", "body": None, "trace": ["traceparent"]},
        {**Notification("readiness").to_wire(), "trace": {"traceparent": TRACEPARENT}},
    ],
)
def test_malformed_trace_or_a_traced_notification_is_a_frame_error(wire: Any) -> None:
    with pytest.raises(FrameError):
        parse_message(msgpack.unpackb(encode_frame(wire)[4:]))


async def test_call_made_in_a_span_runs_in_its_context_on_the_other_side(
    short_tmp: Path, tracer: trace.Tracer
) -> None:
    seen = Seen()
    harness = Harness(str(short_tmp / "c.sock"), seen)
    await harness.server.start()
    try:
        channel = await harness.connect()
        token = otel_context.attach(baggage.set_baggage("k", "v"))
        try:
            with tracer.start_as_current_span("caller") as span:
                assert await channel.request("echo", 1) == 1
        finally:
            otel_context.detach(token)
        assert await channel.request("echo", 2) == 2  # outside any span
        await channel.close()
    finally:
        await harness.server.close()
    (inside, carried), (outside, none) = seen.contexts
    assert (inside.trace_id, inside.span_id) == (
        span.get_span_context().trace_id, span.get_span_context().span_id)
    assert inside.is_remote and carried == "v"
    assert not outside.is_valid and none is None


async def test_without_tracing_a_call_carries_nothing_and_a_trace_sent_is_ignored(
    short_tmp: Path,
) -> None:
    assert tracing.carrier() is None
    seen = Seen()
    harness = Harness(str(short_tmp / "c.sock"), seen)
    await harness.server.start()
    try:
        channel = await harness.connect()
        assert await channel.request("echo", 1) == 1
        with tracing.continued({"traceparent": TRACEPARENT}):
            assert not trace.get_current_span().get_span_context().is_valid
        await channel.close()
    finally:
        await harness.server.close()
    [(context, _)] = seen.contexts
    assert not context.is_valid
