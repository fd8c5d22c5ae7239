"""An unmodified FastAPI app (served with `--sessions cookie`): its handlers read the
caller (`request.client.host`, `url_for`) and its login rotates the session ID, as a
careful login does, moving the session's state to the new ID."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from starlette.middleware.sessions import SessionMiddleware

from tether import worker_of

SECRET = "accounts-secret"

app = FastAPI()
app.add_middleware(SessionMiddleware, secret_key=SECRET)
counts: dict[str, int] = {}


@app.post("/seed_session")
async def seed_session(request: Request) -> dict[str, Any]:
    body = await request.json()
    counts.setdefault(body["session_id"], 0)
    return {"session_id": body["session_id"], "worker": worker_of(request.scope)}


@app.post("/login")
async def login(request: Request) -> dict[str, Any]:
    old = request.session["session_id"]
    if old not in counts:
        raise HTTPException(404, "session_lost")
    new = secrets.token_hex(16)
    counts[new] = counts.pop(old)
    request.session["session_id"] = new
    return {"old": old, "session_id": new, "worker": worker_of(request.scope)}


@app.post("/increment")
async def increment(request: Request) -> dict[str, Any]:
    session_id = request.session["session_id"]
    if session_id not in counts:
        raise HTTPException(404, "session_lost")
    counts[session_id] += 1
    worker = worker_of(request.scope)
    return {"session_id": session_id, "count": counts[session_id], "worker": worker}


@app.get("/whoami", name="whoami")
async def whoami(request: Request) -> dict[str, Any]:
    # What a handler written for plain uvicorn does: `request.client` is never None there.
    return {
        "host": request.client.host,  # type: ignore[union-attr]
        "port": request.client.port,  # type: ignore[union-attr]
        "scheme": request.url.scheme,
        "root_path": request.scope.get("root_path", ""),
        "url_for": str(request.url_for("whoami")),
        "worker": worker_of(request.scope),
    }
