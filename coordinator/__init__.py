"""The main process: the coordinator, its channel, the launcher, the controller and the CLI."""

from tether.coordinator.controller import (
    Blocked,
    ControlError,
    Controller,
    ControllerError,
    RestoreFailed,
    Server,
    ServerClient,
)
from tether.coordinator.launcher import serve
from tether.coordinator.options import ServeOptions

__all__ = [
    "Blocked",
    "ControlError",
    "Controller",
    "ControllerError",
    "RestoreFailed",
    "ServeOptions",
    "Server",
    "ServerClient",
    "serve",
]
