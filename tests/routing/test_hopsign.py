"""The signature of a hop between hosts and its check: pure, on a clock the tests move."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tether.routing.hopsign import (
    FULL,
    HopSecretError,
    HopSigner,
    HopVerifier,
    load_hop_secret,
    request_target,
    sign,
)
from tether.routing.types import WorkerId

SECRET = b"k" * 32
WORKER = WorkerId("a" * 32)
OTHER = WorkerId("b" * 32)
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(clock: Clock | None = None, **options: Any) -> HopVerifier:
    return HopVerifier(SECRET, clock=clock or Clock(), **options)


def signed(now: float = T0, nonce: str | None = None, **fields: str) -> str:
    request = {"method": "GET", "path": "/a?b=1", **fields}
    return sign(SECRET, request["method"], request["path"], WORKER, now=now, nonce=nonce)


def test_a_valid_signature_passes_once() -> None:
    check = verifier()
    value = signed()

    assert check.check(value, "GET", "/a?b=1", WORKER) is None
    assert check.check(value, "GET", "/a?b=1", WORKER) == "replayed"


def test_the_value_is_seconds_nonce_and_hex_hmac() -> None:
    when, nonce, mac = signed(now=T0 + 0.9).split(".")

    assert when == str(int(T0))
    assert len(nonce) == 16
    assert len(mac) == 64 and int(mac, 16) >= 0
    assert signed(nonce="n" * 16) == signed(nonce="n" * 16)
    assert signed() != signed()  # a fresh nonce each time


@pytest.mark.parametrize(
    ("age", "reason"),
    [(31.0, "too old"), (-31.0, "from the future"), (30.0, None), (-30.0, None)],
)
def test_a_signature_is_accepted_within_30_s_of_now_either_way(
    age: float, reason: str | None
) -> None:
    check = verifier(Clock(T0 + age))

    assert check.check(signed(), "GET", "/a?b=1", WORKER) == reason


def test_a_signature_made_with_another_secret_is_a_bad_signature() -> None:
    forged = sign(b"z" * 32, "GET", "/a?b=1", WORKER, now=T0)

    assert verifier().check(forged, "GET", "/a?b=1", WORKER) == "bad signature"


@pytest.mark.parametrize(
    ("method", "path", "target"),
    [
        ("POST", "/a?b=1", WORKER),  # another method
        ("GET", "/a?b=2", WORKER),  # another query
        ("GET", "/a", WORKER),  # no query
        ("GET", "/b?b=1", WORKER),  # another path
        ("GET", "/a?b=1", OTHER),  # signed for another worker
        ("GETa", "?b=1", WORKER),  # a byte moved from the path to the method: framed
    ],
)
def test_a_signature_names_one_method_target_and_worker(
    method: str, path: str, target: WorkerId
) -> None:
    assert verifier().check(signed(), method, path, target) == "bad signature"


@pytest.mark.parametrize(
    "value",
    [
        "nonsense",
        "1700000000.short.00",
        f"{int(T0)}.{'n' * 16}.{'0' * 63}",  # a digest one hex digit short
        f"{int(T0)}.{'n' * 16}.{'A' * 64}",  # upper-case hex
        f"x{int(T0)}.{'n' * 16}.{'0' * 64}",
        f"{int(T0)}.{'n!' * 8}.{'0' * 64}",  # a nonce outside the alphabet
        signed(nonce="n" * 16) + " ",
    ],
)
def test_a_malformed_value_is_refused_as_malformed(value: str) -> None:
    assert verifier().check(value, "GET", "/a?b=1", WORKER) == "malformed"


@pytest.mark.parametrize("value", [None, ""])
def test_no_value_is_refused_as_missing(value: str | None) -> None:
    assert verifier().check(value, "GET", "/a?b=1", WORKER) == "missing"


def test_a_forged_signature_is_not_remembered_so_its_nonce_stays_usable() -> None:
    check = verifier()
    nonce = "n" * 16
    forged = sign(b"z" * 32, "GET", "/a?b=1", WORKER, now=T0, nonce=nonce)

    for _ in range(100):
        assert check.check(forged, "GET", "/a?b=1", WORKER) == "bad signature"

    assert len(check) == 0
    assert check.check(signed(nonce=nonce), "GET", "/a?b=1", WORKER) is None


def test_nonces_age_out_once_their_signature_is_too_old_anyway() -> None:
    clock = Clock()
    check = verifier(clock)
    for _ in range(3):
        assert check.check(signed(), "GET", "/a?b=1", WORKER) is None
    assert len(check) == 3

    clock.now = T0 + 30  # still valid, so still remembered
    assert check.check(signed(now=clock.now), "GET", "/a?b=1", WORKER) is None
    assert len(check) == 4

    clock.now = T0 + 31
    assert check.check(signed(now=clock.now), "GET", "/a?b=1", WORKER) is None
    assert len(check) == 2  # the three of T0 went


def test_a_signature_whose_nonce_went_stays_too_old_when_the_clock_steps_back() -> None:
    """A time correction sets the clock back: a signature seen, and let go once too old,
    would be fresh again with nothing remembering it. It stays refused; signatures made
    after the one let go still pass."""
    clock = Clock()
    check = verifier(clock)
    first = signed()
    assert check.check(first, "GET", "/a?b=1", WORKER) is None
    clock.now = T0 + 31  # the next check lets the first nonce go
    assert check.check(signed(now=clock.now), "GET", "/a?b=1", WORKER) is None
    assert len(check) == 1

    clock.now = T0 + 10  # stepped back: `first` is 10 s old again
    assert check.check(first, "GET", "/a?b=1", WORKER) == "too old"
    assert check.check(signed(now=T0 + 1), "GET", "/a?b=1", WORKER) is None
    assert check.check(signed(now=clock.now), "GET", "/a?b=1", WORKER) is None


def test_over_the_cap_a_valid_signature_is_refused_rather_than_a_nonce_forgotten() -> None:
    clock = Clock()
    check = verifier(clock, max_nonces=2)
    first = signed()
    assert check.check(first, "GET", "/a?b=1", WORKER) is None
    assert check.check(signed(), "GET", "/a?b=1", WORKER) is None

    assert check.check(signed(), "GET", "/a?b=1", WORKER) == FULL
    assert check.check(first, "GET", "/a?b=1", WORKER) == "replayed"  # still remembered
    assert len(check) == 2

    clock.now = T0 + 31
    assert check.check(signed(now=clock.now), "GET", "/a?b=1", WORKER) is None


def test_a_bound_signer_signs_as_sign_does() -> None:
    signer = HopSigner(SECRET)

    assert signer("GET", "/a?b=1", WORKER, T0, "n" * 16) == signed(nonce="n" * 16)


def test_a_nonce_outside_the_alphabet_is_not_signed() -> None:
    with pytest.raises(ValueError, match="nonce"):
        signed(nonce="short")


def test_the_request_target_is_the_raw_path_and_the_query_if_any() -> None:
    scope = {"path": "/a b", "raw_path": b"/a%20b", "query_string": b"x=%2F"}

    assert request_target(scope) == "/a%20b?x=%2F"
    assert request_target({**scope, "query_string": b""}) == "/a%20b"
    assert request_target({"path": "/a b", "query_string": b""}) == "/a%20b"


# The hop secret file


def write(path: Path, content: bytes, mode: int = 0o600) -> str:
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


def test_a_private_file_of_32_bytes_or_more_is_the_secret_less_whitespace(
    short_tmp: Path,
) -> None:
    secret = b"Q" * 44
    assert load_hop_secret(write(short_tmp / "s", b"  " + secret + b"\n")) == secret
    assert load_hop_secret(write(short_tmp / "r", secret, 0o400)) == secret


@pytest.mark.parametrize(
    ("content", "mode", "says"),
    [
        (b"Q" * 44, 0o640, "chmod 600"),
        (b"Q" * 44, 0o604, "chmod 600"),
        (b"Q" * 44, 0o620, "chmod 600"),
        (b"", 0o600, "is empty: head -c 32 /dev/urandom | base64 >"),
        (b" \n\t", 0o600, "is empty: head -c 32 /dev/urandom | base64 >"),
        (b"Q" * 31 + b"\n", 0o600, "31 bytes, fewer than 32: head -c 32 /dev/urandom"),
    ],
)
def test_a_secret_file_open_to_others_empty_or_short_is_refused_in_one_line(
    short_tmp: Path, content: bytes, mode: int, says: str
) -> None:
    path = write(short_tmp / "secret", content, mode)

    with pytest.raises(HopSecretError) as refused:
        load_hop_secret(path)

    message = str(refused.value)
    assert "\n" not in message
    assert path in message
    assert says in message
    assert content.strip() == b"" or content.decode() not in message  # never the secret


def test_a_missing_secret_file_is_refused_saying_how_to_make_one(short_tmp: Path) -> None:
    path = str(short_tmp / "none")

    with pytest.raises(HopSecretError) as refused:
        load_hop_secret(path)

    assert str(refused.value) == (
        f"hop secret file {path} does not exist: "
        f"head -c 32 /dev/urandom | base64 > {path} && chmod 600 {path}"
    )
    assert isinstance(refused.value, ValueError)


def test_a_directory_is_not_a_secret_file(short_tmp: Path) -> None:
    with pytest.raises(HopSecretError, match="not a regular file"):
        load_hop_secret(str(short_tmp))
