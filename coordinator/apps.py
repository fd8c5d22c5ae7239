"""Finding the user's app and the session kind it declares or a preset gives it."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Literal

from tether.checkpoint.inprocess import InProcess
from tether.routing.kinds import SessionKind, cookie_kind, declared_kind, mcp_kind

Preset = Literal["cookie", "mcp"]


class AppError(Exception):
    """The app cannot be imported or cannot be served as asked."""


def import_app(target: str) -> Any:
    """Import `module:attribute` from the current directory."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise AppError(f"APP must be module:attribute, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AppError(f"cannot import {module_name!r}: {error}") from error
    try:
        app = module
        for part in attribute.split("."):
            app = getattr(app, part)
    except AttributeError as error:
        raise AppError(f"module {module_name!r} has no attribute {attribute!r}") from error
    return app.app if isinstance(app, InProcess) else app


def resolve_kind(
    app: Any, preset: Preset | None, close_window_s: float | None
) -> SessionKind | None:
    """The app's own kind if it declares one, else the preset's; None routes no sessions."""
    kind = declared_kind(app)
    if kind is None and preset == "cookie":
        try:
            kind = cookie_kind(app)
        except ValueError as error:
            raise AppError(f"--sessions cookie: {error}") from error
    elif kind is None and preset == "mcp":
        kind = mcp_kind()
    if kind is not None and close_window_s is not None:
        kind = kind.with_close_window(close_window_s)
    return kind
