"""The controller's Python API (SPEC 7): drive tether servers through checkpoints.

::

    servers = [Server("a", "http://10.0.0.1:8000", token), Server(None, url_b, token)]
    async with Controller(servers, "/data/ckpt") as controller:
        summary = await controller.checkpoint(controller_state={"step": 1200})
        ...
        answers = await controller.restore("latest")

`ServerClient` is one server's control API (SPEC 6), one method per route, on its own
aiohttp session. `Controller` runs the procedures across servers: `checkpoint` (prepare
in order while renewing the prepared ones, commit, write CHECKPOINT.json last, resume in
reverse order), `restore` (dry run everywhere, restore in order, abort the restored ones
on failure, resume in reverse order), and `retire`, `forget`, `status` everywhere.

Every failure is a `ControllerError`; the tree::

    TetherError              routing.errors: a stable code, a detail, an HTTP status
    └── ControllerError      code, detail, status, `server` (its name, or URL if unnamed)
        ├── ControlError     a server answered an error `{code, detail}`: `status` is the
        │                    HTTP status it sent, `code` its code (kept as sent if unknown)
        ├── ServerUnreachable  server_unreachable: no answer (refused, reset, timed out)
        ├── BadAnswer        bad_answer: an answer that is not the control API's JSON
        ├── Blocked          blocked: a prepare answered `blocked`; `blockers`
        └── RestoreFailed    a restore failed on a server and the servers already restored
                             were aborted; code, status and server are the cause's

plus plain `ControllerError` for `root_mismatch`, `name_mismatch` and `no_checkpoint`
(nothing for `latest` to mean). The store's own `TetherError`s (`invalid_checkpoint_id`,
`commit_failed`, `stale_checkpoint`) pass through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from tether.checkpoint.store import (
    CHECKPOINT_NAME,
    ParticipantEntry,
    read_manifest_digest,
    resolve_latest,
    validate_checkpoint_id,
    validate_participant,
    write_checkpoint_json,
)
from tether.routing.errors import ERRORS, TetherError

__all__ = [
    "CONTROLLER_ERRORS",
    "BadAnswer",
    "Blocked",
    "ControlError",
    "Controller",
    "ControllerError",
    "RestoreFailed",
    "Server",
    "ServerClient",
    "ServerUnreachable",
    "new_checkpoint_id",
]

JSON = dict[str, Any]
StrPath = str | os.PathLike[str]

DEFAULT_DEADLINE_S = 60.0
DEFAULT_LEASE_S = 300.0
# An answer can take up to the call's deadline; the margin covers the network and the
# server's own bookkeeping after the deadline (a blocked prepare answers at it).
TIMEOUT_MARGIN_S = 30.0

CONTROLLER_ERRORS: dict[str, tuple[int, str]] = {
    "server_unreachable": (503, "no answer from the server: refused, reset or timed out"),
    "bad_answer": (502, "the server's answer is not the control API's JSON"),
    "blocked": (409, "a prepare answered blocked"),
    "root_mismatch": (409, "the server's checkpoint root is not the controller's"),
    "name_mismatch": (409, "the server's name is missing, repeated or not the configured one"),
}
"""The controller's own codes (failures no server answered), with a nominal status."""


class ControllerError(TetherError):
    """A controller call failed; `server` names the server it concerns (None: no one)."""

    # Wider than the base's `ErrorCode`: a newer server may answer a code this client
    # does not know, and it is kept exactly as sent.
    code: str  # type: ignore[assignment]

    def __init__(
        self, code: str, detail: Any = None, *, server: str | None = None,
        status: int | None = None, **extra: Any,
    ) -> None:
        known = CONTROLLER_ERRORS.get(code) or ERRORS.get(code)  # type: ignore[call-overload]
        self.code = code
        self.detail = detail if detail is not None else (known[1] if known else code)
        self.extra = extra
        self.server = server
        self._status = status if status is not None else (known[0] if known else 500)
        where = f" (server {server})" if server else ""
        Exception.__init__(self, f"{code}{where}: {self.detail}")

    @property
    def status(self) -> int:
        return self._status

    def body(self) -> JSON:
        """`{code, detail, server, status}` and any extra fields, as `tether ctl --json` prints."""
        return {
            "code": self.code, "detail": self.detail, "server": self.server,
            "status": self.status, **self.extra,
        }


