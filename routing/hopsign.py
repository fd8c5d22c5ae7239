"""The signature a request carries on a hop between hosts (SPEC 12), and its check.

A worker reaches a worker of another host on that worker's TCP hop listener
(`PrivateServer.tcp`), which serves only requests signed for it with the service's hop
secret. The signature travels in the one hop header (hop.py), as its first token::

    x-tether-hop: <unix seconds>.<nonce>.<hex HMAC-SHA256> <the six caller fields>

On a same-host hop (the Unix socket) the value is the six caller fields alone. On a hop
listener the first token is always the signature: the listener takes it off
(`hop.take_signature`) and checks it before the app runs, then the router's `take_hop`
reads the caller's fields as from the Unix socket. One header, one module that parses
it, and no extra work on a same-host hop. A hop header that is not the last header, or
a last header that is not the hop header, counts as no signature.

What the HMAC-SHA256, keyed by the hop secret, covers: a version tag, then each field
as its decimal length, a colon and its bytes, so no two different sets of fields frame
to the same bytes::

    b"tether-hop-1" + b"<n>:" + field, for method, target, time, nonce, worker ID

`method` is the request's (`GET` for a WebSocket handshake); `target` is the request
target as sent and as the listener's uvicorn sees it unchanged: the raw path and, when
the query is not empty, `?` and the raw query (`request_target`); `time` and `nonce` are
the strings of the header. So a signature names one request line for one worker, once.
It does not cover the other headers, the caller fields or the body: it proves who sent
the request and stops its replay, it does not protect its content from someone on the
path (run the hops on a private network, or under a mesh that encrypts them).

The listener accepts a signature whose time is within `window_s` (30 s) of its own
clock either way (the hosts' clocks must agree that well), and each nonce once: it
remembers a nonce until its signature is too old to pass anyway, only once the HMAC
checked (so forged requests cannot fill the memory), and at most `max_nonces` at a time.
A signature no newer than one whose nonce it let go stays too old even if the clock
then steps back (a time correction), when it would otherwise pass again unremembered;
so a step back of more than `window_s` refuses hops until the clock is back within
`window_s` of where it was.
Past that many it refuses new signatures (`FULL`, answered 503 `claimant_unavailable`)
rather than forget a nonce early, which would open a replay.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from urllib.parse import quote

from starlette.types import Scope

from tether.routing.types import WorkerId

__all__ = [
    "FULL",
    "MAX_NONCES",
    "MIN_SECRET_BYTES",
    "WINDOW_S",
    "HopSecretError",
    "HopSigner",
    "HopVerifier",
    "load_hop_secret",
    "request_target",
    "sign",
]

WINDOW_S = 30.0
MIN_SECRET_BYTES = 32
MAX_NONCES = 1 << 18
"""Nonces one listener remembers at most: at 30 s each, over 8,700 signed requests a
second to one worker."""
FULL = "nonce memory full"
"""The reason a valid signature is refused while `max_nonces` are remembered."""

_TAG = b"tether-hop-1"
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_SIGNATURE = re.compile(r"([0-9]{1,12})\.([A-Za-z0-9_-]{16,64})\.([0-9a-f]{64})")


class HopSecretError(ValueError):
    """The hop secret file is missing, unreadable, not a regular file, open to group or
    others, empty or too short; the message is one line saying what to do."""


def _mac(key: hmac.HMAC, method: str, path: str, when: str, nonce: str, worker: str) -> str:
    m, p = method.encode("latin-1"), path.encode("latin-1")
    w, n, i = when.encode("ascii"), nonce.encode("ascii"), worker.encode("ascii")
    mac = key.copy()  # the key's pads and the tag already hashed
    mac.update(b"%d:%b%d:%b%d:%b%d:%b%d:%b" % (
        len(m), m, len(p), p, len(w), w, len(n), n, len(i), i
    ))
    return mac.hexdigest()


def _keyed(secret: bytes) -> hmac.HMAC:
    key = hmac.new(secret, digestmod=hashlib.sha256)
    key.update(_TAG)
    return key


def sign(
    secret: bytes,
    method: str,
    path: str,
    target: WorkerId,
    now: float | None = None,
    nonce: str | None = None,
) -> str:
    """`<unix seconds>.<nonce>.<hex HMAC-SHA256>` for a request `method path` (the request
    target, `request_target`) to worker `target`, made at `now` (default: the clock)."""
    return HopSigner(secret)(method, path, target, now, nonce)


class HopSigner:
    """`sign` with the secret bound (its HMAC key set up once), as the forwarder and the
    relay call it: `signer(method, path, target)`."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        self._key = _keyed(secret)

    def __call__(
        self,
        method: str,
        path: str,
        target: WorkerId,
        now: float | None = None,
        nonce: str | None = None,
    ) -> str:
        when = str(int(time.time() if now is None else now))
        if nonce is None:
            nonce = secrets.token_urlsafe(12)  # 96 random bits, 16 characters
        elif not _NONCE.fullmatch(nonce):
            raise ValueError("a nonce is 16 to 64 characters of A-Z, a-z, 0-9, _ and -")
        return f"{when}.{nonce}.{_mac(self._key, method, path, when, nonce, target)}"


