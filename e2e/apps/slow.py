"""An app whose `/slow` route takes a while, for graceful-shutdown tests.

Each request first drops a marker file into the directory named by `$TETHER_E2E_MARKERS`,
so a test knows the request reached the app before it signals the server.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MARKERS_ENV = "TETHER_E2E_MARKERS"
SLOW_S = 2.0


async def slow(request: Request) -> JSONResponse:
    marker = Path(os.environ[MARKERS_ENV], f"{os.getpid()}-{secrets.token_hex(8)}")
    await asyncio.to_thread(marker.touch)
    await asyncio.sleep(SLOW_S)
    return JSONResponse({"ok": True, "pid": os.getpid()})


app = Starlette(routes=[Route("/slow", slow)])
