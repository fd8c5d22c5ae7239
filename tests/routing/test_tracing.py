"""The hop's span on real in-process workers, and when a process traces at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import Receive, Scope, Send

from tests.routing.apps import session_app
from tests.routing.conftest import Cluster
from tether.routing import tracing
from tether.routing.kinds import declared_kind

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


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


class Recording:
    """The app behind a router, recording the headers each request reached it with."""

    def __init__(self) -> None:
        self.inner = session_app()
        self.kind = declared_kind(self.inner)
        self.headers: list[list[tuple[str, str]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.headers.append([(k.decode(), v.decode()) for k, v in scope["headers"]])
        await self.inner(scope, receive, send)

    def last(self, name: str) -> list[str]:
        return [value for key, value in self.headers[-1] if key == name]


async def forwarded_touch(cluster: Cluster, headers: dict[str, str]) -> tuple[Recording, Any]:
    """Seed a session on worker a, then GET /touch for it through worker b (forwarded)."""
    holder, other = Recording(), Recording()
    a = await cluster.add(holder, kind=holder.kind)
    b = await cluster.add(other, kind=other.kind)
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "traced"})
    async with b.client(cookies=seeded.cookies) as cb:
        touched = await cb.get("/touch", headers=headers)
    assert touched.status_code == 200
    assert touched.json()["worker"] == a.id
    assert b.routing.router.stats.forwarded == 1
    return holder, (a, b)


def traceparent(span: ReadableSpan) -> str:
    """The W3C header naming `span`."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


