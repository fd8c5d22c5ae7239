"""Checkpoints of an app's in-memory state (SPEC 5). Not built yet: see issue 3."""

__all__: list[str] = []
