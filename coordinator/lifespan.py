"""Running an app's own lifespan from inside another lifespan handler."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Scope


class AppLifespan:
    """Drives the wrapped app's lifespan: `startup()` before tether's own start-up,
    `shutdown()` after tether's own shutdown. An app without lifespan support is fine."""

    def __init__(self, app: ASGIApp, scope: Scope) -> None:
        self._app = app
        self._scope = scope
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._supported = True

    async def startup(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tether-app-lifespan")
        await self._to_app.put({"type": "lifespan.startup"})
        message = await self._from_app.get()
        if message["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app's startup failed: {message.get('message', '')}")

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

