"""Running a coroutine that waits on nothing (an ASGI middleware asked about a scope, a
refusal sent to a collecting `send`) from plain code, with no event loop turn."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

__all__ = ["ran_at_once"]


def ran_at_once(step: Coroutine[Any, Any, Any]) -> bool:
    """Run `step` to its end; False, and `step` closed, if it would have waited."""
    try:
        step.send(None)
    except StopIteration:
        return True
    step.close()
    return False
