"""Held episode records kept by the coordinator (SPEC 5.8, 5.9): claimed, handed back,
and retired while claimed. (The rules themselves: `tests/checkpoint/test_held.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.coordinator.coordinator import Coordinator
from tether.coordinator.fleet import ChannelFleet
from tether.routing.errors import TetherError
from tether.routing.types import WorkerId, new_worker_id

ENTRY = ["episode", "e", None, 1, 0, 10]


def fleet_holding(tmp_path: Path) -> ChannelFleet:
    """A coordinator's fleet holding attempt 1's record of episode `e`."""
    fleet = ChannelFleet(Coordinator(expected_workers=2), str(tmp_path))
    fleet.hand_back({"episode_id": "e", "attempt": 1, "path": str(tmp_path / "s"),
                     "entry": ENTRY})
    return fleet


def test_a_record_handed_back_is_held_again_for_the_same_attempt(tmp_path: Path) -> None:
    fleet = fleet_holding(tmp_path)
    worker = WorkerId(new_worker_id())
    assert fleet.claim(worker, "e", 2) is not None
    assert fleet.held_episodes() == []
    fleet.hand_back({"episode_id": "e", "attempt": 1, "path": str(tmp_path / "s"),
                     "entry": ENTRY})
    assert fleet.held_episodes() == [{"episode_id": "e", "attempt_to_send": 2}]


def test_a_record_handed_back_after_its_claiming_attempt_was_retired_is_dropped(
    tmp_path: Path,
) -> None:
    fleet = fleet_holding(tmp_path)
    assert fleet.claim(WorkerId(new_worker_id()), "e", 2) is not None
    fleet.records.retire("e", 2)  # what retire marks before the worker stops the attempt
    fleet.hand_back({"episode_id": "e", "attempt": 1, "path": str(tmp_path / "s"),
                     "entry": ENTRY})
    assert fleet.held_episodes() == []
    assert "e" not in fleet.held


def test_a_hand_back_from_a_worker_that_does_not_hold_the_claim_is_refused(
    tmp_path: Path,
) -> None:
    fleet = fleet_holding(tmp_path)
    claimant, other = WorkerId(new_worker_id()), WorkerId(new_worker_id())
    assert fleet.claim(claimant, "e", 2) is not None
    with pytest.raises(TetherError) as refused:
        fleet.hand_back({"episode_id": "e", "attempt": 1, "path": str(tmp_path / "s"),
                         "entry": ENTRY}, other)
    assert (refused.value.code, refused.value.detail) == ("episode_claimed", {"worker": claimant})
    assert fleet.held["e"].claimed_by == claimant


def test_the_coordinator_refuses_a_claim_of_a_retired_attempt(tmp_path: Path) -> None:
    """Even from a worker that has not applied the mark yet."""
    fleet = fleet_holding(tmp_path)
    fleet.records.retire("e", 2)
    with pytest.raises(TetherError, match="stale_attempt"):
        fleet.claim(WorkerId(new_worker_id()), "e", 2)
