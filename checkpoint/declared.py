"""What an app declares in code: its session kind and its participant, together."""

from __future__ import annotations

from typing import Any

from tether.checkpoint.participant import (
    Participant,
    SessionState,
    declare_participant,
    declared_participant,
)
from tether.routing.kinds import SessionKind, declare


class UndeclaredSessions(ValueError):
    """The app registers session state but declares no session kind."""


def checkpointable(
    app: Any,
    *,
    sessions: SessionKind,
    state: SessionState | None = None,
    state_version: str | None = None,
) -> Participant:
    """Declare the app's session kind and its participant at once, and return the
    participant (for episodes). `state` is the app's session state, if it keeps any.

    The two belong together: a checkpoint's readiness sees a session's requests only
    through the kind, so session state without one could be written half-applied.
    """
    declare(app, sessions)
    participant = declared_participant(app) or Participant(state_version=state_version)
    if state is not None:
        participant.register_sessions(state)
    declare_participant(app, participant)
    return participant


def check_declared(app: Any, kind: SessionKind | None) -> None:
    """Refuse an app whose participant holds session state that no kind routes."""
    participant = declared_participant(app)
    if kind is None and participant is not None and participant.provider is not None:
        raise UndeclaredSessions(
            "the app registers session state but declares no session kind, so a "
            "checkpoint could not see its requests; declare both with "
            "tether.checkpointable(app, sessions=..., state=...) or pass --sessions"
        )
