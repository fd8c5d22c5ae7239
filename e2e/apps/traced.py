"""The counter app with OpenTelemetry's ASGI instrumentation, as a user would trace it:
each request it serves is a SERVER span that continues the `traceparent` it came with
(for a forwarded request, the receiving worker's `tether forward` span)."""

from __future__ import annotations

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

from tether.examples.counter import create_app

app = create_app()
app.add_middleware(OpenTelemetryMiddleware)
