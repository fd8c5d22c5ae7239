"""Checkpoints of an app's in-memory state (SPEC 5): what an app registers, the control
API, the phase machine and the on-disk format."""

from tether.checkpoint.checkpointer import Checkpointer
from tether.checkpoint.declared import checkpointable
from tether.checkpoint.inprocess import in_process
from tether.checkpoint.participant import (
    Episode,
    Participant,
    SessionState,
    declare_participant,
    declared_participant,
)
from tether.checkpoint.store import resolve_latest

__all__ = [
    "Checkpointer",
    "Episode",
    "Participant",
    "SessionState",
    "checkpointable",
    "declare_participant",
    "declared_participant",
    "in_process",
    "resolve_latest",
]
