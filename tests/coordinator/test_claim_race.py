"""A claim the coordinator answers reaches its worker before the next close (SPEC 5.8,
5.11): an episode claimed as a prepare starts is waited for and exported exactly once.

Composed in-process from the real pieces of `tether serve --workers 2`: the coordinator
with its `ChannelFleet` and `Checkpointer` behind a `ChannelServer` on a Unix socket, and
two `TetherWorker`s (the episodes example app, its participant, the router, the control
API), each served by uvicorn on 127.0.0.1 and registered over the channel by its own
lifespan. Nothing of tether is replaced. The test decides two moments, no more:

- the controller's prepare starts at the instant the coordinator answers the claim (the
  coordinator's handler is composed with a step that starts it, before the answer is
  written), so the close travels right behind the answer on the same channel;
- the loop's default executor holds back the claimed record's read (`Held.load`) until the
  test lets it go, as a record of many MiB would take long to read; so the close reaches
  the worker while its request is between the claim's answer and its first boundary,
  every time, not when the timing happens to fall that way.

The second test is the coordinator's half on its own: swept over every interleaving of one
claim with one close, a granted claim's answer always reaches the worker first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import httpx
import uvicorn

from tests.checkpoint.conftest import eventually
from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.participant import Held, Participant
from tether.checkpoint.segments import IndexEntry, read_index
from tether.checkpoint.store import read_manifest_digest, write_checkpoint_json
from tether.coordinator.apps import resolve_kind
from tether.coordinator.channel import Channel, ChannelServer, Handler, RemoteError, connect
from tether.coordinator.coordinator import Coordinator
from tether.coordinator.fleet import ChannelFleet
from tether.coordinator.runtime import COORDINATOR_SOCKET
from tether.coordinator.worker import TetherWorker, WorkerSettings
from tether.examples import counter, episodes
from tether.routing.types import WorkerId, new_worker_id

P = ParamSpec("P")
T = TypeVar("T")

TOKEN = "claim-race-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NAME = "episodes"
EPISODE = "e1"
STEPS = 20
STEP_MS = 10
SHORT_DEADLINE_S = 0.5
MOST_YIELDS = 30
"""Loop turns between a claim and a close, swept from 0 (the close goes first) up."""
BOUND = 10.0
"""Every wait here is bounded by this; nothing should come close."""
GRACE_S = 1


class HeldReads(ThreadPoolExecutor):
    """The loop's default executor, holding back each call of `function` run through
    `asyncio.to_thread` until `release` is set: a read that takes as long as the test
    needs. Everything else runs at once."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__(thread_name_prefix="held-reads")
        self.function = function
        self.requested = threading.Event()
        self.release = threading.Event()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        if not self._holds(fn):
            return super().submit(fn, *args, **kwargs)
        self.requested.set()

        def held_back() -> T:
            self.release.wait(BOUND)
            return fn(*args, **kwargs)

        return super().submit(held_back)

    def _holds(self, fn: object) -> bool:
        # asyncio.to_thread(f) submits functools.partial(context.run, f, ...).
        if not isinstance(fn, functools.partial) or not fn.args:
            return False
        called = fn.args[0]
        return called is self.function or getattr(called, "__func__", None) is self.function


@dataclass
class Worker:
    """One worker of an in-process server, served by uvicorn on its own port."""

    worker: TetherWorker
    server: uvicorn.Server
    listener: socket.socket
    url: str
    http: httpx.AsyncClient

    @property
    def id(self) -> WorkerId:
        return self.worker.id

    @property
    def participant(self) -> Participant:
        return self.worker.participant

    async def run(self, attempt: int) -> httpx.Response:
        body = {"episode_id": EPISODE, "attempt": attempt, "steps": STEPS, "step_ms": STEP_MS}
        return await self.http.post("/run", json=body)

    async def ok(self, route: str, **body: Any) -> Any:
        """A control call through this worker (relayed to the coordinator); must be 200."""
        reply = await self.http.post(f"/_tether/{route}", json=body, headers=AUTH)
        assert reply.status_code == 200, (route, body, reply.status_code, reply.text[:500])
        return reply.json()

    async def stop(self) -> None:
        await self.http.aclose()
        await self.server.shutdown(sockets=[self.listener])
        self.listener.close()


