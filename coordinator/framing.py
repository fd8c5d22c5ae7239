"""Frames and messages of the coordinator channel, with no I/O.

A frame is a 4-byte big-endian body length followed by a msgpack body. Every body is
one map, and every map is one of four messages::

    Request       {"id": int, "kind": str, "body": Any,         a reply is expected
                   "trace"?: {str: str}}
    Notification  {"id": None, "kind": str, "body": Any}        no reply
    Reply         {"reply_to": int, "ok": True, "body": Any}
    ErrorReply    {"reply_to": int, "ok": False,
                   "error": {"status": int, "code": str, "detail": Any, "extra"?: map}}

`extra` carries a `TetherError`'s extra body fields (e.g. `failure_kind`) and is left
out when there are none, so the common shape is exactly the spec's. `trace` likewise: the
caller's span context (W3C `traceparent`, `tracestate`, `baggage`; `routing/tracing.py`),
sent only while the caller traces a span, so the callee's spans join its trace.

`FrameDecoder` turns a byte stream into decoded maps; `parse_message` checks a map's
shape and returns the message it holds. Anything else raises `FrameError`, after which
the connection cannot be trusted and should be closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgpack

__all__ = [
    "HEADER_SIZE",
    "MAX_FRAME",
    "ErrorReply",
    "FrameDecoder",
    "FrameError",
    "Message",
    "Notification",
    "Reply",
    "Request",
    "decode_body",
    "encode_frame",
    "parse_message",
]

MAX_FRAME = 16 * 1024 * 1024
HEADER_SIZE = 4
# A 4-byte length cannot say more than this, whatever max_frame is set to.
_LENGTH_LIMIT = 2**32 - 1


class FrameError(Exception):
    """A frame or message that breaks the channel's format."""


# -- frames -------------------------------------------------------------------------


def encode_frame(message: Any, *, max_frame: int = MAX_FRAME) -> bytes:
    """Encode `message` as one frame; refuse it if its body is over `max_frame` bytes."""
    try:
        body = msgpack.packb(message, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FrameError(f"message cannot be encoded: {exc}") from exc
    if len(body) > min(max_frame, _LENGTH_LIMIT):
        raise FrameError(f"message body of {len(body)} bytes is over the {max_frame}-byte limit")
    return len(body).to_bytes(HEADER_SIZE, "big") + body


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise FrameError(f"msgpack ext type {code} is not allowed")


def decode_body(body: bytes) -> dict[str, Any]:
    """Decode one frame body, which must be exactly one msgpack map with str keys.

    msgpack's `unpackb` bounds every string, bin, array and map length by the size of
    `body`, which the decoder already bounded by `max_frame`. Ext types and timestamps
    are refused: no message needs them.
    """
    try:
        decoded = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            # Timestamps (ext -1) bypass ext_hook; a zero ext limit refuses them.
            max_ext_len=0,
        )
    except FrameError:
        raise
    except Exception as exc:  # unpackb may raise any of several types on bad input
        raise FrameError(f"frame body is not valid msgpack: {exc!r}") from exc
    if not isinstance(decoded, dict):
        raise FrameError(f"frame body is a {type(decoded).__name__}, not a map")
    for key in decoded:
        if not isinstance(key, str):
            raise FrameError(f"message key {key!r} is not a str")
    return decoded


class FrameDecoder:
    """Turns bytes from a stream, in any chunking, into the maps they carry.

    A declared length over `max_frame` raises as soon as its header is complete, before
    any of the body is buffered. After a `FrameError` the decoder stays broken: every
    later `feed` raises the same error.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        if max_frame < 1:
            raise ValueError("max_frame must be positive")
        self.max_frame = max_frame
        self._buffer = bytearray()
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add `data` and return every message it completes, in order."""
        if self._error is not None:
            raise self._error
        try:
            return self._feed(data)
        except FrameError as exc:
            self._error = exc
            self._buffer.clear()
            raise

    def _feed(self, data: bytes) -> list[dict[str, Any]]:
        buffer = self._buffer
        buffer += data
        messages: list[dict[str, Any]] = []
        start = 0
        while len(buffer) - start >= HEADER_SIZE:
            length = int.from_bytes(buffer[start : start + HEADER_SIZE], "big")
            if length > self.max_frame:
                raise FrameError(f"frame length {length} is over the {self.max_frame}-byte limit")
            end = start + HEADER_SIZE + length
            if len(buffer) < end:
                break
            messages.append(decode_body(bytes(buffer[start + HEADER_SIZE : end])))
            start = end
        # Drop consumed frames once per feed rather than once per frame.
        del buffer[:start]
        return messages


