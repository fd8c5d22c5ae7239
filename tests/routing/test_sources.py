"""Where session IDs come from, and what bad input gets: a code or no session, never a
500 and never a claim for garbage."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from base64 import b64encode
from collections.abc import AsyncIterator
from pathlib import Path

import itsdangerous

from tests.routing.apps import SECRET, session_app
from tests.routing.conftest import Cluster
from tether.routing.kinds import TOKEN_SALT, mint_session_token
from tether.routing.sources import MAX_BODY
from tether.routing.types import SessionId


def claims_named(cluster: Cluster) -> set[str]:
    """The session IDs that claim files name."""
    directory = Path(cluster.runtime_dir) / "claims"
    return {
        (directory / name).read_text().partition("\n")[2]
        for name in os.listdir(directory)
        if not name.endswith(".tmp")
    }


def cookie(session: dict[str, object], secret: str = SECRET, timestamp: int | None = None) -> str:
    class Signer(itsdangerous.TimestampSigner):
        def get_timestamp(self) -> int:
            return timestamp if timestamp is not None else super().get_timestamp()

    data = b64encode(json.dumps(session).encode())
    return "session=" + Signer(secret).sign(data).decode()


async def test_signed_token_routes_to_the_worker_that_holds_the_session(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        await ca.post("/seed_session", json={"session_id": "tok-1"})
    token = mint_session_token(SECRET, "tok-1")
    async with b.client() as cb:
        touched = await cb.get("/touch", headers={"x-tether-session-token": token})
    assert touched.json() == {"session_id": "tok-1", "n": 1, "worker": a.id}


def signed_garbage() -> str:
    """A token with a valid signature whose payload does not decode (only a holder of
    the secret can make one: a bug, not a forgery)."""
    serializer = itsdangerous.URLSafeSerializer(SECRET, salt=TOKEN_SALT)
    return str(serializer.make_signer(TOKEN_SALT).sign(b"%%not-base64").decode())


async def test_forged_or_expired_cookies_and_tokens_name_no_session(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        await ca.post("/seed_session", json={"session_id": "victim"})
    forged = cookie({"session_id": "victim"}, secret="not-the-secret")
    expired = cookie({"session_id": "victim"}, timestamp=1)  # max_age is 3600
    bad_token = mint_session_token("not-the-secret", "victim")
    async with b.client() as cb:
        for headers in (
            {"cookie": forged},
            {"cookie": expired},
            {"x-tether-session-token": bad_token},
            {"cookie": "session=" + "x" * 10_000},
            {"x-tether-session-token": "y" * 10_000},
            {"x-tether-session-token": signed_garbage()},
        ):
            reply = await cb.get("/touch", headers=headers)
            assert reply.status_code == 200
            assert reply.json()["session_id"] != "victim"  # a fresh session, served here
            assert reply.json()["worker"] == b.id
    assert a.app.state.values == {}


async def test_seed_bodies_that_name_no_valid_id_leave_no_claim(cluster: Cluster) -> None:
    from tether.examples.counter import create_app

    a = await cluster.add(create_app())
    await cluster.add(create_app())
    async with a.client() as client:
        for body in (b"not json", b"[1, 2]", b'{"session_id": 5}', b"[" * 100_000,
                     b'{"a": ' * 100_000,  # (nested past Python's stack: still no ID)
                     json.dumps({"session_id": "z" * 300}).encode(), b'{"session_id": ""}'):
            reply = await client.post("/seed_session", content=body)
            assert reply.status_code == 422, body
            assert reply.json()["code"] == "seed_rejected"
            assert "set-cookie" not in reply.headers
    assert claims_named(cluster) == set()


async def test_seed_body_over_the_cap_is_413_before_anything_is_claimed(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    await cluster.add(session_app())

    async def too_big() -> AsyncIterator[bytes]:
        chunk = b" " * (1024 * 1024)
        for _ in range(MAX_BODY // len(chunk) + 1):
            yield chunk

    reader, writer = await asyncio.open_connection("127.0.0.1", int(a.url.rsplit(":", 1)[1]))
    writer.write(
        b"POST /seed_session HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {MAX_BODY + 1}\r\n\r\n{{}}".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    await writer.wait_closed()
    assert head.startswith(b"HTTP/1.1 413 ")
    async with a.client() as client:
        streamed = await client.post("/seed_session", content=too_big())
        assert streamed.status_code == 413
    assert claims_named(cluster) == set()


async def test_a_9_mib_seed_reaches_its_claimant_unchanged(cluster: Cluster) -> None:
    a = await cluster.add(session_app())
    b = await cluster.add(session_app())
    async with a.client() as ca:
        await ca.post("/seed_session", json={"session_id": "big"})
    body = json.dumps({"session_id": "big", "task": "x" * (9 * 1024 * 1024)}).encode()
    async with b.client() as cb:
        reply = await cb.post("/echo", content=body)  # not a seed route: streamed as is
        assert reply.json()["worker"] == b.id
        seeded = await cb.post("/seed_session", content=body)
    assert seeded.json() == {"worker": a.id, "sha256": hashlib.sha256(body).hexdigest()}
    assert b.routing.router.stats.forwarded == 1


async def test_session_id_that_is_too_long_or_not_printable_names_no_session(
    cluster: Cluster,
) -> None:
    a = await cluster.add(session_app())
    await cluster.add(session_app())
    for value in ("q" * 257, "tab\there"):
        async with a.client() as client:
            seeded = await client.post("/seed_session", json={"session_id": value})
            assert seeded.status_code == 200
    named = claims_named(cluster)
    assert len(named) == 2  # each seed claimed a minted ID, never the bad value
    assert all(len(s) == 32 and all(c in "0123456789abcdef" for c in s) for s in named)
    assert a.routing.claims is not None
    assert not a.routing.claims.mine(SessionId("q" * 257))
