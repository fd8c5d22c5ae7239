"""Traces of a real `tether serve` exported over OTLP/HTTP to a receiver this test runs
(SPEC 9): a forwarded request is one trace across the hop, a checkpoint one trace with an
export span per worker, a restore one trace with an install span per worker. Set up
only through the standard `OTEL_*` variables, as a user would."""

from __future__ import annotations

import gzip
import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from e2e.conftest import Serve
from e2e.harness import Connection, Http, Reply, Server, eventually
from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json

pytestmark = pytest.mark.e2e

APP = "e2e.apps.traced:app"
NAME = "counter"
CLIENT_TRACE = secrets.token_hex(16)
CLIENT_SPAN = secrets.token_hex(8)
SERVER_KIND = 2  # OTLP's Span.SpanKind
CLIENT_KIND = 3


@dataclass(frozen=True)
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any]
    service: str


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1, in a thread of its own (so it answers
    while the test's event loop waits on something else, and while servers stop)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    raw = gzip.decompress(raw)
                receiver.take(ExportTraceServiceRequest.FromString(raw))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver")

    @property
    def env(self) -> dict[str, str]:
        port = self.server.server_address[1]
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
            "OTEL_SERVICE_NAME": "tether-e2e",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "5",
        }

    def take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(Span(
                        span.name, span.kind, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), _attributes(span.attributes),
                        resource.get("service.name", ""),
                    ))
        with self._lock:
            self.spans += found

    def named(self, name: str, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self.spans
                    if s.name == name and trace_id in (None, s.trace_id)]

    def children(self, parent: Span) -> list[Span]:
        with self._lock:
            return [s for s in self.spans
                    if s.parent == parent.span_id and s.trace_id == parent.trace_id]


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value") or "string_value")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """Requested before `serve`, so it outlives the servers: they flush to it as they stop."""
    found = Receiver()
    found.thread.start()
    try:
        yield found
    finally:
        found.server.shutdown()
        found.thread.join()
        found.server.server_close()


def assert_every_output_line_is_json(server: Server) -> None:
    """`--log-format json`: every line on stdout and stderr is one JSON object, span
    exports included (they go over OTLP, not to either stream)."""
    for path in (server.stdout_path, server.stderr_path):
        for line in path.read_text().splitlines():
            assert isinstance(json.loads(line), dict), (path.name, line)


async def worker_ids(server: Server) -> dict[int, str]:
    async with Http(server.url) as http:
        status = await server.status(http)
    return {worker["pid"]: worker["id"] for worker in status["workers"]}


async def control(server: Server, route: str, **body: Any) -> Any:
    async with Http(server.url) as http:
        reply = await http.request("POST", f"/_tether/{route}", json=body,
                                   headers={"authorization": f"Bearer {server.token}"})
    assert reply.status == 200, reply
    return reply.json


async def connection_to(server: Server, pids: dict[int, str], wanted: set[int]) -> Connection:
    """A new connection accepted by one of the workers `wanted` (new ones until one is)."""
    host, port = server.host_port
    for _ in range(200):
        connection = await Connection.open(host, port)
        if await connection.owner(pids) in wanted:
            return connection
        await connection.close()
    raise AssertionError(f"no connection in 200 was accepted by one of {wanted}")


async def test_forwarded_request_is_one_trace_whose_holder_span_is_the_hops_child(
    receiver: Receiver, serve: Serve
) -> None:
    server = serve(APP, 2, env=receiver.env)
    pids = await worker_ids(server)
    seeding = await connection_to(server, pids, set(pids))
    holder_pid = await seeding.owner(pids)
    seeded = await seeding.request("POST", "/seed_session", json={"session_id": "traced"})
    await seeding.close()
    cookie = seeded.cookie()
    assert seeded.status == 200 and cookie is not None, seeded

    other = await connection_to(server, pids, set(pids) - {holder_pid})
    reply: Reply = await other.request("GET", "/count", headers={
        "cookie": cookie, "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    await other.close()
    assert reply.status == 200 and reply.json["worker"] == pids[holder_pid], reply

    [forward] = await eventually(
        lambda: receiver.named("tether forward", CLIENT_TRACE), 10.0, "the hop's span")
    assert (forward.kind, forward.parent, forward.service) == (
        CLIENT_KIND, CLIENT_SPAN, "tether-e2e")
    assert forward.attributes["tether.holder"] == pids[holder_pid]
    assert forward.attributes["tether.worker"] != pids[holder_pid]
    assert forward.attributes["http.response.status_code"] == 200
    # The holder's app (OpenTelemetry's ASGI middleware) continued the hop's traceparent.
    held = await eventually(
        lambda: [s for s in receiver.children(forward) if s.kind == SERVER_KIND], 10.0,
        "the holder's server span, a child of the hop's")
    assert len(held) == 1, held
    assert_every_output_line_is_json(server)


async def test_checkpoint_and_restore_are_each_one_trace_with_a_span_per_worker(
    receiver: Receiver, serve: Serve, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    args = ("--checkpoint-root", str(root), "--name", NAME)
    server = serve(APP, 2, *args, env=receiver.env)
    workers = set((await worker_ids(server)).values())
    async with Http(server.url) as http:
        for n in range(8):
            assert (await http.request(
                "POST", "/seed_session", json={"session_id": f"t-{n}"})).status == 200
    prepared = await control(server, "prepare", checkpoint_id="c1", deadline_s=10)
    assert prepared["state"] == "prepared", prepared
    manifest = await control(server, "commit", checkpoint_id="c1")
    entry: Any = {"name": NAME, "url": server.url,  # what the controller writes
                  "manifest_digest": read_manifest_digest(root, "c1", NAME)}
    write_checkpoint_json(root, "c1", [entry], None, None)
    await control(server, "resume", checkpoint_id="c1")

    [checkpoint] = await eventually(lambda: receiver.named("tether checkpoint"), 10.0,
                                    "the checkpoint's root, ended by the resume")
    assert checkpoint.parent == ""
    assert checkpoint.attributes["tether.checkpoint.id"] == "c1"
    assert checkpoint.attributes["tether.records"] == 8
    assert checkpoint.attributes["tether.workers"] == 2
    assert checkpoint.attributes["tether.bytes"] == sum(s["bytes"] for s in manifest["segments"])
    phases = {s.name: s for s in receiver.children(checkpoint)}
    assert sorted(phases) == ["tether commit", "tether prepare", "tether resume"]
    exports = await eventually(
        lambda: len(receiver.children(phases["tether commit"])) == 2
        and receiver.children(phases["tether commit"]), 10.0, "an export span per worker")
    assert {s.name for s in exports} == {"tether export"}
    assert {s.attributes["tether.worker"] for s in exports} == workers
    assert {s.attributes["tether.checkpoint.id"] for s in exports} == {"c1"}
    assert sum(s.attributes["tether.records"] for s in exports) == 8
    assert_every_output_line_is_json(server)

    fresh = serve(APP, 2, *args, "--restore", "c1", env=receiver.env)
    restored_on = set((await worker_ids(fresh)).values())
    [restore] = await eventually(lambda: receiver.named("tether restore"), 10.0,
                                 "the restore's root, ended by the resume")
    assert (restore.parent, restore.attributes["tether.checkpoint.id"]) == ("", "c1")
    assert restore.attributes["tether.records"] == 8
    spans = await eventually(
        lambda: len(receiver.children(restore)) == 3 and receiver.children(restore), 10.0,
        "an install span per worker and the resume")
    installs = [s for s in spans if s.name == "tether install"]
    assert {s.attributes["tether.worker"] for s in installs} == restored_on
    assert sum(s.attributes["tether.records"] for s in installs) == 8
    assert [s.name for s in spans if s not in installs] == ["tether resume"]
    assert_every_output_line_is_json(fresh)


async def test_spans_still_batched_when_the_server_stops_are_exported_as_it_stops(
    receiver: Receiver, serve: Serve, tmp_path: Path
) -> None:
    # Batches are only sent when full or as a process stops: these spans only by the stop
    # (a worker's lifespan shutdown, the main process's exit; a checkpoint still open
    # then ends with the server).
    env = {**receiver.env, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    server = serve(APP, 2, "--checkpoint-root", str(tmp_path), "--name", NAME, env=env)
    async with Http(server.url) as http:
        for n in range(4):
            assert (await http.request(
                "POST", "/seed_session", json={"session_id": f"b-{n}"})).status == 200
    prepared = await control(server, "prepare", checkpoint_id="open", deadline_s=10)
    assert prepared["state"] == "prepared", prepared
    assert receiver.named("POST /seed_session") == []
    server.terminate()
    assert await server.exit_code() == 0
    assert len(receiver.named("POST /seed_session")) == 4
    [checkpoint] = receiver.named("tether checkpoint")
    assert [s.name for s in receiver.children(checkpoint)] == ["tether prepare"]
