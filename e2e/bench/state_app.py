"""The checkpoint benchmark's app: many sessions and many parked episodes, made cheaply.

Serve it with ``tether serve e2e.bench.state_app:app --workers 1 --checkpoint-root DIR
--name bench``; `e2e/bench/checkpoint.py` drives it. It holds its session states in a
dict registered with its participant, like any app, and adds bench-only routes:

    POST /bench/sessions {"n", "size", "start"?}
                                         create sessions s-<start> ... s-<start+n-1> (start
                                         0 by default), each state `make_state(i, size)`
                                         (about `size` bytes packed), straight into the
                                         session dict (no request each)
    POST /bench/episodes {"n", "size", "step_ms", "start"?}
                                         start n background episodes e-<start> ...
                                         (attempt 1) through `participant.episode()`; each
                                         calls `boundary(state)` every `step_ms`, at phases
                                         spread over one step, so it parks at its next
                                         boundary once a checkpoint opens
    GET  /bench/digest                   this worker's sessions: `digest`, sha256 over
                                         every session's ID and packed state in ID order;
                                         `sum`, the sum mod 2**256 of each session's own
                                         sha256 (order-independent, so the sums of several
                                         workers add up to the sum of their union)
    POST /bench/parks                    when each episode parked since the last call
                                         (CLOCK_MONOTONIC, comparable across processes),
                                         then forgets them
    GET  /bench/tables                   the size of this worker's routing tables (the
                                         placed-session and owner-alias tables a restore
                                         loads): entries, and bytes by `sys.getsizeof`
    GET  /health                         {"ok": true}

With `tether serve --workers N` a request reaches a chosen worker with the
`x-tether-worker` header; `start` keeps IDs unique when several workers are filled.

The episodes are tasks inside the app rather than 10,000 concurrent HTTP `/run` requests:
they go through the same `episode()`/`boundary()` calls a `/run` handler makes, while
10,000 open connections from one client on two cores would mostly time the client and
uvicorn's connection handling. The bench routes are for the benchmark only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import random
import string
import sys
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgpack
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether import Participant, SessionKind, declare, declare_participant, in_process

STATE_VERSION = "bench/1"
DIGEST_MODULUS = 1 << 256
TOKENS = 32
_POOL = "".join(random.Random(20261129).choices(string.ascii_letters + string.digits, k=1 << 16))


def session_id(index: int) -> str:
    return f"s-{index:07d}"


def episode_id(index: int) -> str:
    return f"e-{index:05d}"


@functools.cache
def _overhead() -> int:
    """Packed bytes of a state around its text (the text's own length excluded)."""
    return len(msgpack.packb(_state(0, "")))


def _state(index: int, text: str) -> dict[str, Any]:
    return {
        "step": index,
        "score": index / 7.0,
        "tokens": [(index * 31 + k * 17) & 0xFFFF for k in range(TOKENS)],
        "text": text,
    }


def make_state(index: int, size: int) -> dict[str, Any]:
    """A deterministic state of about `size` bytes packed: a few scalars, a list of small
    ints and an ASCII text (the benchmark builds the very same values for its baseline)."""
    length = min(max(size - _overhead(), 0), len(_POOL) // 2)
    start = (index * 7919) % (len(_POOL) - length)
    return _state(index, _POOL[start : start + length])


def session_record(index: int, size: int) -> dict[str, Any]:
    """The record tether writes for session `index` on a server without routing."""
    return {
        "kind": "session",
        "id": session_id(index),
        "open": True,
        "owner": None,
        "state": make_state(index, size),
    }


def episode_record(index: int, size: int, step: int = 1) -> dict[str, Any]:
    """The record of episode `index` parked after `step` steps of attempt 1."""
    state = make_state(index, size)
    state["step"] = step
    return {"kind": "episode", "episode_id": episode_id(index), "attempt": 1, "state": state}


def summed_digest(sums: Iterable[str]) -> str:
    """The `sum` of several workers' `/bench/digest`: that of their sessions' union."""
    return f"{sum(int(value, 16) for value in sums) % DIGEST_MODULUS:064x}"


def routing_tables_size() -> dict[str, Any]:
    """The placed-session and owner-alias tables of this process's router, measured.

    The worker's router keeps them on `TetherWorker.routing.tables`, which the app cannot
    reach, so this finds the worker among the collector's objects (bench-only). `bytes`
    is `sys.getsizeof` of both dicts, of every key and of each distinct value once (the
    worker shares one string per worker ID): what the tables keep, allocator rounding
    and the file's transient load aside. None outside `tether serve --workers N`.
    """
    kind = getattr(sys.modules.get("tether.coordinator.worker"), "TetherWorker", None)
    found = [o for o in gc.get_objects() if type(o) is kind] if kind is not None else []
    if len(found) != 1:
        names = ("placed_sessions", "owner_aliases", "bytes", "placed_bytes")
        return dict.fromkeys((*names, "placed_dict_bytes", "placed_key_bytes"))
    tables = found[0].routing.tables
    placed, aliases = tables.placed, tables.aliases
    placed_bytes = _dict_bytes(placed)
    return {
        "placed_sessions": len(placed),
        "owner_aliases": len(aliases),
        "bytes": sum(placed_bytes) + sum(_dict_bytes(aliases)),
        "placed_bytes": sum(placed_bytes),
        "placed_dict_bytes": placed_bytes[0],
        "placed_key_bytes": placed_bytes[1],
    }


def _dict_bytes(table: Any) -> tuple[int, int, int]:
    """The dict itself, its keys, its distinct values."""
    values = {id(v): sys.getsizeof(v) for v in table.values()}
    keys = sum(sys.getsizeof(k) for k in table)
    return sys.getsizeof(table), keys, sum(values.values())


class States:
    """The sessions this worker holds (the app's `SessionState`)."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}

    def sessions(self) -> Iterable[str]:
        return self.states.keys()

    def holds(self, session_id: str) -> bool:
        return session_id in self.states

    def export(self, session_id: str) -> Any:
        return self.states[session_id]

    async def install(self, session_id: str, state: Any) -> None:
        self.states[session_id] = state

    async def release(self, session_id: str) -> None:
        self.states.pop(session_id, None)

    def busy(self, session_id: str) -> bool:
        return False


def create_app() -> Starlette:
    """A fresh bench app with its own participant."""
    participant = Participant(state_version=STATE_VERSION)
    states = States()
    participant.register_sessions(states)
    tasks: set[asyncio.Task[None]] = set()
    parks: list[float] = []

    async def run_episode(
        index: int, size: int, step_s: float, phase_s: float, entered: asyncio.Queue[int]
    ) -> None:
        async with participant.episode(episode_id(index), 1) as episode:
            entered.put_nowait(index)
            state = make_state(index, size)
            step = 0
            await asyncio.sleep(phase_s)
            while True:
                step += 1
                state["step"] = step
                if participant.admission_closed:
                    parks.append(time.monotonic())
                await episode.boundary(state)
                await asyncio.sleep(step_s)

    async def bulk_sessions(request: Request) -> JSONResponse:
        body = await request.json()
        n, size, start = int(body["n"]), int(body["size"]), int(body.get("start", 0))
        for index in range(start, start + n):
            states.states[session_id(index)] = make_state(index, size)
        return JSONResponse({"sessions": len(states.states)})

    async def start_episodes(request: Request) -> JSONResponse:
        body = await request.json()
        n, size, step_s = int(body["n"]), int(body["size"]), float(body["step_ms"]) / 1000
        start = int(body.get("start", 0))
        entered: asyncio.Queue[int] = asyncio.Queue()
        for index in range(start, start + n):
            phase_s = step_s * (index - start) / n
            task = asyncio.create_task(run_episode(index, size, step_s, phase_s, entered))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for _ in range(n):  # every one has entered its episode
            await entered.get()
        return JSONResponse({"episodes": len(participant.episodes)})

    async def digest(request: Request) -> JSONResponse:
        hasher = hashlib.sha256()
        packer = msgpack.Packer(use_bin_type=True)
        total = 0
        for key in sorted(states.states):
            packed = packer.pack([key, states.states[key]])
            hasher.update(packed)
            total += int.from_bytes(hashlib.sha256(packed).digest(), "big")
        return JSONResponse(
            {
                "sessions": len(states.states),
                "digest": hasher.hexdigest(),
                "sum": f"{total % DIGEST_MODULUS:064x}",
            }
        )

    async def take_parks(request: Request) -> JSONResponse:
        taken = sorted(parks)
        parks.clear()
        return JSONResponse(
            {
                "parks": len(taken),
                "first": taken[0] if taken else None,
                "last": taken[-1] if taken else None,
            }
        )

    async def tables(request: Request) -> JSONResponse:
        return JSONResponse(routing_tables_size())

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app = Starlette(
        routes=[
            Route("/bench/sessions", bulk_sessions, methods=["POST"]),
            Route("/bench/episodes", start_episodes, methods=["POST"]),
            Route("/bench/digest", digest, methods=["GET"]),
            Route("/bench/parks", take_parks, methods=["POST"]),
            Route("/bench/tables", tables, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    # The bench fills its sessions in bulk; a request would name one in this header.
    kind = SessionKind(header="x-bench-session", token_header=None)
    declare(app, kind)
    declare_participant(app, participant)
    return app


app = in_process(create_app())
