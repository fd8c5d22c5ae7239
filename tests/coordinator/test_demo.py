"""What `tether demo` counts as a right restore row (issue #13): every count right, and the
restored sessions spread over every worker within one, every worker answering."""

from __future__ import annotations

import pytest

from tether.coordinator.demo import Row


def restore_row(held: list[int], workers_seen: int, right: int = 1000) -> Row:
    return Row("rescale to 3", right, 1000, workers_seen, 1.0, held, spread=True)


def test_a_restore_that_spreads_within_one_over_every_worker_is_right() -> None:
    assert restore_row([334, 333, 333], workers_seen=3).ok


@pytest.mark.parametrize(
    ("held", "workers_seen"),
    [
        ([500, 500, 0], 2),  # issue #13: owner groups kept whole left a worker empty
        ([500, 250, 250], 3),  # 2:1:1
        ([334, 333, 333], 2),  # a worker that never answered
        ([], 0),  # no status row at all
    ],
)
def test_a_restore_that_leaves_a_worker_empty_or_uneven_fails_the_demo(
    held: list[int], workers_seen: int
) -> None:
    assert not restore_row(held, workers_seen).ok


def test_a_wrong_count_fails_a_row_however_well_spread() -> None:
    assert not restore_row([334, 333, 333], workers_seen=3, right=999).ok


def test_rows_outside_the_restores_are_not_held_to_the_spread() -> None:
    assert Row("tether, 4 workers", 1000, 1000, 4, 1.0, [310, 253, 249, 188]).ok
