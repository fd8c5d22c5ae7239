"""OpenTelemetry traces (SPEC 9): whether this process traces, and the hop's span.

Tracing is decided once per process, when it starts (`start`): it is on when
`opentelemetry` is importable and a real SDK tracer provider is configured, either
already (by `opentelemetry-instrument`, or by the app as it was imported) or from the
standard `OTEL_*` variables, which tether reads itself when `OTEL_TRACES_EXPORTER` or an
OTLP endpoint is set and `opentelemetry-sdk` is installed. Otherwise it is off: nothing is
emitted, `opentelemetry` is not even imported, and a forwarded request pays one None
check (`Router.tracing`).

The span made here is `tether forward` (CLIENT), on the worker that received a request
another worker holds. It continues the caller's `traceparent` (W3C) if one came; the
request goes on to the holder with a fresh `traceparent` naming this span in place of the
caller's, so the holder's server span (the app's OpenTelemetry instrumentation) is its
child. The checkpoint's spans are in `checkpoint/tracing.py`; `carrier` and `continued`
carry a span's context (and baggage) across the coordinator channel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import structlog
from starlette.types import Message, Receive, Scope, Send

from tether.routing.types import WorkerId

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer, TracerProvider

    from tether.routing.forward import Forwarder

__all__ = ["HopTraces", "carrier", "continued", "hop_traces", "start", "stop", "tracer", "use"]

log = structlog.get_logger("tether.tracing")

TRACER_NAME = "tether"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_EXPORTERS_GROUP = "opentelemetry_traces_exporter"
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}

_decided = False
_tracer: Tracer | None = None
_owned: SdkTracerProvider | None = None
"""The provider tether configured from the environment (flushed by `stop`), if any."""
_found: TracerProvider | None = None
"""The provider someone else configured, which tether traces with (flushed by `stop`)."""
_channel: TextMapPropagator | None = None
"""How a span's context crosses the coordinator channel: W3C trace context and baggage."""


def start() -> bool:
    """Decide, once per process, whether it traces; True if it does. Called as each
    worker starts (after it imported the app, so an SDK the app configured at import is
    used) and as the main process starts."""
    global _decided, _owned, _found
    if _decided:
        return _tracer is not None
    _decided = True
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    provider = _found = _configured_provider()
    if provider is None and _configured_by_environment():
        provider = _owned = _provider_from_environment()
    if provider is not None:
        _use(provider)
    return _tracer is not None


def use(provider: TracerProvider | None) -> None:
    """Trace with `provider` from now on, or stop tracing (None): for tests, and for
    an embedder that decides itself. Never sets the global provider."""
    global _decided, _tracer
    _decided = True
    _tracer = None
    if provider is not None:
        _use(provider)


def stop() -> None:
    """As the process ends: flush and shut down the provider tether configured; flush one
    it found (its owner shuts it down, if the process lives long enough to)."""
    global _owned, _found
    if _owned is not None:
        owned, _owned = _owned, None
        owned.shutdown()
    if _found is not None:
        found, _found = _found, None
        flush = getattr(found, "force_flush", None)
        if callable(flush):
            flush()


def tracer() -> Tracer | None:
    """This process's tracer, or None when it does not trace."""
    return _tracer


def carrier() -> dict[str, str] | None:
    """The W3C context (`traceparent`, `tracestate`, `baggage`) of the current span, to
    send with a call; None when this process does not trace or no span is current."""
    if _tracer is None or _channel is None:
        return None
    from opentelemetry import trace

    if not trace.get_current_span().get_span_context().is_valid:
        return None
    found: dict[str, str] = {}
    _channel.inject(found)
    return found or None


@contextlib.contextmanager
def continued(context: Mapping[str, str] | None) -> Iterator[None]:
    """Run the block in the span context a peer's `carrier()` sent (nothing without one,
    or when this process does not trace)."""
    if context is None or _tracer is None or _channel is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(_channel.extract(context))
    try:
        yield
    finally:
        otel_context.detach(token)


def hop_traces(forwarder: Forwarder, worker: str) -> HopTraces | None:
    """What the router forwards through when this process traces, else None."""
    return None if _tracer is None else HopTraces(forwarder, worker, _tracer)


