"""`tether.run(...)`: `tether serve` for programs that start servers themselves."""

from __future__ import annotations

from typing import Any


def run(app: str, **options: Any) -> int:
    """Serve `app` ("module:attribute") until SIGTERM or SIGINT, as `tether serve` would,
    and return its exit code. Keyword arguments are `tether serve`'s flags, named as
    `uvicorn.run` names them (`workers=4`, `port=8000`, `root_path="/api"`, ...)."""
    from tether.coordinator.launcher import ServeOptions, serve

    if not isinstance(app, str):
        raise TypeError(
            "tether.run needs the app as an import string such as 'main:app', since every "
            "worker process imports it itself"
        )
    return serve(ServeOptions(app=app, **options))
