"""Pausing collection around a checkpoint's bursts of allocation: nesting, threads, and
an app that turned collection off itself."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from tether.checkpoint import gcpause


@pytest.fixture(autouse=True)
def collection_restored() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_collection_resumes_only_when_the_last_of_nested_pauses_ends() -> None:
    gc.enable()
    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_pauses_overlapping_in_threads_leave_collection_enabled() -> None:
    gc.enable()
    first_in, second_out = threading.Event(), threading.Event()

    def first() -> None:
        with gcpause.paused():
            first_in.set()
            second_out.wait(5)  # the second pause begins and ends inside this one

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(5)
    with gcpause.paused():
        pass
    assert not gc.isenabled()  # the first pause still runs
    second_out.set()
    thread.join(5)
    assert gc.isenabled()


def test_a_pause_leaves_collection_off_when_the_app_had_turned_it_off() -> None:
    gc.disable()
    with gcpause.paused():
        pass
    assert not gc.isenabled()


def test_a_pause_leaves_what_the_app_froze_frozen() -> None:
    gc.enable()
    kept = [object() for _ in range(10)]
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        with gcpause.paused():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    del kept


def test_a_pause_freezes_only_for_its_length() -> None:
    gc.enable()
    assert gc.get_freeze_count() == 0
    with gcpause.paused():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def in_generation(generation: int, target: object) -> bool:
    return any(o is target for o in gc.get_objects(generation=generation))


def test_what_a_pause_built_goes_straight_to_the_oldest_generation() -> None:
    """Else the first young collection after a commit traverses the whole index."""
    gc.enable()
    with gcpause.paused():
        built = [["entry", n] for n in range(1000)]
    assert in_generation(2, built) and in_generation(2, built[-1])
    assert not in_generation(0, built)


def test_an_app_that_froze_its_heap_keeps_it_frozen_and_young_stays_young() -> None:
    gc.enable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gcpause.paused():
            built = [["entry", n] for n in range(10)]
        assert gc.get_freeze_count() == frozen
        assert in_generation(0, built)
    finally:
        gc.unfreeze()
