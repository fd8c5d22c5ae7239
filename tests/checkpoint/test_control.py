"""The control API on one in-process worker: tokens, strict bodies, retries, conflicts,
phases and stale IDs (SPEC 5.2, 6)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.checkpoint.conftest import TOKEN, Nodes, assert_error

ROUTES = ["status", "prepare", "commit", "resume", "renew", "restore", "abort_restore",
          "retire", "forget"]
ID_ROUTES = ["prepare", "commit", "resume", "renew", "restore", "abort_restore"]
GOOD_BODIES: dict[str, dict[str, Any]] = {
    "status": {},
    "prepare": {"checkpoint_id": "c1", "deadline_s": 1},
    "commit": {"checkpoint_id": "c1"},
    "resume": {"checkpoint_id": "c1"},
    "renew": {"checkpoint_id": "c1"},
    "restore": {"checkpoint_id": "c1"},
    "abort_restore": {"checkpoint_id": "c1"},
    "retire": {"episode_id": "e", "attempt": 1},
    "forget": {"episode_ids": ["e"]},
}


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Bearer wrong", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN,
     f"Basic {TOKEN}", f"Bearer  {TOKEN}"],
)
async def test_every_control_route_refuses_a_missing_or_wrong_token(
    nodes: Nodes, authorization: str | None
) -> None:
    a = await nodes.start()
    headers = {} if authorization is None else {"authorization": authorization}

    async def call(route: str, body: dict[str, Any]) -> httpx.Response:
        if route == "status":
            return await a.http.get("/_tether/status", headers=headers)
        return await a.http.post(f"/_tether/{route}", json=body, headers=headers)

    for route in ROUTES:
        reply = await call(route, GOOD_BODIES[route])
        assert_error(reply, 401, "unauthorized")
        assert reply.headers["www-authenticate"] == "Bearer"
    # 401 comes before body validation, and nothing happened.
    reply = await call("prepare", {"checkpoint_id": "latest", "x": 1})
    assert_error(reply, 401, "unauthorized")
    assert not a.participant.admission_closed
    assert (await a.status())["phase"] == "open"


@pytest.mark.parametrize("route", [r for r in ROUTES if r != "status"])
async def test_unknown_body_fields_are_refused_on_every_route(nodes: Nodes, route: str) -> None:
    a = await nodes.start()
    assert_error(await a.control(route, **GOOD_BODIES[route], surprise=1), 422,
                 "invalid_request")
    assert not a.participant.admission_closed


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"checkpoint_id": "c1", "deadline_s": -1},
        {"checkpoint_id": "c1", "deadline_s": "10"},
        {"checkpoint_id": 7},
    ],
)
async def test_malformed_bodies_are_invalid_request(nodes: Nodes, body: dict[str, Any]) -> None:
    a = await nodes.start()
    assert_error(await a.control("prepare", **body), 422, "invalid_request")
    reply = await a.http.post("/_tether/prepare", content=b"{not json",
                              headers={"authorization": f"Bearer {TOKEN}"})
    assert_error(reply, 422, "invalid_request")


@pytest.mark.parametrize("bad", ["latest", "", "-c1", ".c1", "c 1", "c/1", "c1\n", "x" * 129])
async def test_a_malformed_or_latest_checkpoint_id_is_422_on_every_route(
    nodes: Nodes, bad: str
) -> None:
    a = await nodes.start()
    await a.prepared("c1")  # 422 comes before conflicts and phases
    for route in ID_ROUTES:
        assert_error(await a.control(route, checkpoint_id=bad), 422, "invalid_checkpoint_id")
    assert (await a.status())["checkpoint_id"] == "c1"


async def test_the_same_prepare_commit_or_resume_twice_gives_the_same_result(
    nodes: Nodes,
) -> None:
    a = await nodes.start()
    await a.seed("s")
    first = await a.prepared("c1")
    again = await a.prepared("c1")
    assert again["lease_expires_at"] >= first["lease_expires_at"]
    both = await asyncio.gather(
        a.ok("commit", checkpoint_id="c1"), a.ok("commit", checkpoint_id="c1")
    )
    assert both[0] == both[1]
    assert await a.ok("commit", checkpoint_id="c1") == both[0]
    assert both[0]["records"] == {"sessions": 1, "episodes": 0}
    assert await a.ok("resume", checkpoint_id="c1") == {"phase": "open"}
    assert await a.ok("resume", checkpoint_id="c1") == {"phase": "open"}
    assert await a.ok("resume", checkpoint_id="never-seen") == {"phase": "open"}
    assert_error(await a.control("prepare", checkpoint_id="never-seen"), 409,
                 "stale_checkpoint")


async def test_another_checkpoint_id_while_one_is_active_is_a_conflict(nodes: Nodes) -> None:
    a = await nodes.start()
    await a.prepared("c1")
    for route in ("prepare", "commit", "resume", "renew", "abort_restore"):
        assert_error(await a.control(route, checkpoint_id="c2"), 409, "checkpoint_conflict")
    assert_error(await a.control("restore", checkpoint_id="c2"), 409, "checkpoint_conflict")
    await a.ok("commit", checkpoint_id="c1", scope=["e1"])
    assert_error(await a.control("commit", checkpoint_id="c1"), 409, "checkpoint_conflict")
    assert_error(await a.control("commit", checkpoint_id="c1", scope=["e2"]), 409,
                 "checkpoint_conflict")
    assert (await a.ok("commit", checkpoint_id="c1", scope=["e1"]))["checkpoint_id"] == "c1"
    await a.ok("resume", checkpoint_id="c1")
    assert (await a.prepared("c2"))["state"] == "prepared"


async def test_calls_in_the_wrong_phase_are_invalid_phase(nodes: Nodes) -> None:
    a = await nodes.start()
    assert_error(await a.control("commit", checkpoint_id="c1"), 409, "invalid_phase")
    assert_error(await a.control("renew", checkpoint_id="c1"), 409, "invalid_phase")
    assert_error(await a.control("abort_restore", checkpoint_id="c1"), 409, "invalid_phase")
    await a.prepared("c1")
    assert_error(await a.control("restore", checkpoint_id="c1"), 409, "invalid_phase")
    assert_error(await a.control("abort_restore", checkpoint_id="c1"), 409, "invalid_phase")
    await a.ok("commit", checkpoint_id="c1")
    assert_error(await a.control("prepare", checkpoint_id="c1"), 409, "invalid_phase")
    assert (await a.ok("renew", checkpoint_id="c1", lease_s=5))["lease_expires_at"] > 0
    await a.ok("resume", checkpoint_id="c1")


async def test_a_delayed_call_of_a_resumed_id_is_stale_and_stale_comes_before_conflict(
    nodes: Nodes,
) -> None:
    a = await nodes.start()
    await a.seed("s")
    await a.checkpoint("c1")
    for route in ("prepare", "commit", "renew"):
        assert_error(await a.control(route, checkpoint_id="c1"), 409, "stale_checkpoint")
    assert await a.ok("resume", checkpoint_id="c1") == {"phase": "open"}
    await a.prepared("c2")
    assert_error(await a.control("prepare", checkpoint_id="c1"), 409, "stale_checkpoint")
    assert (await a.status())["checkpoint_id"] == "c2"
    await a.ok("resume", checkpoint_id="c2")


async def test_a_published_id_is_stale_on_a_new_server_too(nodes: Nodes) -> None:
    a = await nodes.start()
    await a.seed("s")
    await a.checkpoint("c1")
    await a.stop()
    b = await nodes.start()
    assert_error(await b.control("prepare", checkpoint_id="c1"), 409, "stale_checkpoint")
    assert not b.participant.admission_closed