def request_target(scope: Scope) -> str:
    """The request target a signature covers: the raw path, and `?` and the raw query
    when there is one, as the forwarder writes it and the listener's uvicorn reads it."""
    path: bytes = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    query: bytes = scope.get("query_string", b"")
    return (path + b"?" + query if query else path).decode("latin-1")


class HopVerifier:
    """Checks the signatures of requests reaching one hop listener: each is valid for
    `window_s` either side of `clock()`, once."""

    def __init__(
        self,
        secret: bytes,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.time,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self.max_nonces = max_nonces
        self._key = _keyed(secret)
        self._seen: set[str] = set()
        self._expiries: list[tuple[float, str]] = []  # a heap: when each nonce may go
        self._forgotten = -math.inf
        """The latest expiry of a nonce let go: a signature whose own is no later may
        have been seen (the clock stepped back since), so it is too old."""

    def __len__(self) -> int:
        """How many nonces are remembered now."""
        return len(self._seen)

    def check(
        self, value: str | None, method: str, path: str, target: WorkerId
    ) -> str | None:
        """None if `value` signs `method path` for worker `target`, now, for the first
        time (its nonce is then remembered); else why not: "missing", "malformed", "too
        old", "from the future", "bad signature", "replayed" or `FULL`."""
        if not value:
            return "missing"
        match = _SIGNATURE.fullmatch(value)
        if match is None:
            return "malformed"
        when, nonce, mac = match.groups()
        now = self.clock()
        age = now - int(when)
        if age > self.window_s:
            return "too old"
        if -age > self.window_s:
            return "from the future"
        if int(when) + self.window_s <= self._forgotten:
            return "too old"  # (by the clock its nonce went at, since stepped back)
        expected = _mac(self._key, method, path, when, nonce, target)
        if not hmac.compare_digest(mac, expected):
            return "bad signature"
        self._prune(now)
        if nonce in self._seen:
            return "replayed"
        if len(self._seen) >= self.max_nonces:
            return FULL
        self._seen.add(nonce)
        # Past this time the signature is too old, so its nonce need not be remembered.
        heapq.heappush(self._expiries, (int(when) + self.window_s, nonce))
        return None

    def _prune(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] < now:
            self._forgotten, nonce = heapq.heappop(expiries)
            self._seen.discard(nonce)


def load_hop_secret(path: str) -> bytes:
    """The hop secret in file `path`, surrounding whitespace stripped. Raises
    `HopSecretError` for a file that is missing, open to group or others (any bit of
    mode 0o077), empty or under 32 bytes."""
    make = f"head -c 32 /dev/urandom | base64 > {path} && chmod 600 {path}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise HopSecretError(f"hop secret file {path} does not exist: {make}") from None
    except OSError as exc:
        raise HopSecretError(f"cannot read hop secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HopSecretError(f"hop secret file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise HopSecretError(
                f"hop secret file {path} is open to group or others "
                f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 {path}"
            )
        with os.fdopen(fd, "rb", closefd=False) as file:
            secret = file.read().strip()
    finally:
        os.close(fd)
    if not secret:
        raise HopSecretError(f"hop secret file {path} is empty: {make}")
    if len(secret) < MIN_SECRET_BYTES:
        raise HopSecretError(
            f"hop secret file {path} holds {len(secret)} bytes, fewer than "
            f"{MIN_SECRET_BYTES}: {make}"
        )
    return secret