class ControlError(ControllerError):
    """A server answered an error `{code, detail}` (extra fields of the answer kept)."""


class ServerUnreachable(ControllerError):
    """No answer: the connection was refused or reset, or the call timed out."""

    def __init__(self, detail: str, *, server: str | None) -> None:
        super().__init__("server_unreachable", detail, server=server)


class BadAnswer(ControllerError):
    """An answer that is not the control API's JSON (a proxy's error page, say)."""

    def __init__(self, detail: str, *, server: str | None, status: int) -> None:
        super().__init__("bad_answer", detail, server=server, status=status)


class Blocked(ControllerError):
    """A prepare answered `blocked`; every server the procedure prepared was resumed."""

    def __init__(self, server: str, answer: JSON) -> None:
        blockers = answer.get("blockers") or []
        total = answer.get("blockers_total", len(blockers))
        super().__init__(
            "blocked", f"server {server} is not ready: {total} blocker(s)", server=server,
            blockers=blockers, blockers_total=total,
        )
        self.blockers: list[JSON] = blockers
        self.blockers_total: int = total


class RestoreFailed(ControllerError):
    """A restore failed on `server`; the servers in `aborted` were restored, then aborted.

    Code, status and server are the cause's (`no_checkpoint`, `corrupt_checkpoint`...).
    """

    def __init__(self, cause: ControllerError, aborted: list[str]) -> None:
        super().__init__(
            cause.code, cause.detail, server=cause.server, status=cause.status,
            aborted=aborted, **cause.extra,
        )
        self.cause = cause
        self.aborted = aborted


# -- one server ------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A server to control: its name (None: ask its status), base URL and control token."""

    name: str | None
    url: str
    token: str = field(repr=False)


