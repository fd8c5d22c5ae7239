"""Frames and messages of the coordinator channel, checked without sockets."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.coordinator.framing import (
    MAX_FRAME,
    ErrorReply,
    FrameDecoder,
    FrameError,
    Notification,
    Reply,
    Request,
    encode_frame,
    parse_message,
)


def frame_of(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


# -- frames -------------------------------------------------------------------------


def test_a_message_round_trips_through_one_frame() -> None:
    message = {"id": 7, "kind": "register", "body": {"pid": 12, "blob": b"\x00\xff", "x": 1.5}}
    frame = encode_frame(message)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert FrameDecoder().feed(frame) == [message]


def test_bytes_and_str_stay_distinct() -> None:
    message = {"s": "text", "b": b"text"}
    assert FrameDecoder().feed(encode_frame(message)) == [message]


def test_several_frames_in_one_chunk_all_decode_in_order() -> None:
    messages = [{"n": n} for n in range(5)]
    assert FrameDecoder().feed(b"".join(encode_frame(m) for m in messages)) == messages


def test_a_partial_frame_waits_for_the_rest() -> None:
    decoder = FrameDecoder()
    frame = encode_frame({"k": "v" * 100})
    assert decoder.feed(frame[:3]) == []
    assert decoder.feed(frame[3:50]) == []
    assert decoder.feed(frame[50:]) == [{"k": "v" * 100}]
    assert decoder.buffered == 0


def test_encoding_refuses_a_body_over_the_limit() -> None:
    with pytest.raises(FrameError, match="over the 64-byte limit"):
        encode_frame({"blob": b"x" * 64}, max_frame=64)


def test_encoding_refuses_an_unserializable_message() -> None:
    with pytest.raises(FrameError, match="cannot be encoded"):
        encode_frame({"x": object()})


def test_a_length_over_the_limit_raises_on_the_header_alone() -> None:
    decoder = FrameDecoder()  # default 16 MiB limit
    with pytest.raises(FrameError, match="over the"):
        decoder.feed((1024**3).to_bytes(4, "big"))
    assert decoder.buffered == 0


def test_a_length_over_a_small_limit_raises_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame=16)
    with pytest.raises(FrameError):
        decoder.feed((17).to_bytes(4, "big") + b"x")


def test_a_decoder_stays_broken_after_an_error() -> None:
    decoder = FrameDecoder(max_frame=16)
    with pytest.raises(FrameError):
        decoder.feed((17).to_bytes(4, "big"))
    with pytest.raises(FrameError):
        decoder.feed(encode_frame({"ok": 1}))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(b"\xc1", "not valid msgpack", id="reserved-byte"),
        pytest.param(b"", "not valid msgpack", id="empty-body"),
        pytest.param(b"\x82\xa1a", "not valid msgpack", id="truncated-map"),
        pytest.param(b"\xa2\xff\xfe", "not valid msgpack", id="invalid-utf8"),
        pytest.param(msgpack.packb({"a": 1}) + b"\x00", "not valid msgpack", id="trailing"),
        pytest.param(msgpack.packb([1, 2]), "not a map", id="array"),
        pytest.param(msgpack.packb(3), "not a map", id="int"),
        pytest.param(msgpack.packb({1: 2}), "not valid msgpack", id="int-key"),
        pytest.param(b"\x91" * 5000, "not valid msgpack", id="too-deep"),
        pytest.param(
            msgpack.packb({"t": msgpack.Timestamp(1, 0)}), "not valid msgpack", id="timestamp"
        ),
        pytest.param(msgpack.packb({"e": msgpack.ExtType(5, b"")}), "ext type", id="ext-type"),
    ],
)
def test_a_malformed_body_raises_frame_error(body: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        FrameDecoder().feed(frame_of(body))


def test_a_bad_frame_after_good_ones_still_raises() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame({"n": 1})) == [{"n": 1}]
    with pytest.raises(FrameError):
        decoder.feed(frame_of(b"\xc1"))


# -- property: any chunking of a stream yields the same messages ----------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
maps = st.dictionaries(st.text(max_size=8), values, max_size=5)


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(maps, max_size=8), data=st.data())
def test_any_chunking_of_a_frame_stream_decodes_to_the_same_messages(
    messages: list[dict[str, Any]], data: st.DataObject
) -> None:
    stream = b"".join(encode_frame(message) for message in messages)
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=20)))
    decoder = FrameDecoder()
    decoded: list[dict[str, Any]] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        decoded.extend(decoder.feed(stream[start:end]))
    assert decoded == messages
    assert decoder.buffered == 0


def test_feeding_one_byte_at_a_time_decodes_every_frame() -> None:
    messages = [{"n": n, "pad": "x" * n} for n in range(10)]
    stream = b"".join(encode_frame(m) for m in messages)
    decoder = FrameDecoder()
    decoded = [m for i in range(len(stream)) for m in decoder.feed(stream[i : i + 1])]
    assert decoded == messages


def test_the_default_limit_is_16_mib() -> None:
    assert MAX_FRAME == 16 * 1024 * 1024
    assert FrameDecoder().max_frame == MAX_FRAME


# -- message shapes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        Request(1, "register", {"pid": 3}),
        Notification("worker_left", None),
        Reply(1, {"ok": True}),
        ErrorReply(1, 409, "invalid_phase", "not now"),
        ErrorReply(1, 404, "session_lost", "gone", {"failure_kind": "session_lost"}),
    ],
    ids=["request", "notification", "reply", "error-reply", "error-reply-with-extra"],
)
def test_every_message_shape_survives_the_wire(
    message: Request | Notification | Reply | ErrorReply,
) -> None:
    (decoded,) = FrameDecoder().feed(encode_frame(message.to_wire()))
    assert parse_message(decoded) == message


def test_the_wire_shapes_are_the_specs() -> None:
    assert Request(1, "k", 2).to_wire() == {"id": 1, "kind": "k", "body": 2}
    assert Notification("k").to_wire() == {"id": None, "kind": "k", "body": None}
    assert Reply(1, 2).to_wire() == {"reply_to": 1, "ok": True, "body": 2}
    assert ErrorReply(1, 503, "workers_missing", "d").to_wire() == {
        "reply_to": 1,
        "ok": False,
        "error": {"status": 503, "code": "workers_missing", "detail": "d"},
    }
    assert ErrorReply(1, 404, "session_lost", None, {"k": 1}).to_wire()["error"] == {
        "status": 404,
        "code": "session_lost",
        "detail": None,
        "extra": {"k": 1},
    }


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param([], id="not-a-map"),
        pytest.param({}, id="empty"),
        pytest.param({"id": 1, "kind": "k"}, id="request-without-body"),
        pytest.param({"id": 1, "kind": "k", "body": 1, "x": 2}, id="request-extra-key"),
        pytest.param({"id": "1", "kind": "k", "body": 1}, id="str-id"),
        pytest.param({"id": True, "kind": "k", "body": 1}, id="bool-id"),
        pytest.param({"id": -1, "kind": "k", "body": 1}, id="negative-id"),
        pytest.param({"id": 1, "kind": 5, "body": 1}, id="int-kind"),
        pytest.param({"id": 1, "kind": "", "body": 1}, id="empty-kind"),
        pytest.param({"reply_to": 1, "ok": 1, "body": 1}, id="int-ok"),
        pytest.param({"reply_to": None, "ok": True, "body": 1}, id="no-reply-to"),
        pytest.param({"reply_to": 1, "ok": True}, id="reply-without-body"),
        pytest.param({"reply_to": 1, "ok": False, "body": 1}, id="error-without-error"),
        pytest.param({"reply_to": 1, "ok": False, "error": "x"}, id="error-not-a-map"),
        pytest.param(
            {"reply_to": 1, "ok": False, "error": {"status": 409, "code": "x"}},
            id="error-without-detail",
        ),
        pytest.param(
            {"reply_to": 1, "ok": False, "error": {"status": "409", "code": "x", "detail": 1}},
            id="str-status",
        ),
        pytest.param(
            {"reply_to": 1, "ok": False, "error": {"status": 42, "code": "x", "detail": 1}},
            id="status-not-http",
        ),
        pytest.param(
            {"reply_to": 1, "ok": False, "error": {"status": 409, "code": 1, "detail": 1}},
            id="int-code",
        ),
        pytest.param(
            {
                "reply_to": 1,
                "ok": False,
                "error": {"status": 409, "code": "x", "detail": 1, "extra": [1]},
            },
            id="extra-not-a-map",
        ),
        pytest.param(
            {
                "reply_to": 1,
                "ok": False,
                "error": {"status": 409, "code": "x", "detail": 1, "other": 1},
            },
            id="error-unknown-key",
        ),
        pytest.param({"kind": "x", "body": None, "trace": {}}, id="traced-without-id"),
    ],
)
def test_a_malformed_message_raises_frame_error(obj: Any) -> None:
    with pytest.raises(FrameError):
        parse_message(obj)