class HopTraces:
    """`Forwarder.forward` in a `tether forward` span, whose context the holder gets as
    its `traceparent` (and `tracestate`) in place of the caller's."""

    def __init__(self, forwarder: Forwarder, worker: str, tracer: Tracer) -> None:
        from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.forwarder = forwarder
        self.worker = worker
        self.tracer = tracer
        self._w3c = TraceContextTextMapPropagator()
        self._client = SpanKind.CLIENT
        self._error = StatusCode.ERROR
        self._in_context = set_span_in_context

    async def forward(
        self,
        socket_path: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes | None = None,
        hop: bytes | None = None,
        target: WorkerId | None = None,
        fresh: bool = False,
    ) -> None:
        """`Forwarder.forward`, traced; raises what it raises."""
        incoming: dict[str, str] = {}
        headers: list[tuple[bytes, bytes]] = []
        for name, value in scope["headers"]:
            if name in _TRACE_HEADERS:
                incoming[name.decode("latin-1")] = value.decode("latin-1")
            else:
                headers.append((name, value))
        holder = target or os.path.basename(socket_path).removesuffix(".sock")
        span = self.tracer.start_span(
            "tether forward",
            context=self._w3c.extract(incoming),
            kind=self._client,
            attributes={
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "tether.worker": self.worker,
                "tether.holder": holder,
            },
        )
        outgoing: dict[str, str] = {}
        self._w3c.inject(outgoing, context=self._in_context(span))
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in outgoing.items()]
        status = 0

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.forwarder.forward(
                socket_path, {**scope, "headers": headers}, receive, traced_send, body, hop,
                target, fresh,
            )
        except BaseException as error:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(self._error, str(error) or type(error).__name__)
            raise
        finally:
            if status:
                span.set_attribute("http.response.status_code", status)
                if status >= 400:
                    span.set_status(self._error)
            span.end()


def _use(provider: TracerProvider) -> None:
    global _tracer, _channel
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace import NoOpTracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from tether._version import __version__

    found = provider.get_tracer(TRACER_NAME, __version__)
    _tracer = None if isinstance(found, NoOpTracer) else found
    # W3C whatever OTEL_PROPAGATORS says: both ends of the channel are tether's.
    _channel = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def _configured_provider() -> TracerProvider | None:
    """The global provider someone configured in this process, if any. Nobody has unless
    `opentelemetry.trace` was imported: then it is not imported here either."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


def _configured_by_environment() -> bool:
    """Whether the `OTEL_*` variables ask for traces: an exporter named (not `none`), or
    an OTLP endpoint (the exporter then defaults to `otlp`)."""
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if names:
        return names != "none"
    return any(os.environ.get(f"OTEL_EXPORTER_OTLP_{part}ENDPOINT") for part in ("TRACES_", ""))


def _provider_from_environment() -> SdkTracerProvider | None:
    """An SDK provider as `opentelemetry-instrument` would configure it from `OTEL_*`,
    traces only: resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`; service
    `tether` if neither names one), sampler (`OTEL_TRACES_SAMPLER`), a batch processor
    (`OTEL_BSP_*`) per exporter named in `OTEL_TRACES_EXPORTER`, each configured by its
    own variables. Set as the global provider, so the app's instrumentation shares it."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing_off", reason="OTEL_* variables ask for traces, but "
                    "opentelemetry-sdk is not installed; install it and an exporter")
        return None
    exporters = [e for e in map(_exporter, _exporter_names()) if e is not None]
    if not exporters:
        return None
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "tether"}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def _exporter_names() -> list[str]:
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    otlp = _OTLP_BY_PROTOCOL.get(protocol, "otlp_proto_grpc")
    return [otlp if name == "otlp" else name for name in names if name]


def _exporter(name: str) -> SpanExporter | None:
    """The span exporter the SDK's entry point `name` makes, or None (logged)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # One compact JSON object a line on stderr, beside the logs: stdout stays the
        # operator's, and under --log-format json every line still parses.
        return ConsoleSpanExporter(out=sys.stderr, formatter=lambda s: s.to_json(None) + "\n")
    found = importlib.metadata.entry_points(group=_EXPORTERS_GROUP, name=name)
    if not found:
        log.warning("trace_exporter_missing", exporter=name,
                    fix=f"install the package that provides {name!r}, or name another in "
                        "OTEL_TRACES_EXPORTER")
        return None
    try:
        exporter: SpanExporter = next(iter(found)).load()()
    except Exception as error:
        log.warning("trace_exporter_failed", exporter=name, error=repr(error))
        return None
    return exporter