async def test_forwarded_request_is_a_client_span_the_holders_traceparent_names(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    holder, (a, b) = await forwarded_touch(
        cluster, {"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=1"}
    )
    [forward] = finished(spans, "tether forward")
    assert forward.kind is SpanKind.CLIENT
    assert forward.parent is not None
    assert f"{forward.parent.trace_id:032x}" == CLIENT_TRACE
    assert f"{forward.parent.span_id:016x}" == CLIENT_SPAN
    assert dict(forward.attributes or {}) == {
        "http.request.method": "GET",
        "url.path": "/touch",
        "tether.worker": b.id,
        "tether.holder": a.id,
        "http.response.status_code": 200,
    }
    # The holder got one traceparent: this span's, in the caller's trace; the state kept.
    assert holder.last("traceparent") == [traceparent(forward)]
    assert traceparent(forward).startswith(f"00-{CLIENT_TRACE}-")
    assert holder.last("tracestate") == ["vendor=1"]
    assert holder.last("x-tether-hop") == []  # still taken off by the private side


async def test_forwarded_request_without_traceparent_starts_its_trace_at_the_hop(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    holder, _ = await forwarded_touch(cluster, {})
    [forward] = finished(spans, "tether forward")
    assert forward.parent is None
    assert holder.last("traceparent") == [traceparent(forward)]


async def test_without_tracing_the_holder_gets_the_callers_traceparent_as_sent(
    cluster: Cluster,
) -> None:
    holder, (_, b) = await forwarded_touch(cluster, {"traceparent": CLIENT_TRACEPARENT})
    assert b.routing.router.tracing is None
    assert holder.last("traceparent") == [CLIENT_TRACEPARENT]


async def test_request_served_where_it_landed_makes_no_span(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    app = Recording()
    a = await cluster.add(app, kind=app.kind)
    await cluster.add(Recording(), kind=app.kind)
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "local"})
        ca.cookies = seeded.cookies
        touched = await ca.get("/touch", headers={"traceparent": CLIENT_TRACEPARENT})
    assert touched.status_code == 200
    assert spans.get_finished_spans() == ()
    assert app.last("traceparent") == [CLIENT_TRACEPARENT]


async def test_forward_to_a_claimant_that_is_gone_ends_its_span_as_an_error(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    app = Recording()
    a = await cluster.add(app, kind=app.kind)
    b = await cluster.add(Recording(), kind=app.kind)
    async with a.client() as ca:
        seeded = await ca.post("/seed_session", json={"session_id": "gone"})
    await a.routing.stop()  # its socket is gone while b still thinks it is live
    async with b.client(cookies=seeded.cookies) as cb:
        gone = await cb.get("/touch")
    assert gone.status_code == 410
    [forward] = finished(spans, "tether forward")
    assert forward.status.status_code is StatusCode.ERROR
    assert (forward.attributes or {})["error.type"] == "ClaimantGone"
    assert "http.response.status_code" not in (forward.attributes or {})


# Deciding whether a process traces: each in a fresh interpreter, since the decision is
# made once per process and may set the global provider.

def decide(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**clean, **env}, capture_output=True, text=True, timeout=60, check=False,
    )


def test_start_without_otel_variables_is_off_and_never_imports_opentelemetry() -> None:
    done = decide("""
        import sys
        import tether.checkpoint.checkpointer, tether.coordinator.launcher
        import tether.coordinator.worker
        from tether.routing import tracing
        print(tracing.start(), tracing.tracer(), sorted(
            m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "False None []"


def test_start_with_otel_traces_exporter_configures_the_sdk_from_the_environment() -> None:
    done = decide("""
        from opentelemetry import trace
        from tether.routing import tracing
        assert tracing.start()
        assert trace.get_tracer_provider().resource.attributes["service.name"] == "shop"
        tracer = tracing.tracer()
        assert tracer is not None
        tracer.start_span("probe", attributes={"tether.records": 3}).end()
        tracing.stop()  # flushes the batch
        print("stdout stays the operator's")
    """, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="shop")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stdout stays the operator's\n"
    # The console exporter writes one compact JSON object a line, on stderr.
    [line] = done.stderr.splitlines()
    span = json.loads(line)
    assert span["name"] == "probe"
    assert span["attributes"] == {"tether.records": 3}
    assert span["resource"]["attributes"]["service.name"] == "shop"


def test_start_names_the_service_tether_if_the_environment_does_not() -> None:
    done = decide("""
        from opentelemetry import trace
        from tether.routing import tracing
        assert tracing.start()
        print(trace.get_tracer_provider().resource.attributes["service.name"])
        tracing.stop()
    """, OTEL_TRACES_EXPORTER="console")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "tether\n"


def test_an_otlp_endpoint_alone_asks_for_the_otlp_exporter_of_its_protocol() -> None:
    done = decide("""
        from opentelemetry import trace
        from tether.routing import tracing
        assert tracing.start()
        processor, = trace.get_tracer_provider()._active_span_processor._span_processors
        print(type(processor.span_exporter).__module__)
        tracing.stop()
    """, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL=
        "http/protobuf")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "opentelemetry.exporter.otlp.proto.http.trace_exporter\n"


def test_start_uses_the_sdk_provider_the_app_configured_and_never_replaces_it() -> None:
    done = decide("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        mine = TracerProvider()
        trace.set_tracer_provider(mine)
        from tether.routing import tracing
        assert tracing.start()
        assert trace.get_tracer_provider() is mine
        print(tracing.tracer().__class__.__module__)
    """, OTEL_TRACES_EXPORTER="console")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "opentelemetry.sdk.trace\n"


@pytest.mark.parametrize(
    ("env", "warning"),
    [
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_TRACES_EXPORTER": "zipkin_json"}, "trace_exporter_missing"),
        # otlp names the gRPC exporter by default, which the dev extra does not install
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "trace_exporter_missing"),
    ],
)
def test_start_stays_off_when_the_environment_asks_for_no_usable_exporter(
    env: dict[str, str], warning: str | None
) -> None:
    done = decide("""
        from tether.routing import tracing
        from tether.routing.logs import configure_logging
        configure_logging("json")
        print(tracing.start())
    """, **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"
    events = [json.loads(line)["event"] for line in done.stderr.splitlines()]
    assert events == ([] if warning is None else [warning])
