"""What a forwarded request carries of its caller: the one hop header.

The worker that received a request knows its caller as uvicorn saw it (and as uvicorn's
`ProxyHeadersMiddleware` corrected it on the public port): `client`, `scheme`,
`root_path` and `server`. The forwarder sends them to the holder as the last header of the
request, `x-tether-hop`, and the holder's router takes that header off and puts them back
into the scope, so the app sees the request as if it had landed there directly.

The value is six fields separated by single spaces: scheme, client host, client port,
server host, server port, root path (`http 127.0.0.1 51234 127.0.0.1 8000 /api`). An empty
host stands for no client (or no server), an empty port for none; a field holding a space,
a `%` or anything but printable ASCII is percent-encoded. Only the private socket reads the
header; the public side never passes a copy on (`forward.py` drops it) nor lets the app see
one (the router strips it), so a client cannot forge its address.

On a hop between hosts (to a worker's TCP hop listener, `PrivateServer.tcp`) the value
starts with one more token, the signature (`<unix seconds>.<nonce>.<hex HMAC>`,
hopsign.py), and a space: `<signature> <the six fields>`. The listener takes it off with
`take_signature` and checks it before anything else runs, so what `take_hop` reads is the
same on both kinds of hop, and a same-host hop pays nothing for it.
"""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import quote, unquote

from starlette.types import Scope

__all__ = [
    "HOP_HEADER",
    "hop_value",
    "signed_hop_value",
    "strip_hop",
    "take_hop",
    "take_signature",
]

HOP_HEADER = b"x-tether-hop"
_SAFE = "!\"#$&'()*+,/:;<=>?@[\\]^_`{|}~"


def _field(text: str) -> str:
    if text.isascii() and text.isprintable() and " " not in text and "%" not in text:
        return text
    return quote(text, safe=_SAFE)


def hop_value(scope: Scope) -> bytes:
    """The hop header's value for a request received on the public port."""
    client = scope.get("client")
    server = scope.get("server")
    client_host, client_port = (_field(client[0]), client[1]) if client else ("", "")
    server_host, server_port = ("", "")
    if server:
        server_host = _field(server[0])
        server_port = "" if server[1] is None else server[1]
    root_path = _field(scope.get("root_path", ""))
    scheme = scope.get("scheme", "http")
    value = f"{scheme} {client_host} {client_port} {server_host} {server_port} {root_path}"
    return value.encode("latin-1")


def signed_hop_value(signature: str, value: bytes | None) -> bytes:
    """The hop header's value on a hop between hosts: the signature, then `value`."""
    token = signature.encode("ascii")
    return token if value is None else token + b" " + value


def take_signature(scope: Scope) -> str | None:
    """On a hop listener: take the first token, the signature, off the hop header the
    forwarder put last, leaving the caller's fields (maybe none) for `take_hop`. None
    without a hop header (the scope is then unchanged)."""
    headers = scope["headers"]
    if not headers or headers[-1][0] != HOP_HEADER:
        return None
    value: bytes = headers[-1][1]
    signature, _, rest = value.partition(b" ")
    scope["headers"] = [*headers[:-1], (HOP_HEADER, rest)]
    return signature.decode("latin-1")


def take_hop(scope: Scope) -> None:
    """On the private socket: remove the hop header the forwarder put last and restore
    the caller it names into the scope. A missing or malformed header changes nothing."""
    headers = scope["headers"]
    if not headers or headers[-1][0] != HOP_HEADER:
        return
    scope["headers"] = headers[:-1]
    caller = _caller(headers[-1][1])
    if caller is not None:
        scope["scheme"], scope["client"], scope["server"], scope["root_path"] = caller


@functools.lru_cache(maxsize=4096)
def _caller(value: bytes) -> tuple[str, Any, Any, str] | None:
    """Scheme, client, server and root path from a hop header's value; None if it is
    malformed. (Every request of one client connection carries the same value.)"""
    fields = value.decode("latin-1").split(" ")
    if len(fields) == 5:
        # An empty root path ends the value with a space, which a parser may strip as
        # trailing whitespace (websockets' handshake parser does).
        fields.append("")
    if len(fields) != 6:
        return None
    scheme, client_host, client_port, server_host, server_port, root_path = fields
    try:
        client = (unquote(client_host), int(client_port)) if client_host else None
        server = (unquote(server_host), int(server_port) if server_port else None)
    except ValueError:
        return None
    return scheme, client, server if server_host else None, unquote(root_path)


def strip_hop(scope: Scope) -> None:
    """Remove every hop header a client sent, so nothing downstream can trust it."""
    scope["headers"] = [item for item in scope["headers"] if item[0] != HOP_HEADER]
