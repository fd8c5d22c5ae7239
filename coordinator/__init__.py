"""The main process: the coordinator, its channel, the launcher, the controller and the CLI.

The public names load on first use: every worker imports this package (its module
`tether.coordinator.worker`), and must not pay for the controller's and the launcher's
imports."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "Blocked": "controller",
    "ControlError": "controller",
    "Controller": "controller",
    "ControllerError": "controller",
    "RestoreFailed": "controller",
    "Server": "controller",
    "ServerClient": "controller",
    "serve": "launcher",
    "ServeOptions": "options",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tether.coordinator.{home}"), name)
    globals()[name] = value
    return value
