"""The main process: the coordinator, its channel, the launcher, the controller and the CLI."""

from coordinator.controller import (
    Blocked,
    ControlError,
    Controller,
    ControllerError,
    Server,
    ServerClient,
)
from coordinator.launcher import ServeOptions, serve

__all__ = [
    "Blocked",
    "ControlError",
    "Controller",
    "ControllerError",
    "ServeOptions",
    "Server",
    "ServerClient",
    "serve",
]