@dataclass
class Server:
    """`tether serve examples.episodes:app --workers 2`, composed in one event loop."""

    runtime_dir: Path
    root: Path
    coordinator: Coordinator
    checkpointer: Checkpointer
    channels: ChannelServer = field(init=False)
    workers: list[Worker] = field(default_factory=list)
    on_claim_answered: Callable[[], None] | None = None
    """Run once, at the instant the coordinator answers a claim with a held record."""
    stopped: bool = False

    @property
    def fleet(self) -> ChannelFleet:
        assert self.coordinator.fleet is not None
        return self.coordinator.fleet

    def handler_for(self, channel: Channel) -> Handler:
        """The coordinator's own handler, and `on_claim_answered` right as it answers."""
        handle = self.coordinator.handler_for(channel)

        async def handle_and_act(kind: str, body: Any) -> Any:
            answer = await handle(kind, body)
            if kind == "claim_episode" and answer is not None and self.on_claim_answered:
                act, self.on_claim_answered = self.on_claim_answered, None
                act()
            return answer

        return handle_and_act

    async def checkpoint(self, checkpoint_id: str, via: Worker) -> dict[str, Any]:
        """commit → CHECKPOINT.json (the controller's part) → resume; the manifest."""
        manifest: dict[str, Any] = await via.ok("commit", checkpoint_id=checkpoint_id)
        digest = read_manifest_digest(self.root, checkpoint_id, NAME)
        entry = {"name": NAME, "url": via.url, "manifest_digest": digest}
        write_checkpoint_json(self.root, checkpoint_id, [entry], None, None)  # type: ignore[list-item]
        await via.ok("resume", checkpoint_id=checkpoint_id)
        return manifest

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.coordinator.stopping = True
        for worker in self.workers:
            await worker.stop()
        await self.channels.close()
        await self.checkpointer.stop()


@contextlib.asynccontextmanager
async def started() -> AsyncIterator[tuple[list[Server], list[asyncio.Task[Any]]]]:
    """The servers and requests a test starts (it appends them), stopped and cancelled
    however the test ends."""
    servers: list[Server] = []
    pending: list[asyncio.Task[Any]] = []
    try:
        yield servers, pending
    finally:
        for server in servers:
            await server.stop()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def start_server(
    base: Path, root: Path, label: str, app: str = "tether.examples.episodes:app"
) -> Server:
    runtime_dir = base / label
    runtime_dir.mkdir(mode=0o700)
    for sub in ("w", "claims"):
        (runtime_dir / sub).mkdir(mode=0o700)
    coordinator = Coordinator(2, NAME, str(root))
    coordinator.fleet = ChannelFleet(coordinator, str(runtime_dir))
    checkpointer = Checkpointer(coordinator.fleet, name=NAME, root=str(root))
    coordinator.checkpointer = checkpointer
    checkpointer.start()
    server = Server(runtime_dir, root, coordinator, checkpointer)
    server.channels = ChannelServer(
        runtime_dir / COORDINATOR_SOCKET, server.handler_for, on_channel=coordinator.on_channel
    )
    await server.channels.start()
    settings = WorkerSettings(
        app=app,
        runtime_dir=str(runtime_dir),
        workers=2,
        fd=-1,
        token=TOKEN,
        name=NAME,
        checkpoint_root=str(root),
    )
    for _ in range(2):
        server.workers.append(await _start_worker(settings))
    assert sorted(coordinator.links) == sorted(w.id for w in server.workers)
    return server


async def _start_worker(settings: WorkerSettings) -> Worker:
    app = (counter if settings.app.startswith("tether.examples.counter") else episodes).create_app()
    worker = TetherWorker(app, resolve_kind(app, None, None), settings)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    config = uvicorn.Config(
        worker,
        lifespan="on",
        access_log=False,
        log_config=None,
        http="httptools",
        interface="asgi3",
        timeout_graceful_shutdown=GRACE_S,
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    worker.server = server
    await server.startup(sockets=[listener])  # the lifespan registers with the coordinator
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3 * BOUND))
    return Worker(worker, server, listener, url, http)


def episode_entries(
    root: Path, checkpoint_id: str, manifest: dict[str, Any]
) -> list[tuple[str, IndexEntry]]:
    """Every episode record of `EPISODE` in the committed segments, with its worker."""
    directory = root / checkpoint_id / NAME
    return [
        (segment["worker"], entry)
        for segment in manifest["segments"]
        for entry in read_index(directory / segment["file"])
        if entry.kind == "episode" and entry.id == EPISODE
    ]


