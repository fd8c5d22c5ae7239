"""Finding the user's app, and the session kind it declares or a preset gives it.

Only workers import the app: the main process never does, so an app that loads a large
model at import costs its memory once per worker, as under uvicorn. Every way this can
fail is an `AppError` whose message is the one line `tether serve` prints.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any, Literal

import structlog
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import Mount

from tether.checkpoint.declared import UndeclaredSessions, check_declared
from tether.checkpoint.inprocess import InProcess
from tether.routing.kinds import SessionKind, cookie_kind, declared_kind, mcp_kind

Preset = Literal["cookie", "mcp"]
log = structlog.get_logger("tether.apps")


class AppError(Exception):
    """The app cannot be imported or cannot be served as asked; the message says what to do."""


def import_app(target: str, app_dir: str = ".", factory: bool = False) -> Any:
    """Import `module:attribute` from `app_dir` (as uvicorn does), calling it if it is a
    factory: with `factory`, or when it can be called without arguments."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise AppError(f"APP must be module:attribute (such as main:app), got {target!r}")
    directory = os.path.abspath(app_dir)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise AppError(
                f"cannot import {module_name!r}: no such module in {directory}; run from the "
                "app's directory or pass --app-dir"
            ) from None
        raise AppError(
            f"cannot import {module_name!r}: it imports {error.name!r}, which is not installed"
        ) from None
    except BaseException as error:  # the app's own code failed: say where, in one line
        raise AppError(f"cannot import {module_name!r}: {_one_line(error)}") from None
    try:
        app: Any = module
        for part in attribute.split("."):
            app = getattr(app, part)
    except AttributeError:
        raise AppError(f"module {module_name!r} has no attribute {attribute!r}") from None
    app = _called_if_factory(app, target, factory)
    if isinstance(app, InProcess):
        app = app.app
    if not callable(app):
        raise AppError(f"{target!r} is a {type(app).__name__}, not an ASGI app")
    return app


def _called_if_factory(app: Any, target: str, factory: bool) -> Any:
    """uvicorn's rule: call it; a TypeError means it was the app itself, unless `factory`."""
    if isinstance(app, InProcess):
        return app
    try:
        made = app()
    except TypeError as error:
        if factory:
            raise AppError(f"--factory: calling {target!r} failed: {error}") from None
        return app
    except BaseException as error:
        raise AppError(f"the app factory {target!r} raised {_one_line(error)}") from None
    if not factory:
        log.warning("app_factory_detected", app=target, hint="pass --factory to say so")
    return made


def _one_line(error: BaseException) -> str:
    """`Type: message (file:line)`, the line being the innermost frame outside importlib."""
    where = ""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "importlib" not in f.filename]
    if frames:
        frame = frames[-1]
        where = f" ({os.path.relpath(frame.filename)}:{frame.lineno})"
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else ''}{where}"


def resolve_kind(
    app: Any, preset: Preset | None, close_window_s: float | None
) -> SessionKind | None:
    """The app's own kind if it declares one, else the preset's; None routes no sessions.

    An app that registers session state must come with a kind (`check_declared`)."""
    kind = declared_kind(app)
    if kind is None and preset == "cookie":
        try:
            kind = cookie_kind(app)
        except ValueError:
            raise AppError(f"--sessions cookie: {_why_no_session_middleware(app)}") from None
    elif kind is None and preset == "mcp":
        kind = mcp_kind()
    try:
        check_declared(app, kind)
    except UndeclaredSessions as error:
        raise AppError(str(error)) from None
    if kind is not None and close_window_s is not None:
        kind = kind.with_close_window(close_window_s)
    return kind


def _why_no_session_middleware(app: Any) -> str:
    """What the cookie preset found instead of a SessionMiddleware, and what to do."""
    if not hasattr(app, "user_middleware"):
        return (
            f"the app is a {type(app).__name__}, not a Starlette app, so its SessionMiddleware "
            "cannot be found; declare the kind in code with "
            "tether.declare(starlette_app, tether.cookie_kind(starlette_app))"
        )
    for route in getattr(app, "routes", ()):
        mounted = getattr(route, "app", None) if isinstance(route, Mount) else None
        middleware = getattr(mounted, "user_middleware", ())
        if any(m.cls is SessionMiddleware for m in middleware):
            return (
                f"SessionMiddleware is on the sub-app mounted at {route.path!r}, not on the "
                "app; add it to the app itself, or declare the kind in code with "
                "tether.cookie_kind(sub_app)"
            )
    return (
        "the app has no Starlette SessionMiddleware, so the cookie preset cannot read its "
        "session cookie; add SessionMiddleware(secret_key=...), or, for a cookie of the "
        "app's own, declare a SessionKind in code (docs/routing.md)"
    )
