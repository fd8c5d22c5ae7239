"""The session fence helpers, with an injected clock."""

from __future__ import annotations

import asyncio

import pytest

from tether.routing.errors import TetherError
from tether.routing.fence import SessionFence, lost_verification, seed_rejected, session_lost


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_late_seed_after_close_is_refused_within_the_window() -> None:
    clock = Clock()
    fence = SessionFence(10, clock)
    fence.close("s")
    with pytest.raises(TetherError) as caught:
        fence.raise_if_closed("s")
    assert (caught.value.code, caught.value.status) == ("session_closed", 409)
    clock.now = 10.5
    fence.raise_if_closed("s")


def test_retried_close_keeps_the_first_record_and_its_expiry() -> None:
    clock = Clock()
    fence = SessionFence(10, clock)
    fence.close("s")
    clock.now = 8
    fence.close("s")
    clock.now = 10.5
    assert not fence.is_closed("s")


def test_binding_to_another_episode_is_a_conflict_even_after_close() -> None:
    fence = SessionFence(10, Clock())
    fence.bind("s", "episode-1")
    with pytest.raises(TetherError) as caught:
        fence.bind("s", "episode-2")
    assert caught.value.code == "session_conflict"
    fence.close("s", "episode-1")
    with pytest.raises(TetherError):
        fence.close("s", "episode-2")


def test_a_thousand_closes_leave_no_record_after_the_window() -> None:
    clock = Clock()
    fence = SessionFence(10, clock)
    for i in range(1000):
        clock.now = i / 100
        fence.close(f"s{i}")
    assert fence.closed_count() == 1000
    clock.now = 25
    assert fence.closed_count() == 0


async def test_lock_serialises_one_session_and_is_dropped_after() -> None:
    fence = SessionFence()
    order: list[str] = []

    async def hold(name: str) -> None:
        async with fence.locked("s"):
            order.append(f"{name}-in")
            await asyncio.sleep(0)
            order.append(f"{name}-out")

    await asyncio.gather(hold("a"), hold("b"))
    assert order == ["a-in", "a-out", "b-in", "b-out"]
    assert fence._locks == {}


def test_errors_and_masked_results_carry_the_contract_codes() -> None:
    assert (seed_rejected("bad").status, seed_rejected("bad").code) == (422, "seed_rejected")
    lost = session_lost("s")
    assert (lost.status, lost.body()["failure_kind"]) == (404, "session_lost")
    assert lost_verification("s") == {
        "session_id": "s", "reward": 0, "masked": True, "failure_kind": "session_lost"
    }