async def restored_after_attempt_1(
    base: Path, root: Path, servers: list[Server]
) -> tuple[Server, int]:
    """Checkpoint c1 with attempt 1 parked at a boundary, stop that server, and restore c1
    on a fresh one (its coordinator holds the record by location). The fresh server and
    the step attempt 1 parked at."""
    first = await start_server(base, root, "r1")
    servers.append(first)
    a = first.workers[0]
    running = asyncio.create_task(a.run(1))
    try:
        await eventually(
            lambda: (EPISODE, 1) in a.participant.episodes, BOUND, "attempt 1 runs"
        )
        prepared = await a.ok("prepare", checkpoint_id="c1", deadline_s=BOUND)
        assert prepared["state"] == "prepared", prepared
        parked_at: int = a.participant.episodes[(EPISODE, 1)].state["step"]
        assert 0 < parked_at < STEPS - 1, parked_at
        await first.checkpoint("c1", via=a)
        assert (await running).json()["steps_done"] == STEPS
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    await first.stop()
    second = await start_server(base, root, "r2")
    servers.append(second)
    restored = await second.workers[1].ok("restore", checkpoint_id="c1", deadline_s=BOUND)
    assert restored["held_episodes"] == [{"episode_id": EPISODE, "attempt_to_send": 2}]
    await second.workers[1].ok("resume", checkpoint_id="c1")
    return second, parked_at


async def test_an_episode_claimed_as_a_prepare_starts_is_waited_for_and_exported_once(
    short_tmp: Path,
) -> None:
    """Attempt 2 claims a restored record on worker A; the prepare starts as the claim is
    answered and the close reaches A while the record is still being read. The prepare
    must wait for the episode (blocked on it at a short deadline, prepared once it parks),
    the commit must hold it once, from A, and a restore of that commit continues it."""
    loads = HeldReads(Held.load)  # the runner shuts the loop's default executor down
    asyncio.get_running_loop().set_default_executor(loads)
    root = short_tmp / "ckpt"
    async with started() as (servers, pending):
        try:
            second, parked_at = await restored_after_attempt_1(short_tmp, root, servers)
            a, b = second.workers

            # Attempt 2 claims it on worker A; the prepare of c2 starts as the claim is answered.
            prepares: list[asyncio.Task[Any]] = []

            def prepare_now() -> None:
                call = {"checkpoint_id": "c2", "deadline_s": SHORT_DEADLINE_S}
                prepares.append(asyncio.create_task(second.checkpointer.call("prepare", call)))

            second.on_claim_answered = prepare_now
            running = asyncio.create_task(a.run(2))
            pending.append(running)
            await eventually(lambda: prepares, BOUND, "the coordinator answered the claim")
            pending.extend(prepares)
            assert second.fleet.held[EPISODE].claimed_by == a.id
            await eventually(loads.requested.is_set, BOUND, "worker A reads the claimed record")
            await eventually(
                lambda: a.participant.admission_closed, BOUND, "the close reached worker A"
            )
            # The premise: the close reached A while its request had the claim's answer and
            # was still reading the record, so the app has not run a step of attempt 2.
            assert not any(e.boundaries for e in a.participant.episodes.values())

            first_answer = await prepares[0]
            episode = a.participant.episodes.get((EPISODE, 2))
            now = "absent" if episode is None else "parked" if episode.parked else "stepping"
            assert first_answer["state"] == "blocked", (
                "prepare answered prepared without waiting for the episode worker A claimed: "
                f"{first_answer}; A's attempt 2 is {now} (the record was still being read)"
            )
            assert [(x["kind"], x["worker"], x["id"]) for x in first_answer["blockers"]] == [
                ("episode_running", a.id, EPISODE)
            ], first_answer

            # Once the record is read, the request runs one step and parks; only then prepared.
            loads.release.set()
            prepared = await b.ok("prepare", checkpoint_id="c2", deadline_s=BOUND)
            assert prepared["state"] == "prepared", prepared
            episode = a.participant.episodes[(EPISODE, 2)]
            assert episode.parked
            assert episode.state["step"] == parked_at + 1
            manifest = await second.checkpoint("c2", via=b)

            # Exported once, by the worker running it; the coordinator carried nothing.
            assert [(worker, e.attempt) for worker, e in episode_entries(root, "c2", manifest)] == [
                (a.id, 2)
            ]
            assert manifest["records"]["episodes"] == 1
            done = (await running).json()
            assert (done["attempt"], done["resumed_from"], done["steps_done"]) == (
                2,
                parked_at,
                STEPS,
            )
            await second.stop()

            # Restoring c2 expects attempt 3, which continues where c2 parked attempt 2.
            third = await start_server(short_tmp, root, "r3")
            servers.append(third)
            a, b = third.workers
            restored = await a.ok("restore", checkpoint_id="c2", deadline_s=BOUND)
            assert restored["held_episodes"] == [{"episode_id": EPISODE, "attempt_to_send": 3}]
            await a.ok("resume", checkpoint_id="c2")
            done = (await b.run(3)).json()
            assert (done["attempt"], done["resumed_from"], done["steps_done"]) == (
                3,
                parked_at + 1,
                STEPS,
            )
        finally:
            loads.release.set()


