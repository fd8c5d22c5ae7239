"""The coordinator channel over real Unix sockets: calls, errors, loss, ordering, cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

from tether.coordinator.channel import (
    Channel,
    ChannelLost,
    ChannelServer,
    Handler,
    RemoteError,
    connect,
)
from tether.coordinator.framing import Notification, Reply, encode_frame
from tether.routing.errors import TetherError

BOUND = 5.0  # every wait in these tests is bounded; nothing should come close
PROJECT = Path(__file__).resolve().parents[2]


def socket_file_exists(path: str) -> bool:
    return os.path.lexists(path)


async def echo(kind: str, body: Any) -> Any:
    """A handler with one behaviour per kind."""
    if kind == "echo":
        return body
    if kind == "refuse":
        raise TetherError("invalid_phase", "not in this phase")
    if kind == "relay":
        raise RemoteError(503, "internal_error", "from further away")
    if kind == "lost":
        raise TetherError("session_lost", "not held here", failure_kind="session_lost")
    if kind == "crash":
        raise RuntimeError("kaput")
    if kind == "unencodable":
        return object()
    if kind == "hang":
        await asyncio.Event().wait()
    raise TetherError("invalid_request", f"unknown kind {kind!r}")


class Harness:
    """A ChannelServer on a short socket path that hands over each accepted channel."""

    def __init__(self, path: str, handler: Handler = echo, **kw: Any) -> None:
        self.path = path
        self._accepted: asyncio.Queue[Channel] = asyncio.Queue()
        self.server = ChannelServer(path, lambda _: handler, on_channel=self._on_channel, **kw)

    async def _on_channel(self, channel: Channel) -> None:
        await self._accepted.put(channel)

    async def accepted(self) -> Channel:
        async with asyncio.timeout(BOUND):
            return await self._accepted.get()

    async def connect(self, handler: Handler = echo, **kw: Any) -> Channel:
        return await connect(self.path, handler, **kw)


@pytest.fixture
def socket_path(short_tmp: Path) -> str:
    return str(short_tmp / "c.sock")


@pytest.fixture
async def harness(socket_path: str) -> AsyncIterator[Harness]:
    harness = Harness(socket_path)
    await harness.server.start()
    try:
        yield harness
    finally:
        await harness.server.close()


@pytest.fixture
async def client(harness: Harness) -> AsyncIterator[Channel]:
    channel = await harness.connect()
    try:
        yield channel
    finally:
        await channel.close()


@contextlib.asynccontextmanager
async def raw_connection(
    path: str,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A bare socket to a server, for sending bytes no Channel would send."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def raw_server(
    path: str, serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
) -> AsyncIterator[None]:
    """A bare Unix server whose connections `serve` handles, then closes."""
    done: list[asyncio.Task[Any]] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        done.append(task)
        try:
            await serve(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_unix_server(on_connect, path=path)
    try:
        yield
    finally:
        server.close()
        await asyncio.gather(*done, return_exceptions=True)
        await server.wait_closed()


async def eventually(condition: Callable[[], bool]) -> None:
    """Wait, with a bound, until `condition()` holds."""
    async with asyncio.timeout(BOUND):
        while not condition():  # noqa: ASYNC110 - a bounded poll of state we do not own
            await asyncio.sleep(0.005)


# -- calls both ways ------------------------------------------------------------------


async def test_a_worker_request_gets_the_coordinators_reply(client: Channel) -> None:
    body = {"n": 1, "blob": b"\x00\x01", "list": [1.5, None, True, "x"]}
    assert await client.request("echo", body) == body


async def test_the_coordinator_can_call_the_worker_on_the_same_channel(
    harness: Harness, client: Channel
) -> None:
    coordinator_side = await harness.accepted()
    assert await coordinator_side.request("echo", "to the worker") == "to the worker"
    assert await client.request("echo", "to the coordinator") == "to the coordinator"


async def test_handler_factory_gives_each_connection_its_own_state(socket_path: str) -> None:
    def factory(channel: Channel) -> Handler:
        async def whoami(kind: str, body: Any) -> Any:
            return channel.name

        return whoami

    server = ChannelServer(socket_path, factory, name="coord")
    await server.start()
    first = await connect(socket_path, echo)
    second = await connect(socket_path, echo)
    try:
        names = {await first.request("whoami"), await second.request("whoami")}
        assert names == {"coord#1", "coord#2"}
    finally:
        await first.close()
        await second.close()
        await server.close()


async def test_byte_counters_match_on_both_ends(harness: Harness, client: Channel) -> None:
    coordinator_side = await harness.accepted()
    await client.request("echo", "x" * 1000)
    assert client.bytes_sent == coordinator_side.bytes_received > 1000
    assert coordinator_side.bytes_sent == client.bytes_received > 1000


# -- errors ---------------------------------------------------------------------------


async def test_an_error_reply_keeps_status_code_and_detail(client: Channel) -> None:
    with pytest.raises(RemoteError) as caught:
        await client.request("refuse")
    assert caught.value.code == "invalid_phase"
    assert caught.value.status == 409
    assert caught.value.detail == "not in this phase"
    assert caught.value.body() == {"code": "invalid_phase", "detail": "not in this phase"}


async def test_an_error_reply_keeps_the_errors_extra_body_fields(client: Channel) -> None:
    with pytest.raises(RemoteError) as caught:
        await client.request("lost")
    assert caught.value.status == 404
    assert caught.value.body() == {
        "code": "session_lost",
        "detail": "not held here",
        "failure_kind": "session_lost",
    }


async def test_a_relayed_remote_error_keeps_its_status(client: Channel) -> None:
    with pytest.raises(RemoteError) as caught:
        await client.request("relay")
    assert (caught.value.status, caught.value.code) == (503, "internal_error")
    assert caught.value.detail == "from further away"


async def test_an_unexpected_exception_is_a_500_and_the_channel_stays_up(client: Channel) -> None:
    with capture_logs() as logs, pytest.raises(RemoteError) as caught:
        await client.request("crash")
    assert (caught.value.status, caught.value.code, caught.value.detail) == (
        500,
        "internal_error",
        "kaput",
    )
    assert any(entry["event"] == "channel_handler_failed" for entry in logs)
    assert await client.request("echo", 1) == 1


async def test_a_reply_that_cannot_be_encoded_becomes_a_500(client: Channel) -> None:
    with capture_logs(), pytest.raises(RemoteError) as caught:
        await client.request("unencodable")
    assert (caught.value.status, caught.value.code) == (500, "internal_error")
    assert await client.request("echo", 2) == 2


async def test_a_request_that_cannot_be_encoded_fails_only_that_call(client: Channel) -> None:
    from tether.coordinator.framing import FrameError

    with pytest.raises(FrameError):
        await client.request("echo", object())
    assert client.pending_calls == 0
    assert await client.request("echo", 3) == 3


# -- concurrency and ordering -------------------------------------------------------------


async def test_concurrent_requests_are_matched_to_their_own_replies(socket_path: str) -> None:
    count = 20
    gates = [asyncio.Event() for _ in range(count)]
    started: list[int] = []

    async def gated(kind: str, body: Any) -> Any:
        started.append(body)
        await gates[body].wait()
        return body * 10

    harness = Harness(socket_path, gated)
    await harness.server.start()
    client = await harness.connect()
    try:
        calls = [asyncio.create_task(client.request("gated", i)) for i in range(count)]
        await eventually(lambda: len(started) == count)
        assert started == list(range(count))  # handlers start in arrival order
        for gate in reversed(gates):  # and finish in the opposite one
            gate.set()
        async with asyncio.timeout(BOUND):
            assert await asyncio.gather(*calls) == [i * 10 for i in range(count)]
    finally:
        await client.close()
        await harness.server.close()


@pytest.mark.parametrize("direction", ["worker_to_coordinator", "coordinator_to_worker"])
async def test_a_thousand_notifications_arrive_in_order(socket_path: str, direction: str) -> None:
    seen: list[int] = []
    all_seen = asyncio.Event()

    async def record(kind: str, body: Any) -> None:
        seen.append(body)
        if len(seen) == 1000:
            all_seen.set()

    harness = Harness(socket_path, record)
    await harness.server.start()
    client = await harness.connect(record)
    try:
        sender = client if direction == "worker_to_coordinator" else await harness.accepted()
        for n in range(1000):
            await sender.notify("note", n)
        async with asyncio.timeout(BOUND):
            await all_seen.wait()
        assert seen == list(range(1000))
    finally:
        await client.close()
        await harness.server.close()


async def test_a_reply_reaches_its_caller_before_a_later_message_is_handled(
    socket_path: str,
) -> None:
    events: list[str] = []

    def factory(channel: Channel) -> Handler:
        async def coordinator(kind: str, body: Any) -> Any:
            # Sent once this handler has returned and its reply has been written.
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(channel.notify("tables"))
            )
            return "welcome"

        return coordinator

    async def worker(kind: str, body: Any) -> None:
        events.append(kind)

    server = ChannelServer(socket_path, factory)
    await server.start()
    client = await connect(socket_path, worker)
    try:
        assert await client.request("register") == "welcome"
        events.append("welcome")
        await eventually(lambda: len(events) == 2)
        assert events == ["welcome", "tables"]
    finally:
        await client.close()
        await server.close()


# -- malformed input ---------------------------------------------------------------------

BAD_FRAMES = [
    pytest.param((1024**3).to_bytes(4, "big"), id="length-over-the-limit"),
    pytest.param(b"\x00\x00\x00\x01\xc1", id="not-msgpack"),
    pytest.param(encode_frame([1, 2, 3]), id="not-a-map"),
    pytest.param(encode_frame({"id": "x", "kind": 1}), id="wrong-shape"),
    pytest.param(encode_frame(Reply(999, "hi").to_wire()), id="reply-to-an-unsent-request"),
]


@pytest.mark.parametrize("frame", BAD_FRAMES)
async def test_a_malformed_frame_closes_only_that_connection(
    harness: Harness, client: Channel, frame: bytes
) -> None:
    await harness.accepted()
    with capture_logs() as logs:
        async with raw_connection(harness.path) as (reader, writer):
            bad_side = await harness.accepted()
            writer.write(frame)
            await writer.drain()
            async with asyncio.timeout(BOUND):
                assert await reader.read() == b""  # the server hung up on us
                await bad_side.wait_closed()
    assert any(entry["event"] == "channel_malformed_frame" for entry in logs)
    await eventually(lambda: len(harness.server.channels) == 1)
    assert await client.request("echo", "still served") == "still served"
    fresh = await harness.connect()
    try:
        assert await fresh.request("echo", "new ones too") == "new ones too"
    finally:
        await fresh.close()


async def test_a_malformed_frame_from_the_peer_fails_pending_calls(socket_path: str) -> None:
    async def answer_with_garbage(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.read(1)
        writer.write(b"\x00\x00\x00\x02\xc1\xc1")
        await reader.read()

    async with raw_server(socket_path, answer_with_garbage):
        client = await connect(socket_path, echo, default_timeout=60)
        try:
            with capture_logs() as logs:
                async with asyncio.timeout(BOUND):
                    with pytest.raises(ChannelLost, match="malformed frame"):
                        await client.request("echo", 1)
            assert any(entry["event"] == "channel_malformed_frame" for entry in logs)
            assert client.closed
        finally:
            await client.close()


async def test_a_late_reply_after_a_timeout_is_logged_and_ignored(socket_path: str) -> None:
    gate = asyncio.Event()

    async def slow(kind: str, body: Any) -> Any:
        if kind == "slow":
            await gate.wait()
        return kind

    harness = Harness(socket_path, slow)
    await harness.server.start()
    client = await harness.connect()
    try:
        with capture_logs() as logs:
            with pytest.raises(TimeoutError):
                await client.request("slow", timeout=0.05)
            gate.set()
            await eventually(
                lambda: any(entry["event"] == "channel_late_reply_ignored" for entry in logs)
            )
        assert not client.closed
        assert await client.request("fast") == "fast"
    finally:
        await client.close()
        await harness.server.close()


# -- timeouts and lost peers -----------------------------------------------------------


async def test_a_call_times_out_and_leaves_nothing_pending(client: Channel) -> None:
    with pytest.raises(TimeoutError, match="no reply to 'hang'"):
        await client.request("hang", timeout=0.05)
    assert client.pending_calls == 0
    assert await client.request("echo", 4) == 4


async def test_the_default_timeout_applies_when_none_is_given(harness: Harness) -> None:
    client = await harness.connect(default_timeout=0.05)
    try:
        async with asyncio.timeout(BOUND):
            with pytest.raises(TimeoutError):
                await client.request("hang")
        assert client.pending_calls == 0
    finally:
        await client.close()


@pytest.mark.parametrize("how", ["eof", "reset"])
async def test_a_peer_that_vanishes_mid_call_fails_it_at_once(socket_path: str, how: str) -> None:
    async def vanish_after_the_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.read(1)
        if how == "reset":
            writer.transport.abort()

    async with raw_server(socket_path, vanish_after_the_request):
        client = await connect(socket_path, echo, default_timeout=60)
        try:
            async with asyncio.timeout(BOUND):
                with pytest.raises(ChannelLost):
                    await client.request("echo", 1)
                await client.wait_closed()
            assert client.closed
            with pytest.raises(ChannelLost):
                await client.notify("after")
        finally:
            await client.close()


async def test_a_killed_worker_process_fails_the_coordinators_call_at_once(
    harness: Harness,
) -> None:
    worker = textwrap.dedent(
        f"""
        import asyncio
        from tether.coordinator.channel import connect

        async def hang(kind, body):
            await asyncio.Event().wait()

        async def main():
            channel = await connect({harness.path!r}, hang)
            await channel.notify("ready")
            await asyncio.Event().wait()

        asyncio.run(main())
        """
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", worker, cwd=PROJECT)
    try:
        coordinator_side = await harness.accepted()
        call = asyncio.create_task(coordinator_side.request("export", timeout=60))
        await eventually(lambda: coordinator_side.bytes_sent > 0)
        process.kill()
        async with asyncio.timeout(BOUND):
            with pytest.raises(ChannelLost):
                await call
            await coordinator_side.wait_closed()
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def test_a_worker_that_closes_fails_the_coordinators_pending_calls(
    harness: Harness,
) -> None:
    client = await harness.connect()
    coordinator_side = await harness.accepted()
    call = asyncio.create_task(coordinator_side.request("hang", timeout=60))
    await eventually(lambda: client.bytes_received > 0)
    await client.close()
    async with asyncio.timeout(BOUND):
        with pytest.raises(ChannelLost):
            await call
    await eventually(lambda: not harness.server.channels)


# -- closing -----------------------------------------------------------------------------


async def test_close_is_idempotent_and_fails_pending_calls(harness: Harness) -> None:
    client = await harness.connect()
    call = asyncio.create_task(client.request("hang", timeout=60))
    await eventually(lambda: client.pending_calls == 1)
    await client.close()
    await client.close()
    assert client.closed
    with pytest.raises(ChannelLost):
        await call
    with pytest.raises(ChannelLost):
        await client.request("echo")
    async with asyncio.timeout(BOUND):
        await client.wait_closed()


async def test_closing_everything_leaves_no_task_and_no_socket_file(socket_path: str) -> None:
    handler_cancelled = asyncio.Event()

    async def hang(kind: str, body: Any) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            handler_cancelled.set()

    harness = Harness(socket_path, hang)
    await harness.server.start()
    clients = [await harness.connect(hang) for _ in range(3)]
    for _ in clients:
        await harness.accepted()
    await clients[0].notify("busy")  # leaves a handler running on the coordinator side
    await eventually(lambda: any(ch.bytes_received for ch in harness.server.channels))
    await harness.server.close()
    await harness.server.close()
    assert handler_cancelled.is_set()
    assert not harness.server.channels
    assert not socket_file_exists(socket_path)
    for client in clients:
        async with asyncio.timeout(BOUND):
            await client.wait_closed()  # the server hung up on every worker
        await client.close()
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_handler_may_close_its_own_channel(socket_path: str) -> None:
    def factory(channel: Channel) -> Handler:
        async def bye(kind: str, body: Any) -> None:
            await channel.close()

        return bye

    server = ChannelServer(socket_path, factory)
    await server.start()
    client = await connect(socket_path, echo)
    try:
        with pytest.raises(ChannelLost):
            await client.request("bye", timeout=BOUND)
        await eventually(lambda: not server.channels)
    finally:
        await client.close()
        await server.close()


async def test_a_failing_on_channel_closes_only_that_connection(socket_path: str) -> None:
    calls = 0

    async def on_channel(channel: Channel) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("setup failed")

    server = ChannelServer(socket_path, lambda _: echo, on_channel=on_channel)
    await server.start()
    try:
        with capture_logs() as logs:
            first = await connect(socket_path, echo)
            async with asyncio.timeout(BOUND):
                await first.wait_closed()
            await first.close()
        assert any(entry["event"] == "channel_setup_failed" for entry in logs)
        second = await connect(socket_path, echo)
        try:
            assert await second.request("echo", "ok") == "ok"
        finally:
            await second.close()
    finally:
        await server.close()


# -- the socket file ---------------------------------------------------------------------


async def test_the_socket_file_is_owner_only(harness: Harness) -> None:
    mode = os.stat(harness.path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


async def test_a_stale_socket_file_is_replaced(socket_path: str) -> None:
    # A crashed coordinator leaves its socket file behind, with nobody listening on it.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as crashed:
        crashed.bind(socket_path)
    second = ChannelServer(socket_path, lambda _: echo)
    await second.start()
    try:
        client = await connect(socket_path, echo)
        assert await client.request("echo", 5) == 5
        await client.close()
    finally:
        await second.close()


async def test_a_live_socket_is_not_taken_over(harness: Harness) -> None:
    with pytest.raises(OSError, match="already served"):
        await ChannelServer(harness.path, lambda _: echo).start()
    client = await harness.connect()
    try:
        assert await client.request("echo", 6) == 6
    finally:
        await client.close()


async def test_a_notification_gets_no_reply(harness: Harness) -> None:
    async with raw_connection(harness.path) as (reader, writer):
        writer.write(encode_frame(Notification("echo", "quiet").to_wire()))
        writer.write(encode_frame({"id": 1, "kind": "echo", "body": "loud"}))
        await writer.drain()
        async with asyncio.timeout(BOUND):
            header = await reader.readexactly(4)
            body = await reader.readexactly(int.from_bytes(header, "big"))
        assert msgpack.unpackb(body) == {"reply_to": 1, "ok": True, "body": "loud"}
