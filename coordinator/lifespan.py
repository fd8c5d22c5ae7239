"""Running an app's own lifespan from inside another lifespan handler."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Scope


class AppLifespan:
    """Drives the wrapped app's lifespan: `startup()` before tether's own start-up,
    `shutdown()` after tether's own shutdown. `mode` is uvicorn's `--lifespan`: with
    "auto" an app without lifespan support is fine, with "on" it fails, "off" skips it."""

    def __init__(self, app: ASGIApp, scope: Scope, mode: str = "auto") -> None:
        self._app = app
        self._scope = scope
        self._mode = mode
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._supported = True

    async def startup(self) -> None:
        if self._mode == "off":
            return
        self._task = asyncio.create_task(self._run(), name="tether-app-lifespan")
        await self._to_app.put({"type": "lifespan.startup"})
        message = await self._from_app.get()
        if message["type"] == "lifespan.startup.failed":
            # Starlette sends the whole traceback; its last line names the error.
            lines = [line for line in str(message.get("message", "")).splitlines() if line.strip()]
            await asyncio.gather(self._task, return_exceptions=True)  # it re-raises: retrieved
            raise RuntimeError(f"the app's lifespan start-up failed: {lines[-1] if lines else ''}")
        if not self._supported and self._mode == "on":
            raise RuntimeError("the app does not take lifespan events, which --lifespan on needs")

    async def shutdown(self) -> None:
        if self._task is None:
            return
        if self._supported and not self._task.done():
            await self._to_app.put({"type": "lifespan.shutdown"})
            message = await self._from_app.get()
            if message["type"] == "lifespan.shutdown.failed":
                raise RuntimeError(f"the app's shutdown failed: {message.get('message', '')}")
        await self._task

    async def _run(self) -> None:
        started = False

        async def send(message: Message) -> None:
            nonlocal started
            started = True
            await self._from_app.put(message)

        try:
            await self._app(self._scope, self._to_app.get, send)
        except Exception:
            if started:
                raise
            self._supported = False
            await self._from_app.put({"type": "lifespan.startup.complete"})