# -- messages -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """A call that expects one reply carrying the same `id`."""

    id: int
    kind: str
    body: Any = None
    trace: dict[str, str] | None = None
    """The caller's span context, if it traces one."""

    def to_wire(self) -> dict[str, Any]:
        wire = {"id": self.id, "kind": self.kind, "body": self.body}
        if self.trace is not None:
            wire["trace"] = self.trace
        return wire


@dataclass(frozen=True, slots=True)
class Notification:
    """A one-way message; nothing answers it."""

    kind: str
    body: Any = None

    def to_wire(self) -> dict[str, Any]:
        return {"id": None, "kind": self.kind, "body": self.body}


@dataclass(frozen=True, slots=True)
class Reply:
    """The successful answer to request `reply_to`."""

    reply_to: int
    body: Any = None

    def to_wire(self) -> dict[str, Any]:
        return {"reply_to": self.reply_to, "ok": True, "body": self.body}


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The failed answer to request `reply_to`, with the error's HTTP status and code."""

    reply_to: int
    status: int
    code: str
    detail: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        error = {"status": self.status, "code": self.code, "detail": self.detail}
        if self.extra:
            error["extra"] = self.extra
        return {"reply_to": self.reply_to, "ok": False, "error": error}


Message = Request | Notification | Reply | ErrorReply

_REQUEST_KEYS = frozenset({"id", "kind", "body"})
_TRACED_REQUEST_KEYS = _REQUEST_KEYS | {"trace"}
_REPLY_KEYS = frozenset({"reply_to", "ok", "body"})
_ERROR_REPLY_KEYS = frozenset({"reply_to", "ok", "error"})
_ERROR_KEYS = frozenset({"status", "code", "detail"})
_ERROR_KEYS_WITH_EXTRA = _ERROR_KEYS | {"extra"}


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True is not a message id.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_keys(what: str, obj: dict[str, Any], keys: frozenset[str]) -> None:
    if obj.keys() != keys:
        raise FrameError(f"{what} has keys {sorted(obj)}, expected {sorted(keys)}")


def _check_id(what: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise FrameError(f"{what} {value!r} is not a non-negative int")
    return int(value)


def parse_message(obj: Any) -> Message:
    """Return the message a decoded map holds; raise `FrameError` if it has no valid shape.

    Shapes are exact: a missing or an extra key is an error.
    """
    if not isinstance(obj, dict):
        raise FrameError(f"message is a {type(obj).__name__}, not a map")
    if "reply_to" in obj:
        reply_to = _check_id("reply_to", obj["reply_to"])
        ok = obj.get("ok")
        if ok is True:
            _check_keys("reply", obj, _REPLY_KEYS)
            return Reply(reply_to, obj["body"])
        if ok is False:
            _check_keys("error reply", obj, _ERROR_REPLY_KEYS)
            error = obj["error"]
            if not isinstance(error, dict):
                raise FrameError("error reply's error is not a map")
            _check_keys("error", error, _ERROR_KEYS_WITH_EXTRA if "extra" in error else _ERROR_KEYS)
            status, code = error["status"], error["code"]
            if not _is_int(status) or not 100 <= status <= 599:
                raise FrameError(f"error status {status!r} is not an HTTP status")
            if not isinstance(code, str) or not code:
                raise FrameError(f"error code {code!r} is not a non-empty str")
            extra = error.get("extra", {})
            if not isinstance(extra, dict) or not all(isinstance(key, str) for key in extra):
                raise FrameError("error extra is not a map with str keys")
            return ErrorReply(reply_to, status, code, error["detail"], extra)
        raise FrameError(f"reply's ok is {ok!r}, not a bool")
    traced = "trace" in obj and obj.get("id") is not None  # (no `id`: `_check_keys` says so)
    _check_keys("request", obj, _TRACED_REQUEST_KEYS if traced else _REQUEST_KEYS)
    kind = obj["kind"]
    if not isinstance(kind, str) or not kind:
        raise FrameError(f"kind {kind!r} is not a non-empty str")
    if obj["id"] is None:
        return Notification(kind, obj["body"])
    trace = obj.get("trace")
    if trace is not None and not (
        isinstance(trace, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in trace.items())
    ):
        raise FrameError("request trace is not a map of str to str")
    return Request(_check_id("request id", obj["id"]), kind, obj["body"], trace)
