"""The main process: the coordinator, its channel, the launcher and the CLI."""

from coordinator.launcher import ServeOptions, serve

__all__ = ["ServeOptions", "serve"]