async def test_a_claim_answer_reaches_its_worker_before_a_close_that_follows_it(
    short_tmp: Path,
) -> None:
    """The coordinator's half, over every interleaving of one claim with one close: a claim
    it handles before the close is answered, and the answer arrives ahead of the close;
    one it handles after is refused and stays held. (The worker here is a bare channel
    that records, as it handles the close, whether its claim had its answer.)"""
    coordinator = Coordinator(1, NAME, None)
    fleet = coordinator.fleet = ChannelFleet(coordinator, str(short_tmp))
    path = short_tmp / COORDINATOR_SOCKET
    channels = ChannelServer(path, coordinator.handler_for, on_channel=coordinator.on_channel)
    await channels.start()
    claim: asyncio.Task[Any] | None = None
    answered_at_close: list[bool] = []

    async def worker(kind: str, body: Any) -> Any:
        if kind == "close_admission":
            assert claim is not None
            answered_at_close.append(claim.done())
        return None

    channel = await connect(path, worker, name="bare-worker")
    try:
        await channel.request("register", {"worker": new_worker_id(), "pid": os.getpid()})
        outcomes: list[str] = []
        for yields in range(MOST_YIELDS + 1):
            episode_id = f"e{yields}"
            entry = ["episode", episode_id, None, 1, 0, 1]
            where = {"path": str(short_tmp / "segment.msgpack"), "entry": entry}
            await channel.request("hand_back", {"episode_id": episode_id, "attempt": 1, **where})
            answered_at_close.clear()
            body = {"episode_id": episode_id, "attempt": 2}
            claim = asyncio.create_task(channel.request("claim_episode", body))
            for _ in range(yields):
                await asyncio.sleep(0)
            await fleet.close_admission()
            await asyncio.wait({claim}, timeout=BOUND)
            refused = claim.exception()
            if refused is not None:
                assert isinstance(refused, RemoteError), refused
                assert refused.code == "checkpoint_parked", refused
                assert len(answered_at_close) == 1
                assert fleet.held[episode_id].claimed_by is None, "refused, yet claimed"
                outcomes.append("refused")
            else:
                assert claim.result()["episode_id"] == episode_id
                assert fleet.held[episode_id].claimed_by is not None
                assert answered_at_close == [True], (
                    f"after {yields} loop turns the close reached the worker before the "
                    "answer to a claim the coordinator had granted"
                )
                outcomes.append("answered")
            await fleet.open_admission()
        assert outcomes[0] == "refused"
        assert outcomes[-1] == "answered"
    finally:
        await channel.close()
        await channels.close()


async def test_a_request_cancelled_while_its_claim_is_answered_hands_the_record_back(
    short_tmp: Path,
) -> None:
    """The coordinator grants attempt 2's claim; the request is cancelled (an app's
    timeout) before the answer reaches it. The record must be held again for attempt 2,
    not stay claimed by a live worker that runs nothing (SPEC 5.8)."""
    root = short_tmp / "ckpt"
    async with started() as (servers, pending):
        second, _ = await restored_after_attempt_1(short_tmp, root, servers)
        a, b = second.workers

        async def attempt_2() -> None:
            async with a.participant.episode(EPISODE, 2):
                raise AssertionError("the claim's answer never reached this request")

        request = asyncio.create_task(attempt_2())
        pending.append(request)
        def cancel_the_request() -> None:  # granted, and the answer in flight
            request.cancel()

        second.on_claim_answered = cancel_the_request
        await asyncio.gather(request, return_exceptions=True)
        assert request.cancelled()
        await eventually(
            lambda: second.fleet.held_episodes() == [{"episode_id": EPISODE,
                                                      "attempt_to_send": 2}],
            BOUND,
            "the granted record is held again",
        )
        done = (await b.run(2)).json()
        assert (done["attempt"], done["steps_done"]) == (2, STEPS)
