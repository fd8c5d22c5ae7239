"""An app with its own prometheus_client metrics, for `tether serve --app-metrics`: a
counter its route increments, and a live gauge each worker sets to 1 at import (so the
sum over live workers tells whether a dead worker's files were marked)."""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

HITS = Counter("app_hits", "Requests to /hit")
ALIVE = Gauge("app_workers_alive", "Worker processes alive", multiprocess_mode="livesum")
ALIVE.set(1)


async def hit(request: Request) -> JSONResponse:
    HITS.inc()
    return JSONResponse(
        {"pid": os.getpid(), "multiproc_dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR")}
    )


app = Starlette(routes=[Route("/hit", hit, methods=["POST"])])