class ServerClient:
    """One server's control API (SPEC 6), on one aiohttp session; close it when done.

    Methods return the answer's JSON object and raise `ControlError` for an error
    answer, `ServerUnreachable` when no answer comes, `BadAnswer` for anything else.
    A call times out `TIMEOUT_MARGIN_S` after its deadline (60 s when not given).
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self.name: str | None = server.name
        self._base = server.url.rstrip("/") + "/_tether/"
        self._session: aiohttp.ClientSession | None = None

    @property
    def label(self) -> str:
        """The server's name, or its URL while it has none."""
        return self.name or self.server.url

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session; safe to call more than once."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def status(self) -> JSON:
        """`GET /_tether/status`."""
        return await self._call("GET", "status", None, None)

    async def prepare(
        self, checkpoint_id: str, deadline_s: float | None = None, lease_s: float | None = None
    ) -> JSON:
        """`{state: "prepared" | "blocked", blockers, blockers_total, lease_expires_at}`."""
        body = {"checkpoint_id": checkpoint_id, "deadline_s": deadline_s, "lease_s": lease_s}
        return await self._call("POST", "prepare", body, deadline_s)

    async def commit(
        self, checkpoint_id: str, scope: Sequence[str] | None = None,
        deadline_s: float | None = None,
    ) -> JSON:
        """The participant's manifest. `scope`: the episode IDs kept (None: all)."""
        body = {
            "checkpoint_id": checkpoint_id,
            "scope": None if scope is None else list(scope),
            "deadline_s": deadline_s,
        }
        return await self._call("POST", "commit", body, deadline_s)

    async def resume(self, checkpoint_id: str) -> JSON:
        """`{phase: "open"}`; idempotent."""
        return await self._call("POST", "resume", {"checkpoint_id": checkpoint_id}, None)

    async def renew(self, checkpoint_id: str, lease_s: float | None = None) -> JSON:
        """`{lease_expires_at}`."""
        body = {"checkpoint_id": checkpoint_id, "lease_s": lease_s}
        return await self._call("POST", "renew", body, None)

    async def restore(
        self, checkpoint_id: str, deadline_s: float | None = None,
        scope: Sequence[str] | None = None, dry_run: bool = False,
    ) -> JSON:
        """`{installed_sessions, held_episodes, placed_sessions, owner_aliases}`."""
        body = {
            "checkpoint_id": checkpoint_id,
            "deadline_s": deadline_s,
            "scope": None if scope is None else list(scope),
            "dry_run": True if dry_run else None,
        }
        return await self._call("POST", "restore", body, deadline_s)

    async def abort_restore(self, checkpoint_id: str) -> JSON:
        """`{phase: "open", fresh: true}`."""
        return await self._call("POST", "abort_restore", {"checkpoint_id": checkpoint_id}, None)

    async def retire(
        self, episode_id: str, attempt: int, deadline_s: float | None = None
    ) -> JSON:
        """`{retired: [{episode_id, attempt, stopped, dropped_held}]}`."""
        body = {"episode_id": episode_id, "attempt": attempt, "deadline_s": deadline_s}
        return await self._call("POST", "retire", body, deadline_s)

    async def forget(self, episode_ids: Sequence[str]) -> JSON:
        """`{forgotten: [...]}`."""
        return await self._call("POST", "forget", {"episode_ids": list(episode_ids)}, None)

    async def _call(
        self, method: str, route: str, body: JSON | None, deadline_s: float | None
    ) -> JSON:
        # Optional fields left out are the server's defaults; sending null could be
        # refused by strict validation.
        payload = None if body is None else {k: v for k, v in body.items() if v is not None}
        wait_s = (deadline_s if deadline_s is not None else DEFAULT_DEADLINE_S) + TIMEOUT_MARGIN_S
        url = self._base + route
        try:
            async with self._open().request(
                method, url, json=payload, timeout=aiohttp.ClientTimeout(total=wait_s)
            ) as response:
                status = response.status
                raw = await response.read()
        except TimeoutError:
            raise ServerUnreachable(
                f"{method} {url}: no answer within {wait_s:g} s", server=self.label
            ) from None
        except aiohttp.ClientError as exc:
            raise ServerUnreachable(f"{method} {url}: {exc}", server=self.label) from exc
        return self._decode(route, status, raw)

    def _decode(self, route: str, status: int, raw: bytes) -> JSON:
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            text = raw[:200].decode("utf-8", "replace")
            raise BadAnswer(
                f"{route} answered {status} with {text!r}", server=self.label, status=status
            )
        if status == 200:
            return answer
        code = answer.pop("code", None)
        if not isinstance(code, str):
            raise BadAnswer(
                f"{route} answered {status} without an error code: {answer!r}",
                server=self.label, status=status,
            )
        detail = answer.pop("detail", None)
        answer.pop("server", None)
        answer.pop("status", None)
        raise ControlError(code, detail, server=self.label, status=status, **answer)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.server.token}"}
            )
        return self._session


# -- several servers -------------------------------------------------------------------


