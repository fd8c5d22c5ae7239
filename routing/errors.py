"""Every error code tether answers with, its HTTP status, and how it is sent.

The table `ERRORS` is the one source of codes and statuses for all three packages,
the channel and the CLI. The tree is flat on purpose::

    TetherError            code + detail; status comes from the table
    ├── routing errors     raised by the router and the fence (this package)
    ├── checkpoint errors  raised by the participant (checkpoint package)
    └── coordinator errors raised by the coordinator (coordinator package)

Each package subclasses `TetherError` only where a caller needs to catch one kind.
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

from starlette.types import Send

ErrorCode = Literal[
    "unauthorized",
    "invalid_request",
    "invalid_checkpoint_id",
    "body_too_large",
    "session_mismatch",
    "session_conflict",
    "session_closed",
    "seed_rejected",
    "session_lost",
    "session_gone",
    "worker_gone",
    "claimant_unavailable",
    "checkpoint_parked",
    "checkpoint_conflict",
    "invalid_phase",
    "stale_checkpoint",
    "not_ready",
    "commit_failed",
    "deadline_exceeded",
    "not_fresh",
    "workers_missing",
    "no_checkpoint",
    "corrupt_checkpoint",
    "incompatible_state",
    "episode_claimed",
    "stale_attempt",
    "attempt_mismatch",
    "worker_unreported",
    "worker_lost",
    "unsupported_topology",
    "cluster_unavailable",
    "hop_unauthorized",
    "internal_error",
]

ERRORS: dict[ErrorCode, tuple[int, str]] = {
    "unauthorized": (401, "missing or wrong token"),
    "invalid_request": (422, "body fails validation"),
    "invalid_checkpoint_id": (422, "bad checkpoint ID"),
    "body_too_large": (413, "seed or close body over the cap"),
    "session_mismatch": (409, "cookie and body name different sessions"),
    "session_conflict": (409, "another worker claimed the ID, or another episode bound it"),
    "session_closed": (409, "seed of a closed session within the window"),
    "seed_rejected": (422, "seed input fails validation"),
    "session_lost": (404, "the server no longer holds the session"),
    "session_gone": (410, "the session's worker exited"),
    "worker_gone": (410, "a named worker is dead and unaliased"),
    "claimant_unavailable": (503, "transient failure to reach a live claimant"),
    "checkpoint_parked": (503, "admission closed by an open checkpoint"),
    "checkpoint_conflict": (409, "another checkpoint is active, or same ID other scope"),
    "invalid_phase": (409, "call not allowed in this phase"),
    "stale_checkpoint": (409, "ID already resumed, expired or published"),
    "not_ready": (409, "commit's readiness re-check failed"),
    "commit_failed": (500, "writing the checkpoint failed"),
    "deadline_exceeded": (504, "commit or restore missed its deadline"),
    "not_fresh": (409, "restore on a server that has state or was restored"),
    "workers_missing": (503, "restore deadline passed without enough workers"),
    "no_checkpoint": (404, "checkpoint missing or incomplete"),
    "corrupt_checkpoint": (422, "digest, count, format or duplicate check failed"),
    "incompatible_state": (422, "state version mismatch"),
    "episode_claimed": (409, "another request already continues this record"),
    "stale_attempt": (409, "attempt retired, or older than the held record's"),
    "attempt_mismatch": (409, "attempt beyond the one the held record expects"),
    "worker_unreported": (503, "a worker did not confirm in time"),
    "worker_lost": (503, "a worker exited during the call; the checkpoint is intact, retry"),
    "unsupported_topology": (409, "plain uvicorn with several workers"),
    "cluster_unavailable": (503, "the cluster store cannot be reached or this host's lease lapsed"),
    "hop_unauthorized": (401, "a forwarded request between hosts without a valid signature"),
    "internal_error": (500, "an unexpected failure, logged where it happened"),
}

assert set(ERRORS) == set(get_args(ErrorCode)), "every code needs a status and meaning"


RETRY_AFTER_S = "1"


class TetherError(Exception):
    """An error with a stable code; its HTTP status comes from `ERRORS`."""

    def __init__(self, code: ErrorCode, detail: Any = None, **extra: Any) -> None:
        self.code: ErrorCode = code
        self.detail: Any = detail if detail is not None else ERRORS[code][1]
        self.extra = extra
        super().__init__(f"{code}: {self.detail}")

    @property
    def status(self) -> int:
        return ERRORS[self.code][0]

    def headers(self) -> list[tuple[str, str]]:
        """The headers sent with it: a 503 says when to retry."""
        return [("retry-after", RETRY_AFTER_S)] if self.status == 503 else []

    def body(self) -> dict[str, Any]:
        """The JSON body every tether error is sent as."""
        return {"code": self.code, "detail": self.detail, **self.extra}


def encode_error(error: TetherError) -> bytes:
    return json.dumps(error.body(), separators=(",", ":")).encode()


async def send_error(
    send: Send, error: TetherError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer a request with `error` as JSON, on a raw ASGI send."""
    await send_json(send, error.status, error.body(), with_error_headers(error, headers))


def with_error_headers(
    error: TetherError, headers: list[tuple[bytes, bytes]] | None
) -> list[tuple[bytes, bytes]]:
    """`headers` plus the error's own (`Retry-After` on a 503) unless already there."""
    given = list(headers or [])
    names = {name for name, _ in given}
    for name, value in error.headers():
        if name.encode() not in names:
            given.append((name.encode(), value.encode()))
    return given


async def send_json(
    send: Send,
    status: int,
    body: Any,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answer a request with a JSON body, on a raw ASGI send."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    all_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": payload})