def new_checkpoint_id(clock: Callable[[], float] = time.time) -> str:
    """A sortable, time-based checkpoint ID: ``20261129T084500.123456Z-1a2b``."""
    stamp = datetime.fromtimestamp(clock(), UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{stamp}-{secrets.token_hex(2)}"


def _scope(scope: Sequence[str] | None) -> list[str] | None:
    if scope is None:
        return None
    if isinstance(scope, str) or not all(isinstance(e, str) and e for e in scope):
        raise TetherError("invalid_request", "scope is neither None nor a list of episode IDs")
    return list(scope)


def _summary(manifest: JSON) -> JSON:
    """What a checkpoint summary shows of one manifest: record counts and bytes."""
    segments = manifest.get("segments")
    total = sum(s.get("bytes", 0) for s in segments if isinstance(s, dict)) if isinstance(
        segments, list
    ) else 0
    return {"records": manifest.get("records"), "bytes": total}


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait for it to end, without swallowing our own cancellation."""
    task.cancel()
    await asyncio.wait([task])


class Controller:
    """Drives several servers through checkpoints (SPEC 7); use it as an async context.

    `checkpoint_root` is the directory the servers write to (it must be theirs, compared
    by real path); it may be None for calls that do not touch the disk (`status`,
    `prepare`, `resume`, `retire`, `forget`). Servers without a name take the one their
    status answers. `progress` receives one line per step. `renew_interval_s` is how
    often prepared servers are renewed while a checkpoint runs (default `lease_s / 3`).
    """

    def __init__(
        self,
        servers: Sequence[Server],
        checkpoint_root: StrPath | None,
        *,
        renew_interval_s: float | None = None,
        clock: Callable[[], float] = time.time,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if not servers:
            raise ValueError("a controller needs at least one server")
        self.clients = [ServerClient(server) for server in servers]
        self.checkpoint_root = checkpoint_root
        self.renew_interval_s = renew_interval_s
        self._clock = clock
        self._progress = progress
        self._connected = False

    async def __aenter__(self) -> Controller:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every server's session."""
        await asyncio.gather(*(client.close() for client in self.clients))

    @property
    def names(self) -> list[str]:
        """The servers' names, in order (those without one yet show their URL)."""
        return [client.label for client in self.clients]

    def _say(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)

    # -- checks ------------------------------------------------------------------------

    async def connect(self) -> list[JSON]:
        """Ask every server's status; name the unnamed; refuse wrong names and roots.

        Runs once, before the first procedure. Raises `name_mismatch` for a name that
        differs from the server's own, is missing or repeats, and `root_mismatch` when
        the controller has a checkpoint root and a server's differs.
        """
        statuses = await self._each(self.clients, ServerClient.status, concurrent=True)
        for client, status in zip(self.clients, statuses, strict=True):
            reported = status.get("name")
            if client.server.name is not None and reported != client.server.name:
                raise ControllerError(
                    "name_mismatch",
                    f"{client.server.url} calls itself {reported!r}, not {client.server.name!r}",
                    server=client.server.name,
                )
            try:
                client.name = validate_participant(reported)
            except ValueError:
                raise ControllerError(
                    "name_mismatch", f"{client.server.url} reports no usable name ({reported!r})",
                    server=client.label,
                ) from None
        seen: set[str] = set()
        for client in self.clients:
            if client.label in seen:
                raise ControllerError(
                    "name_mismatch", f"two servers are named {client.label!r}",
                    server=client.label,
                )
            seen.add(client.label)
        if self.checkpoint_root is not None:
            roots = [status.get("checkpoint_root") for status in statuses]
            ours, theirs = await asyncio.to_thread(_real_paths, self.checkpoint_root, roots)
            for client, root, real in zip(self.clients, roots, theirs, strict=True):
                if real != ours:
                    raise ControllerError(
                        "root_mismatch",
                        f"server {client.label} writes checkpoints to {root!r}, "
                        f"this controller reads {ours!r}",
                        server=client.label,
                    )
        self._connected = True
        return statuses

    async def _ready(self) -> None:
        if not self._connected:
            await self.connect()

    def _root(self) -> StrPath:
        if self.checkpoint_root is None:
            raise ValueError("this call needs the controller's checkpoint_root")
        return self.checkpoint_root

    async def _each(
        self, clients: Iterable[ServerClient], call: Callable[..., Any], *args: Any,
        concurrent: bool = False, **kwargs: Any,
    ) -> list[JSON]:
        """`call` on every client (in order, or all at once); raise the first failure
        only after every call ended, the others' failures added as notes."""
        clients = list(clients)
        results: list[Any]
        if concurrent:
            results = await asyncio.gather(
                *(call(c, *args, **kwargs) for c in clients), return_exceptions=True
            )
        else:
            results = []
            for client in clients:
                try:
                    results.append(await call(client, *args, **kwargs))
                except TetherError as error:
                    results.append(error)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also: {other}")
            raise errors[0]
        return results

    # -- single steps, on every server -------------------------------------------------

    async def status(self) -> dict[str, JSON]:
        """Every server's status, by name, asked at once (no name or root checks)."""
        statuses = await self._each(self.clients, ServerClient.status, concurrent=True)
        named: dict[str, JSON] = {}
        for client, status in zip(self.clients, statuses, strict=True):
            name = client.server.name or status.get("name") or client.server.url
            named[name if name not in named else client.server.url] = status
        return named

    async def prepare(
        self, checkpoint_id: str, deadline_s: float | None = None, lease_s: float | None = None
    ) -> dict[str, JSON]:
        """Prepare every server in order; answers by name. A `blocked` answer is returned,
        not raised, and nothing is resumed: the caller decides (or the lease expires)."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        await self._ready()
        answers: dict[str, JSON] = {}
        for client in self.clients:
            self._say(f"prepare {client.label}")
            answers[client.label] = await client.prepare(checkpoint_id, deadline_s, lease_s)
        return answers

    async def commit(
        self, checkpoint_id: str, scope: Sequence[str] | None = None,
        controller_state: Any = None, deadline_s: float | None = None,
    ) -> JSON:
        """Commit every (prepared) server in order, then write CHECKPOINT.json.

        Nothing is resumed. Committing again returns the same manifests, and a
        CHECKPOINT.json already listing the same manifests counts as written.
        """
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        scope = _scope(scope)
        await self._ready()
        started = time.perf_counter()
        servers = await self._commit_all(checkpoint_id, scope, deadline_s, {})
        doc = await self._write(checkpoint_id, servers, scope, controller_state, reuse=True)
        return self._result(doc, servers, {"total_s": time.perf_counter() - started})

    async def resume(self, checkpoint_id: str) -> dict[str, JSON]:
        """Resume every server, in reverse order; answers by name."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        await self._ready()
        return await self._resume(checkpoint_id, self.clients)

    async def abort_restore(self, checkpoint_id: str) -> dict[str, JSON]:
        """Undo a restore left `restored` (`resume=False`) on every server, in reverse order."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        await self._ready()
        clients = self.clients[::-1]
        answers = await self._each(clients, ServerClient.abort_restore, checkpoint_id)
        return {c.label: a for c, a in zip(clients, answers, strict=True)}

    async def retire(
        self, episode_id: str, attempt: int, deadline_s: float | None = None
    ) -> dict[str, JSON]:
        """Retire attempt `attempt` of `episode_id` on every server; answers by name.

        Every server is asked even if one fails; the first failure is raised after.
        """
        await self._ready()
        answers = await self._each(
            self.clients, ServerClient.retire, episode_id, attempt, deadline_s
        )
        return {c.label: a for c, a in zip(self.clients, answers, strict=True)}

    async def forget(self, episode_ids: Sequence[str]) -> dict[str, JSON]:
        """Drop the retire marks of `episode_ids` on every server; answers by name."""
        await self._ready()
        answers = await self._each(self.clients, ServerClient.forget, list(episode_ids))
        return {c.label: a for c, a in zip(self.clients, answers, strict=True)}

    # -- checkpoint --------------------------------------------------------------------

    async def checkpoint(
        self,
        checkpoint_id: str | None = None,
        scope: Sequence[str] | None = None,
        controller_state: Any = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> JSON:
        """Take a checkpoint of every server; return its summary.

        Prepares every server in order, renewing the prepared ones meanwhile; a
        `blocked` answer resumes every server prepared so far, the blocked one
        included, in reverse order, and raises `Blocked`. Then commits each with
        `scope`, writes CHECKPOINT.json (listing each MANIFEST.json's digest) last of
        all, and resumes every server in reverse order. Any other failure resumes the
        servers prepared so far too and is raised; the checkpoint is then incomplete.
        """
        self._root()
        checkpoint_id = (
            new_checkpoint_id(self._clock) if checkpoint_id is None
            else validate_checkpoint_id(checkpoint_id)
        )
        scope = _scope(scope)
        await self._ready()
        started = time.perf_counter()
        timings: dict[str, float] = {}
        prepared: list[ServerClient] = []
        leased: dict[str, ServerClient] = {}
        interval = self.renew_interval_s or max(lease_s / 3, 0.1)
        renewer = asyncio.create_task(self._renew(checkpoint_id, leased, lease_s, interval))
        try:
            try:
                for client in self.clients:
                    self._say(f"prepare {client.label}")
                    # Counted as prepared before the answer: a prepare that got no
                    # answer may have closed admission all the same.
                    prepared.append(client)
                    try:
                        answer = await client.prepare(checkpoint_id, deadline_s, lease_s)
                    except ControlError:
                        prepared.pop()  # refused: a refused call changes nothing (SPEC 5.2)
                        raise
                    if answer.get("state") == "blocked":
                        raise Blocked(client.label, answer)
                    if answer.get("state") != "prepared":
                        raise BadAnswer(
                            f"prepare answered state {answer.get('state')!r}",
                            server=client.label, status=200,
                        )
                    leased[client.label] = client
                timings["prepare_s"] = time.perf_counter() - started
                servers = await self._commit_all(checkpoint_id, scope, deadline_s, leased)
                timings["commit_s"] = time.perf_counter() - started - timings["prepare_s"]
            finally:
                await _stop(renewer)
            mark = time.perf_counter()
            doc = await self._write(checkpoint_id, servers, scope, controller_state)
            timings["write_s"] = time.perf_counter() - mark
        except BaseException as error:
            await self._resume_after(checkpoint_id, prepared, error)
            raise
        mark = time.perf_counter()
        await self._resume(checkpoint_id, self.clients)
        timings["resume_s"] = time.perf_counter() - mark
        timings["total_s"] = time.perf_counter() - started
        return self._result(doc, servers, timings)

    async def _renew(
        self, checkpoint_id: str, leased: dict[str, ServerClient], lease_s: float,
        interval: float,
    ) -> None:
        """Renew the servers in `leased` every `interval` until cancelled.

        A failed renew is reported and the loop goes on: the next commit will answer
        what went wrong (`stale_checkpoint` after an expiry).
        """
        while True:
            await asyncio.sleep(interval)
            for name, client in list(leased.items()):
                if name not in leased:
                    continue
                try:
                    await client.renew(checkpoint_id, lease_s)
                except ControllerError as error:
                    self._say(f"renew {name} failed: {error}")

    async def _commit_all(
        self, checkpoint_id: str, scope: list[str] | None, deadline_s: float | None,
        leased: dict[str, ServerClient],
    ) -> list[JSON]:
        """Commit each server in order; per server its name, URL, digest and summary."""
        root = self._root()
        servers: list[JSON] = []
        for client in self.clients:
            self._say(f"commit {client.label}")
            # A running commit holds its own lease (SPEC 5.4): no renew meanwhile.
            leased.pop(client.label, None)
            mark = time.perf_counter()
            manifest = await client.commit(checkpoint_id, scope, deadline_s)
            elapsed = time.perf_counter() - mark
            leased[client.label] = client
            try:
                digest = await asyncio.to_thread(
                    read_manifest_digest, root, checkpoint_id, client.label
                )
            except TetherError as error:
                raise ControllerError(
                    "commit_failed",
                    f"server {client.label} committed, but {error.detail}: does it write to "
                    f"this controller's checkpoint root?",
                    server=client.label,
                ) from error
            servers.append({
                "name": client.label, "url": client.server.url, "manifest_digest": digest,
                **_summary(manifest), "commit_s": elapsed,
            })
        return servers

    async def _write(
        self, checkpoint_id: str, servers: list[JSON], scope: list[str] | None,
        controller_state: Any, reuse: bool = False,
    ) -> JSON:
        """Write CHECKPOINT.json; with `reuse`, an existing one listing the same
        participants is returned instead of refused."""
        root = self._root()
        participants = [
            ParticipantEntry(name=s["name"], url=s["url"], manifest_digest=s["manifest_digest"])
            for s in servers
        ]
        self._say(f"write {CHECKPOINT_NAME}")
        try:
            doc: JSON = await asyncio.to_thread(
                write_checkpoint_json, root, checkpoint_id, participants, scope,
                controller_state, clock=self._clock,
            )
        except TetherError as error:
            if not (reuse and error.code == "stale_checkpoint"):
                raise
            existing = await asyncio.to_thread(_read_checkpoint_json, root, checkpoint_id)
            if existing is None or existing.get("participants") != participants:
                raise
            doc = existing
        return doc

    def _result(self, doc: JSON, servers: list[JSON], timings: dict[str, float]) -> JSON:
        return {
            "checkpoint_id": doc["checkpoint_id"],
            "created_at": doc["created_at"],
            "scope": doc["scope"],
            "servers": servers,
            "timings": timings,
        }

    async def _resume(self, checkpoint_id: str, clients: Sequence[ServerClient]) -> dict[str, JSON]:
        """Resume `clients` in reverse order, every one even if one fails."""
        answers: dict[str, JSON] = {}
        errors: list[ControllerError] = []
        for client in list(clients)[::-1]:
            self._say(f"resume {client.label}")
            try:
                answers[client.label] = await client.resume(checkpoint_id)
            except ControllerError as error:
                errors.append(error)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also: {other}")
            raise errors[0]
        return answers

    async def _resume_after(
        self, checkpoint_id: str, prepared: list[ServerClient], error: BaseException
    ) -> None:
        """Best effort after a failed checkpoint: resume `prepared` in reverse order."""
        for client in prepared[::-1]:
            self._say(f"resume {client.label}")
            try:
                await client.resume(checkpoint_id)
            except ControllerError as other:
                error.add_note(f"resuming {client.label} failed too: {other}")

    # -- restore -----------------------------------------------------------------------

    async def restore(
        self,
        checkpoint_id: str = "latest",
        *,
        resume: bool = True,
        deadline_s: float = DEFAULT_DEADLINE_S,
        scope: Sequence[str] | None = None,
    ) -> JSON:
        """Restore a checkpoint (an ID or ``"latest"``) onto every (fresh) server.

        A dry run on every server first; then restore in order. If a restore fails, the
        servers already restored are aborted in reverse order and `RestoreFailed` is
        raised. Otherwise every server is resumed in reverse order, unless `resume` is
        False (they stay `restored`: `resume` or `abort_restore` them later). Returns
        `{checkpoint_id, servers: {name: answer}, resumed, controller_state}`.
        """
        root = self._root()
        if checkpoint_id == "latest":
            resolved = await asyncio.to_thread(resolve_latest, root)
            if resolved is None:
                raise ControllerError("no_checkpoint", f"no complete checkpoint in {root}")
            checkpoint_id = resolved
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        scope = _scope(scope)
        await self._ready()
        for client in self.clients:
            self._say(f"dry run {client.label}")
            await client.restore(checkpoint_id, deadline_s, scope, dry_run=True)
        restored: list[ServerClient] = []
        answers: dict[str, JSON] = {}
        try:
            for client in self.clients:
                self._say(f"restore {client.label}")
                try:
                    answers[client.label] = await client.restore(checkpoint_id, deadline_s, scope)
                except ServerUnreachable:
                    # No answer: it may have restored all the same.
                    restored.append(client)
                    raise
                restored.append(client)
        except BaseException as error:
            aborted = await self._abort(checkpoint_id, restored, error)
            if isinstance(error, ControllerError):
                failed = RestoreFailed(error, aborted)
                for note in getattr(error, "__notes__", []):
                    failed.add_note(note)
                raise failed from error
            raise
        if resume:
            await self._resume(checkpoint_id, self.clients)
        doc = await asyncio.to_thread(_read_checkpoint_json, root, checkpoint_id)
        return {
            "checkpoint_id": checkpoint_id,
            "servers": answers,
            "resumed": resume,
            "controller_state": None if doc is None else doc.get("controller_state"),
        }

    async def _abort(
        self, checkpoint_id: str, restored: list[ServerClient], error: BaseException
    ) -> list[str]:
        """abort_restore `restored` in reverse order; the names it reached."""
        aborted: list[str] = []
        for client in restored[::-1]:
            self._say(f"abort_restore {client.label}")
            try:
                await client.abort_restore(checkpoint_id)
            except ControllerError as other:
                error.add_note(f"abort_restore of {client.label} failed: {other}")
            else:
                aborted.append(client.label)
        return aborted


def _real_paths(ours: StrPath, theirs: list[Any]) -> tuple[str, list[str | None]]:
    """Real paths of our root and the servers' (None for a server that reports none)."""
    return os.path.realpath(ours), [
        os.path.realpath(p) if isinstance(p, str) else None for p in theirs
    ]


def _read_checkpoint_json(root: StrPath, checkpoint_id: str) -> JSON | None:
    """CHECKPOINT.json as written, or None if it is missing or unreadable."""
    try:
        doc = json.loads((Path(root) / checkpoint_id / CHECKPOINT_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
